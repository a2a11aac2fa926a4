"""The fused LM-head log-prob / entropy op against full-logits autograd.

CPU: the Triton kernels run under the interpreter in a worker subprocess
(``interpreter_worker``); in float32 every output and every gradient (hidden, weight,
bias) is compared with the float64 full-logits computation (``token_logprobs_dense``)
for gradients arriving on the log-probs, on the entropy, or on both, under every logit
transform, at odd sizes and chunk boundaries; in float16 by the flash-attention rule.
The kernels are also compared stage by stage with their torch twins. The torch path
(float64, CPU without the interpreter) and the input checks run in this process.
Under the interpreter, bf16 stores truncate instead of rounding to nearest (Triton 3.6),
so bf16 is tested on GPU only.

GPU (``-m gpu``): bf16/fp16 by the flash-attention rule (error against the float32
full-logits reference at most 2x (forward) / 3x (gradients) that of the same
computation in torch at the input precision, plus an absolute floor), at vocab 151,936.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")

from interpreter_worker import InterpreterWorker  # noqa: E402

from dtree.ops.logprobs import fused_head as fh  # noqa: E402
from dtree.ops.logprobs import triton_kernels as lt  # noqa: E402

TRANSFORMS = {
    "plain": {},
    "scale": {"logit_scale": 0.37},
    "softcap": {"softcap": 2.5},
    "temperature": {"temperature": 0.6},
    "all": {"logit_scale": 1.3, "softcap": 4.0, "temperature": 1.7},
}
# (rows, hidden, vocab, chunk): ragged last chunk, chunks that end exactly at N, one
# chunk, vocab below one block, one token in the vocabulary
SIZES = {
    "ragged": (63, 60, 1000, 17),
    "exact": (64, 60, 1000, 32),
    "one_chunk": (23, 20, 300, 4096),
    "small_vocab": (5, 8, 100, 2),
    "vocab_1": (3, 4, 1, 2),
    "small": (21, 24, 300, 8),  # for the transform x gradient-seed matrix
}


# --------------------------------------------------------------------------- problems
def make_problem(n, h, v, *, dtype=torch.float32, device="cpu", seed=0, bias=True, logit_std=3.0):
    """Leaf hidden [n, h], weight [v, h], bias [v] (or None) whose logits have standard
    deviation ``logit_std``; labels [n] with the vocabulary's first and last ids in."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * (logit_std / h**0.5)
    b = torch.randn(v, generator=gen) if bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[0], labels[-1] = 0, v - 1
    leaves = [x.to(device=device, dtype=dtype).requires_grad_() if x is not None else None for x in (hidden, weight, b)]
    return (*leaves, labels.to(device))


