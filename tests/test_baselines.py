"""The baselines (linearized varlen, tree mask) give the loss and the gradients of HF
run on every path on its own (tests/reference.py) and of dtree, with and without
micro-batch splits; their attention ops match a float64 dense computation."""

from __future__ import annotations

import copy
import types
import warnings

import numpy as np
import pytest
import torch
from hf_models import ARCHS, VOCAB, make_config, make_model
from hypothesis import given
from hypothesis import strategies as st
from reference import grad_errors, linearized_step
from strategies import batches_with_fields
from test_runtime_exact import EDGE_CASES, FP32_TOL, assert_exact

import dtree
from dtree.baselines import METHODS, LinearizedTrainer, TreeMaskTrainer, make_method
from dtree.baselines.kernels.tree_mask_attention import (
    FlexRecompileLimitError,
    TreeMaskLayout,
    compiled_call,
    tree_mask_attention,
)
from dtree.baselines.kernels.varlen_attention import VarlenLayout
from dtree.baselines.kernels.varlen_interface import varlen_attention
from dtree.baselines.step import pack_in_order
from dtree.baselines.tree_mask import split_tree, token_subtree_end
from dtree.losses import TokenLoss

ALL_EDGE_SEQS = [s for case in EDGE_CASES.values() for s in case]

# every method, unsplit and with budgets small enough to split the edge cases
CONFIGS = {
    "dtree": ("dtree", {}),
    "linearized": ("linearized", {}),
    "linearized/split": ("linearized", dict(max_tokens_per_batch=7)),
    "tree-mask": ("tree-mask", {}),
    "tree-mask/split": ("tree-mask", dict(max_tokens_per_batch=5)),
}


def make_loss(kind, reduction, **kw):
    return dtree.losses.nll(reduction=reduction) if kind == "nll" else dtree.losses.ppo_clip(reduction=reduction, **kw)


def run_methods(model, seqs, fields=None, kind="nll", reduction="token_mean", configs=CONFIGS, loss_kw=None):
    """Reference loss, and per config (StepOutput, per-parameter gradient errors)."""
    loss_kw = loss_kw or {}
    ref_model = copy.deepcopy(model)
    ref_loss, _ = linearized_step(ref_model, seqs, fields, kind, reduction, **loss_kw)
    forest = dtree.Forest.from_sequences(seqs, **(fields or {}))
    loss = make_loss(kind, reduction, **loss_kw)
    results = {}
    for label, (name, kw) in configs.items():
        m = copy.deepcopy(model)
        results[label] = (make_method(name, m, **kw).forward_backward(forest, loss), grad_errors(m, ref_model))
    return ref_loss, results


def assert_all_exact(ref_loss, results, tol=FP32_TOL):
    for label, (out, errs) in results.items():
        try:
            assert_exact(out, ref_loss, errs, tol)
        except AssertionError as e:
            raise AssertionError(f"{label}: {e}") from None


# ----------------------------------------------------------------------------- exactness
# llama and qwen2 (q/k/v biases) tied and untied, qwen3 (q/k norms); the random forests
# below draw from every architecture
@pytest.mark.parametrize(
    "arch, tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", False)]
)
def test_edge_cases(arch, tied):
    ref, results = run_methods(make_model(arch, tied), ALL_EDGE_SEQS)
    assert_all_exact(ref, results)
    assert results["linearized/split"][0].num_model_calls > 1
    assert results["tree-mask/split"][0].metrics["split_trees"] > 0


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_each_edge_case_with_tiny_budgets(case):
    configs = {
        "linearized/1": ("linearized", dict(max_tokens_per_batch=1, attention="reference")),
        "tree-mask/1": ("tree-mask", dict(max_tokens_per_batch=1)),
        "tree-mask/3": ("tree-mask", dict(max_tokens_per_batch=3)),
    }
    ref, results = run_methods(make_model("llama"), EDGE_CASES[case], configs=configs)
    assert_all_exact(ref, results)


