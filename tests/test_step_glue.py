"""dtree's attention function hands q, k and v over as views, with nothing to copy back.

Every decoder layer passes ``[1, H, T, D]`` q, k and v to dtree's attention function, which
attends over ``[T, H, D]``. Taken with ``x[0]`` (a select), each one's backward zero-fills a
tensor of the input's shape and copies the gradient into it (two kernels per tensor, three
tensors per layer), and the gradient then reaches the q/k/v projections' view in head-major
order, which their view backward copies once more: GRPO case 1 on an H200 ran 9 such kernels
per layer of its 75 (``benchmarks/results/h200/session_p``). Taken with ``squeeze(0)``, the
backward is a view, and the gradient arrives in the projection's own memory order. The
exactness tests hold the values; these hold the graph.
"""

from __future__ import annotations

import torch

from dtree.models.attention_function import dtree_attention_function
from dtree.models.guard import activate
from dtree.models.layer_recompute import graph_nodes


class _Recording:
    """Stands in for a model call's attention (:class:`dtree.models.guard.AttentionCalls`): the
    function under test is the hand-over around it. Returns ``q`` scaled, so gradients flow."""

    model_name = "test"

    def __call__(self, module, q, k, v, scale, **options):
        self.seen = (q, k, v)
        return q * scale + (k.sum() + v.sum()) * 0


def _projection_views(t: int = 5, heads: int = 4, d: int = 8):
    """(the projections' [1, T, H*D] outputs, their [1, T, H, D] views, and q, k, v as HF
    passes them: those views transposed to [1, H, T, D])."""
    flat = [torch.randn(1, t, heads * d, requires_grad=True) for _ in range(3)]
    views = [x.view(1, t, heads, d) for x in flat]
    return flat, views, [x.transpose(1, 2) for x in views]


def test_q_k_v_reach_the_attention_as_views_without_select_backwards():
    flat, _, (q, k, v) = _projection_views()
    calls = _Recording()
    with activate(calls):
        out, _ = dtree_attention_function(torch.nn.Module(), q, k, v, None, scaling=0.5)
    assert all(x.is_contiguous() and x.shape == (5, 4, 8) for x in calls.seen)
    assert all(x.data_ptr() == f.data_ptr() for x, f in zip(calls.seen, flat))  # views, not copies
    names = [type(n).__name__ for n in graph_nodes(out.grad_fn)]
    assert not [n for n in names if n.startswith("SelectBackward")], names


def test_the_projections_views_get_their_gradients_in_their_own_memory_order():
    """The gradient reaching each projection's [1, T, H, D] view is contiguous, so the view's
    backward to [1, T, H*D] is a view too (with a select it arrived head-major: a copy)."""
    flat, views, (q, k, v) = _projection_views()
    grads = {}
    for i, x in enumerate(views):
        x.register_hook(lambda g, i=i: grads.__setitem__(i, g))
    with activate(_Recording()):
        out, _ = dtree_attention_function(torch.nn.Module(), q, k, v, None, scaling=0.5)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    assert grads[0].is_contiguous() and grads[0].shape == (1, 5, 4, 8)
    torch.testing.assert_close(flat[0].grad, (upstream * 0.5).reshape(1, 5, 32))



def test_the_tree_mask_baselines_attention_output_is_a_view_back():
    """The mask baseline hands its [1, H, N, D] attention output back the same way (a
    stronger baseline is the honest one). SDPA here; its FlexAttention twin has the same
    line and no backward on CPU."""
    from dtree.baselines.kernels.tree_mask_attention import TreeMaskLayout, tree_mask_attention_sdpa

    q, k, v = (torch.randn(4, 2, 8, requires_grad=True) for _ in range(3))
    out = tree_mask_attention_sdpa(q, k, v, TreeMaskLayout([4, 3, 3, 4]), 0.5)
    names = [type(n).__name__ for n in graph_nodes(out.grad_fn)]
    assert not [n for n in names if n.startswith("SelectBackward")], names
