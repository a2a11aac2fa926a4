import subprocess
import sys

from dtree import Forest
from dtree.cli import main


def test_stats(tmp_path, capsys):
    path = tmp_path / "b.jsonl"
    Forest.from_sequences([[1, 2, 3], [1, 2, 4], [5]]).to_jsonl(str(path))
    assert main(["stats", str(path)]) == 0
    out = capsys.readouterr().out
    assert "compression ratio" in out and "1.400x" in out  # 7 linearized / 5 unique


def test_stats_bad_file(tmp_path, capsys):
    path = tmp_path / "b.jsonl"
    path.write_text('{"tokens": []}\n')
    assert main(["stats", str(path)]) == 2
    assert "sequence 0 is empty" in capsys.readouterr().err


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "dtree", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "stats" in r.stdout


def test_import_dtree_reaches_distributed():
    """A fresh ``import dtree`` makes ``dtree.distributed`` reachable, as the README uses it."""
    code = "import dtree; print(dtree.distributed.DistributedTreeTrainer.__name__, dtree.distributed.plan_partition.__name__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["DistributedTreeTrainer", "plan_partition"]