PER_PATH = (
    [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 5], [7, 8]],
    {
        "advantages": [[0, 1.0, -0.5, 2.0, 1.0], [0, -1.0, 0.7, -2.0, 0.5], [0, 0.3, 0.3, 0.3, -3.0], [0, 1.5]],
        "old_logprobs": [
            [0, -4.5, -4.6, -4.4, -4.5],
            [0, -4.7, -4.5, -4.6, -4.4],
            [0, -4.1, -4.9, -4.5, -4.6],
            [0, -4.0],
        ],
        "ref_logprobs": [
            [0, -4.6, -4.6, -4.5, -4.5],
            [0, -4.5, -4.5, -4.5, -4.4],
            [0, -4.2, -4.8, -4.5, -4.6],
            [0, -4.4],
        ],
        "loss_mask": [[0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 0, 1], [0, 0]],
    },
)


@pytest.mark.parametrize("kind", ["nll", "ppo"])
@pytest.mark.parametrize("reduction", dtree.losses.REDUCTIONS)
def test_losses_and_reductions(kind, reduction):
    """Shared tokens with their own advantages and masks; a sequence fully masked."""
    seqs, fields = PER_PATH
    loss_kw = dict(clip_eps=0.1, kl_coef=0.05) if kind == "ppo" else {}
    ref, results = run_methods(make_model("qwen2", tied=True), seqs, fields, kind, reduction, loss_kw=loss_kw)
    assert_all_exact(ref, results)


@given(batch=batches_with_fields(max_sequences=6, max_len=12, alphabet=5), data=st.data())
def test_random_forests(batch, data):
    seqs, fields = batch
    arch = data.draw(st.sampled_from(ARCHS), label="arch")
    kind = data.draw(st.sampled_from(["nll", "ppo"]), label="loss")
    reduction = data.draw(st.sampled_from(dtree.losses.REDUCTIONS), label="reduction")
    configs = {
        "linearized": (
            "linearized",
            dict(max_tokens_per_batch=data.draw(st.sampled_from([1, 5, 64]), label="lin_budget")),
        ),
        "tree-mask": (
            "tree-mask",
            dict(max_tokens_per_batch=data.draw(st.sampled_from([None, 1, 4, 9]), label="tree_budget")),
        ),
    }
    loss_kw = dict(kl_coef=0.1) if kind == "ppo" else {}
    model = make_model(arch, tied=arch in ("qwen2", "qwen3"))
    ref, results = run_methods(model, seqs, fields, kind, reduction, configs, loss_kw)
    assert_all_exact(ref, results)


# ----------------------------------------------------------------------------- micro-batch plans
@pytest.mark.parametrize("rows", [None, 0, 3])
def test_checkpointed_baselines_run_the_rerun_in_their_chunk_rows(monkeypatch, rows):
    """``checkpoint=True`` with ``rerun_chunk_rows``: the re-run's SwiGLU backward takes the rows given
    (None: the op's own, monkeypatched to 4 here; 0: each micro-batch in one chunk) and the gradients
    stay exact."""
    from dtree.ops.swiglu import interface as swiglu

    monkeypatch.setattr(swiglu, "CONSUMING_CHUNK_ROWS", 4)
    chunks = []
    original = swiglu._backward_in_place
    monkeypatch.setattr(swiglu, "_backward_in_place", lambda *a: chunks.append(a[0].shape[0]) or original(*a))
    from dtree.models.lean_layers import apply_lean_layers

    model = make_model("qwen2")
    ref_model = copy.deepcopy(model)  # HF's own layers
    ref_loss, _ = linearized_step(ref_model, ALL_EDGE_SEQS, None, "nll", "token_mean")
    forest = dtree.Forest.from_sequences(ALL_EDGE_SEQS)
    results = {}
    for name in ("tree-mask", "linearized"):
        m = copy.deepcopy(model)
        apply_lean_layers(m)
        method = make_method(name, m, checkpoint=True, rerun_chunk_rows=rows)
        out = method.forward_backward(forest, make_loss("nll", "token_mean"))
        results[name] = (out, grad_errors(m, ref_model))
    assert_all_exact(ref_loss, results)
    if rows is None or rows:
        assert chunks and max(chunks) == (rows or 4)
    else:
        assert chunks and max(chunks) > 4  # whole micro-batches


