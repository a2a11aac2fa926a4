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


def test_every_malformed_file_is_one_error_line(tmp_path, capsys):
    """The issue's files that used to print a traceback: exit code 2 and one
    ``dtree <cmd>: error: file:line: ...`` line (tests/test_fuzz_inputs.py fuzzes more)."""
    files = {
        "huge.jsonl": ('{"tokens": [1, 2], "a": [1, ' + "1" * 401 + "]}\n", "huge.jsonl:1: field 'a'"),
        "deep.jsonl": ('{"tokens": ' + "[" * 5000 + "]" * 5000 + "}\n", "deep.jsonl:1: nested too deeply"),
        "sequences.jsonl": ('{"tokens": [1], "sequences": [1]}\n', "field name 'sequences' is reserved"),
        "cls.jsonl": ('{"tokens": [1], "cls": [1]}\n', "field name 'cls' is reserved"),
    }
    for name, (text, match) in files.items():
        (tmp_path / name).write_text(text)
    cases = [(str(tmp_path / n), m) for n, (_, m) in files.items()] + [(str(tmp_path), "is a directory")]
    for path, match in cases:
        for argv in (["stats", path], ["bench", "--no-report", "--data", path]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err.splitlines()
            assert len(err) == 1 and err[0].startswith(f"dtree {argv[0]}: error: ") and match in err[0], err


def test_bench_data_outside_the_vocabulary(tmp_path, capsys):
    path = tmp_path / "big_ids.jsonl"
    path.write_text('{"tokens": [1, 5000000]}\n')
    assert main(["bench", "--no-report", "--data", str(path)]) == 2
    err = capsys.readouterr().err
    assert "token id 5000000 at sequence 0, position 1 is outside the vocabulary" in err and "--model" in err