def run(fn, hidden, weight, bias, labels, kw, seeds: str, seed=0):
    """(logp, entropy, d hidden, d weight, d bias) of ``fn`` for random gradients on the
    outputs named by ``seeds`` ("logp", "entropy" or "both")."""
    with_entropy = seeds != "logp"
    logp, ent = fn(hidden, weight, labels, bias, with_entropy=with_entropy, **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    g, ge = (torch.randn(logp.shape, generator=gen).to(logp) for _ in range(2))
    total = 0.0
    if seeds in ("logp", "both"):
        total = total + (logp * g).sum()
    if seeds in ("entropy", "both"):
        total = total + (ent * ge).sum()
    leaves = [x for x in (hidden, weight, bias) if x is not None]
    grads = torch.autograd.grad(total, leaves)
    grads = list(grads) + ([None] if bias is None else [])
    return [logp, ent, *grads]


def float64_copy(hidden, weight, bias, labels):
    return [x.detach().double().requires_grad_() if x is not None else None for x in (hidden, weight, bias)] + [labels]


NAMES = ["logp", "entropy", "d hidden", "d weight", "d bias"]


def assert_close_rel(got, want, rel=1e-5, what=""):
    """max |got - want| <= rel * max |want| (a floor of 1 for values near 0, where float32
    rounding of O(1) intermediates dominates)."""
    for name, g, w in zip(NAMES, got, want):
        if w is None:
            assert g is None, f"{what} {name}: expected None"
            continue
        err = (g.double() - w.double()).abs().max().item()
        scale = max(w.abs().max().item(), 1.0)
        assert err <= rel * scale, f"{what} {name}: max error {err:.3e} > {rel:g} x {scale:.3e}"


# --------------------------------------------------------------------------- interpreted cases
def _interpreted():
    assert lt._INTERPRET, "the worker must start with TRITON_INTERPRET=1"
    return fh


def _case_against_float64(size, transform, seeds, bias=True, seed=0):
    n, h, v, chunk = SIZES[size]
    inputs = make_problem(n, h, v, seed=seed, bias=bias)
    kw = dict(TRANSFORMS[transform])
    got = run(_interpreted().token_logprobs_triton, *inputs, {**kw, "chunk_size": chunk, "impl": "triton"}, seeds)
    want = run(fh.token_logprobs_dense, *float64_copy(*inputs), kw, seeds)
    assert got[0].dtype == torch.float32 and (got[1] is None or got[1].dtype == torch.float32)
    assert_close_rel(got, want, what=f"{size}/{transform}/{seeds}")


def _case_peaked_entropy():
    """Nearly one-hot rows with |logits| ~ 100: the kernel's entropy of given float32
    logits keeps its absolute precision (5e-7; computing lse - sum p z would lose ~1e-5
    to cancellation against the max logit), and the whole op stays within 1e-5."""
    inputs = make_problem(40, 16, 700, seed=3, logit_std=40.0)
    hidden, weight, bias, labels = inputs
    logits = torch.nn.functional.linear(hidden, weight, bias).detach()
    logq = torch.log_softmax(logits.double(), -1)
    exact = -(logq.exp() * logq).sum(-1)
    assert exact.min().item() < 1e-3 and logits.abs().max().item() > 100
    _, _, entropy = _interpreted()._row_stats_triton(logits, labels, lt.LogitTransform(), True)
    assert (entropy.double() - exact).abs().max().item() <= 5e-7
    got = run(fh.token_logprobs_triton, *inputs, {"chunk_size": 16, "impl": "triton"}, "both")
    want = run(fh.token_logprobs_dense, *float64_copy(*inputs), {}, "both")
    assert_close_rel(got, want, what="peaked")


def _case_stages_match_torch_twins(dtype):
    """Each kernel against its torch twin on raw logits (ragged tiles, extreme rows)."""
    lt_ = _interpreted()
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(5)
    n, v = 13, 300
    x = torch.randn(n, v, generator=gen) * 4
    x[1] *= 30  # peaked
    x[2] = 0.0  # uniform
    x = x.to(dtype)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[0], labels[3] = v - 1, 0
    g, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    for kw in TRANSFORMS.values():
        tf = lt_.LogitTransform(kw.get("logit_scale", 1.0), kw.get("softcap"), kw.get("temperature", 1.0))
        fused = lt_._row_stats_triton(x, labels, tf, True)
        twin = lt_._row_stats_torch(x, labels, tf, True)
        for name, a, b in zip(("logp", "normalizer", "entropy"), fused, twin):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6, msg=lambda m, name=name: f"{kw} {name}: {m}")
        norm, ent = twin[1], twin[2]
        for gg, gge in ((g, ge), (g, None), (None, ge)):
            d_fused = lt_._dlogits_triton(x.clone(), labels, norm, ent, gg, gge, tf)
            d_twin = lt_._dlogits_torch(x.clone(), labels, norm, ent, gg, gge, tf)
            # float16: the two round the same float32 value; allow one ulp where they differ by rounding
            tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-3, "rtol": 1e-3}
            torch.testing.assert_close(d_fused, d_twin, **tol, msg=lambda m: f"{kw} dlogits: {m}")
            # a slice of the vocabulary (the backward's pieces): the same columns of the whole rows' result,
            # the one-hot term only where a label falls inside it
            for lo, hi in ((0, 77), (77, 128), (128, v)):
                s_fused = lt_._dlogits_triton(x[:, lo:hi].contiguous(), labels, norm, ent, gg, gge, tf, lo)
                s_twin = lt_._dlogits_torch(x[:, lo:hi].contiguous(), labels, norm, ent, gg, gge, tf, lo)
                torch.testing.assert_close(s_fused, d_twin[:, lo:hi], **tol, msg=lambda m: f"{kw} [{lo}, {hi}): {m}")
                torch.testing.assert_close(s_twin, d_twin[:, lo:hi], **tol, msg=lambda m: f"{kw} twin [{lo}, {hi}): {m}")