def test_pack_in_order():
    assert pack_in_order(np.array([4, 3, 5, 2]), 7) == [(0, 2), (2, 4)]
    assert pack_in_order(np.array([4, 3, 5, 2]), 3) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # 4 and 5 run alone
    assert pack_in_order(np.array([4, 3, 5, 2]), None) == [(0, 4)]


def test_linearized_plan():
    forest = dtree.Forest.from_sequences([[1, 2, 3, 4], [1, 2, 5], [6, 7, 8, 9, 10], [1, 2]])
    batches = LinearizedTrainer(make_model("llama"), max_tokens_per_batch=7).plan(forest)
    assert [b.layout.cu_seqlens.tolist() for b in batches] == [[0, 4, 7], [0, 5, 7]]
    assert batches[0].position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert forest.tokens[batches[1].row_unique].tolist() == [6, 7, 8, 9, 10, 1, 2]
    assert batches[1].term_lin.tolist() == [8, 9, 10, 11, 13]  # every token after a sequence's first


def test_tree_mask_split_like_areal():
    """A 13-token tree (4-token prompt, three 3-token answers) and a 2-token tree,
    budget 10: the big tree splits into {a1, a2} (10 tokens) and {a3} (7 tokens, its
    prompt recomputed); the small tree rides along with the second group."""
    prompt = [1, 2, 3, 4]
    seqs = [prompt + [10, 11, 12], [20, 21], prompt + [30, 31, 32], prompt + [40, 41, 42]]
    forest = dtree.Forest.from_sequences(seqs)
    trainer = TreeMaskTrainer(make_model("llama"), max_tokens_per_batch=10)
    batches = trainer.plan(forest)
    assert [b.num_tokens for b in batches] == [10, 9]
    out = trainer.forward_backward(forest, dtree.losses.nll())
    assert out.num_model_calls == 2
    assert out.metrics == dict(
        attention="sdpa", micro_batches=2, computed_tokens=19, tokens_recomputed=4, split_trees=1, checkpoint=False
    )
    groups = split_tree(forest, np.array([0, 2, 3]), 10)
    assert sorted(len(g) for g in groups) == [1, 2]
    assert [len(g) for g in split_tree(forest, np.array([0, 2, 3]), 2)] == [1, 1, 1]  # each longer than the budget


def ancestors_mask(forest: dtree.Forest, row_unique: np.ndarray) -> np.ndarray:
    """[N, N] bool from the predecessor chains (no intervals): key j is an ancestor of
    query i or i itself."""
    pos = {int(u): r for r, u in enumerate(row_unique)}
    allowed = np.zeros((len(row_unique), len(row_unique)), dtype=bool)
    for i, u in enumerate(row_unique):
        u = int(u)
        while u >= 0:
            allowed[i, pos[u]] = True
            u = int(forest.predecessor[u])
    return allowed


@given(batch=batches_with_fields(max_sequences=7, max_len=10, alphabet=3), budget=st.sampled_from([None, 1, 2, 6, 15]))
def test_plans_are_consistent(batch, budget):
    """Every plan computes each prediction once, from the row of its predecessor, with
    positions = depths; every tree-mask row (whole trees, split groups, trees side by
    side) has the ancestor-or-self mask of its tokens, found here by walking predecessor."""
    forest = dtree.Forest.from_sequences(batch[0])
    lengths = forest.sequence_lengths()
    model = make_model("llama")
    for trainer in (
        TreeMaskTrainer(model, max_tokens_per_batch=budget),
        LinearizedTrainer(model, max_tokens_per_batch=budget or 64),
    ):
        batches = trainer.plan(forest)
        predicted = np.concatenate([b.term_lin for b in batches])
        assert np.array_equal(
            np.sort(predicted), np.setdiff1d(np.arange(len(forest.lin_tokens)), forest.seq_offsets[:-1])
        )
        for b in batches:
            u = forest.lin_unique[b.term_lin]
            assert np.array_equal(b.row_unique[b.term_row], forest.predecessor[u])
            assert np.array_equal(forest.tokens[b.row_unique[b.term_target]], forest.lin_tokens[b.term_lin])
            assert np.array_equal(b.position_ids, forest.positions[b.row_unique])
            if budget is not None:
                assert b.num_tokens <= max(budget, lengths.max())
            if isinstance(trainer, TreeMaskTrainer):
                assert len(np.unique(b.row_unique)) == b.num_tokens
                got = b.layout.dense_mask(torch.device("cpu")).numpy()
                assert np.array_equal(got, ancestors_mask(forest, b.row_unique))


