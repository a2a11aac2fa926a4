"""Harness of the per-setup tests (test_peft, test_frozen, test_late_changes, ...): a
forest that needs several model calls, the three modes and three group budgets, and
every parameter gradient compared with the same model run on each path by HF
(tests/reference.py)."""

from __future__ import annotations

import contextlib
import copy

import torch
from reference import grad_errors, linearized_step, path_logprobs

import dtree

FP32_TOL = 1e-5
MODES = ("auto", "retain", "recompute")
GROUP_TOKENS = (0, 8, None)  # node by node, a few segments per call, the default (one call here)
CHUNK = 3  # 3-token segments: chains of calls, and subtrees packed with in-call ancestors

# Three trees: a deep one with branches at several depths, a duplicate and a sequence
# that ends inside another; a second with two branches; a two-token one.
SEQS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    [1, 2, 3, 4, 5, 6, 7, 12, 13, 14],
    [1, 2, 3, 4, 5, 15, 16, 17, 18, 19, 20, 21],
    [1, 2, 3, 22, 23],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    [1, 2, 3, 4, 5, 6],
    [30, 31, 32, 33, 34, 35, 36],
    [30, 31, 32, 40, 41, 42, 43, 44, 45],
    [50, 51],
]


def reference(model, seqs=SEQS, loss_kind: str = "nll"):
    """(per-path model with its gradients, loss) of linearized HF training on ``seqs``."""
    ref_model = copy.deepcopy(model)
    ref_loss, _ = linearized_step(ref_model, seqs, None, loss_kind, "token_mean")
    return ref_model, ref_loss


def run_dtree(model, seqs=SEQS, *, copy_model: bool = True, **rt_kw):
    """(dtree output, the model it trained): one ``forward_backward`` with token-mean NLL."""
    tree_model = copy.deepcopy(model) if copy_model else model
    rt_kw.setdefault("chunk_size", CHUNK)
    out = dtree.TreeRuntime(tree_model, **rt_kw).forward_backward(dtree.Forest.from_sequences(seqs), dtree.losses.nll())
    return out, tree_model


def assert_exact(tree_model, ref_model, out=None, ref_loss=None, tol: float = FP32_TOL) -> None:
    """Every parameter's gradient within ``tol`` (relative, with the floor of
    ``grad_errors``), the same parameters with and without gradients, and some
    gradient that is not zero (so the comparison can fail)."""
    errs = grad_errors(tree_model, ref_model)
    worst = max(errs, key=errs.get)
    assert errs[worst] < tol, f"gradient of {worst} off by {errs[worst]:.2e}"
    ref = dict(ref_model.named_parameters())
    for name, p in tree_model.named_parameters():
        assert (p.grad is None) == (ref[name].grad is None), name
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tree_model.parameters())
    if out is not None:
        assert abs(out.loss - ref_loss) <= tol * max(1.0, abs(ref_loss)), (out.loss, ref_loss)


def assert_logprobs_exact(model, rt_kw: dict, seqs=SEQS, tol: float = FP32_TOL) -> None:
    """``TreeRuntime.logprobs`` equals the per-path log-probs of the same model."""
    rt_kw = {"chunk_size": CHUNK, **rt_kw}
    got = dtree.TreeRuntime(model, **rt_kw).logprobs(dtree.Forest.from_sequences(seqs))
    with torch.no_grad():
        for s, lp in zip(seqs, got):
            torch.testing.assert_close(lp, path_logprobs(model, s), atol=tol, rtol=tol)


def grads_of(model) -> dict:
    """name -> a copy of ``param.grad`` (None where there is none)."""
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def assert_grads_equal(model, before: dict) -> None:
    """``param.grad`` is exactly ``before`` (a failed step touched nothing)."""
    for n, p in model.named_parameters():
        if before[n] is None:
            assert p.grad is None, n
        else:
            assert torch.equal(p.grad, before[n]), n


