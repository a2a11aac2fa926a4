"""A [B, L] tensor passed as ``sequences`` (a padded batch would turn its pads into
tokens) is refused with the constructor to use instead."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dtree


@pytest.mark.parametrize("batch", [torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]]), np.array([[0, 5, 6], [7, 8, 9]])])
def test_2d_batch_is_refused(batch):
    with pytest.raises(ValueError, match=r"\[B, L\] tensor.*Forest.from_padded\(input_ids, attention_mask\)"):
        dtree.Forest.from_sequences(batch)


def test_rows_of_a_tensor_are_fine():
    batch = torch.tensor([[1, 5, 6], [1, 5, 9]])
    forest = dtree.Forest.from_sequences(list(batch))
    assert forest.num_sequences == 2 and forest.num_unique_tokens == 4
