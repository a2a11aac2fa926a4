"""verl's actor batch as a dtree forest, and dtree's per-sequence results back in verl's
layout. Imports no verl: the batch is read as the ``TensorDict`` verl's engines receive
(``verl/workers/utils/padding.py::left_right_2_no_padding``, or verl's nested trainer):

* ``input_ids`` / ``position_ids``: nested ``[B, j]``, each row's real tokens (prompt
  then response), ``position_ids`` counting from 0;
* ``prompts`` / ``responses``: nested, or padded ``[B, P]`` / ``[B, R]`` with
  ``attention_mask`` ``[B, P + R]`` (the response is a row's last tokens);
* response fields ``[B, R]`` (or nested): ``response_mask``, ``old_log_probs``,
  ``advantages``, ``ref_log_prob``; column ``j`` belongs to the row's ``j``-th response
  token, i.e. to its prediction (dtree's alignment at the row's token ``len - R_b + j``).

verl's model output is a nested ``[B, j]`` tensor whose entry ``t`` is ``log p(token
t+1)`` (the last entry of a row is never read): :meth:`VerlBatch.nested` builds it from
dtree's ``[len - 1]`` per-row log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..forest.forest import Forest

__all__ = ["RESPONSE_FIELDS", "VerlBatch"]

# verl's response fields -> dtree's field names
RESPONSE_FIELDS = {
    "response_mask": "loss_mask",
    "advantages": "advantages",
    "old_log_probs": "old_logprobs",
    "ref_log_prob": "ref_logprobs",
}


def _padded(t: torch.Tensor) -> torch.Tensor:
    return torch.nested.to_padded_tensor(t, 0.0) if t.is_nested else t


def _response_lengths(data: Any) -> np.ndarray:
    """[B] each row's response length, read as verl's ``no_padding_2_padding`` reads it."""
    prompts, responses = data["prompts"], data["responses"]
    if prompts.is_nested:
        return responses.offsets().diff().cpu().numpy()
    return data["attention_mask"][:, prompts.shape[1] :].sum(dim=1).cpu().numpy()


def _check_positions(data: Any, offsets: np.ndarray) -> None:
    """dtree gives the token at depth d position d: refuse anything else (mRoPE, offsets)."""
    if "position_ids" not in data.keys():
        return
    pos = data["position_ids"]
    if pos.dim() == 3:
        raise ValueError(
            "position_ids are 3-D (mRoPE, a vision-language model): the dtree engine trains text-only causal LMs "
            "whose positions are the token depths"
        )
    values = (pos.values() if pos.is_nested else pos.reshape(-1)).cpu().numpy()
    lengths = np.diff(offsets)
    expected = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], lengths)
    if values.shape != expected.shape or not np.array_equal(values, expected):
        row = int(np.searchsorted(offsets, int(np.flatnonzero(values != expected)[0]), side="right") - 1) if (
            values.shape == expected.shape) else 0
        raise ValueError(
            f"position_ids of row {row} are not 0, 1, 2, ...: the dtree engine gives each token its depth in the "
            "row as its position (left padding removed), as verl's left_right_2_no_padding does"
        )


@dataclass(frozen=True)
class VerlBatch:
    """One rank's verl batch as a forest.

    Attributes:
        forest: row ``b`` is sequence ``b`` (its real tokens), with the response fields
            present in the batch as dtree fields (:data:`RESPONSE_FIELDS`).
        offsets: [B+1] int64 row offsets of the nested ``input_ids`` (on their device).
        response_lengths: [B] each row's response length.
        response_width: ``R``, the padded response width (``[B, R]`` fields).
    """

    forest: Forest
    offsets: torch.Tensor
    response_lengths: np.ndarray
    response_width: int

    @classmethod
    def from_tensordict(cls, data: Any) -> "VerlBatch":
        """Read ``data`` (see the module docstring); ValueError naming the row on a
        layout dtree cannot train exactly."""
        ids = data["input_ids"]
        if not ids.is_nested:
            raise ValueError(
                "input_ids must be verl's nested (no-padding) layout: the dtree engine supports "
                "pad_mode=NO_PADDING only"
            )
        offsets = ids.offsets()
        host_offsets = offsets.cpu().numpy()
        tokens = ids.values().cpu().numpy()
        _check_positions(data, host_offsets)
        lengths = np.diff(host_offsets)
        resp = _response_lengths(data)
        bad = np.flatnonzero((resp < 1) | (resp >= lengths))
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"row {b} has {int(resp[b])} response tokens in {int(lengths[b])} tokens: verl needs a prompt of at "
                "least one token and a response of at least one"
            )
        present = [k for k in RESPONSE_FIELDS if k in data.keys()]
        padded = {k: _padded(data[k]).detach().to("cpu", torch.float64).numpy() for k in present}
        width = int(next(iter(padded.values())).shape[1]) if padded else int(resp.max())
        fields: dict[str, list[np.ndarray]] = {RESPONSE_FIELDS[k]: [] for k in present}
        rows = []
        for b in range(len(lengths)):
            n, r = int(lengths[b]), int(resp[b])
            rows.append(tokens[host_offsets[b] : host_offsets[b + 1]])
            for k in present:
                arr = np.zeros(n)
                arr[n - r :] = padded[k][b, :r]
                fields[RESPONSE_FIELDS[k]].append(arr)
        forest = Forest.from_sequences(rows, **fields)
        return cls(forest=forest, offsets=offsets, response_lengths=resp, response_width=width)

    def nested(self, per_row: Sequence[torch.Tensor]) -> torch.Tensor:
        """verl's model-output layout from per-row ``[len - 1]`` values (differentiable):
        nested ``[B, len]``, entry ``t`` the value of the prediction of token ``t + 1``,
        a 0 at each row's last entry."""
        if len(per_row) != len(self.response_lengths):
            raise ValueError(f"got {len(per_row)} rows of values for {len(self.response_lengths)} rows")
        values = torch.cat([torch.cat([v, v.new_zeros(1)]) for v in per_row]).to(self.offsets.device)
        return torch.nested.nested_tensor_from_jagged(values, self.offsets)
