"""End to end on CUDA: the fused Triton path (in-call subtrees, packed siblings,
chunk chains, recompute) against HF run on each path, every parameter gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import make_model
from reference import grad_errors, linearized_step
from test_runtime_exact import EDGE_CASES

import dtree

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["retain", "recompute", "auto"])
@pytest.mark.parametrize("group_tokens", [0, 7, 4096])
def test_triton_runtime_matches_per_path_reference(mode, group_tokens):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    seqs = [s for case in EDGE_CASES.values() for s in case]
    seqs += [torch.randint(0, 97, (300,)).tolist()]
    seqs += [seqs[-1][:150] + torch.randint(0, 97, (90,)).tolist()]
    model = make_model("qwen2", tied=True).cuda()
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    rt = dtree.TreeRuntime(tree_model, mode=mode, attention="triton", chunk_size=64, group_tokens=group_tokens)
    out = rt.forward_backward(dtree.Forest.from_sequences(seqs), dtree.losses.nll("sum"))
    ref_loss, _ = linearized_step(ref_model, seqs, None, "nll", "sum")
    errs = grad_errors(tree_model, ref_model)
    assert max(errs.values()) < 1e-4, errs  # fp32 kernels (no tf32), different summation order
    assert abs(out.loss - ref_loss) < 1e-4 * abs(ref_loss)


@pytest.mark.parametrize("checkpoint_layers", [False, True])
@pytest.mark.parametrize("mode", ["retain", "recompute"])
def test_checkpoint_layers_on_cuda_match_per_path(mode, checkpoint_layers):
    """fp32 (no tf32) on the fused Triton attention: dtree's layer checkpointing re-runs
    every layer in backward, re-pushing and seeding its K/V."""
    torch.backends.cuda.matmul.allow_tf32 = False
    seqs = [s for case in EDGE_CASES.values() for s in case]
    model = make_model("qwen2", tied=True).cuda()
    tree_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    rt = dtree.TreeRuntime(tree_model, mode=mode, attention="triton", chunk_size=5, group_tokens=16,
                           checkpoint_layers=checkpoint_layers)
    out = rt.forward_backward(dtree.Forest.from_sequences(seqs), dtree.losses.nll("sum"))
    assert out.metrics["memory_plan"]["checkpoint_layers"] == (2 if checkpoint_layers else 0)
    ref_loss, _ = linearized_step(ref_model, seqs, None, "nll", "sum")
    errs = grad_errors(tree_model, ref_model)
    assert max(errs.values()) < 1e-4, errs
    assert abs(out.loss - ref_loss) < 1e-4 * abs(ref_loss)


@pytest.mark.parametrize("memory", ["auto", "low", "auto-kept"])
def test_bf16_runtime_with_the_fused_head_by_the_flash_rule(memory, monkeypatch):
    """bf16 on CUDA: the LM head runs the fused Triton op (counted) and, with
    ``memory="low"``, every layer is checkpointed; ``auto-kept``: the policy's head chunks are
    32 rows, so the plan (``dtree.plan.head_keep``) runs calls of more loss rows in one chunk, their
    logits kept. Every gradient's error against the float32 model per path is at most 3x (the
    loss's 2x) that of the bf16 model per path, plus a floor."""
    from dtree.ops.logprobs import fused_head as fh
    from dtree.plan import memory_policy

    calls = []
    original = fh.token_logprobs_triton

    def counted(*a, **k):
        calls.append((a[0].shape[0], k.get("chunk_size"), k.get("keep_logits")))
        return original(*a, **k)

    monkeypatch.setattr(fh, "token_logprobs_triton", counted)
    if memory == "auto-kept":
        monkeypatch.setattr(memory_policy, "LOGPROB_CHUNKS", (32,))
    torch.manual_seed(0)
    seqs = [s for case in EDGE_CASES.values() for s in case]
    seqs += [torch.randint(0, 97, (300,)).tolist()]
    seqs += [seqs[-1][:150] + torch.randint(0, 97, (90,)).tolist()]
    base = make_model("qwen2", tied=True).cuda()
    exact, bf16_ref = copy.deepcopy(base), copy.deepcopy(base).to(torch.bfloat16)
    model = copy.deepcopy(base).to(torch.bfloat16)
    exact_loss, _ = linearized_step(exact, seqs)
    bf16_loss, _ = linearized_step(bf16_ref, seqs)
    rt = dtree.TreeRuntime(model, chunk_size=64, memory=memory.removesuffix("-kept"))
    out = rt.forward_backward(dtree.Forest.from_sequences(seqs), dtree.losses.nll())
    assert calls, "the fused LM-head op did not run"
    plan = out.metrics["memory_plan"]
    if memory == "auto-kept":
        assert plan["logprob_chunk"] == 32 and plan["kept_head_rows"] > 32
        assert any(keep and chunk == rows > 32 for rows, chunk, keep in calls), calls
    assert plan["checkpoint_layers"] == 2 if memory == "low" else 0 <= plan["checkpoint_layers"] <= 2
    assert plan["bytes_per_token"]["source"] == "measured"  # the probe ran on the GPU
    assert rt.stack is None and not out.metrics["memory"]["freed_after_step"]  # the stack dropped, the cache kept
    assert abs(out.loss - exact_loss) <= 2 * abs(bf16_loss - exact_loss) + 1e-3 * max(1.0, abs(exact_loss))
    for (name, p), (_, e), (_, b) in zip(model.named_parameters(), exact.named_parameters(), bf16_ref.named_parameters()):
        err = (p.grad.float() - e.grad).abs().max().item()
        base_err = (b.grad.float() - e.grad).abs().max().item()
        assert err <= 3 * base_err + 1e-3 * max(1e-3, e.grad.abs().max().item()), (
            f"{memory} {name}: dtree {err:.3e}, bf16 per path {base_err:.3e}"
        )


