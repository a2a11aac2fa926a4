"""benchmarks/flash4_bwd_tiles.py: its layouts are calls the masked-call tables express, with
the visible (query, key) pairs its TFLOP/s divide by; it refuses unknown configurations and
machines without a Hopper GPU by name; on Hopper, every configuration flash-attn-4 compiles
agrees with the default one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import flash4_bwd_tiles

from dtree.ops.stack_attention.call_mask import call_mask


def _script(*args: str) -> subprocess.CompletedProcess:
    # the checkout first, then what the caller's path has (flash-attn-4 from carried wheels lives there)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.run([sys.executable, "benchmarks/flash4_bwd_tiles.py", *args], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("name", ["grpo", "agentic16k", "deep"])
def test_layouts_are_masked_calls_with_their_pairs(name):
    (case,) = flash4_bwd_tiles.layouts([name])
    mask = call_mask(case.layout)
    assert mask is not None
    assert (mask.base, mask.num_keys) == (case.slots, case.slots + case.tokens)
    # row m sees slot n iff slot_row_lo[n] <= m < slot_row_hi[n]
    seen = np.maximum(0, mask.slot_row_hi.astype(np.int64) - mask.slot_row_lo.astype(np.int64)).sum()
    assert seen == case.pairs()


def test_unknown_configuration_is_refused_by_name():
    proc = _script("--configs", "default,nonesuch")
    assert proc.returncode == 2
    assert "unknown configurations ['nonesuch']" in proc.stderr and "pds1" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of machines without a Hopper GPU")
def test_needs_a_hopper_gpu():
    proc = _script("--configs", "default")
    assert proc.returncode != 0
    assert "needs a Hopper GPU" in proc.stderr


@pytest.mark.gpu
def test_configurations_agree_with_the_default(tmp_path):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("flash-attn-4's SM90 backward")
    pytest.importorskip("flash_attn.cute")
    proc = _script("--configs", "default,dq_swap", "--layouts", "grpo", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "flash4_bwd_tiles.md").read_text()
    rows = re.findall(r"^\| grpo \| (\w+) \| .*\| ([0-9.]+e[+-][0-9]+) \|$", text, re.MULTILINE)
    assert [r[0] for r in rows] == ["default", "dq_swap"], text
    assert all(float(err) < 2e-2 for _, err in rows), text