# ----------------------------------------------------------------------------- failures
def test_non_finite_loss_names_the_token_and_restores_grads():
    seqs = [[1, 2, 3, 4], [1, 2, 5, 6, 7], [9, 8]]
    flag = [[0, 0, 0, 0], [0, 0, 0, 1, 0], [0, 0]]  # sequence 1, position 3 goes bad

    def per_token(logp, f):
        return torch.where(f["flag"] > 0, torch.log(-logp.abs() - 1), -logp)

    bad = TokenLoss(per_token, reduction="sum", required_fields=("flag",), name="explodes")
    for cls in (LinearizedTrainer, TreeMaskTrainer):
        model = make_model("llama")
        trainer = cls(model, max_tokens_per_batch=5)
        trainer.forward_backward(dtree.Forest.from_sequences(seqs[:1]), dtree.losses.nll())
        before = {n: p.grad.clone() for n, p in model.named_parameters()}
        with pytest.raises(ValueError, match=r"loss is not finite \(nan\) at sequence 1, position 3"):
            trainer.forward_backward(dtree.Forest.from_sequences(seqs, flag=flag), bad)
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, before[n]), (cls.__name__, n)


def test_bad_arguments():
    model = make_model("llama", max_positions=16)
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        make_method("nope", model)
    assert METHODS == ("dtree", "linearized", "tree-mask")
    with pytest.raises(ValueError, match="max_tokens_per_batch must be >= 1"):
        LinearizedTrainer(model, max_tokens_per_batch=0)
    with pytest.raises(ValueError, match="max_tokens_per_batch must be None or >= 1"):
        TreeMaskTrainer(model, max_tokens_per_batch=0)
    for bad in (-1, True):
        with pytest.raises(ValueError, match="rerun_chunk_rows must be an integer >= 0 or None"):
            TreeMaskTrainer(model, checkpoint=True, rerun_chunk_rows=bad)
    with pytest.raises(ValueError, match="attention must be 'auto' or one of"):
        LinearizedTrainer(model, attention="flex")
    with pytest.raises(ValueError, match="attention must be 'auto' or one of"):
        TreeMaskTrainer(model, attention="flash")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="attention='flash' needs"):
            LinearizedTrainer(model, attention="flash")
        with pytest.raises(ValueError, match="attention='flash-attn' needs the flash-attn package"):
            LinearizedTrainer(model, attention="flash-attn")
        with pytest.raises(ValueError, match="attention='flex' trains on CUDA only"):
            TreeMaskTrainer(model, attention="flex")
    for trainer in (LinearizedTrainer(model), TreeMaskTrainer(model)):
        with pytest.raises(TypeError, match="TokenLoss"):
            trainer.forward_backward(dtree.Forest.from_sequences([[1, 2]]), lambda lps, f: lps[0].sum())
        with pytest.raises(ValueError, match=rf"token id {VOCAB + 1} at sequence 1, position 1 is outside"):
            trainer.forward_backward(dtree.Forest.from_sequences([[1, 2], [3, VOCAB + 1]]), dtree.losses.nll())
        with pytest.raises(ValueError, match="sequence 0 has 17 tokens, longer than the model's 16 positions"):
            trainer.forward_backward(dtree.Forest.from_sequences([list(range(17))]), dtree.losses.nll())
        with pytest.raises(ValueError, match=r"needs per-token fields \['advantages', 'old_logprobs'\]"):
            trainer.forward_backward(dtree.Forest.from_sequences([[1, 2]]), dtree.losses.ppo_clip())
    assert all(p.grad is None for p in model.parameters())