def assert_flash_rule(got, base, exact, label: str = "", outputs: int = 1) -> None:
    """The flash-attention test rule, entry by entry: each tensor of ``got`` (the bf16 path
    under test) is at most 2x (its first ``outputs`` entries: outputs) or 3x (gradients)
    as far from the float32 reference ``exact`` as ``base`` (the bf16 PyTorch reference)
    is, plus a floor of 1e-3 of the reference's size. None entries of ``exact`` are skipped."""
    for k, (g, b, e) in enumerate(zip(got, base, exact)):
        if e is None:
            continue
        err = (g.float() - e.float()).abs().max().item()
        base_err = (b.float() - e.float()).abs().max().item()
        bound = (2 if k < outputs else 3) * base_err + 1e-3 * max(1e-3, e.float().abs().max().item())
        assert err <= bound, f"{label}[{k}]: error {err:.3e}, the bf16 reference's {base_err:.3e}"


def assert_model_flash_rule(
    model, exact, bf16_ref, loss: float, exact_loss: float, bf16_loss: float, label: str
) -> None:
    """:func:`assert_flash_rule` on the loss (2x) and every parameter's gradient (3x) of
    ``model`` (bf16, the path under test) against ``exact`` (float32) and ``bf16_ref``."""
    assert abs(loss - exact_loss) <= 2 * abs(bf16_loss - exact_loss) + 1e-3 * max(1.0, abs(exact_loss))
    params = zip(model.named_parameters(), exact.named_parameters(), bf16_ref.named_parameters())
    for (name, p), (_, e), (_, b) in params:
        assert_flash_rule([p.grad], [b.grad], [e.grad], f"{label} {name}", outputs=0)



def assert_flash_attn_steps(window: int | None, label: str, check=None, **rt_kw) -> None:
    """bf16 steps through the flash-attn backend (flash-attn-4, a CUDA device) on a head-dim-64
    Mistral (``window``: its sliding window, None for plain attention), with calls of every size
    (one segment, packed subtrees, the whole forest): every gradient by the flash-attention rule
    against the float32 model per path. ``check(out)`` inspects each step's output."""
    from test_runtime_exact import EDGE_CASES
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(0)
    seqs = [s for case in EDGE_CASES.values() for s in case]
    seqs += [torch.randint(0, 97, (300,)).tolist()]
    seqs += [seqs[-1][:150] + torch.randint(0, 97, (90,)).tolist(), seqs[-1][:200] + [5, 6, 7]]
    cfg = MistralConfig(vocab_size=97, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=window,
                        tie_word_embeddings=True, attn_implementation="eager")
    base = AutoModelForCausalLM.from_config(cfg).cuda()
    exact, bf16_ref = copy.deepcopy(base), copy.deepcopy(base).to(torch.bfloat16)
    exact_loss, _ = linearized_step(exact, seqs)
    bf16_loss, _ = linearized_step(bf16_ref, seqs)
    for group_tokens in (0, 64, 4096):
        model = copy.deepcopy(base).to(torch.bfloat16)
        rt = dtree.TreeRuntime(model, attention="flash-attn", chunk_size=16, group_tokens=group_tokens, **rt_kw)
        out = rt.forward_backward(dtree.Forest.from_sequences(seqs), dtree.losses.nll())
        assert out.metrics["attention"] == "flash-attn"
        if check is not None:
            check(out)
        assert_model_flash_rule(model, exact, bf16_ref, out.loss, exact_loss, bf16_loss,
                                f"{label} window={window} group_tokens={group_tokens}")

@contextlib.contextmanager
def grads_when_first_reached(model):
    """Yields ``{name: param.grad}`` as each parameter's ``.grad`` was when the block's first
    gradient for it arrived (a tensor hook runs before autograd accumulates it): None when a
    step moved the old gradients aside, the old tensor when it accumulates in place."""
    seen = {}

    def hook(name):
        def record(grad):
            seen.setdefault(name, model.get_parameter(name).grad)
            return grad
        return record

    handles = [p.register_hook(hook(n)) for n, p in model.named_parameters()]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()
