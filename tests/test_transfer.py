"""Uploads through dtree's pinned staging (dtree/device/transfer.py): the values arrive
whatever the dtype and shape, also while the GPU runs far behind the host (a buffer is
reused only after the copy that read it ran), and the pool stops growing at its limit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtree.device.transfer import PinnedStaging, upload, upload_arrays


def test_upload_on_cpu_copies_read_only_arrays():
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    a.flags.writeable = False
    t = upload(a, "cpu")
    assert t.tolist() == a.tolist()
    t[0, 0] = 7
    assert a[0, 0] == 0
    ints, floats = upload_arrays([np.arange(3), np.array([5])], [np.array([0.5, 1.5])], "cpu", torch.float32)
    assert [x.tolist() for x in ints] == [[0, 1, 2], [5]] and floats[0].dtype == torch.float32


def _busy(device):
    """Queue ~100 ms of GPU work so the host runs ahead of the copies."""
    x = torch.randn(4096, 4096, device=device)
    for _ in range(20):
        x = x @ x
        x = x / x.norm()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_staged_uploads_arrive_while_the_gpu_runs_behind():
    device = torch.device("cuda")
    staging = PinnedStaging()
    rng = np.random.default_rng(0)
    sent, got = [], []
    _busy(device)
    for i in range(40):
        dtype = [np.int64, np.int32, np.float32, np.float64, np.bool_][i % 5]
        a = (rng.integers(0, 1000, size=int(rng.integers(1, 50000))) % (2 if dtype is np.bool_ else 1000)).astype(dtype)
        sent.append(a.copy())
        got.append(staging.copy_to(a, device))
        a[:] = 0  # the caller's array may change at once: the data was staged
    torch.cuda.synchronize(device)
    for a, t in zip(sent, got):
        assert t.cpu().numpy().tolist() == a.tolist()
    before = staging.held_bytes()
    for i in range(40):  # the GPU caught up: buffers are reused, the pool does not grow
        staging.copy_to(sent[i], device)
        torch.cuda.synchronize(device)
    assert staging.held_bytes() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_pool_stops_at_its_limit():
    device = torch.device("cuda")
    staging = PinnedStaging(limit_bytes=4 * PinnedStaging.MIN_BYTES)
    _busy(device)
    arrays = [np.full(PinnedStaging.MIN_BYTES // 8, i, dtype=np.int64) for i in range(12)]
    outs = [staging.copy_to(a, device) for a in arrays]
    assert staging.held_bytes() <= 4 * PinnedStaging.MIN_BYTES
    torch.cuda.synchronize(device)
    assert all(bool((t == i).all()) for i, t in enumerate(outs))
