"""Forest: trie construction, layout invariants, stats, JSONL, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from strategies import sequence_batches

from dtree import Forest


def check_invariants(f: Forest, seqs):
    # every sequence reads back through its unique tokens, with depth positions
    for s, seq in enumerate(seqs):
        u = f.lin_unique[f.seq_offsets[s] : f.seq_offsets[s + 1]]
        assert f.tokens[u].tolist() == list(seq)
        assert f.positions[u].tolist() == list(range(len(seq)))
        assert f.predecessor[u[0]] == -1 and np.array_equal(f.predecessor[u[1:]], u[:-1])
    # each unique token is one distinct prefix: the trie is maximal
    prefixes = set()
    for x in range(f.num_unique_tokens):
        path, y = [], x
        while y >= 0:
            path.append(int(f.tokens[y]))
            y = f.predecessor[y]
        assert tuple(path) not in prefixes
        prefixes.add(tuple(path))
    assert f.num_unique_tokens == len({tuple(s[: t + 1]) for s in seqs for t in range(len(s))})
    # compressed: no inner node with exactly one child; preorder subtree ranges
    kids = np.diff(f.child_offsets)
    assert not np.any(kids == 1)
    for n in range(f.num_nodes):
        ch = f.child_index[f.child_offsets[n] : f.child_offsets[n + 1]]
        assert np.all(f.node_parent[ch] == n)
        assert np.all((ch > n) & (ch < f.node_subtree_end[n]))
        # children ordered by subtree size, largest last
        sizes = [f.node_length[c : f.node_subtree_end[c]].sum() for c in ch]
        assert sizes == sorted(sizes)
    assert f.node_subtree_end[f.tree_roots].tolist() == list(f.tree_roots[1:]) + [f.num_nodes]


@given(sequence_batches(max_sequences=10, max_len=20, alphabet=4))
def test_trie_invariants(seqs):
    check_invariants(Forest.from_sequences(seqs), seqs)


def test_stats():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2], [7, 8], [1, 2, 3, 4], [1, 9]]
    st = Forest.from_sequences(seqs).stats()
    assert (st.num_sequences, st.num_trees, st.unique_tokens, st.linearized_tokens) == (6, 2, 9, 19)
    assert st.num_nodes == 6  # [1] -> {[9], [2,3] -> {[4], [5,6]}}, and [7,8]
    assert st.max_depth == 3 and st.max_path_length == 5
    assert st.compression_ratio == pytest.approx(19 / 9)
    assert "compression ratio" in st.format()


def test_tensor_inputs_and_fields():
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4])]
    f = Forest.from_sequences(seqs, advantages=[torch.tensor([0.0, 1.0, 2.0]), [0, -1, -2]])
    assert f.field("advantages", 1).tolist() == [0, -1, -2]
    assert f.num_unique_tokens == 4


def test_deep_trie_without_recursion():
    """A comb: a 3000-token spine with a branch at every position (3000-deep nodes)."""
    rng = np.random.default_rng(0)
    spine = rng.integers(0, 50, 3000)
    seqs = [spine] + [np.append(spine[:k], 50 + k % 7) for k in range(1, 3000)]
    f = Forest.from_sequences(seqs)
    assert f.stats().max_depth >= 2999
    assert f.num_unique_tokens == 3000 + 2999


def test_jsonl_roundtrip(tmp_path):
    seqs = [[1, 2, 3], [1, 2, 4, 5], [9]]
    fields = {"loss_mask": [[0, 1, 1], [0, 0, 1, 1], [1]], "advantages": [[0.5, 0.25, -1e-9], [1, 2, 3, 4.125], [0.1]]}
    f = Forest.from_sequences(seqs, **fields)
    path = tmp_path / "batch.jsonl"
    f.to_jsonl(str(path))
    g = Forest.from_jsonl(str(path))
    assert [s.tolist() for s in g.sequences()] == seqs
    for n in fields:
        assert np.array_equal(g.fields[n], f.fields[n])


def test_jsonl_errors(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"tokens": [1, 2]}\n{"tokens": [1], "loss_mask": [1]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: fields"):
        Forest.from_jsonl(str(p))
    p.write_text('{"tokens": [1, 2]}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        Forest.from_jsonl(str(p))


@pytest.mark.parametrize(
    "seqs, fields, match",
    [
        ([[1, 2], []], {}, "sequence 1 is empty"),
        ([], {}, "sequences is empty"),
        ([[1, -3, 2]], {}, "token id -3 at sequence 0, position 1 is negative"),
        ([[1, 2.5]], {}, "sequence 0 must hold integer token ids"),
        ([[[1, 2]]], {}, "sequence 0 must be 1-D"),
        ([[1, 2], [3]], {"advantages": [[1, 2]]}, "field 'advantages' has 1 entries but there are 2 sequences"),
        ([[1, 2], [3]], {"loss_mask": [[1, 1], [1, 1]]}, "field 'loss_mask' of sequence 1 has 2 values but the sequence has 1 tokens"),
        ([[1, 2, 3]], {"old_logprobs": [[0, float("nan"), 1]]}, "field 'old_logprobs' of sequence 0 at position 1 is nan"),
    ],
)
def test_bad_input(seqs, fields, match):
    with pytest.raises(ValueError, match=match):
        Forest.from_sequences(seqs, **fields)


def test_flop_compression_ratio():
    f = Forest.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5]])
    # dense only: token ratio; attention only: sum of (p+1) ratio
    assert f.flop_compression_ratio(1.0, 0.0) == pytest.approx(8 / 5)
    assert f.flop_compression_ratio(0.0, 1.0) == pytest.approx((10 + 10) / (1 + 2 + 3 + 4 + 4))


def test_forest_is_immutable():
    import dataclasses
    import pickle

    f = Forest.from_sequences([[1, 2, 3], [1, 2, 4], [5, 6]], advantages=[1.0, -1.0, 0.5])
    arrays = {k: v for k, v in vars(f).items() if isinstance(v, np.ndarray)}
    assert len(arrays) == 14
    for name, arr in arrays.items():
        with pytest.raises(ValueError, match="read-only"):
            arr[...] = 0
    with pytest.raises(ValueError, match="read-only"):
        f.fields["advantages"][0] = 2.0
    with pytest.raises(TypeError):
        f.fields["advantages"] = np.zeros(f.num_linearized_tokens)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.tokens = np.zeros(3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.fields = {}
    # new forests share the trie; the original keeps its fields
    g = f.with_fields(loss_mask=[[0, 1, 1], [0, 1, 1], [0, 1]], advantages=None)
    assert g.tokens is f.tokens and sorted(g.fields) == ["loss_mask"] and sorted(f.fields) == ["advantages"]
    assert not g.fields["loss_mask"].flags.writeable
    # pickling (e.g. to another worker) keeps the layout and the protection
    h = pickle.loads(pickle.dumps(g))
    check_invariants(h, [[1, 2, 3], [1, 2, 4], [5, 6]])
    assert np.array_equal(h.fields["loss_mask"], g.fields["loss_mask"])
    assert not h.tokens.flags.writeable and not h.fields["loss_mask"].flags.writeable
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.lin_unique = None


def test_read_only_arrays_upload_as_copies():
    """The runtime's host-to-device copy of a forest array neither warns nor aliases it."""
    import warnings

    from dtree.device.transfer import upload

    f = Forest.from_sequences([[1, 2, 3], [1, 2, 4]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = upload(f.tokens, "cpu")
    t[0] = 99
    assert f.tokens[0] == 1 and t.tolist() == [99, 2, 3, 4]