def test_bad_layouts():
    with pytest.raises(ValueError, match="strictly increasing: sequence 1 has 0 tokens"):
        VarlenLayout([0, 3, 3, 5])
    with pytest.raises(ValueError, match="start at 0"):
        VarlenLayout([1, 3])
    with pytest.raises(ValueError, match=r"subtree_end\[1\] = 1 must be in \(1, 3\]"):
        TreeMaskLayout([3, 1, 3])
    with pytest.raises(ValueError, match=r"subtree_end\[0\] = 4 must be in \(0, 3\]"):
        TreeMaskLayout([4, 3, 3])
    q = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="q has 4 rows but cu_seqlens covers 5"):
        varlen_attention(q, q, q, VarlenLayout([0, 5]), 1.0)
    with pytest.raises(ValueError, match="query heads \\(2\\) must be a multiple of key/value heads \\(3\\)"):
        tree_mask_attention(q, torch.zeros(4, 3, 8), torch.zeros(4, 3, 8), TreeMaskLayout([4, 4, 4, 4]), 1.0)
    with pytest.raises(ValueError, match="unknown varlen attention backend"):
        varlen_attention(q, q, q, VarlenLayout([0, 4]), 1.0, "flex")


# ----------------------------------------------------------------------------- attention ops
def dense_attention(q, k, v, allowed, scale, upcast=True):
    """[N, Hq, D] attention with an explicit [N, N] mask; float64 when ``upcast``, else
    in the inputs' dtype (the low-precision PyTorch reference of the tolerance rule)."""
    dt = torch.float64 if upcast else q.dtype
    group = q.shape[1] // k.shape[1]
    kk, vv = (x.to(dt).repeat_interleave(group, 1) for x in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.to(dt), kk) * scale
    p = torch.softmax(s.masked_fill(~allowed.to(q.device), -torch.inf), -1)
    return torch.einsum("hqk,khd->qhd", p, vv)


def varlen_allowed(cu: np.ndarray) -> torch.Tensor:
    n = int(cu[-1])
    seq = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return torch.from_numpy((seq[:, None] == seq[None, :]) & (j <= i))


def forest_ends(rng, trees: int, length: int) -> tuple[dtree.Forest, np.ndarray]:
    """A forest of a few trees that share prefixes, and its tokens' subtree ends."""
    seqs = []
    for t in range(trees):
        base = [1000 + t] + rng.integers(0, 4, length).tolist()
        for _ in range(int(rng.integers(1, 5))):
            cut = int(rng.integers(1, length + 1))
            seqs.append(base[:cut] + rng.integers(0, 4, int(rng.integers(0, length))).tolist())
    forest = dtree.Forest.from_sequences(seqs)
    return forest, token_subtree_end(forest)


def qkv(n, hq, hkv, d, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    make = lambda h: torch.randn(n, h, d, generator=g).to(device, dtype).requires_grad_()  # noqa: E731
    return make(hq), make(hkv), make(hkv)


def check_against_dense(out, inputs, allowed, scale, tol=dict(atol=2e-5, rtol=1e-4)):
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, go)
    ref_in = [x.detach().double().requires_grad_() for x in inputs]
    want = dense_attention(*ref_in, allowed, scale)
    torch.testing.assert_close(out.double(), want, **tol)
    for a, b in zip(got, torch.autograd.grad(want, ref_in, go.double())):
        torch.testing.assert_close(a.double(), b, **tol)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("seed", range(4))
def test_varlen_backends_match_dense(backend, seed):
    rng = np.random.default_rng(seed)
    hq, hkv, d = [(4, 4, 16), (6, 2, 12), (3, 1, 20), (2, 2, 8)][seed]
    layout = VarlenLayout.from_lengths(rng.integers(1, 23, int(rng.integers(1, 6))))
    q, k, v = qkv(layout.num_tokens, hq, hkv, d, seed=seed)
    out = varlen_attention(q, k, v, layout, d**-0.5 * 1.3, backend)
    check_against_dense(out, (q, k, v), varlen_allowed(layout.cu_seqlens), d**-0.5 * 1.3)


VARLEN_SIGNATURES = {  # parameter names of torch.nn.attention.varlen.varlen_attn across releases
    "2.10": ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal", "return_aux"),
    "2.11": ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "return_aux", "scale", "window_size"),
    "2.12+": ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "return_aux", "scale", "window_size",
              "enable_gqa", "seqused_k", "block_table", "num_splits"),
}  # fmt: skip


