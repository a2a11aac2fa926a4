"""Hypothesis strategies for batches of sequences that share prefixes."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def sequence_batches(draw, vocab: int = 97, max_sequences: int = 7, max_len: int = 14, alphabet: int | None = None):
    """Lists of token sequences where later sequences often extend, branch from,
    duplicate or cut short an earlier one. ``alphabet`` limits tokens to a few ids,
    which makes accidental sharing (and same-token siblings at depth) likely."""
    top = min(vocab, alphabet or vocab) - 1
    tok = st.integers(0, top)
    n = draw(st.integers(1, max_sequences))
    seqs: list[list[int]] = []
    for _ in range(n):
        kind = draw(st.sampled_from(["fresh", "branch", "branch", "duplicate", "prefix"])) if seqs else "fresh"
        if kind == "fresh":
            s = draw(st.lists(tok, min_size=1, max_size=max_len))
        else:
            base = draw(st.sampled_from(seqs))
            if kind == "duplicate":
                s = list(base)
            elif kind == "prefix":
                s = base[: draw(st.integers(1, len(base)))]
            else:
                k = draw(st.integers(1, len(base)))
                s = base[:k] + draw(st.lists(tok, min_size=0 if k else 1, max_size=max_len))
        seqs.append(s)
    return seqs


@st.composite
def batches_with_fields(draw, **kw):
    """(sequences, fields) with loss_mask, advantages, old_logprobs and ref_logprobs."""
    seqs = draw(sequence_batches(**kw))
    floats = lambda lo, hi: st.floats(lo, hi, allow_nan=False, allow_infinity=False, width=32)  # noqa: E731
    fields = {
        "loss_mask": [draw(st.lists(st.sampled_from([0.0, 1.0, 1.0]), min_size=len(s), max_size=len(s))) for s in seqs],
        "advantages": [draw(st.lists(floats(-2, 2), min_size=len(s), max_size=len(s))) for s in seqs],
        "old_logprobs": [draw(st.lists(floats(-6, -3), min_size=len(s), max_size=len(s))) for s in seqs],
        "ref_logprobs": [draw(st.lists(floats(-6, -3), min_size=len(s), max_size=len(s))) for s in seqs],
    }
    return seqs, fields
