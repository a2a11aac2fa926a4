"""The KV window (dtree/ops/stack_ops/kv_window.py): a leaf call attending through one layer's
window gives the outputs and gradients it gives through the whole KV stack, its ancestors'
gradients landing in the stack's slots of the bound layer; a stale binding or an add past the
stack's slots raises; and whole training steps with every layer checkpointed run their leaf
calls in the window, exactly (against HF per path, float32), with a stack that holds the
groups with children only."""

from __future__ import annotations

import pytest
import torch
from test_stack_attention import nested_layout

from dtree.ops.stack_attention.call_mask import call_mask
from dtree.ops.stack_attention.masked_call import TORCH_MASKED_CALL, stack_attention_masked_call
from dtree.ops.stack_ops.kv_stack import KVStack
from dtree.ops.stack_ops.kv_window import KVWindow


def _stack(layers: int, capacity: int, grad_slots: int, gen: torch.Generator) -> KVStack:
    stack = KVStack(layers, capacity, 2, 8, dtype=torch.float64, device="cpu", grad_dtype=torch.float64,
                    grad_slots=grad_slots)
    stack.k.copy_(torch.randn(stack.k.shape, generator=gen, dtype=torch.float64))
    stack.v.copy_(torch.randn(stack.v.shape, generator=gen, dtype=torch.float64))
    stack.grad_k.copy_(torch.randn(stack.grad_k.shape, generator=gen, dtype=torch.float64))
    stack.grad_v.copy_(torch.randn(stack.grad_v.shape, generator=gen, dtype=torch.float64))
    return stack