@pytest.mark.parametrize("version", sorted(VARLEN_SIGNATURES))
def test_flash_backend_adapts_to_varlen_attn_signature(version):
    """The flash backend's call, on the CPU with a stand-in kernel that has FlashAttention's
    semantics (scale 1/sqrt(D) unless given, equal head counts unless enable_gqa) and
    only the parameters of that torch release."""
    from dtree.baselines.kernels.varlen_attention import _call_varlen, varlen_attention_reference

    params = frozenset(VARLEN_SIGNATURES[version])

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kw):
        assert set(kw) <= params and cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
        assert kw.pop("window_size") == (-1, 0) if "window_size" in params else kw.pop("is_causal") is True
        assert key.shape[1] == query.shape[1] or kw.pop("enable_gqa")
        layout = VarlenLayout(cu_seq_q.numpy())
        assert max_q == max_k == layout.max_len
        return varlen_attention_reference(query, key, value, layout, kw.pop("scale", query.shape[-1] ** -0.5))

    layout = VarlenLayout.from_lengths([5, 1, 9, 3])
    q, k, v = qkv(layout.num_tokens, 6, 2, 16, seed=3)
    scale = 0.7
    out = _call_varlen(kernel, params, q, k, v, layout, scale)
    check_against_dense(out, (q, k, v), varlen_allowed(layout.cu_seqlens), scale)


@pytest.mark.parametrize("seed", range(4))
def test_tree_mask_sdpa_matches_dense(seed):
    rng = np.random.default_rng(seed)
    forest, ends = forest_ends(rng, trees=int(rng.integers(1, 4)), length=15)
    hq, hkv, d = [(4, 4, 16), (6, 2, 12), (3, 1, 20), (2, 2, 8)][seed]
    q, k, v = qkv(len(ends), hq, hkv, d, seed=seed)
    out = tree_mask_attention(q, k, v, TreeMaskLayout(ends), 0.4, "sdpa")
    allowed = torch.from_numpy(ancestors_mask(forest, np.arange(forest.num_unique_tokens)))
    check_against_dense(out, (q, k, v), allowed, 0.4)


@pytest.mark.parametrize("seed", range(6))
def test_block_mask_equals_create_block_mask(seed):
    """The O((N/B)^2) BlockMask built from the intervals is the one create_block_mask
    derives from the full N x N grid (partial and full blocks, both orientations)."""
    from torch.nn.attention.flex_attention import create_block_mask

    rng = np.random.default_rng(seed)
    _, ends = forest_ends(rng, trees=int(rng.integers(1, 4)), length=int(rng.integers(3, 40)))
    e = torch.from_numpy(ends)
    n = len(ends)
    for block in (2, 4, 16, 128):
        got = TreeMaskLayout(ends).block_mask(torch.device("cpu"), block)
        want = create_block_mask(
            lambda b, h, qi, kv: (kv <= qi) & (qi < e[kv]), 1, 1, n, n, device="cpu", BLOCK_SIZE=block
        )
        for num, idx in [
            ("kv_num_blocks", "kv_indices"),
            ("full_kv_num_blocks", "full_kv_indices"),
            ("q_num_blocks", "q_indices"),
            ("full_q_num_blocks", "full_q_indices"),
        ]:
            assert torch.equal(getattr(got, num), getattr(want, num)), (block, num)
            counts = getattr(got, num)[0, 0].tolist()
            for r, c in enumerate(counts):
                a, b = getattr(got, idx)[0, 0, r, :c], getattr(want, idx)[0, 0, r, :c]
                assert torch.equal(a.sort().values, b.sort().values), (block, idx, r)


def test_flex_mask_mod_on_cpu():
    """FlexAttention on the CPU runs eagerly (forward only): checks the mask_mod."""
    rng = np.random.default_rng(7)
    forest, ends = forest_ends(rng, trees=3, length=20)
    q, k, v = (x.detach() for x in qkv(len(ends), 6, 2, 16))
    layout = TreeMaskLayout(ends)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        got = tree_mask_attention(q, k, v, layout, 0.25, "flex")
    want = tree_mask_attention(q, k, v, layout, 0.25, "sdpa")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _double(x):
    return x * 2


