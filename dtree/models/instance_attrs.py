"""Per-step attributes of modules, written into the instance's ``__dict__`` directly.

The lean layers and the shared q/k/v projections give ~170 modules of a 28-layer model a
``forward`` of their own (and a mark or two) at every step and take them back after it.
``nn.Module.__setattr__`` and ``__delattr__`` check every value against parameters,
buffers and submodules first: ~3.6 us a module for the pair, ~0.6 ms a step before the
first kernel (GRPO case 1's step waits ~10 ms on its host there, session AM). These values
are none of those (bound methods, flags, plain objects), and the instance ``__dict__`` is
where ``nn.Module`` would put them too, so writing it directly is the same state.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["module_attr", "remove_instance_attrs", "set_instance_attrs"]


def set_instance_attrs(module: torch.nn.Module, **values) -> None:
    """``setattr(module, name, value)`` for plain values (no parameter, buffer or module)."""
    module.__dict__.update(values)


def remove_instance_attrs(module: torch.nn.Module, *names: str) -> None:
    """``delattr(module, name)`` for attributes :func:`set_instance_attrs` set."""
    attrs = module.__dict__
    for name in names:
        del attrs[name]


def module_attr(module: torch.nn.Module, name: str, default=None):
    """``getattr(module, name, default)`` for a plain attribute (not a parameter, buffer or
    submodule, nor a property): the instance's ``__dict__``, else its class's, read once per
    class (a class default; dtree, torch and transformers set these names on instances). Where
    neither has it, ``getattr`` goes through ``nn.Module.__getattr__``, which raises (and
    ``getattr`` catches) an AttributeError: ~2 us a module, ~1,100 of them a step over a
    28-layer model's per-step checks (its marks, flags and compile state), all before the
    first kernel."""
    attrs = module.__dict__
    return attrs[name] if name in attrs else _class_attr(type(module), name, default)


@functools.cache
def _class_attr(cls: type, name: str, default):
    return getattr(cls, name, default)
