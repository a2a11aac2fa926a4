"""Prefix trees (tries) of token sequences: the data model every other module reads.

A :class:`Forest` holds a batch of token sequences in two layouts at once:

* the **linearized** layout, sequence after sequence, exactly as the user gave them.
  Per-token fields (``loss_mask``, ``advantages``, ...) live here, because each
  (sequence, position) keeps its own value even where sequences share tokens;
* the **tree** layout: the sequences merged into compressed tries (one trie per
  distinct first token), each unique token stored once, in depth-first order.

``lin_unique`` maps every linearized token to its unique token, which is the
whole bridge between the two: a loss written per linearized token gathers its
log-prob from the unique token, and autograd sums the gradient back.

Nodes are numbered in depth-first preorder, so the nodes (and the unique tokens)
of any subtree form one contiguous range. Children are ordered by subtree size,
largest last (DESIGN.md section 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["Forest", "ForestStats"]

@dataclass(frozen=True)
class ForestStats:
    """Size and sharing figures of a forest (``Forest.stats()``)."""

    num_sequences: int
    num_trees: int
    num_nodes: int
    unique_tokens: int
    linearized_tokens: int
    compression_ratio: float  # linearized_tokens / unique_tokens
    max_depth: int  # most nodes on one root-to-leaf path
    max_path_length: int  # most tokens on one root-to-leaf path (= longest sequence)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def format(self) -> str:
        rows = [
            ("sequences", f"{self.num_sequences:,}"),
            ("trees", f"{self.num_trees:,}"),
            ("nodes", f"{self.num_nodes:,}"),
            ("unique tokens", f"{self.unique_tokens:,}"),
            ("linearized tokens", f"{self.linearized_tokens:,}"),
            ("compression ratio", f"{self.compression_ratio:.3f}x"),
            ("max depth (nodes)", f"{self.max_depth:,}"),
            ("max path length (tokens)", f"{self.max_path_length:,}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _as_token_array(seq: Any, index: int) -> np.ndarray:
    """One sequence as a 1-D int64 array, with a clear error for anything else."""
    if hasattr(seq, "detach") and hasattr(seq, "cpu"):  # torch.Tensor, without importing torch
        seq = seq.detach().cpu().numpy()
    arr = np.asarray(seq)
    if arr.ndim != 1:
        raise ValueError(f"sequence {index} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        raise ValueError(f"sequence {index} is empty: every sequence needs at least one token")
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool):
        if np.issubdtype(arr.dtype, np.floating) and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"sequence {index} must hold integer token ids, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    negative = np.flatnonzero(arr < 0)
    if negative.size:
        t = int(negative[0])
        raise ValueError(f"token id {int(arr[t])} at sequence {index}, position {t} is negative")
    return arr


def _as_field_array(name: str, value: Any, index: int, length: int, prediction_aligned: bool = False) -> np.ndarray:
    """One sequence's values of a field as [length] float64.

    ``value`` is either one number (a per-sequence scalar: Python number, numpy scalar,
    0-d array or tensor), broadcast to every token, or a 1-D array of ``length`` values.
    With ``prediction_aligned``, a 1-D array of ``length - 1`` values is accepted too
    (value ``i`` belongs to token ``i + 1``, as ``TreeRuntime.logprobs`` returns them)
    and gets a 0 at position 0, which is never predicted.
    """
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().float().cpu().numpy() if value.dtype.is_floating_point else value.detach().cpu().numpy()
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(
            f"field {name!r} of sequence {index} must be a number or a 1-D list of numbers, got {type(value).__name__}"
        ) from None
    if arr.ndim == 0:
        arr = np.full(length, float(arr))
    if arr.ndim != 1:
        raise ValueError(
            f"field {name!r} of sequence {index} must be a number (per sequence) or 1-D (per token), "
            f"got shape {tuple(arr.shape)}"
        )
    if prediction_aligned and arr.shape[0] == length - 1:
        arr = np.concatenate([[0.0], arr])
    if arr.shape[0] != length:
        expected = f"{length} (or {length - 1}, prediction-aligned)" if prediction_aligned else f"{length}"
        hint = (
            "; for prediction-aligned values (one per predicted token, as TreeRuntime.logprobs returns them) "
            "use Forest.with_fields"
            if not prediction_aligned and arr.shape[0] == length - 1
            else ""
        )
        raise ValueError(
            f"field {name!r} of sequence {index} has {arr.shape[0]} values but the sequence has {length} tokens "
            f"(expected {expected} values, or one number per sequence){hint}"
        )
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        t = int(bad[0])
        raise ValueError(f"field {name!r} of sequence {index} at position {t} is {arr[t]} (must be finite)")
    return arr


def _field_arrays(name: str, values: Any, lengths: Sequence[int], prediction_aligned: bool = False) -> list[np.ndarray]:
    """A field's values per sequence (see :func:`_as_field_array`), one entry per sequence."""
    try:
        count = len(values) if not isinstance(values, (str, bytes)) else None
    except TypeError:  # a number or a 0-d array/tensor
        count = None
    if count is None:
        raise ValueError(
            f"field {name!r} must hold one entry per sequence (a list, array or tensor), got {type(values).__name__}"
        )
    if count != len(lengths):
        raise ValueError(f"field {name!r} has {count} entries but there are {len(lengths)} sequences")
    return [_as_field_array(name, v, i, n, prediction_aligned) for i, (v, n) in enumerate(zip(values, lengths))]