def _fresh_compiled(name):
    """``_double`` under a code object of its own (dynamo counts recompiles per code object), compiled
    with dynamo's eager backend (no inductor build): its recompiles count as flex_attention's do."""
    fn = types.FunctionType(_double.__code__.replace(co_name=f"double_{name}"), globals())
    return torch.compile(fn, backend="eager", dynamic=False)


def test_compiled_call_refuses_to_run_past_the_recompile_limit():
    """Past dynamo's recompile limit a compiled function runs as plain Python, which for FlexAttention is
    the full score matrix; the tree-mask call raises a named error instead."""
    fn = _fresh_compiled("refuses")
    with torch._dynamo.config.patch(recompile_limit=1):
        assert torch.equal(compiled_call(fn, torch.ones(3), limit=1), torch.full((3,), 2.0))
        with pytest.raises(FlexRecompileLimitError, match="torch._dynamo.reset"):
            compiled_call(fn, torch.ones(5), limit=1)
        # a bare call under the same limit silently runs the Python function: what the guard prevents
        assert torch.equal(fn(torch.ones(7)), torch.full((7,), 2.0))


def test_compiled_call_raises_the_limit_for_its_calls_only():
    fn = _fresh_compiled("raises")
    with torch._dynamo.config.patch(recompile_limit=1):
        for n in (2, 3, 4):  # three configurations under a process limit of one
            assert torch.equal(compiled_call(fn, torch.ones(n), limit=3), torch.full((n,), 2.0))
        assert torch._dynamo.config.recompile_limit == 1
        with pytest.raises(FlexRecompileLimitError):
            compiled_call(fn, torch.ones(5), limit=3)


# ----------------------------------------------------------------------------- CUDA
def assert_low_precision_close(got, want_lp, want_fp32, factor, name):
    """flash-attention's rule: error vs the fp32 reference at most ``factor`` times that of
    the same math in low precision, plus a floor: the rounding of the fp32 result itself."""
    floor = (want_fp32.to(got.dtype).float() - want_fp32.float()).abs().max().item()
    err = (got.float() - want_fp32.float()).abs().max().item()
    ref_err = (want_lp.float() - want_fp32.float()).abs().max().item()
    assert err <= factor * ref_err + floor, f"{name}: {err:.3e} > {factor} x {ref_err:.3e} + {floor:.3e}"


