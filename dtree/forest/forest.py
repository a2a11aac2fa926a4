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
largest last (docs/design.md section 2). :mod:`dtree.forest.trie` builds the tree layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from .inputs import check_field_names, field_arrays, sequence_entries, token_array
from .padding import padded_rows, prompt_completion_rows
from .trie import TrieLayout, build_trie

__all__ = ["FieldMap", "Forest", "ForestStats"]


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


class FieldMap(Mapping[str, np.ndarray]):
    """A forest's fields: a read-only ``name -> [N] float64`` mapping (picklable, unlike
    ``types.MappingProxyType``). Arrays are read-only too; ``Forest.with_fields``
    makes a forest with other fields."""

    def __init__(self, fields: Mapping[str, np.ndarray]) -> None:
        self._fields = dict(fields)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._fields[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        return f"FieldMap({sorted(self._fields)})"


@dataclass(frozen=True, eq=False, repr=False)
class Forest(TrieLayout):
    """A batch of token sequences merged into prefix trees; immutable once built.

    Build one with :meth:`from_sequences` (or :meth:`from_padded`,
    :meth:`from_prompt_completion`, :meth:`from_jsonl`); the constructor takes the
    finished arrays. All arrays are numpy (host side) and read-only; no attribute can
    be assigned; :meth:`with_fields` and :meth:`subset` return new forests. The runtime
    moves what it needs to the device.

    Linearized layout (``S`` sequences, ``N`` linearized tokens):
        seq_offsets:  [S+1] int64, sequence ``s`` is ``lin_tokens[seq_offsets[s]:seq_offsets[s+1]]``
        lin_tokens:   [N] int64
        lin_unique:   [N] int64, unique-token index of every linearized token
        fields:       name -> [N] float64, per-token values; the value at position ``t``
                      belongs to the prediction of ``s[t]`` from ``s[:t]`` (``t = 0`` is unused)

    Tree layout (``U`` unique tokens, ``M`` nodes, ``T`` trees), depth-first order
    (built by :func:`dtree.forest.trie.build_trie`):
        tokens:       [U] int64 token ids
        positions:    [U] int64 depth of each token (its position in every path through it)
        predecessor:  [U] int64 unique index of the token before it on its path, -1 at a root
                      (the token whose hidden state predicts it)
        node_start:   [M] int64 first unique token of each node; node_length: [M]
        node_parent:  [M] int64, -1 for roots; node_depth: [M] number of ancestors
        node_subtree_end: [M] int64, node ``i``'s subtree is nodes ``[i, node_subtree_end[i])``
        child_offsets: [M+1], child_index: [M-T] children of node ``i`` (CSR), largest subtree last
        tree_roots:   [T] root node of each tree
    """

    seq_offsets: np.ndarray  # the tree layout's arrays are TrieLayout's fields
    lin_tokens: np.ndarray
    fields: Mapping[str, np.ndarray]

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", FieldMap(self.fields))
        self._lock()

    def __setstate__(self, state: dict) -> None:  # unpickled arrays come back writable
        self.__dict__.update(state)
        self._lock()

    def _lock(self) -> None:
        for value in (*self.__dict__.values(), *self.fields.values()):
            if isinstance(value, np.ndarray):
                value.flags.writeable = False

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sequences(cls, /, sequences: Sequence[Any], **fields: Sequence[Any]) -> "Forest":
        """Merge token sequences into tries.

        Args:
            sequences: list of token-id sequences (lists of ints, 1-D integer numpy arrays
                or tensors).
            **fields: per-token values, each a list (or array, or tensor) aligned with
                ``sequences`` whose entry ``s`` is either ``len(sequences[s])`` numbers
                (per token) or one number (per sequence, e.g. a GRPO advantage; it is
                broadcast to every token of the sequence). What an entry is follows from
                its own dimensionality, never from lengths: a ``[S]`` tensor or a list
                of floats gives one scalar per sequence, a list of lists (or ``[S, L]``)
                gives per-token values. ``loss_mask``, ``advantages``, ``old_logprobs``
                and ``ref_logprobs`` are read by :mod:`dtree.losses`; any other name is
                carried along for custom losses. Values are stored as float64, at their
                own precision (a float64 tensor keeps every bit).

        Raises:
            TypeError: ``sequences`` is not a list of sequences (None, a number, a string,
                a dict or tokenizer ``BatchEncoding``: the message names what to pass), or
                an entry or a value has the wrong type: bool, float or string token ids,
                string or complex field values.
            ValueError: empty, nested or 1-D-instead-of-list sequences, a ``[B, L]``
                tensor (a padded batch: ``from_padded``), negative ids or ids beyond
                int64, fields whose lengths do not match, non-finite or too large field
                values, reserved field names (:data:`dtree.forest.inputs.RESERVED_FIELD_NAMES`).
                Messages name the sequence, the position and the field
                (:mod:`dtree.forest.inputs`).
        """
        return cls._build(sequences, fields)

    @classmethod
    def _build(cls, /, sequences: Any, fields: Mapping[str, Any]) -> "Forest":
        """:meth:`from_sequences` with the fields as one mapping (what the other
        constructors pass, so no field name can collide with an argument)."""
        check_field_names(fields)
        seqs = [token_array(s, i) for i, s in enumerate(sequence_entries(sequences))]
        lengths = [len(s) for s in seqs]
        per_field = {name: field_arrays(name, v, lengths) for name, v in fields.items() if v is not None}
        seq_offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=seq_offsets[1:])
        return cls(
            seq_offsets=seq_offsets,
            lin_tokens=np.concatenate(seqs),
            fields={name: np.concatenate(arrs) for name, arrs in per_field.items()},
            **vars(build_trie(seqs)),
        )

    @classmethod
    def from_padded(cls, /, input_ids: Any, attention_mask: Any, loss_mask: Any = None, **fields: Any) -> "Forest":
        """A forest from a padded ``[B, L]`` batch (verl / OpenRLHF / AReaL layout); row
        ``b`` is sequence ``b`` (:mod:`dtree.integrations.padded` describes the layouts).

        Args:
            input_ids: [B, L] integer token ids.
            attention_mask: [B, L] 0/1; each row's ones are one contiguous run (left
                and/or right padding), with at least one token.
            loss_mask: [B, L] weights aligned with ``input_ids`` (e.g. verl's response
                mask placed at the response columns); 0 wherever ``attention_mask`` is 0.
                Default: every token counts (dtree never counts a sequence's first token).
            **fields: each [B, L] aligned with ``input_ids`` (the value at column ``c``
                belongs to the prediction of the token at column ``c``), or [B], one
                number per row.

        Returns:
            A :class:`Forest` over the rows' real tokens, in row order.
        """
        sequences, per_row = padded_rows(input_ids, attention_mask, loss_mask, **fields)
        return cls._build(sequences, per_row)

    @classmethod
    def from_prompt_completion(
        cls,
        /,
        prompt_ids: Any,
        prompt_mask: Any,
        completion_ids: Any,
        completion_mask: Any,
        *,
        loss_mask: Any = None,
        **completion_fields: Any,
    ) -> "Forest":
        """A forest from separate prompt and completion tensors (TRL's layout); row ``b``
        is sequence ``b``: its prompt tokens, then its completion tokens.

        Args:
            prompt_ids, prompt_mask: [B, P]; the prompt's real tokens are one contiguous
                run (TRL left-pads them). May be empty for a row whose completion is not.
            completion_ids, completion_mask: [B, R]; one contiguous run (right-padded). A
                row may have no completion token (TRL's ``mask_truncated_completions``
                zeroes a whole row): the sequence is then its prompt, with no loss token,
                and still counts as a sequence (``Normalization.num_sequences``).
            loss_mask: [B, R] aligned with the completion, 0 where ``completion_mask`` is
                0 (TRL: ``completion_mask * tool_mask``). Default: ``completion_mask``.
                Prompt tokens never count.
            **completion_fields: each [B, R] aligned with the completion tokens
                (``advantages``, ``old_logprobs``, ...; 0 is put on the prompt tokens),
                or [B], one number per row, broadcast to the whole sequence.
        """
        sequences, per_row = prompt_completion_rows(
            prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask=loss_mask, **completion_fields
        )
        return cls._build(sequences, per_row)

    def with_fields(self, /, **fields: Any) -> "Forest":
        """A new forest that shares this one's trie, with fields added or replaced.

        Each field is given as in :meth:`from_sequences` (per token, or one number per
        sequence), and also **prediction-aligned**: an entry of ``len - 1`` values, as
        :meth:`TreeRuntime.logprobs` returns them (value ``i`` belongs to the prediction
        of token ``i + 1``), gets a 0 put at position 0. So the round trip is direct::

            forest = forest.with_fields(old_logprobs=rt.logprobs(forest))

        Lengths ``len`` and ``len - 1`` never coincide, so each entry's alignment is
        unambiguous. ``None`` removes a field. This forest is left unchanged.
        """
        check_field_names(fields)
        lengths = self.sequence_lengths().tolist()
        new_fields = dict(self.fields)
        for name, values in fields.items():
            if values is None:
                new_fields.pop(name, None)
            else:
                new_fields[name] = np.concatenate(field_arrays(name, values, lengths, prediction_aligned=True))
        return replace(self, fields=new_fields)

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
        return Forest._build([self.sequence(i) for i in ids], {n: [self.field(n, i) for i in ids] for n in self.fields})

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
        """Load sequences from JSON Lines (see :mod:`dtree.forest.jsonl`)."""
        from .jsonl import read_jsonl

        sequences, fields = read_jsonl(path)
        return cls._build(sequences, fields)

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