class Forest:
    """A batch of token sequences merged into prefix trees.

    Build one with :meth:`from_sequences` or :meth:`from_jsonl`. All arrays are numpy
    (host side); the runtime moves what it needs to the device.

    Linearized layout (``S`` sequences, ``N`` linearized tokens):
        seq_offsets:  [S+1] int64, sequence ``s`` is ``lin_tokens[seq_offsets[s]:seq_offsets[s+1]]``
        lin_tokens:   [N] int64
        lin_unique:   [N] int64, unique-token index of every linearized token
        fields:       name -> [N] float64, per-token values; the value at position ``t``
                      belongs to the prediction of ``s[t]`` from ``s[:t]`` (``t = 0`` is unused)

    Tree layout (``U`` unique tokens, ``M`` nodes, ``T`` trees), depth-first order:
        tokens:       [U] int64 token ids
        positions:    [U] int64 depth of each token (its position in every path through it)
        pred_row:     [U] int64 unique index of the token before it on its path, -1 at a root
        node_start:   [M] int64 first unique token of each node; node_length: [M]
        node_parent:  [M] int64, -1 for roots; node_depth: [M] number of ancestors
        node_subtree_end: [M] int64, node ``i``'s subtree is nodes ``[i, node_subtree_end[i])``
        child_offsets: [M+1], child_index: [M-T] children of node ``i`` (CSR), largest subtree last
        tree_roots:   [T] root node of each tree
    """

    def __init__(self) -> None:  # use the constructors below
        self.seq_offsets: np.ndarray
        self.lin_tokens: np.ndarray
        self.lin_unique: np.ndarray
        self.fields: dict[str, np.ndarray] = {}
        self.tokens: np.ndarray
        self.positions: np.ndarray
        self.pred_row: np.ndarray
        self.node_start: np.ndarray
        self.node_length: np.ndarray
        self.node_parent: np.ndarray
        self.node_depth: np.ndarray
        self.node_subtree_end: np.ndarray
        self.child_offsets: np.ndarray
        self.child_index: np.ndarray
        self.tree_roots: np.ndarray

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sequences(cls, sequences: Sequence[Any], **fields: Sequence[Any]) -> "Forest":
        """Merge token sequences into tries.

        Args:
            sequences: list of token-id sequences (lists, numpy arrays or 1-D int tensors).
            **fields: per-token values, each a list (or array, or tensor) aligned with
                ``sequences`` whose entry ``s`` is either ``len(sequences[s])`` numbers
                (per token) or one number (per sequence, e.g. a GRPO advantage; it is
                broadcast to every token of the sequence). What an entry is follows from
                its own dimensionality, never from lengths: a ``[S]`` tensor or a list
                of floats gives one scalar per sequence, a list of lists (or ``[S, L]``)
                gives per-token values. ``loss_mask``, ``advantages``, ``old_logprobs``
                and ``ref_logprobs`` are read by :mod:`dtree.losses`; any other name is
                carried along for custom losses.

        Raises:
            ValueError: empty or non-integer sequences, negative token ids, fields whose
                lengths do not match, or non-finite field values. The message names the
                sequence and position.
        """
        if isinstance(sequences, (str, bytes)):
            raise TypeError("sequences must be a list of token-id sequences, not a string")
        if getattr(sequences, "ndim", 1) != 1:  # a tensor or array: a padded [B, L] batch is the usual mistake
            raise ValueError(
                f"sequences is a [B, L] tensor (shape {tuple(sequences.shape)}): a padded batch would make its pads "
                "tokens. Use Forest.from_padded(input_ids, attention_mask), or list(tensor) if every row is a "
                "whole sequence without padding"
            )
        seqs = [_as_token_array(s, i) for i, s in enumerate(sequences)]
        if not seqs:
            raise ValueError("sequences is empty: a forest needs at least one sequence")
        lengths = [len(s) for s in seqs]
        field_arrays = {name: _field_arrays(name, v, lengths) for name, v in fields.items() if v is not None}
        forest = cls()
        forest._build(seqs, field_arrays)
        return forest

    @classmethod
    def from_padded(cls, input_ids: Any, attention_mask: Any, loss_mask: Any = None, **fields: Any) -> "Forest":
        """Sequences from a padded ``[B, L]`` batch (verl / OpenRLHF / AReaL layout); see
        :func:`dtree.integrations.padded.from_padded`."""
        from .integrations.padded import from_padded

        return from_padded(input_ids, attention_mask, loss_mask, **fields)

    @classmethod
    def from_prompt_completion(
        cls, prompt_ids: Any, prompt_mask: Any, completion_ids: Any, completion_mask: Any, **completion_fields: Any
    ) -> "Forest":
        """Sequences from separate prompt and completion tensors (TRL's layout); see
        :func:`dtree.integrations.padded.from_prompt_completion`."""
        from .integrations.padded import from_prompt_completion

        return from_prompt_completion(prompt_ids, prompt_mask, completion_ids, completion_mask, **completion_fields)

    def with_fields(self, **fields: Any) -> "Forest":
        """A new forest that shares this one's trie, with fields added or replaced.

        Each field is given as in :meth:`from_sequences` (per token, or one number per
        sequence), and also **prediction-aligned**: an entry of ``len - 1`` values, as
        :meth:`TreeRuntime.logprobs` returns them (value ``i`` belongs to the prediction
        of token ``i + 1``), gets a 0 put at position 0. So the round trip is direct::

            forest = forest.with_fields(old_logprobs=rt.logprobs(forest))

        Lengths ``len`` and ``len - 1`` never coincide, so each entry's alignment is
        unambiguous. ``None`` removes a field. This forest is left unchanged.
        """
        lengths = self.sequence_lengths().tolist()
        out = Forest()
        out.__dict__.update(self.__dict__)
        out.fields = dict(self.fields)
        for name, values in fields.items():
            if values is None:
                out.fields.pop(name, None)
            else:
                out.fields[name] = np.concatenate(_field_arrays(name, values, lengths, prediction_aligned=True))
        return out

    def _build(self, seqs: list[np.ndarray], field_arrays: dict[str, list[np.ndarray]]) -> None:
        lengths = np.array([len(s) for s in seqs], dtype=np.int64)
        self.seq_offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.seq_offsets[1:])
        self.lin_tokens = np.concatenate(seqs)
        self.fields = {name: np.concatenate(arrs) for name, arrs in field_arrays.items()}

        # 1. Compressed trie from the lexicographically sorted sequences: consecutive
        #    sorted sequences share exactly their longest common prefix, so one pass
        #    with a stack of the current path builds every node (no per-token dicts).
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].tolist())
        rep: list[int] = []  # a sequence that contains the node's tokens
        d0: list[int] = []  # node covers depths [d0, d1)
        d1: list[int] = []
        parent: list[int] = []
        children: list[list[int]] = []
        path: list[int] = []
        prev: np.ndarray | None = None
        for s in order:
            cur = seqs[s]
            if prev is None:
                lcp = 0
            else:
                m = min(len(prev), len(cur))
                neq = np.flatnonzero(prev[:m] != cur[:m])
                lcp = int(neq[0]) if neq.size else m
            while path and d0[path[-1]] >= lcp:
                path.pop()
            if path and d1[path[-1]] > lcp:  # the new sequence leaves the top node midway: split it
                top = path[-1]
                low = len(rep)
                rep.append(rep[top])
                d0.append(lcp)
                d1.append(d1[top])
                parent.append(top)
                children.append(children[top])
                for c in children[low]:
                    parent[c] = low
                children[top] = [low]
                d1[top] = lcp
            if len(cur) > lcp:
                node = len(rep)
                rep.append(s)
                d0.append(lcp)
                d1.append(len(cur))
                parent.append(path[-1] if path else -1)
                children.append([])
                if path:
                    children[path[-1]].append(node)
                path.append(node)
            prev = cur

        # A sequence that ends inside a path (a prefix of another) leaves a node with a
        # single child; merge such chains so every inner node is a real branch point.
        merged = [False] * len(rep)
        for node in range(len(rep)):
            if merged[node]:
                continue
            while len(children[node]) == 1:
                only = children[node][0]
                d1[node], rep[node], children[node] = d1[only], rep[only], children[only]
                for c in children[node]:
                    parent[c] = node
                merged[only] = True

        num_nodes = len(rep)
        d0_a = np.array(d0, dtype=np.int64)
        d1_a = np.array(d1, dtype=np.int64)
        length_a = d1_a - d0_a

        # 2. Subtree token counts. A split can re-parent older nodes under newer ones,
        #    so creation order is not a post-order; start depth is (a child starts
        #    where its parent ends).
        subtree_tokens = length_a.copy()
        parent_a = np.array(parent, dtype=np.int64)
        for node in sorted(range(num_nodes), key=lambda n: -d0[n]):
            if not merged[node] and parent[node] >= 0:
                subtree_tokens[parent[node]] += subtree_tokens[node]

        # 3. Depth-first preorder with children sorted by subtree size (largest last),
        #    ties broken by first token so the layout is deterministic.
        def first_token(n: int) -> int:
            return int(seqs[rep[n]][d0[n]])

        roots = [n for n in range(num_nodes) if parent[n] < 0]
        first_seen: dict[int, int] = {}
        for i, s in enumerate(seqs):
            first_seen.setdefault(int(s[0]), i)
        roots.sort(key=lambda n: first_seen[first_token(n)])  # trees in order of first appearance
        new_id = np.full(num_nodes, -1, dtype=np.int64)
        preorder: list[int] = []
        todo = list(reversed(roots))
        while todo:
            n = todo.pop()
            new_id[n] = len(preorder)
            preorder.append(n)
            kids = sorted(children[n], key=lambda c: (int(subtree_tokens[c]), first_token(c)))
            children[n] = kids
            todo.extend(reversed(kids))

        pre = np.array(preorder, dtype=np.int64)
        num_nodes = len(pre)  # merged nodes are gone from here on
        self.node_length = length_a[pre]
        self.node_start = np.zeros(num_nodes, dtype=np.int64)
        np.cumsum(self.node_length[:-1], out=self.node_start[1:])
        self.node_parent = np.where(parent_a[pre] >= 0, new_id[np.maximum(parent_a[pre], 0)], -1)
        node_d0 = d0_a[pre]
        self.node_depth = np.zeros(num_nodes, dtype=np.int64)
        for i in range(num_nodes):  # parents precede children in preorder
            p = self.node_parent[i]
            self.node_depth[i] = 0 if p < 0 else self.node_depth[p] + 1
        kid_lists = [[int(new_id[c]) for c in children[old]] for old in preorder]
        self.child_offsets = np.zeros(num_nodes + 1, dtype=np.int64)
        np.cumsum([len(k) for k in kid_lists], out=self.child_offsets[1:])
        self.child_index = np.array([c for k in kid_lists for c in k], dtype=np.int64)
        self.tree_roots = np.array([new_id[r] for r in roots], dtype=np.int64)
        sizes = np.ones(num_nodes, dtype=np.int64)
        for i in range(num_nodes - 1, -1, -1):
            if self.node_parent[i] >= 0:
                sizes[self.node_parent[i]] += sizes[i]
        self.node_subtree_end = np.arange(num_nodes, dtype=np.int64) + sizes

        # 4. Unique tokens in preorder, their depths and their predecessors.
        total = int(self.node_length.sum())
        self.tokens = np.empty(total, dtype=np.int64)
        self.positions = np.empty(total, dtype=np.int64)
        for i, old in enumerate(preorder):
            a, b = self.node_start[i], self.node_start[i] + self.node_length[i]
            self.tokens[a:b] = seqs[rep[old]][d0[old] : d1[old]]
            self.positions[a:b] = np.arange(node_d0[i], node_d0[i] + self.node_length[i])
        self.pred_row = np.arange(total, dtype=np.int64) - 1
        parent_last = np.where(
            self.node_parent >= 0,
            self.node_start[np.maximum(self.node_parent, 0)] + self.node_length[np.maximum(self.node_parent, 0)] - 1,
            -1,
        )
        self.pred_row[self.node_start] = parent_last

        # 5. Map every linearized token to its unique token by walking each sequence
        #    down the trie, one node (not one token) at a time.
        child_by_token: list[dict[int, int]] = [dict() for _ in range(num_nodes)]
        for n in range(num_nodes):
            for c in self.child_index[self.child_offsets[n] : self.child_offsets[n + 1]]:
                child_by_token[n][int(self.tokens[self.node_start[c]])] = int(c)
        root_by_token = {int(self.tokens[self.node_start[r]]): int(r) for r in self.tree_roots}
        self.lin_unique = np.empty(len(self.lin_tokens), dtype=np.int64)
        for s, seq in enumerate(seqs):
            off = self.seq_offsets[s]
            node = root_by_token[int(seq[0])]
            depth = 0
            while True:
                nd0 = self.positions[self.node_start[node]]
                end = min(len(seq), nd0 + self.node_length[node])
                self.lin_unique[off + depth : off + end] = self.node_start[node] + np.arange(depth - nd0, end - nd0)
                depth = int(end)
                if depth >= len(seq):
                    break
                node = child_by_token[node][int(seq[depth])]
        assert np.array_equal(self.tokens[self.lin_unique], self.lin_tokens), "trie construction is inconsistent"

    # ------------------------------------------------------------------ accessors
    @property
    def num_sequences(self) -> int:
        return len(self.seq_offsets) - 1

    @property
    def num_trees(self) -> int:
        return len(self.tree_roots)

    @property
    def num_nodes(self) -> int:
        return len(self.node_start)

    @property
    def num_unique_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_linearized_tokens(self) -> int:
        return len(self.lin_tokens)

    def sequence_lengths(self) -> np.ndarray:
        """[S] int64 number of tokens of each sequence."""
        return np.diff(self.seq_offsets)

    def sequence(self, s: int) -> np.ndarray:
        """Token ids of sequence ``s`` as given."""
        return self.lin_tokens[self.seq_offsets[s] : self.seq_offsets[s + 1]]

    def sequences(self) -> list[np.ndarray]:
        return [self.sequence(s) for s in range(self.num_sequences)]

    def field(self, name: str, s: int) -> np.ndarray:
        """Values of field ``name`` for sequence ``s``."""
        return self.fields[name][self.seq_offsets[s] : self.seq_offsets[s + 1]]

    def locate(self, lin_index: int) -> tuple[int, int]:
        """(sequence, position) of a linearized token index."""
        s = int(np.searchsorted(self.seq_offsets, lin_index, side="right") - 1)
        return s, int(lin_index - self.seq_offsets[s])

    def tree_of_node(self) -> np.ndarray:
        """[M] int64 tree index of every node."""
        out = np.empty(self.num_nodes, dtype=np.int64)
        for t, r in enumerate(self.tree_roots):
            out[r : self.node_subtree_end[r]] = t
        return out

    def sequence_tree(self) -> np.ndarray:
        """[S] int64 tree index of every sequence."""
        tree_of_token = np.repeat(self.tree_of_node(), self.node_length)
        return tree_of_token[self.lin_unique[self.seq_offsets[:-1]]]

    def subset(self, sequence_ids: Sequence[int]) -> "Forest":
        """A new forest with only the given sequences (in that order) and their fields."""
        ids = [int(i) for i in sequence_ids]
        return Forest.from_sequences(
            [self.sequence(i) for i in ids], **{n: [self.field(n, i) for i in ids] for n in self.fields}
        )

    # ------------------------------------------------------------------ statistics
    def stats(self) -> ForestStats:
        unique = self.num_unique_tokens
        lin = self.num_linearized_tokens
        return ForestStats(
            num_sequences=self.num_sequences,
            num_trees=self.num_trees,
            num_nodes=self.num_nodes,
            unique_tokens=unique,
            linearized_tokens=lin,
            compression_ratio=lin / unique,
            max_depth=int(self.node_depth.max()) + 1,
            max_path_length=int(self.sequence_lengths().max()),
        )

    def flop_compression_ratio(self, flops_per_token: float, attn_flops_per_context_token: float) -> float:
        """Ideal speedup of tree training over linearized training, FLOP-weighted.

        A token at position ``p`` costs ``flops_per_token + attn_flops_per_context_token * (p + 1)``
        in either layout (it attends to the same ``p + 1`` keys), so the ratio is the
        linearized FLOPs over the unique-token FLOPs.
        """
        lin_pos = np.arange(self.num_linearized_tokens) - np.repeat(self.seq_offsets[:-1], self.sequence_lengths())
        lin = flops_per_token * len(lin_pos) + attn_flops_per_context_token * float((lin_pos + 1).sum())
        uniq = flops_per_token * self.num_unique_tokens + attn_flops_per_context_token * float((self.positions + 1).sum())
        return lin / uniq

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_jsonl(cls, path: str) -> "Forest":
        """Load sequences from JSON Lines (see :mod:`dtree.jsonl`)."""
        from .jsonl import read_jsonl

        sequences, fields = read_jsonl(path)
        return cls.from_sequences(sequences, **fields)

    def to_jsonl(self, path: str) -> None:
        """Write one JSON object per sequence: ``{"tokens": [...], "<field>": [...]}``."""
        from .jsonl import write_jsonl

        write_jsonl(path, self.sequences(), {n: [self.field(n, s) for s in range(self.num_sequences)] for n in self.fields})

    def __repr__(self) -> str:
        st = self.stats()
        return (
            f"Forest(sequences={st.num_sequences}, trees={st.num_trees}, nodes={st.num_nodes}, "
            f"unique_tokens={st.unique_tokens}, compression={st.compression_ratio:.2f}x)"
        )

