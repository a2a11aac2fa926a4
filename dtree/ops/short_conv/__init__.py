"""Causal depthwise convolution over the packed segments of one call (:mod:`.interface`)."""

from .interface import causal_conv1d_reference, causal_conv1d_segments

__all__ = ["causal_conv1d_reference", "causal_conv1d_segments"]