@pytest.mark.parametrize("pushed", [False, True], ids=["call writes own", "own pushed"])
@pytest.mark.parametrize("layer", [0, 2])
def test_a_call_through_the_window_matches_the_stack(pushed, layer):
    """The nested call (in-call ancestors, a three-range prefix) at ``layer`` of a 3-layer stack:
    through the stack, and through a window bound to that layer of a stack that holds only the
    slots below the call: the same output, dq, dk, dv, and the same gradient slots of every layer."""
    used = 9
    layout, t = nested_layout(used)
    mask = call_mask(layout)
    gen = torch.Generator().manual_seed(layer)
    full = _stack(3, used + t, used, gen)
    lean = KVStack(3, used, 2, 8, dtype=torch.float64, device="cpu", grad_dtype=torch.float64)
    lean.k.copy_(full.k[:, :used]), lean.v.copy_(full.v[:, :used])
    lean.grad_k.copy_(full.grad_k), lean.grad_v.copy_(full.grad_v)
    window = KVWindow(used + t + 3, 2, 8, dtype=torch.float64, device="cpu")
    window.k.fill_(float("nan")), window.v.fill_(float("nan"))  # nothing unwritten may be read
    q = torch.randn(t, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(t, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(t, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(t, 6, 8, generator=gen, dtype=torch.float64)

    def run(stack, index):
        if pushed:
            stack.push(index, used, k.detach(), v.detach())
        out = stack_attention_masked_call(q, k, v, stack, index, layout, mask, 8**-0.5, kernel=TORCH_MASKED_CALL,
                                          own_in_stack=pushed)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    want = run(full, layer)
    got = run(window.bind(lean, layer, used), 0)
    for a, b, name in zip(got, want, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    torch.testing.assert_close(lean.grad_k, full.grad_k, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lean.grad_v, full.grad_v, rtol=1e-12, atol=1e-12)


def test_a_stale_binding_raises_and_so_does_an_add_past_the_stack():
    gen = torch.Generator().manual_seed(0)
    stack = _stack(2, 8, 8, gen)
    window = KVWindow(16, 2, 8, dtype=torch.float64, device="cpu")
    first = window.bind(stack, 0, 4)
    torch.testing.assert_close(first.k[0, :4], stack.k[0, :4])  # the ancestors copied in
    assert first.k.shape == (1, 16, 2, 8)
    second = window.bind(stack, 1, 4)
    with pytest.raises(RuntimeError, match="after another layer or call had bound it"):
        _ = first.k
    torch.testing.assert_close(second.v[0, :4], stack.v[1, :4])
    with pytest.raises(RuntimeError, match="past the stack's 8 slots"):
        second.grad_slots_through(12)
    gk = torch.randn(3, 2, 8, generator=gen, dtype=torch.float64)
    gv = torch.randn(3, 2, 8, generator=gen, dtype=torch.float64)
    dtypes = (torch.float64, torch.float64)
    for got, want in zip(second.seed_grad(0, 2, 5, gk, gv, dtypes), stack.seed_grad(1, 2, 5, gk, gv, dtypes)):
        torch.testing.assert_close(got, want)  # the bound layer's gradient slots
    with pytest.raises(ValueError, match="past the stack"):
        window.bind(stack, 0, 9)
    other = KVStack(1, 8, 2, 4, dtype=torch.float64, device="cpu")
    with pytest.raises(ValueError, match="shape or dtype differs"):
        window.bind(other, 0, 0)


def test_a_window_keeps_no_stack_alive():
    """The window holds no reference to its bindings: the KV stack it was last bound to is freed
    with the last binding (no reference cycle waiting for the garbage collector: in session Y's
    first GPU run each step's stack outlived it, +0.5 GiB a step)."""
    import weakref

    stack = KVStack(2, 8, 2, 8, dtype=torch.float64, device="cpu")
    window = KVWindow(16, 2, 8, dtype=torch.float64, device="cpu")
    layer, ref = window.bind(stack, 1, 4), weakref.ref(stack)
    del stack
    assert ref() is not None and layer.stack is ref()
    del layer
    assert ref() is None


@pytest.mark.parametrize("mode", ["retain", "recompute"])
def test_runtime_runs_leaf_calls_in_the_window_exactly(monkeypatch, mode):
    """Training steps with every layer checkpointed, the one-call path (torch kernel) standing in
    for the ``reference`` backend (which the plan then treats as the flash-attn backend: own K/V
    read from the slots, their gradients returned whole): leaf calls run in the window, the stack
    holds the groups with children's slots; against HF per path in float32 over the DESIGN edge
    cases with subtrees inside calls; a log-prob pass windows its leaf calls too, and gives the
    log-probs it gives without the window."""
    from hf_models import make_model
    from test_masked_call import _one_call_for_reference, _stack_sizes
    from test_runtime_exact import EDGE_CASES, assert_exact, run_both

    import dtree
    from dtree.ops.stack_attention import interface
    from dtree.ops.stack_ops.kv_window import KVWindow as Window
    from dtree.plan import stack_sizes, step_plan
    from dtree.stacks.step_stacks import StepStacks

    ran = _one_call_for_reference(monkeypatch)
    monkeypatch.setattr(stack_sizes, "OWN_KV_IN_STACK", frozenset({"flash-attn", "reference"}))
    monkeypatch.setattr(interface, "OWN_GRADS_IN_CALL", frozenset({"flash-attn", "reference"}))
    bound, bind = [], Window.bind
    monkeypatch.setattr(Window, "bind", lambda self, *a: bound.append(a[2]) or bind(self, *a))
    _, grown = _stack_sizes(monkeypatch)
    windows, init = [], StepStacks.__init__
    monkeypatch.setattr(StepStacks, "__init__", lambda self, spec, tokens, states, **kw: (
        windows.append((tokens, kw.get("window_tokens", 0))), init(self, spec, tokens, states, **kw))[-1])
    seqs = [s for case in EDGE_CASES.values() for s in case]
    for budget in (6, 11, 1000):
        kw = {"mode": mode, "attention": "reference", "chunk_size": 3, "group_tokens": budget, "checkpoint_layers": True}
        out, ref, errs = run_both(make_model("qwen3", tied=True), seqs, rt_kw=kw)
        assert_exact(out, ref, errs)
    assert ran and bound, "no leaf call ran in the window"
    assert any(base > 0 for base in bound), "no windowed call had ancestors in the stack"
    assert grown[0] == 0, "an op added into gradient slots past the groups with children"
    assert any(0 < tokens < window for tokens, window in windows), windows  # the stack below the window's reach
    forest = dtree.Forest.from_sequences(seqs)
    model = make_model("qwen3", tied=True)
    bound.clear()
    windowed = dtree.TreeRuntime(model, attention="reference", chunk_size=3, group_tokens=6).logprobs(forest)
    assert bound, "the log-prob pass ran no leaf call in the window"
    monkeypatch.setattr(step_plan, "leaf_calls_can_window", lambda *args: False)
    plain = dtree.TreeRuntime(model, attention="reference", chunk_size=3, group_tokens=6).logprobs(forest)
    assert len(windowed) == len(plain)
    for a, b in zip(windowed, plain):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 24], ids=["plain: leaf calls in the window", "sliding window: in the stack"])
@pytest.mark.parametrize("mode", ["retain", "recompute"])
def test_gpu_flash_attn_steps_with_every_layer_checkpointed(monkeypatch, mode, window):
    """bf16 through the flash-attn backend (flash-attn-4, head dim 64) with every layer
    checkpointed: a plainly attending model runs its leaf calls in the KV window (each layer
    binds it in the forward and in its re-run), a sliding-window one (whose calls take the
    Triton kernel inside the backend) keeps them in the stack. Every gradient by the
    flash-attention rule against the float32 model per path, with calls of every size."""
    from setups import assert_flash_attn_steps
    from test_stack_attention_regions import _flash4

    from dtree.ops.stack_ops.kv_window import KVWindow as Window

    _flash4()  # skips without flash-attn-4 on a Hopper GPU
    bound, bind = [], Window.bind
    monkeypatch.setattr(Window, "bind", lambda self, *a: bound.append(a[2]) or bind(self, *a))

    def every_layer_checkpointed(out):
        assert out.metrics["memory_plan"]["checkpoint_layers"] == 2

    assert_flash_attn_steps(window, mode, every_layer_checkpointed, mode=mode, checkpoint_layers=True)
    assert bool(bound) == (window is None), len(bound)
    assert window is not None or any(lo > 0 for lo in bound), "no windowed call had ancestors in the stack"
