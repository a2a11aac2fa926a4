"""Workload generators: determinism, shape bounds, field semantics, compression, speed."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dtree import Forest
from dtree.workloads import (
    TINY,
    WORKLOADS,
    agentic,
    describe,
    grpo,
    make_workload,
    mixed_batch,
    search,
    workload_parameters,
)
from dtree.workloads.mixed import KINDS


def runs(mask: np.ndarray) -> list[tuple[float, int]]:
    """Maximal runs of equal values as (value, length)."""
    cuts = np.flatnonzero(np.diff(mask)) + 1
    bounds = np.concatenate([[0], cuts, [len(mask)]])
    return [(float(mask[a]), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:])]


def same_forest(a: Forest, b: Forest) -> bool:
    return (
        np.array_equal(a.seq_offsets, b.seq_offsets)
        and np.array_equal(a.lin_tokens, b.lin_tokens)
        and a.fields.keys() == b.fields.keys()
        and all(np.array_equal(a.fields[k], b.fields[k]) for k in a.fields)
    )


def inner_child_counts(f: Forest) -> np.ndarray:
    kids = np.diff(f.child_offsets)
    return kids[kids > 0]


# ---------------------------------------------------------------------- determinism
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_determinism(name):
    a = make_workload(name, seed=3, tiny=True, vocab_size=97)
    b = make_workload(name, seed=3, tiny=True, vocab_size=97)
    c = make_workload(name, seed=4, tiny=True, vocab_size=97)
    assert same_forest(a, b)
    assert not same_forest(a, c)
    assert set(a.fields) == {"loss_mask", "advantages", "old_logprobs", "ref_logprobs"}
    assert a.lin_tokens.min() >= 0 and a.lin_tokens.max() < 97


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_common_field_semantics(name):
    f = make_workload(name, seed=1, tiny=True, vocab_size=64)
    tree_of_seq = f.sequence_tree()
    for s in range(f.num_sequences):
        mask = f.field("loss_mask", s)
        assert set(np.unique(mask)) <= {0.0, 1.0}
        assert mask[0] == 0 and mask.any()  # a prompt first, then model output
        adv = f.field("advantages", s)
        assert np.all(adv == adv[0])  # one value per sequence
    # advantages are group-normalized within each tree
    seq_adv = f.fields["advantages"][f.seq_offsets[:-1]]
    for t in range(f.num_trees):
        assert abs(seq_adv[tree_of_seq == t].mean()) < 1e-6
    # log-probs are negative and, like real ones, equal wherever sequences share a prefix
    for name_ in ("old_logprobs", "ref_logprobs"):
        vals = f.fields[name_]
        assert np.all(vals <= 0)
        per_unique = np.zeros(f.num_unique_tokens)
        per_unique[f.lin_unique] = vals
        assert np.array_equal(per_unique[f.lin_unique], vals)


# ---------------------------------------------------------------------- grpo
def test_grpo_shape_bounds():
    f = grpo(seed=0, num_prompts=6)
    assert f.num_trees == 6
    assert set(np.bincount(f.sequence_tree())) <= {4, 8, 16}
    assert f.stats().max_depth == 2  # prompt -> answers
    for s in range(f.num_sequences):
        (m0, prompt), (m1, answer) = runs(f.field("loss_mask", s))
        assert (m0, m1) == (0.0, 1.0)
        assert 512 <= prompt <= 4096 and 256 <= answer <= 4096


def test_grpo_fixed_benchmark_case():
    f = grpo(seed=0, num_prompts=4, prompt_len=2048, group_size=8, answer_len=512)
    st = f.stats()
    assert st.num_sequences == 32 and st.num_trees == 4
    assert st.compression_ratio == (2048 + 512) * 8 / (2048 + 8 * 512)
    assert st.unique_tokens == 4 * (2048 + 8 * 512)
    assert np.all(f.sequence_lengths() == 2560)


def test_grpo_group_size_choices():
    f = grpo(seed=5, num_prompts=20, group_size=(2, 3))
    assert set(np.bincount(f.sequence_tree())) == {2, 3}


# ---------------------------------------------------------------------- agentic
def test_agentic_shape_bounds():
    f = agentic(seed=2, num_trees=2)
    assert f.num_trees == 2
    counts = inner_child_counts(f)
    assert counts.min() >= 2 and counts.max() <= 4  # branch points split 2 to 4 ways
    for s in range(f.num_sequences):
        parts = runs(f.field("loss_mask", s))
        (m0, prompt), turns = parts[0], parts[1:]
        assert m0 == 0.0 and 4550 <= prompt <= 5900  # system prompt + task
        assert 3 <= len(turns) <= 10
        # turns alternate assistant (1) / environment (0), starting with the assistant
        assert [m for m, _ in turns] == [float((i + 1) % 2) for i in range(len(turns))]
        assert all(30 <= n <= 2000 for _, n in turns)
        if len(turns) < 10:  # trajectories end on an assistant turn unless truncated
            assert turns[-1][0] == 1.0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_agentic_default_compression_near_9x(seed):
    ratio = agentic(seed=seed).stats().compression_ratio
    assert 7.0 <= ratio <= 11.0, ratio


def test_agentic_large_tree():
    t0 = time.perf_counter()
    f = agentic(seed=0, num_trees=1, target_unique_tokens=65536)
    elapsed = time.perf_counter() - t0
    d = describe(f)
    assert d["num_trees"] == 1 and d["unique_tokens"] >= 65536
    assert inner_child_counts(f).max() <= 4
    assert elapsed < 5.0, elapsed


def test_agentic_depth_override():
    f = agentic(seed=0, num_trees=2, depth=(5, 5), turn_len=40, trajectories=4)
    for s in range(f.num_sequences):
        turns = runs(f.field("loss_mask", s))[1:]
        assert len(turns) == 5 and all(n == 40 for _, n in turns)


# ---------------------------------------------------------------------- search
def test_search_shape():
    f = search(seed=0, num_trees=2, branching=4, beam_width=3, depth=5, step_len=(16, 64))
    st = f.stats()
    assert st.num_trees == 2
    assert st.max_depth == 5 + 1  # prompt + 5 levels of steps
    assert np.all(inner_child_counts(f) == 4)
    # per tree: 4 candidates at level 1 (3 kept), then 12 per level (3 kept), 12 leaves at the end
    assert st.num_sequences == 2 * (1 + 9 * 3 + 12)
    for s in range(f.num_sequences):
        (m0, prompt), (m1, steps) = runs(f.field("loss_mask", s))
        assert (m0, m1) == (0.0, 1.0) and 256 <= prompt <= 1024 and 16 <= steps <= 5 * 64


# ---------------------------------------------------------------------- registry
def test_make_workload_and_overrides():
    f = make_workload("grpo", seed=0, num_prompts=2, prompt_len=100, group_size=4, answer_len=10)
    assert f.num_linearized_tokens == 2 * 4 * 110
    # explicit overrides win over the tiny preset
    g = make_workload("grpo", tiny=True, vocab_size=50, group_size=3)
    assert set(np.bincount(g.sequence_tree())) == {3}
    for name in WORKLOADS:
        assert set(TINY[name]) <= set(workload_parameters(name))
        assert make_workload(name, tiny=True, vocab_size=16).num_linearized_tokens < 5000


@pytest.mark.parametrize(
    "name, overrides, match",
    [
        ("nope", {}, "unknown workload 'nope'; choose one of: agentic, grpo, mixed, search"),
        ("grpo", {"num_promts": 3}, r"unknown parameter\(s\) \['num_promts'\].*valid: num_prompts, prompt_len"),
        ("grpo", {"prompt_len": (10, 5)}, "prompt_len must satisfy"),
        ("grpo", {"prompt_len": "long"}, "prompt_len must be an int or"),
        ("grpo", {"group_size": 0}, "group_size must be"),
        ("grpo", {"group_size": 16, "vocab_size": 8}, "vocab_size=8 is too small"),
        ("agentic", {"stop_prob": 1.5}, "stop_prob must be a number in"),
        ("agentic", {"turn_len_median": 0}, "turn_len_median must be"),
        ("agentic", {"max_branching": 1}, "max_branching must be >= 2"),
        ("agentic", {"target_unique_tokens": 0}, "target_unique_tokens must be"),
        ("agentic", {"depth": 1, "trajectories": 6}, "no room for another trajectory"),
        ("search", {"depth": 0}, "depth must be an integer >= 1"),
        ("agentic", {"context_window": 5000}, r"context_window must be an integer >= 5930"),
        ("mixed", {"grpo_args": {"num_prompts": 3}},
         r"unknown grpo_args \['num_prompts'\].*the tree count is grpo_groups"),
        ("mixed", {"grpo_groups": 0, "agentic_trees": 0, "search_trees": 0}, "needs at least one tree"),
        ("mixed", {"search_trees": -1}, "search_trees must be an integer >= 0"),
        ("mixed", {"search_args": {"prompt_len": 100}}, r"sequence \d+ has \d+ tokens, below min_sequence_len=1024"),
        ("mixed", {"max_sequence_len": 8192}, r"sequence \d+ has \d+ tokens, above max_sequence_len=8192"),
        ("mixed", {"agentic_args": [1]}, "agentic_args must be a dict"),
        ("search", {"seed": -1}, "seed must be an integer >= 0"),
    ],
)
def test_bad_overrides(name, overrides, match):
    with pytest.raises(ValueError, match=match):
        make_workload(name, **overrides)


def test_describe():
    f = grpo(seed=0, num_prompts=2, prompt_len=100, group_size=4, answer_len=10)
    d = describe(f, flops_per_token=1.0, attn_flops_per_context_token=0.0)
    assert d["compression_ratio"] == d["flop_compression_ratio"] == pytest.approx(440 / 140)
    assert d["max_tree_unique_tokens"] == 140 and d["mean_branching"] == 4.0
    assert d["loss_tokens"] == 8 * 10


# ---------------------------------------------------------------------- speed
def test_million_token_workload_builds_fast():
    t0 = time.perf_counter()
    f = grpo(seed=0, num_prompts=24)
    elapsed = time.perf_counter() - t0
    assert f.num_linearized_tokens > 900_000
    assert elapsed < 5.0, elapsed


# ---------------------------------------------------------------------- agentic context window
def test_agentic_context_window_caps_paths():
    f = agentic(seed=0, num_trees=3, system_prompt_len=1000, task_len=0, depth=(6, 12), stop_prob=0.1,
                turn_len=(30, 2000), turn_len_median=800.0, context_window=4000)
    lengths = f.sequence_lengths()
    assert lengths.max() == 4000  # a trajectory ran into the window and was cut to it
    assert lengths.min() >= 1030
    # without the window the same trees run longer
    assert agentic(seed=0, num_trees=3, system_prompt_len=1000, task_len=0, depth=(6, 12), stop_prob=0.1,
                   turn_len=(30, 2000), turn_len_median=800.0).sequence_lengths().max() > 4000


# ---------------------------------------------------------------------- mixed
@pytest.fixture(scope="module")
def mixed0():
    return mixed_batch(seed=0)


def kind_part(batch, kind):
    part = batch.part(kind)
    return part, part.stats()


def test_mixed_holds_all_three_kinds(mixed0):
    f = mixed0.forest
    assert f.num_trees == 12 + 3 + 6
    assert sorted(mixed0.tree_kinds()) == sorted(["grpo"] * 12 + ["agentic"] * 3 + ["search"] * 6)
    assert len(mixed0.sequence_kinds) == f.num_sequences
    assert sum(len(mixed0.sequences_of(k)) for k in KINDS) == f.num_sequences
    # the kinds are interleaved in the batch, not in three blocks
    kinds = mixed0.tree_kinds()
    assert sum(a != b for a, b in zip(kinds, kinds[1:])) > 3
    # each sequence's kind is its tree's kind
    tree_of = f.sequence_tree()
    assert all(kinds[tree_of[s]] == KINDS[k] for s, k in enumerate(mixed0.sequence_kinds))


def test_mixed_sequence_lengths_span_1k_to_32k():
    lengths = np.concatenate([mixed_batch(seed=s).forest.sequence_lengths() for s in range(3)])
    assert lengths.min() >= 1024 and lengths.max() <= 32768
    assert lengths.min() < 1536 and lengths.max() > 28000  # both ends of the range are used


def test_mixed_kinds_have_their_shapes(mixed0):
    grpo_f, grpo_st = kind_part(mixed0, "grpo")
    assert grpo_st.max_depth == 2 and set(np.bincount(grpo_f.sequence_tree())) <= {8, 16}
    for s in range(grpo_f.num_sequences):  # short answers
        (_, prompt), (_, answer) = runs(grpo_f.field("loss_mask", s))
        assert 1024 <= prompt <= 3072 and 64 <= answer <= 512
    agent_f, _ = kind_part(mixed0, "agentic")
    turns = [len(runs(agent_f.field("loss_mask", s))) - 1 for s in range(agent_f.num_sequences)]
    assert np.median(turns) >= 8 and max(turns) <= 20  # deep
    assert agent_f.sequence_lengths().min() > 4000  # long contexts
    search_f, search_st = kind_part(mixed0, "search")
    steps = np.delete(search_f.node_length, search_f.tree_roots)
    assert search_st.num_nodes > 80 * 6 and steps.min() >= 16 and steps.max() <= 96  # many small nodes
    # the point of the batch: an agentic token sees far more context than a GRPO or search token
    mean_pos = {k: float(kind_part(mixed0, k)[0].positions.mean()) for k in KINDS}
    assert mean_pos["agentic"] > 4 * max(mean_pos["grpo"], mean_pos["search"])


def test_mixed_counts_and_shape_overrides():
    b = mixed_batch(seed=1, grpo_groups=2, agentic_trees=0, search_trees=1, grpo_args={"group_size": 4})
    assert b.part("agentic") is None and len(b.sequences_of("agentic")) == 0
    assert b.forest.num_trees == 3 and b.tree_kinds().count("grpo") == 2
    assert set(np.bincount(b.part("grpo").sequence_tree())) == {4}
    assert same_forest(b.forest, make_workload("mixed", seed=1, grpo_groups=2, agentic_trees=0, search_trees=1,
                                               grpo_args={"group_size": 4}))
    with pytest.raises(ValueError, match="unknown kind"):
        b.sequences_of("sft")


def test_mixed_without_fields_has_the_same_tokens():
    with_fields = mixed_batch(seed=2, grpo_groups=2, agentic_trees=1, search_trees=1).forest
    bare = mixed_batch(seed=2, grpo_groups=2, agentic_trees=1, search_trees=1, fields=False).forest
    assert not bare.fields and set(with_fields.fields) == {"loss_mask", "advantages", "old_logprobs", "ref_logprobs"}
    assert np.array_equal(bare.lin_tokens, with_fields.lin_tokens)
    assert np.array_equal(bare.seq_offsets, with_fields.seq_offsets)