def _case_labels_outside_vocab():
    """Ids outside [0, V) give NaN log-probs (no read outside the logits) and leave the
    other rows alone, in the kernel and the torch twin alike."""
    hidden, weight, bias, labels = make_problem(9, 12, 50, seed=2)
    labels[2], labels[5] = -1, 50
    for impl in ("triton", "torch"):
        logp, ent = fh.token_logprobs_triton(hidden, weight, labels, bias, with_entropy=True, chunk_size=4, impl=impl)
        bad = torch.zeros(9, dtype=torch.bool)
        bad[[2, 5]] = True
        assert torch.isnan(logp[bad]).all() and torch.isfinite(logp[~bad]).all(), impl
        assert torch.isfinite(ent).all(), impl
        ok = labels.clamp(0, 49)
        want, _ = fh.token_logprobs_dense(hidden, weight, ok, bias)
        torch.testing.assert_close(logp[~bad], want[~bad], atol=1e-5, rtol=1e-5)


def _case_fp16_flash_rule(transform):
    check_flash_rule(fh.token_logprobs_triton, 57, 40, 700, 16, torch.float16, "cpu", transform, "both")


def _case_weight_frozen_and_no_grad():
    """Only the inputs that require grad get one; under no_grad nothing is saved."""
    hidden, weight, bias, labels = make_problem(20, 8, 90, seed=4)
    weight.requires_grad_(False)
    logp, ent = fh.token_logprobs_triton(hidden, weight, labels, bias, with_entropy=True, chunk_size=7, impl="triton")
    dh, db = torch.autograd.grad((logp + ent).sum(), (hidden, bias))
    hd, wd, bd, _ = float64_copy(hidden, weight, bias, labels)
    wd.requires_grad_(False)
    lp, e = fh.token_logprobs_dense(hd, wd, labels, bd, with_entropy=True)
    wdh, wdb = torch.autograd.grad((lp + e).sum(), (hd, bd))
    torch.testing.assert_close(dh.double(), wdh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(db.double(), wdb, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        logp2, _ = fh.token_logprobs_triton(hidden, weight, labels, bias, chunk_size=7, impl="triton")
    assert not logp2.requires_grad
    torch.testing.assert_close(logp2, logp.detach())


def _case_token_logprobs_runs_the_fused_op(with_entropy: bool):
    """``dtree.ops.logprobs.token_logprobs(impl="triton")``, the path the runtime takes for a
    fused 16-bit head on CUDA, against the chunked torch op (``impl="torch"``) with the
    head's transforms (logit_scale, final_softcap) and a temperature: outputs and every
    gradient (hidden, weight, bias), float32."""
    from dtree.ops.logprobs import OutputHead, token_logprobs

    hidden, weight, bias, labels = make_problem(45, 24, 500, seed=3)
    head = OutputHead(weight=weight, bias=bias, logit_scale=1.3, final_softcap=4.0)
    results = []
    for impl in ("triton", "torch"):
        logp, ent = token_logprobs(hidden, head, labels, 16, temperature=0.7, with_entropy=with_entropy, impl=impl)
        total = logp.sum() + (ent.sum() if with_entropy else 0)
        results.append([logp, ent, *torch.autograd.grad(total, (hidden, weight, bias))])
    assert_close_rel(results[0], results[1], what="fused vs torch")


def _case_runtime_with_the_fused_head(mode: str, group_tokens):
    """The runtime with the fused head switched on (as on CUDA in 16-bit): every gradient
    against HF per path, float32."""
    from hf_models import make_model
    from setups import assert_exact, reference, run_dtree

    from dtree.ops.logprobs import interface as ops_logprobs

    calls = []
    original = fh.token_logprobs_triton

    def spy(*args, **kwargs):
        calls.append((kwargs.get("chunk_size"), kwargs.get("keep_logits")))
        return original(*args, **kwargs)

    predicate = ops_logprobs.fused_head_kernel
    ops_logprobs.fused_head_kernel = lambda head, dtype, device: head.fused
    fh.token_logprobs_triton = spy
    try:
        model = make_model("qwen2", tied=True)
        ref_model, ref_loss = reference(model)
        out, tree_model = run_dtree(model, mode=mode, group_tokens=group_tokens, logprob_chunk=5)
    finally:
        ops_logprobs.fused_head_kernel, fh.token_logprobs_triton = predicate, original
    assert calls and {chunk for chunk, _ in calls} == {5}
    # leaf calls and calls re-run in the backward keep a one-chunk head's logits; retained ones never
    assert any(keep for _, keep in calls), calls
    if mode == "auto":  # one segment per call: the retained groups' calls keep nothing
        assert not all(keep for _, keep in calls), calls
    assert_exact(tree_model, ref_model, out, ref_loss)


# --------------------------------------------------------------------------- worker tests
@pytest.fixture(scope="module")
def worker():
    w = InterpreterWorker("test_logprobs_triton")
    yield w
    w.close()


@pytest.mark.parametrize("size", [s for s in SIZES if s != "small"])
def test_sizes_match_float64(worker, size):
    worker.run("against_float64", size=size, transform="all", seeds="both")


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("seeds", ["logp", "entropy", "both"])
def test_transforms_and_gradient_seeds_match_float64(worker, transform, seeds):
    worker.run("against_float64", size="small", transform=transform, seeds=seeds, seed=len(transform))


def test_without_bias_matches_float64(worker):
    worker.run("against_float64", size="exact", transform="softcap", seeds="both", bias=False)


def test_peaked_entropy_keeps_absolute_precision(worker):
    worker.run("peaked_entropy")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_kernels_match_torch_twins(worker, dtype):
    worker.run("stages_match_torch_twins", dtype=dtype)


def test_labels_outside_vocab_give_nan(worker):
    worker.run("labels_outside_vocab")


@pytest.mark.parametrize("transform", ["plain", "all"])
def test_fp16_flash_rule(worker, transform):
    worker.run("fp16_flash_rule", transform=transform)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_token_logprobs_runs_the_fused_op(worker, with_entropy):
    worker.run("token_logprobs_runs_the_fused_op", with_entropy=with_entropy)


@pytest.mark.parametrize("mode,group_tokens", [("retain", None), ("recompute", 8), ("auto", 0)])
def test_runtime_with_the_fused_head(worker, mode, group_tokens):
    worker.run("runtime_with_the_fused_head", mode=mode, group_tokens=group_tokens)


def test_frozen_weight_and_no_grad(worker):
    worker.run("weight_frozen_and_no_grad")


# --------------------------------------------------------------------------- in process (torch path, checks)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_path_matches_dense(dtype):
    """float64 always takes the torch stages (``impl="auto"``); float32 on request."""
    inputs = make_problem(63, 60, 1000, dtype=dtype, seed=7)
    kw = dict(TRANSFORMS["all"])
    got = run(fh.token_logprobs_triton, *inputs, {**kw, "chunk_size": 17, "impl": "torch" if dtype == torch.float32 else "auto"}, "both")
    want = run(fh.token_logprobs_dense, *float64_copy(*inputs), kw, "both")
    assert got[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close_rel(got, want, rel=1e-12 if dtype == torch.float64 else 1e-5, what=str(dtype))


@pytest.mark.parametrize("rows,chunk", [(63, 17), (64, 32), (40, 40), (5, 2)])
def test_backward_slices_are_contiguous_and_bounded(monkeypatch, rows, chunk):
    """The backward's vocabulary slices cover the vocabulary once, in order, each a contiguous
    ``[rows, slice]`` logits buffer no larger than the forward's ``[chunk, V]`` (a narrower last
    slice as a strided view made the bf16 gradients 3x less accurate on an H200: session M)."""
    hidden, weight, bias, labels = make_problem(rows, 12, 1000, seed=1)
    seen = []
    original = fh._logits_into

    def spy(out, h, w, b):
        seen.append((out.shape, out.is_contiguous(), w.data_ptr()))
        return original(out, h, w, b)

    logp, _ = fh.token_logprobs_triton(hidden, weight, labels, bias, chunk_size=chunk, impl="torch")
    monkeypatch.setattr(fh, "_logits_into", spy)
    logp.sum().backward()
    assert sum(shape[1] for shape, _, _ in seen) == 1000
    assert all(ok and shape[0] == rows and shape[0] * shape[1] <= min(chunk, rows) * 1000 for shape, ok, _ in seen)
    starts = [(ptr - weight.data_ptr()) // (12 * weight.element_size()) for _, _, ptr in seen]
    assert starts == sorted(starts) and starts[0] == 0
    assert len(seen) == (1 if rows <= chunk else -(-1000 // fh.vocab_slice(rows, 1000, chunk)))


@pytest.mark.parametrize("rows,chunk", [(40, 40), (23, 64), (63, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kept_logits_give_the_same_gradients_bit_for_bit(monkeypatch, rows, chunk, dtype):
    """``keep_logits``: rows that fit one chunk keep the forward's logits, and the backward
    makes no product of its own; every gradient is bit for bit the recomputing one's, a second
    backward through the same graph (its kept logits overwritten by the first) recomputes and
    agrees too; more rows than a chunk recompute as before."""
    inputs = make_problem(rows, 12, 1000, dtype=dtype, seed=4)
    kw = {**TRANSFORMS["all"], "chunk_size": chunk, "impl": "torch"}
    want = run(fh.token_logprobs_triton, *inputs, kw, "both")
    products = []
    original = fh._logits_into
    monkeypatch.setattr(fh, "_logits_into", lambda *a: products.append(a[0].shape) or original(*a))
    logp, ent = fh.token_logprobs_triton(inputs[0], inputs[1], inputs[3], inputs[2], with_entropy=True,
                                         keep_logits=True, **kw)
    forward_products = len(products)
    gen = torch.Generator().manual_seed(1)
    g, ge = (torch.randn(logp.shape, generator=gen).to(logp) for _ in range(2))
    total = (logp * g).sum() + (ent * ge).sum()
    for attempt in range(2):
        grads = torch.autograd.grad(total, inputs[:3], retain_graph=attempt == 0)
        for name, a, b in zip(NAMES[2:], grads, want[2:]):
            assert torch.equal(a, b), f"{name}, backward {attempt}"
        recomputed = len(products) - forward_products
        if rows <= chunk:
            assert recomputed == attempt, f"backward {attempt}: {recomputed} products"
        else:
            assert recomputed >= 1
        forward_products = len(products)
    assert torch.equal(logp, want[0]) and torch.equal(ent, want[1])


def test_empty_rows():
    hidden, weight, bias, labels = make_problem(1, 8, 10)
    logp, ent = fh.token_logprobs_triton(hidden[:0], weight, labels[:0], bias, with_entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,)


def test_accumulate_mm_keeps_float32():
    """dW over several chunks of 16-bit products sums in float32 (no per-chunk rounding)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(30, 50, generator=gen).bfloat16()
    b = torch.randn(50, 20, generator=gen).bfloat16()
    acc = torch.full((30, 20), 0.1)
    fh._accumulate_mm(acc, a, b)
    torch.testing.assert_close(acc, 0.1 + a.float() @ b.float(), atol=1e-4, rtol=1e-4)


BAD_INPUTS = [
    ("hidden [N, H]", lambda h, w, b, y: (h[None], w, y, b, {})),
    ("weight [V, H]", lambda h, w, b, y: (h, w[:, :-1], y, b, {})),
    ("labels must be", lambda h, w, b, y: (h, w, y[:-1], b, {})),
    ("int64 or int32", lambda h, w, b, y: (h, w, y.float(), b, {})),
    ("bias must be", lambda h, w, b, y: (h, w, y, b[:-1], {})),
    ("share one floating dtype", lambda h, w, b, y: (h.double(), w, y, b, {})),
    ("temperature", lambda h, w, b, y: (h, w, y, b, {"temperature": 0.0})),
    ("softcap", lambda h, w, b, y: (h, w, y, b, {"softcap": -1.0})),
    ("logit_scale", lambda h, w, b, y: (h, w, y, b, {"logit_scale": float("nan")})),
    ("chunk_size", lambda h, w, b, y: (h, w, y, b, {"chunk_size": 0})),
    ("impl", lambda h, w, b, y: (h, w, y, b, {"impl": "cuda"})),
]


@pytest.mark.parametrize("match,make", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_input_raises_before_any_work(match, make):
    hidden, weight, bias, labels = make_problem(6, 8, 20)
    weight.grad = torch.ones_like(weight)
    h, w, y, b, kw = make(hidden, weight, bias, labels)
    with pytest.raises(ValueError, match=re.escape(match)):
        fh.token_logprobs_triton(h, w, y, b, **kw)
    assert torch.equal(weight.grad, torch.ones_like(weight))


def test_triton_impl_on_cpu_names_the_fix():
    if lt._INTERPRET:
        pytest.skip("the session runs with TRITON_INTERPRET set")
    hidden, weight, bias, labels = make_problem(6, 8, 20)
    with pytest.raises(ValueError, match="impl='auto'"):
        fh.token_logprobs_triton(hidden, weight, labels, bias, impl="triton")


# --------------------------------------------------------------------------- flash rule (CPU fp16, GPU)
def check_flash_rule(fn, n, h, v, chunk, dtype, device, transform, seeds, seed=0, impl="triton"):
    """``fn`` at ``dtype`` against the full-logits reference at higher precision: error at
    most 2x (outputs) / 3x (gradients) the same reference's own error at ``dtype``, plus
    a floor. Returns the errors for reports."""
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    inputs = make_problem(n, h, v, dtype=dtype, device=device, seed=seed)
    labels = inputs[3]
    kw = dict(TRANSFORMS[transform])
    got = run(fn, *inputs, {**kw, "chunk_size": chunk, "impl": impl}, seeds, seed)

    def reference(precision):
        leaves = [x.detach().to(precision).requires_grad_() for x in inputs[:3]]
        return run(fh.token_logprobs_dense, *leaves, labels, kw, seeds, seed)

    exact, same_precision = reference(ref_dtype), reference(dtype)
    errors = {}
    for i, (name, g, e, p) in enumerate(zip(NAMES, got, exact, same_precision)):
        if e is None:
            continue
        err = (g.to(ref_dtype) - e).abs().max().item()
        base = (p.to(ref_dtype) - e).abs().max().item()
        factor, floor = (2, 1e-5) if i < 2 else (3, 1e-4)
        bound = factor * base + floor * max(1.0, e.abs().max().item())
        assert err <= bound, f"{transform}/{seeds} {name}: kernel error {err:.3e}, torch {dtype} error {base:.3e}"
        errors[name] = (err, base)
    return errors


GPU_SHAPES = [  # rows, hidden, vocab, chunk
    (1031, 256, 32003, 512),
    (700, 1536, 151936, 256),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("transform,seeds", [("plain", "logp"), ("all", "both"), ("softcap", "entropy")])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_gpu_flash_rule(dtype, shape, transform, seeds, impl):
    n, h, v, chunk = shape
    check_flash_rule(fh.token_logprobs_triton, n, h, v, chunk, dtype, "cuda", transform, seeds, impl=impl)


@pytest.mark.gpu
def test_gpu_float32_matches_float64():
    inputs = make_problem(300, 128, 20011, device="cuda", seed=9)
    kw = dict(TRANSFORMS["all"])
    # TF32 off: the product itself must be float32 to compare at 1e-5
    torch.backends.cuda.matmul.allow_tf32, saved = False, torch.backends.cuda.matmul.allow_tf32
    try:
        got = run(fh.token_logprobs_triton, *inputs, {**kw, "chunk_size": 128, "impl": "triton"}, "both")
        want = run(fh.token_logprobs_dense, *float64_copy(*inputs), kw, "both")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert_close_rel(got, want, what="cuda fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("keep_logits", [False, True])
@pytest.mark.parametrize("rows", [16384, 2000])
def test_gpu_backward_peak(rows, keep_logits):
    """The allocator's peak over the op's forward and backward against what the memory
    policy plans for it (:func:`dtree.plan.memory_model.head_bytes`): qwen2.5-1.5b's head
    in bf16 at 4,096-row chunks, 16k rows (the vocabulary in slices) and 2,000 (one; with
    ``keep_logits`` the forward's buffer is the backward's)."""
    from types import SimpleNamespace

    from dtree.plan.memory_model import head_bytes

    hidden, weight, _, labels = make_problem(rows, 1536, 151936, dtype=torch.bfloat16, device="cuda", bias=False)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logp, _ = fh.token_logprobs_triton(hidden, weight, labels, chunk_size=4096, impl="triton", keep_logits=keep_logits)
    logp.sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    planned = head_bytes(SimpleNamespace(vocab_size=151936, hidden_size=1536), 2, 4096, rows, fused=True)
    assert 0.85 * planned <= peak <= 1.02 * planned, f"peak {peak / 2**30:.3f} GiB, planned {planned / 2**30:.3f} GiB"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [4096, 700])
def test_gpu_kept_logits_give_the_same_gradients_bit_for_bit(rows):
    """bf16 on the GPU, qwen2.5-1.5b's head: the kept logits are the recomputed ones, so the
    gradients are the same bits (one chunk; cuBLAS makes the same product both times)."""
    inputs = make_problem(rows, 1536, 151936, dtype=torch.bfloat16, device="cuda", seed=5)
    kw = {**TRANSFORMS["all"], "chunk_size": 4096, "impl": "triton"}
    want = run(fh.token_logprobs_triton, *inputs, kw, "both")
    got = run(fh.token_logprobs_triton, *inputs, {**kw, "keep_logits": True}, "both")
    for name, a, b in zip(NAMES, got, want):
        assert torch.equal(a, b), name


@pytest.mark.gpu
def test_gpu_weight_gradient_accumulates_in_float32():
    """Several chunks: dW summed in float32 (by cuBLAS in place when torch has
    ``addmm(out_dtype=)``), then rounded once."""
    if not fh._fp32_out_mm_works(torch.device("cuda")):
        pytest.skip(f"torch {torch.__version__} has no addmm(out_dtype=float32) here: dW chunks are rounded "
                    "to 16 bits before the float32 sum, as in the chunked torch op")
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(64, 4096, device="cuda", generator=gen).bfloat16()
    b = torch.randn(4096, 32, device="cuda", generator=gen).bfloat16()
    acc = torch.full((64, 32), 0.5, device="cuda")
    fh._accumulate_mm(acc, a, b)
    torch.testing.assert_close(acc, 0.5 + a.float() @ b.float(), atol=1e-2, rtol=1e-4)