def check_bf16_rule(out, inputs, allowed, scale):
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, go)
    fp32_in = [x.detach().float().requires_grad_() for x in inputs]
    lp_in = [x.detach().clone().requires_grad_() for x in inputs]
    want = dense_attention(*fp32_in, allowed, scale).float()
    want_lp = dense_attention(*lp_in, allowed, scale, upcast=False)
    assert_low_precision_close(out, want_lp, want, 2, "output")
    want_g = torch.autograd.grad(want, fp32_in, go.float())
    lp_g = torch.autograd.grad(want_lp, lp_in, go)
    for name, a, b, c in zip("qkv", grads, lp_g, want_g):
        assert_low_precision_close(a, b, c, 3, f"d{name}")


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hkv, d", [(8, 2, 64), (4, 4, 128)])
def test_varlen_flash_bf16(hq, hkv, d):
    from dtree.baselines.kernels.varlen_attention import flash_available

    assert flash_available(torch.device("cuda"), torch.bfloat16, hq, hkv, d)
    rng = np.random.default_rng(d)
    layout = VarlenLayout.from_lengths(np.concatenate([rng.integers(1, 300, 7), [1, 1000]]))
    q, k, v = qkv(layout.num_tokens, hq, hkv, d, torch.bfloat16, "cuda")
    out = varlen_attention(q, k, v, layout, d**-0.5, "flash")
    check_bf16_rule(out, (q, k, v), varlen_allowed(layout.cu_seqlens).cuda(), d**-0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hkv, d", [(8, 2, 64), (4, 4, 128)])
def test_tree_mask_flex_bf16(hq, hkv, d):
    rng = np.random.default_rng(d)
    forest, ends = forest_ends(rng, trees=3, length=300)
    q, k, v = qkv(len(ends), hq, hkv, d, torch.bfloat16, "cuda")
    out = tree_mask_attention(q, k, v, TreeMaskLayout(ends), d**-0.5, "flex")
    allowed = torch.from_numpy(ancestors_mask(forest, np.arange(forest.num_unique_tokens))).cuda()
    check_bf16_rule(out, (q, k, v), allowed, d**-0.5)


@pytest.mark.gpu
def test_flex_peak_memory_is_not_quadratic():
    """32k tokens: a dense bool mask alone would be 1 GiB (and SDPA's float bias 4 GiB).
    The flex path's peak, forward + backward, stays within a few copies of q/k/v."""
    prompt = list(range(2048))
    seqs = [prompt + [3000 + b] * 2048 for b in range(15)]  # 2048 + 15 x 2048 = 32768 tokens
    forest = dtree.Forest.from_sequences(seqs)
    ends = token_subtree_end(forest)
    n = len(ends)
    assert n == 32768
    q, k, v = qkv(n, 4, 4, 64, torch.bfloat16, "cuda")
    # The compiled path's memory, in a process that compiled FlexAttention for other configurations (head
    # dims, GQA, dtypes: the GPU tests before this one). Past dynamo's default limit of 8 it ran eagerly, on
    # the full score matrix (106 GiB here, session AK's PART=check); compiled_call raises the limit for it.
    tree_mask_attention(q, k, v, TreeMaskLayout(ends), 0.125, "flex").sum().backward()  # compile outside the window
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = tree_mask_attention(q, k, v, TreeMaskLayout(ends), 0.125, "flex")
    out.sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    qkv_bytes = 3 * q.numel() * q.element_size()  # 48 MiB
    assert peak < 8 * qkv_bytes < n * n // 2, f"peak {peak / 2**20:.0f} MiB for {n} tokens"


def cuda_model(arch, dtype, head_dim=16):
    from transformers import AutoModelForCausalLM

    config = make_config(arch, tied=True)
    config.head_dim = head_dim  # flex and flash need head_dim >= 16
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to("cuda", dtype)


@pytest.mark.gpu
def test_trainers_on_cuda_match_dtree():
    """fp32 on CUDA: tree-mask (flex, whole and split) and linearized (sdpa: flash needs
    16-bit) against TreeRuntime."""
    model = cuda_model("qwen3", torch.float32)
    forest = dtree.Forest.from_sequences(ALL_EDGE_SEQS)
    configs = {
        "dtree": ("dtree", dict(attention="sdpa")),
        "tree-mask": ("tree-mask", {}),
        "tree-mask/split": ("tree-mask", dict(max_tokens_per_batch=5)),
        "linearized": ("linearized", {}),
    }
    runs = {}
    for label, (name, kw) in configs.items():
        m = copy.deepcopy(model)
        runs[label] = (make_method(name, m, **kw).forward_backward(forest, dtree.losses.nll()), m)
    ref_out, ref_m = runs["dtree"]
    assert runs["tree-mask"][0].metrics["attention"] == "flex"
    for label, (out, m) in runs.items():
        errs = grad_errors(m, ref_m)
        assert max(errs.values()) < 1e-3, (label, errs)
        assert abs(out.loss - ref_out.loss) < 1e-4, label


@pytest.mark.gpu
def test_linearized_flash_bf16_matches_sdpa():
    model = cuda_model("llama", torch.bfloat16, head_dim=64)
    forest = dtree.Forest.from_sequences(ALL_EDGE_SEQS)
    outs = {}
    for attention in ("auto", "sdpa"):  # auto picks flash-attn (if installed) or flash for a bf16 model on CUDA
        m = copy.deepcopy(model)
        trainer = LinearizedTrainer(m, attention=attention, max_tokens_per_batch=20)
        outs[attention] = (trainer.forward_backward(forest, dtree.losses.nll()), m)
    assert outs["auto"][0].metrics["attention"] in ("flash", "flash-attn")
    errs = grad_errors(outs["auto"][1], outs["sdpa"][1])
    assert max(errs.values()) < 5e-2, errs
    assert abs(outs["auto"][0].loss - outs["sdpa"][0].loss) < 1e-2 * abs(outs["sdpa"][0].loss)
