"""The README's TRL example runs offline as written (a small local model built from a
config, a character-level tokenizer, GRPOConfig's defaults: bf16 autocast on CPU) and
every step goes through dtree."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def trl_example() -> str:
    text = open(README, encoding="utf-8").read()
    section = text[text.index("### TRL: `TreeGRPOTrainer`"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_trl_example_runs_offline(tmp_path):
    code = trl_example()
    assert "GRPOConfig" in code and "processing_class=" in code and "from_config" in code
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRL_EXPERIMENTAL_SILENCE": "1"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = ast.literal_eval(r.stdout.strip().splitlines()[-1])  # [(dtree/active, dtree/compression), ...]
    assert len(steps) == 3 and all(active == 1.0 and compression > 1.0 for active, compression in steps), steps