@pytest.mark.parametrize("window", [None, 24], ids=["one-call path", "window: the Triton fallback"])
@pytest.mark.parametrize("mode", ["retain", "recompute"])
def test_flash_attn_runtime_with_gradient_slots_for_the_path(monkeypatch, mode, window):
    """bf16 through the flash-attn backend (head dim 64), whose one-call path returns a call's
    own K/V gradients whole: the stack gets gradient slots for the groups with children only.
    Every gradient by the flash-attention rule against the float32 model per path, with calls
    of every size (one segment, packed subtrees, the whole forest); with a sliding window every
    call takes the Triton kernel inside the backend, which adds in-call ancestors' dK/dV into
    the leaf's own slots: the stack grows its gradient slots there and stays within the rule."""
    from setups import assert_flash_attn_steps
    from test_masked_call import _stack_sizes
    from test_stack_attention_regions import _flash4

    _flash4()  # skips without flash-attn-4 on a Hopper GPU
    sizes, grown = _stack_sizes(monkeypatch)
    assert_flash_attn_steps(window, mode, mode=mode, free_after_step=False)
    assert sizes and all(grads < tokens for tokens, grads in sizes), sizes
    assert (grown[0] > 0) if window else (grown[0] == 0), (window, grown)


def test_host_guard_copies_before_the_first_write_and_holds_no_device_copy():
    """``grad_guard="host"`` on CUDA: the old gradients go to pinned host memory on a side stream
    while the step runs; the step adds into the same ``.grad`` tensors only after that copy (a
    large vocabulary makes the copy outlast the first backward, so a missing wait would show up
    as a wrong restore); a failed step restores them bit for bit, a good one equals the
    unguarded step bit for bit, and the step's peak holds no second copy on the device."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=65536, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config).cuda()
    twin = copy.deepcopy(model)
    kw = {"chunk_size": 8, "group_tokens": 8}
    hosted = dtree.TreeRuntime(model, grad_guard="host", **kw)
    plain = dtree.TreeRuntime(twin, grad_guard=False, **kw)
    seqs = [torch.randint(0, 65536, (40,)).tolist() for _ in range(3)]
    seqs += [seqs[0][:20] + torch.randint(0, 65536, (30,)).tolist()]
    forest = dtree.Forest.from_sequences(seqs)
    for rt in (hosted, plain):
        rt.forward_backward(forest, dtree.losses.nll())
    old = {n: p.grad for n, p in model.named_parameters()}
    before = {n: g.clone() for n, g in old.items()}
    calls = [0]

    def raising_last(logp, fields):
        calls[0] += 1
        if calls[0] == 6:
            raise RuntimeError("injected")
        return -logp

    with pytest.raises(RuntimeError, match="injected"):
        hosted.forward_backward(forest, dtree.losses.TokenLoss(raising_last))
    assert calls[0] == 6
    for n, p in model.named_parameters():
        assert p.grad is old[n] and torch.equal(p.grad, before[n]), n
    peaks = {}
    for name, rt in (("host", hosted), ("in place", plain)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        rt.forward_backward(forest, dtree.losses.nll())
        peaks[name] = torch.cuda.max_memory_allocated() - base
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.grad is old[n] and torch.equal(p.grad, q.grad), n
    assert peaks["host"] <= peaks["in place"] + 2**20, peaks


def test_offloaded_checkpoints_on_cuda_are_exact_and_leaner():
    """``offload_checkpoints=True`` on CUDA: the layer inputs go to pinned pages on a side stream
    and come back before each re-run (the layer below prefetched): the step's gradients equal
    the step keeping them on the device bit for bit (deterministic mode); as the backward reaches the decoder layers
    (a hook on the final norm's input, after a device sync) the device holds about all the
    layer inputs less; every page is free again after the step."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from dtree.models import host_checkpoints

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config).cuda()
    twin = copy.deepcopy(model)
    seqs = [torch.randint(0, 4096, (1500,)).tolist() for _ in range(2)]
    seqs += [seqs[0][:700] + torch.randint(0, 4096, (800,)).tolist()]
    forest = dtree.Forest.from_sequences(seqs)
    # deterministic: at this size two plain runs differ in the last bits (~1e-6), so bit-for-bit needs it. The LM
    # head's chunk is pinned: the policy scores the offloaded plan apart and picked 512 rows against the device's 1024
    # (session AE), and the head's matmuls over other row counts round differently in every gradient below them
    kw = {"group_tokens": 8192, "checkpoint_layers": True, "deterministic": True, "logprob_chunk": 1024}
    held_at_backward: dict[str, list[int]] = {}

    def watch(name: str, own) -> None:
        def on_grad(_grad):
            torch.cuda.synchronize()
            torch.empty(1, device="cuda")  # the allocator frees blocks whose side-stream copies ended
            held_at_backward.setdefault(name, []).append(torch.cuda.memory_allocated())

        def hook(module, args, out):
            if args[0].requires_grad:  # not the memory probe's calls without grad
                args[0].register_hook(on_grad)

        own.model.norm.register_forward_hook(hook)

    runs = {"host": dtree.TreeRuntime(model, offload_checkpoints=True, **kw),
            "device": dtree.TreeRuntime(twin, offload_checkpoints=False, **kw)}
    for (name, _), own in zip(runs.items(), (model, twin)):
        watch(name, own)
    for _ in range(2):  # the second: the stack and the pages exist already
        for (name, rt), own in zip(runs.items(), (model, twin)):
            own.zero_grad(set_to_none=True)
            out = rt.forward_backward(forest, dtree.losses.nll())
            torch.cuda.synchronize()
            assert out.metrics["memory_plan"]["offload_checkpoints"] is (name == "host")
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), n
    layer_input = forest.num_unique_tokens * config.hidden_size * 4
    saved = held_at_backward["device"][-1] - held_at_backward["host"][-1]
    assert saved >= 0.9 * config.num_hidden_layers * layer_input, (held_at_backward, layer_input)
    held = host_checkpoints.host_page_bytes()
    assert held >= config.num_hidden_layers * layer_input
    assert host_checkpoints.free_page_bytes() == held
