"""Stack attention as regions merged by log-sum-exp (dtree/ops/stack_attention/region_plan.py,
dtree/ops/stack_attention/regions.py, dtree/ops/stack_attention/lse_merge_triton.py and the
``flash-attn`` backend, dtree/ops/stack_attention/flash4.py).

CPU: the region plan covers every (row, prefix slot) of a call exactly once with
levels that flash-attn can run (sorted, disjoint rows and slots); the whole path with
the pure-torch region kernel equals the naive stack attention in float64 (output, dq,
dk, dv, the stack's gradient buffers) on hand-built, random and nested layouts; the
Triton merge kernel equals the torch merge under the interpreter; the ``flash-attn``
backend hands calls with options to the Triton kernel (interpreted) and says why it
cannot run on a CPU.

GPU (``-m gpu``): flash-attn-4 as the region kernel by the FlashAttention rule, forward
and every gradient (stack dK/dV included), deterministic mode bitwise reproducible; the
Triton kernel's deterministic mode bitwise reproducible too.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from interpreter_worker import InterpreterWorker
from test_stack_attention import OPTIONS, check_against_naive, nested_layout, random_layout, with_flags
from test_stack_attention_triton import LAYOUTS, check_flash_rule, gpu_layouts, layout_of, make_problem

from dtree.ops.registry import resolve_backend
from dtree.ops.stack_attention import AttentionOptions, StackSlots
from dtree.ops.stack_attention.region_plan import region_plan
from dtree.ops.stack_attention.regions import TORCH_REGIONS, lse_merge_reference, stack_attention_regions


def agentic_layout(branches=4, per_branch=3, tool=5, task=16, history=7):
    """Tool results in branches: each under a shared task prefix plus its branch's history
    (two ranges; the first branch's ranges are adjacent)."""
    prefixes = [[(0, task), (task + b * history, task + (b + 1) * history)]
                for b in range(branches) for _ in range(per_branch)]
    used = task + branches * history
    layout, t = layout_of([tool] * (branches * per_branch), prefixes, used)
    return layout, t, used


# --------------------------------------------------------------------------- the plan
def _covered(layout, t, used):
    want = np.zeros((t, used), dtype=int)
    for i, ranges in enumerate(layout.prefix_ranges):
        for lo, hi in ranges:
            want[layout.q_offsets[i] : layout.q_offsets[i + 1], lo:hi] = 1
    return want


PLAN_CASES = [("layout", name) for name in LAYOUTS] + [("random", seed) for seed in range(12)] + [("agentic", 0)]


def _plan_case(kind, arg):
    if kind == "layout":
        layout, t = layout_of(*LAYOUTS[arg])
        return layout, t, LAYOUTS[arg][2]
    if kind == "agentic":
        return agentic_layout()
    rng = np.random.default_rng(arg)
    used = int(rng.integers(5, 60))
    layout, t = random_layout(rng, int(rng.integers(1, 8)), 30, used)
    return layout, t, used


@pytest.mark.parametrize("kind,arg", PLAN_CASES)
def test_plan_covers_every_prefix_pair_once_in_runnable_levels(kind, arg):
    layout, t, used = _plan_case(kind, arg)
    plan = region_plan(layout)
    seen = np.zeros((t, used), dtype=int)
    for level in plan.levels:
        q_end, k_end = level.q_start + level.q_len, level.k_start + level.k_len
        assert np.all(level.q_len > 0) and np.all(level.k_len > 0)
        # sorted and disjoint in rows and in slots, in the same order
        assert np.all(level.q_start[1:] >= q_end[:-1]) and np.all(level.k_start[1:] >= k_end[:-1])
        for qa, qb, ka, kb in zip(level.q_start, q_end, level.k_start, k_end):
            seen[qa:qb, ka:kb] += 1
    assert np.array_equal(seen, _covered(layout, t, used))
    assert plan.own_offsets[0] == 0 and plan.own_offsets[-1] == t and np.all(np.diff(plan.own_offsets) > 0)


def test_plan_of_a_grpo_group_and_an_agentic_call():
    """A GRPO group is one pair (every answer row against the prompt); branches under a
    shared task prefix are two levels: the task prefix for all rows, then each branch's
    history for its rows."""
    grpo, _ = layout_of([5, 9, 3], [[(0, 11)]] * 3, 11)
    (level,) = region_plan(grpo).levels
    assert (level.q_start.tolist(), level.q_len.tolist(), level.k_start.tolist(), level.k_len.tolist()) == (
        [0], [17], [0], [11])
    layout, _, _ = agentic_layout()
    shared, histories = sorted(region_plan(layout).levels, key=lambda level: level.num_pairs)
    assert shared.q_len.tolist() == [60] and (shared.k_start.tolist(), shared.k_len.tolist()) == ([0], [16])
    assert histories.q_start.tolist() == [0, 15, 30, 45] and histories.k_start.tolist() == [16, 23, 30, 37]
    assert histories.gapless


# --------------------------------------------------------------------------- torch region kernel
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layouts_match_naive(name):
    layout, t = layout_of(*LAYOUTS[name])
    check_against_naive(stack_attention_regions, layout, t, LAYOUTS[name][2], 4, 2, 24, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(8))
def test_random_layouts_match_naive(seed):
    rng = np.random.default_rng(seed)
    hq, hkv, d = [(4, 4, 16), (6, 2, 12), (3, 1, 20), (4, 2, 8)][seed % 4]
    used = int(rng.integers(5, 60))
    layout, t = random_layout(rng, int(rng.integers(1, 7)), 30, used)
    check_against_naive(stack_attention_regions, layout, t, used, hq, hkv, d, dtype=torch.float64, seed=seed,
                        grad_init=seed % 2 == 1)


def test_agentic_in_call_ancestors_narrow_values_and_float32():
    layout, t, used = agentic_layout()
    check_against_naive(stack_attention_regions, layout, t, used, 6, 2, 16, 8, dtype=torch.float64, q_view=True)
    layout, t = nested_layout(19)
    check_against_naive(stack_attention_regions, layout, t, 19, 6, 3, 20, dtype=torch.float64)
    check_against_naive(stack_attention_regions, layout, t, 19, 6, 3, 20, 12, dtype=torch.float32)


def test_stack_without_gradient_buffers_and_bad_capacity():
    layout, t = layout_of(*LAYOUTS["odd"])
    stack, q, k, v = make_problem(layout, t, 40, 4, 2, 24, dtype=torch.float64, with_grad=False)
    out = stack_attention_regions(q, k, v, StackSlots(stack, 0, layout), AttentionOptions(scale=0.2))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    small, _ = layout_of([3], [[(0, stack.capacity + 1)]], 4)
    with pytest.raises(ValueError, match="past the stack capacity"):
        stack_attention_regions(q[:3], k[:3], v[:3], StackSlots(stack, 0, small), AttentionOptions(scale=0.2))
    empty, _ = layout_of([], [], 0)
    with pytest.raises(ValueError, match="at least one query row"):
        stack_attention_regions(q[:0], k[:0], v[:0], StackSlots(stack, 0, empty), AttentionOptions(scale=0.2))


def test_merge_is_softmax_over_the_union():
    """Two regions of random keys merged by log-sum-exp equal one softmax over both; a
    row a region does not cover (-inf, garbage output) takes nothing from it."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2, 8, generator=gen, dtype=torch.float64)
    keys = [torch.randn(n, 2, 8, generator=gen, dtype=torch.float64) for n in (4, 6)]
    vals = [torch.randn(n, 2, 8, generator=gen, dtype=torch.float64) for n in (4, 6)]
    outs, lses = [], []
    for k, v in zip(keys, vals):
        s = torch.einsum("qhd,khd->hqk", q, k)
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v))
    lses[0][:, 3] = float("-inf")
    outs[0][3] = float("nan")
    out, lse = lse_merge_reference(torch.stack(outs), torch.stack(lses))
    s = torch.einsum("qhd,khd->hqk", q, torch.cat(keys))
    s[:, 3, :4] = float("-inf")
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), torch.cat(vals)))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))


# --------------------------------------------------------------------------- interpreter
def _case_merge_triton(dtype):
    from dtree.ops.stack_attention.lse_merge_triton import lse_merge_triton

    gen = torch.Generator().manual_seed(1)
    c, t, h, dv = 3, 70, 3, 20
    outs = torch.randn(c, t, h, dv, generator=gen).to(getattr(torch, dtype))
    lses = torch.randn(c, h, t, generator=gen) * 3
    lses[0, :, ::3] = float("-inf")
    lses[1, 1, 5:40] = float("-inf")
    outs[0, ::3] = float("nan")  # uncovered rows are never read
    got_out, got_lse = lse_merge_triton(outs, lses)
    want_out, want_lse = lse_merge_reference(outs, lses)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == "float32" else {"atol": 2e-3, "rtol": 2e-3}
    torch.testing.assert_close(got_out.float(), want_out.float(), **tol)


def _case_options_run_triton(option):
    """The flash-attn backend hands calls with options to the Triton kernel (here
    interpreted: no flash-attn and no GPU needed on that path)."""
    from dtree.ops.stack_attention.flash4 import stack_attention_flash4

    layout, t = layout_of(*LAYOUTS["odd"])
    opts = OPTIONS[option](torch.Generator().manual_seed(1), 4)
    check_against_naive(stack_attention_flash4, layout, t, 40, 4, 2, 24, options=opts)


@pytest.fixture(scope="module")
def worker():
    w = InterpreterWorker("test_stack_attention_regions")
    yield w
    w.close()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_merge_triton_matches_reference(worker, dtype):
    worker.run("merge_triton", dtype=dtype)


@pytest.mark.parametrize("option", ["softcap", "window"])
def test_flash_attn_backend_runs_triton_for_options(worker, option):
    worker.run("options_run_triton", option=option)


def test_flash_attn_backend_says_why_not_on_cpu():
    with pytest.raises(ValueError, match="attention='flash-attn' (cannot run here: flash-attn-4|runs on CUDA)"):
        resolve_backend("stack_attention", "flash-attn", "cpu", torch.bfloat16, head_dim=64)
    assert resolve_backend("stack_attention", "auto", "cpu", torch.bfloat16, head_dim=64) == "sdpa"


# --------------------------------------------------------------------------- GPU
def _gpu_cases(rng):
    yield from gpu_layouts(rng)
    agentic, t = layout_of([256] * 8, [[(0, 512), (512 + 128 * (i // 2), 640 + 128 * (i // 2))] for i in range(8)],
                           1024)
    yield "agentic", agentic, t, 1024
    nested, t = nested_layout(300)
    yield "nested", nested, t, 300


def _flash4():
    from dtree.ops.backends import Target
    from dtree.ops.stack_attention.flash4 import flash4_unavailable

    why = flash4_unavailable(Target(torch.device("cuda"), torch.bfloat16, head_dim=128))
    if why is not None:
        pytest.skip(why)
    from dtree.ops.stack_attention.flash4 import stack_attention_flash4

    return stack_attention_flash4


# each case compiles flash-attn-4 kernels (seconds each): the benchmark's head shapes
# (GQA 4 and 6 at head dim 128, shared through its disk cache), and fp16 MHA at 64
FLASH4_GPU_CASES = [
    pytest.param(torch.bfloat16, 128, 8, 2, False, id="bf16-128-gqa4"),
    pytest.param(torch.bfloat16, 128, 8, 2, True, id="bf16-128-gqa4-deterministic"),
    pytest.param(torch.bfloat16, 128, 12, 2, False, id="bf16-128-gqa6"),
    pytest.param(torch.float16, 64, 4, 4, False, id="fp16-64-mha"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,hq,hkv,deterministic", FLASH4_GPU_CASES)
def test_gpu_flash_attn_flash_rule(dtype, d, hq, hkv, deterministic):
    attn = with_flags(_flash4(), deterministic)
    for name, layout, t, used in _gpu_cases(np.random.default_rng(d + hq)):
        if layout.call_slots is not None:
            continue  # check_flash_rule compares the call's own dk without the stack seeds
        check_flash_rule(name, attn, layout, t, used, hq, hkv, d, dtype)


@pytest.mark.gpu
def test_gpu_flash_attn_in_call_ancestors():
    layout, t = nested_layout(300)
    check_against_naive(_flash4(), layout, t, 300, 8, 2, 128, dtype=torch.bfloat16, device="cuda",
                        tol={"atol": 5e-2, "rtol": 5e-2})


def _grads_of_runs(attn, layout, t, used, hq, hkv, d, runs=3):
    results = []
    for _ in range(runs):
        stack, q, k, v = make_problem(layout, t, used, hq, hkv, d, dtype=torch.bfloat16, device="cuda", seed=7)
        out = attn(q, k, v, StackSlots(stack, 0, layout), AttentionOptions(scale=d**-0.5))
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to("cuda", out.dtype)
        grads = torch.autograd.grad(out, (q, k, v), go)
        results.append([out, *grads, stack.grad_k[0].clone(), stack.grad_v[0].clone()])
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flash-attn"])
def test_gpu_deterministic_mode_is_bitwise_reproducible(backend):
    """Three runs of one call, deterministic mode: identical outputs and gradients, the
    stack's (many prefix items per stack cell: 64-row items under a shared prompt) included."""
    if backend == "flash-attn":
        attn = with_flags(_flash4(), True)
    else:
        from dtree.ops.stack_attention.triton_autograd import stack_attention_triton_tuned

        attn = with_flags(stack_attention_triton_tuned, True, prefix_item_rows=64)
    layout, t = layout_of([700, 300, 513, 900, 29, 300], [[(0, 1500)]] * 6, 1500)
    first, *rest = _grads_of_runs(attn, layout, t, 1500, 8, 2, 128)
    names = ["out", "dq", "dk", "dv", "stack dk", "stack dv"]
    for other in rest:
        for name, a, b in zip(names, first, other):
            assert torch.equal(a, b), f"{backend} {name} differs between runs"


@pytest.mark.gpu
def test_gpu_flash_attn_replays_the_recorded_kernels(monkeypatch):
    """After one interface call per call class, the flash-attn backend launches
    flash-attn-4's compiled kernels itself (dtree/ops/stack_attention/flash4_replay.py): no interface
    call, and results bitwise equal to the interface's (deterministic mode)."""
    from dtree.ops.stack_attention import flash4 as sf

    attn = with_flags(_flash4(), True)
    calls = sf._calls()
    monkeypatch.setattr(calls, "kernels", {})  # every class recorded anew here
    layout, t = layout_of([700, 300, 513, 29], [[(0, 900)]] * 3 + [[(0, 50)]], 900)  # own, two levels
    first = _grads_of_runs(attn, layout, t, 900, 8, 2, 128, runs=1)[0]
    assert calls.kernels and all(k is not None for k in calls.kernels.values()), calls.kernels
    called = []
    for name in ("_flash_attn_fwd", "_flash_attn_bwd"):
        monkeypatch.setattr(calls.fi, name, lambda *a, name=name, **k: called.append(name))
    layout2, t2 = layout_of([700, 300, 513, 29], [[(0, 900)]] * 3 + [[(0, 50)]], 900)  # a fresh layout object
    second = _grads_of_runs(attn, layout2, t2, 900, 8, 2, 128, runs=1)[0]
    assert not called
    for name, a, b in zip(["out", "dq", "dk", "dv", "stack dk", "stack dv"], first, second):
        assert torch.equal(a, b), f"replayed {name} differs from the interface's"


@pytest.mark.gpu
@pytest.mark.parametrize("option", ["plain", "all"])
def test_gpu_triton_deterministic_flash_rule(option):
    from test_stack_attention_triton import GPU_OPTIONS

    from dtree.ops.stack_attention.triton_autograd import stack_attention_triton_tuned

    attn = with_flags(stack_attention_triton_tuned, True, prefix_item_rows=128)
    opts = GPU_OPTIONS[option](8) if option != "plain" else {}
    for name, layout, t, used in _gpu_cases(np.random.default_rng(5)):
        if layout.call_slots is None:
            check_flash_rule(name, attn, layout, t, used, 8, 2, 128, torch.bfloat16, options=opts)


@pytest.mark.gpu
def test_gpu_merge_triton_matches_reference():
    from dtree.ops.stack_attention.lse_merge_triton import lse_merge_triton

    gen = torch.Generator().manual_seed(2)
    outs = torch.randn(3, 1000, 12, 128, generator=gen).to("cuda", torch.bfloat16)
    lses = (torch.randn(3, 12, 1000, generator=gen) * 4).cuda()
    lses[0, :, ::7] = float("-inf")
    got, got_lse = lse_merge_triton(outs, lses)
    want, want_lse = lse_merge_reference(outs, lses)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
