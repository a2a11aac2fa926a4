"""setup.py's decision to build the KV-stack CUDA extension: skipped with
DTREE_SKIP_CUDA_BUILD, without torch in the build environment (pip's build isolation), with
a CPU torch and without nvcc; built with a CUDA torch and nvcc. The last test builds a
wheel from a clean copy of the repository on this (CPU) machine (~2 s)."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP = runpy.run_path(str(ROOT / "setup.py"), run_name="dtree_setup")  # defines, does not call setup()


def _fake_torch(monkeypatch, cuda: str | None, cuda_home: str | None):
    torch = types.ModuleType("torch")
    torch.__version__ = "2.11.0+fake"
    torch.version = types.SimpleNamespace(cuda=cuda)
    ext = types.ModuleType("torch.utils.cpp_extension")
    ext.CUDA_HOME = cuda_home
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.utils", types.ModuleType("torch.utils"))
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", ext)


def test_skip_variable_wins():
    build, reason = SETUP["cuda_build_plan"]({"DTREE_SKIP_CUDA_BUILD": "1"})
    assert not build and "DTREE_SKIP_CUDA_BUILD" in reason


def test_no_torch_in_the_build_environment_skips_and_names_the_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    build, reason = SETUP["cuda_build_plan"]({})
    assert not build and "pip install --no-build-isolation ." in reason
    assert SETUP["extension_kwargs"]({}) == {}


def test_cpu_torch_skips(monkeypatch, tmp_path):
    _fake_torch(monkeypatch, cuda=None, cuda_home=str(tmp_path))
    build, reason = SETUP["cuda_build_plan"]({})
    assert not build and "CPU-only" in reason


def test_cuda_torch_without_nvcc_skips(monkeypatch, tmp_path):
    _fake_torch(monkeypatch, cuda="13.0", cuda_home=str(tmp_path))
    build, reason = SETUP["cuda_build_plan"]({})
    assert not build and "no nvcc" in reason


def test_cuda_torch_with_nvcc_builds(monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    _fake_torch(monkeypatch, cuda="13.0", cuda_home=str(tmp_path))
    build, reason = SETUP["cuda_build_plan"]({})
    assert build and "CUDA 13.0" in reason
    assert not SETUP["cuda_build_plan"]({"DTREE_SKIP_CUDA_BUILD": "true"})[0]


def test_this_machine_decides_without_error():
    build, reason = SETUP["cuda_build_plan"](os.environ)
    assert isinstance(build, bool) and reason


def test_gencode_flags():
    assert SETUP["gencode_flags"]("80;90") == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    assert SETUP["gencode_flags"]("8.0, 9.0")[1] == "-gencode=arch=compute_90,code=sm_90"
    with pytest.raises(ValueError, match="DTREE_CUDA_ARCHS"):
        SETUP["gencode_flags"]("sm90")


def test_sources_exist_and_are_packaged():
    for source in SETUP["SOURCES"]:
        assert (ROOT / source).is_file(), source
    assert "recursive-include csrc" in (ROOT / "MANIFEST.in").read_text()


def _can_build_wheels_here() -> bool:
    """setuptools >= 70.1 builds wheels itself; older ones need the ``wheel`` package
    (``--no-build-isolation`` uses the environment's)."""
    import importlib.util

    import setuptools

    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


@pytest.mark.skipif(not _can_build_wheels_here(), reason="needs setuptools >= 70.1 or the wheel package")
@pytest.mark.parametrize("skip", ["1", ""], ids=["skip-variable", "cpu-torch"])
def test_wheel_builds_from_a_clean_copy_without_the_extension(tmp_path, skip):
    """``pip wheel`` of a clean copy (the tracked files) gives a wheel with dtree and no
    compiled module, both with DTREE_SKIP_CUDA_BUILD=1 and with this machine's CPU torch."""
    if not skip and SETUP["cuda_build_plan"]({k: v for k, v in os.environ.items() if k != "DTREE_SKIP_CUDA_BUILD"})[0]:
        pytest.skip("this machine would build the extension (CUDA torch and nvcc): benchmarks/csrc_gpu.sh builds it")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    src = tmp_path / "src"
    for name in files:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    env = {**os.environ, "DTREE_SKIP_CUDA_BUILD": skip}
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), "."],
        cwd=src, env=env, capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("dtree-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "dtree/__init__.py" in names and "dtree/ops/stack_ops/interface.py" in names
    assert not any(n.endswith(".so") for n in names)
