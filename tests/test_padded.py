"""Padded batches in and out (dtree.integrations.padded): full rows with left, right and
mixed padding; TRL's prompt / completion layout; bad input named by row and column."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_models import make_model
from reference import path_logprobs

import dtree
from dtree import Forest
from dtree.integrations import from_prompt_completion, to_padded, to_padded_completion

PAD = 0
# verl-style rows: a left-padded prompt, then a right-padded response; and one all-right-padded row
IDS = torch.tensor(
    [
        [PAD, PAD, 11, 12, 13, 21, 22, PAD],
        [PAD, 11, 12, 13, 14, 31, PAD, PAD],
        [11, 12, 13, 21, 22, 23, 24, 25],
        [11, 12, 41, PAD, PAD, PAD, PAD, PAD],
    ]
)
MASK = (torch.arange(8)[None, :] >= torch.tensor([[2], [1], [0], [0]])) & (
    torch.arange(8)[None, :] < torch.tensor([[7], [6], [8], [3]])
)
ROWS = [[11, 12, 13, 21, 22], [11, 12, 13, 14, 31], [11, 12, 13, 21, 22, 23, 24, 25], [11, 12, 41]]


def test_rows_become_sequences_without_padding():
    forest = Forest.from_padded(IDS, MASK.long())
    assert [s.tolist() for s in forest.sequences()] == ROWS
    assert forest.num_trees == 1 and forest.stats().unique_tokens < sum(map(len, ROWS))
    assert "loss_mask" not in forest.fields  # default: every prediction counts


def test_fields_align_with_input_ids_and_scalars_broadcast():
    values = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    values[~MASK] = float("nan")  # padding values are never read
    forest = Forest.from_padded(IDS, MASK, loss_mask=MASK.float(), old_logprobs=values, advantages=torch.tensor([1.0, 2, 3, 4]))
    for r in range(4):
        cols = torch.nonzero(MASK[r]).flatten()
        assert forest.field("old_logprobs", r).tolist() == values[r, cols].tolist()
        assert forest.field("advantages", r).tolist() == [r + 1.0] * len(cols)
    back = to_padded([torch.tensor(forest.field("old_logprobs", r)) for r in range(4)], MASK)
    torch.testing.assert_close(back, torch.where(MASK, values, torch.zeros(())).to(back.dtype))


def test_logprobs_round_trip_into_the_padded_layout():
    """old_log_probs = to_padded(rt.logprobs(forest), attention_mask): value at column c
    is log p(token c | tokens before it), the first real column gets the fill."""
    model = make_model("qwen3")
    forest = Forest.from_padded(IDS, MASK)
    old = to_padded(dtree.TreeRuntime(model).logprobs(forest), MASK, fill=-7.0)
    assert old.shape == (4, 8) and old.dtype == torch.float32
    with torch.no_grad():
        for r, row in enumerate(ROWS):
            cols = torch.nonzero(MASK[r]).flatten()
            torch.testing.assert_close(old[r, cols[1:]], path_logprobs(model, row), rtol=1e-5, atol=1e-5)
            assert old[r, cols[0]] == -7.0 and torch.all(old[r, ~MASK[r]] == -7.0)


def test_to_padded_keeps_gradients():
    values = [torch.ones(len(r), requires_grad=True) for r in ROWS]
    out = to_padded(values, MASK)
    (out * 2).sum().backward()
    assert all(torch.all(v.grad == 2) for v in values)


def test_prompt_completion_layout_and_its_inverse():
    prompt_ids = torch.tensor([[PAD, 11, 12], [11, 12, 13], [PAD, PAD, 11], [PAD, 11, 12]])
    prompt_mask = (prompt_ids != PAD).long()
    completion_ids = torch.tensor([[5, 6, 7, PAD], [5, PAD, PAD, PAD], [8, 9, 10, 11], [PAD, PAD, PAD, PAD]])
    completion_mask = (completion_ids != PAD).long()
    tool_mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1], [1, 1, 0, 1], [1, 1, 1, 1]])  # TRL pads it with 1
    old = torch.randn(4, 4)
    forest = from_prompt_completion(
        prompt_ids, prompt_mask, completion_ids, completion_mask,
        loss_mask=completion_mask * tool_mask, old_logprobs=old, advantages=torch.tensor([0.5, -1.0, 2.0, 3.0]),
    )
    assert [s.tolist() for s in forest.sequences()] == [[11, 12, 5, 6, 7], [11, 12, 13, 5], [11, 8, 9, 10, 11], [11, 12]]
    assert forest.field("loss_mask", 0).tolist() == [0, 0, 1, 0, 1]
    assert forest.field("loss_mask", 3).tolist() == [0, 0]  # the row without a completion token still counts
    assert forest.field("old_logprobs", 2).tolist()[1:] == old[2].tolist()
    assert forest.field("old_logprobs", 2)[0] == 0.0  # prompt tokens get 0 for per-token fields ...
    assert forest.field("advantages", 1).tolist() == [-1.0] * 4  # ... and the row's number for scalars
    assert dtree.losses.local_normalization(forest).num_sequences == 4
    # inverse: token-aligned [len] and prediction-aligned [len-1] values give the same [B, R]
    token_aligned = [torch.tensor(forest.field("old_logprobs", r)) for r in range(4)]
    want = torch.where(completion_mask.bool(), old, torch.zeros(()))
    back = to_padded_completion(token_aligned, completion_mask)
    assert back.dtype == torch.float64  # the values' dtype
    torch.testing.assert_close(back, want.double())
    torch.testing.assert_close(to_padded_completion([v[1:] for v in token_aligned], completion_mask), want.double())
    assert Forest.from_prompt_completion(prompt_ids, prompt_mask, completion_ids, completion_mask).field("loss_mask", 0).tolist() == [0, 0, 1, 1, 1]


def test_bfloat16_fields_and_numpy_inputs():
    forest = Forest.from_padded(IDS.numpy(), MASK.numpy(), advantages=torch.ones(4, 8, dtype=torch.bfloat16))
    assert forest.fields["advantages"].dtype == np.float64 and np.all(forest.fields["advantages"] == 1.0)
    assert to_padded([np.ones(len(r)) for r in ROWS], MASK.numpy()).device.type == "cpu"


def _with(tensor, row, col, value):
    out = tensor.clone()
    out[row, col] = value
    return out


NAN_AT_1_3 = _with(torch.zeros(4, 8), 1, 3, float("nan"))
NO_ROW_3 = _with(MASK, 3, slice(None), False)
P_IDS, P_MASK, C_IDS, C_MASK = IDS[:, :3], MASK[:, :3], IDS[:, 3:], MASK[:, 3:]

BAD = {
    "hole": (
        lambda: Forest.from_padded(IDS, _with(MASK, 2, 4, False)),
        "attention_mask has a hole at row 2, column 4",
    ),
    "mask shape": (
        lambda: Forest.from_padded(IDS, MASK[:, :7]),
        r"attention_mask has shape \(4, 7\) but input_ids has shape \(4, 8\)",
    ),
    "1-D ids": (lambda: Forest.from_padded(IDS[0], MASK[0]), r"input_ids must be 2-D \[batch, length\]"),
    "float ids": (lambda: Forest.from_padded(IDS.float(), MASK), "input_ids must hold integer token ids, got dtype float32"),
    "mask not 0/1": (lambda: Forest.from_padded(IDS, MASK * 2), "attention_mask must hold 0 or 1, got 2 at row 0, column 2"),
    "empty row": (lambda: Forest.from_padded(IDS, NO_ROW_3), "row 3 of attention_mask is all zeros"),
    "negative id": (
        lambda: Forest.from_padded(torch.where(IDS == 22, -5, IDS), MASK),
        "negative token id -5 at row 0, column 6",
    ),
    "nan where real": (
        lambda: Forest.from_padded(IDS, MASK, advantages=NAN_AT_1_3),
        "field 'advantages' is nan at row 1, column 3, where the mask is 1",
    ),
    "field shape": (
        lambda: Forest.from_padded(IDS, MASK, advantages=torch.zeros(4, 7)),
        r"field 'advantages' has shape \(4, 7\); expected \(4, 8\) .* or \[4\]",
    ),
    "inf row scalar": (
        lambda: Forest.from_padded(IDS, MASK, advantages=torch.tensor([1.0, float("inf"), 0, 0])),
        "field 'advantages' is inf at row 1",
    ),
    "loss on padding": (
        lambda: Forest.from_padded(IDS, MASK, loss_mask=torch.ones(4, 8)),
        "loss_mask is 1.0 at row 0, column 0, where attention_mask is 0",
    ),
    "too few values": (lambda: to_padded(ROWS[:3], MASK), "got 3 value tensors for 4 rows"),
    "value length": (
        lambda: to_padded([torch.ones(3)] * 4, MASK),
        r"values\[0\] has 3 entries but row 0 has 5 tokens: expected 5 \(token-aligned\) or 4",
    ),
    "2-D values": (lambda: to_padded(torch.ones(4, 8), MASK), "list of per-sequence 1-D tensors"),
    "rows differ": (
        lambda: from_prompt_completion(P_IDS, P_MASK, C_IDS[:3], C_MASK[:3]),
        "completion_ids has 3 rows but prompt_ids has 4",
    ),
    "no token": (
        lambda: from_prompt_completion(P_IDS, torch.zeros(4, 3), C_IDS, torch.zeros(4, 5)),
        "row 0 has no token",
    ),
    "completion field shape": (
        lambda: from_prompt_completion(P_IDS, P_MASK, C_IDS, C_MASK, old=torch.zeros(4, 4)),
        r"field 'old' has shape \(4, 4\); expected \(4, 5\)",
    ),
    "completion values": (
        lambda: to_padded_completion([torch.ones(1)] * 4, C_MASK),
        r"values\[0\] has 1 entries but row 0 has 4 tokens: expected at least 3",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input(case):
    call, match = BAD[case]
    with pytest.raises(ValueError, match=match):
        call()
