"""Run test cases of one test module in a subprocess under the Triton interpreter.

``TRITON_INTERPRET`` must be set before Triton is imported (``triton.jit`` reads it when
it decorates a kernel, Triton's own ``tl.sum``/``tl.max`` included), so interpreted
cases run in one worker process started with it while the rest of the session keeps
compiled Triton. The worker imports the test module and serves
``_case_<name>(**kwargs)`` calls (JSON arguments, one request per line); a failing
case is re-raised in the test as an AssertionError carrying the worker's traceback.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
import torch

TESTS = Path(__file__).resolve().parent


def patch_interpreter() -> None:
    """Make Triton 3.6's interpreter behave like compiled Triton where kernels here and in
    Liger-Kernel need it:

    * it calls int() on (1,)-shaped arrays, which NumPy >= 2.4 refuses: give its tensors
      an ``__index__`` that reads the one element;
    * it passes Python float arguments through as floats, where compiled Triton passes
      float32 scalars (Liger's RMSNorm calls ``eps.to(tl.float32)``): wrap them as such.
    """
    from triton.runtime import interpreter

    try:
        int(np.ones(1))
    except TypeError:
        original = interpreter._patch_lang_tensor

        def patched(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

        interpreter._patch_lang_tensor = patched

    import triton.language as tl

    convert = interpreter._implicit_cvt

    def float32_scalars(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    interpreter._implicit_cvt = float32_scalars


def serve(module_name: str) -> None:
    """Worker main loop: one JSON request per stdin line, one JSON reply per line on the
    original stdout (everything the cases print goes to stderr)."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    patch_interpreter()
    module = importlib.import_module(module_name)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            getattr(module, "_case_" + request["case"])(**request["kwargs"])
            reply = {"ok": True}
        except BaseException:  # noqa: BLE001 (pytest.raises fails with a BaseException; report all)
            reply = {"ok": False, "error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


class InterpreterWorker:
    """The subprocess serving ``module_name``'s cases under ``TRITON_INTERPRET=1``."""

    def __init__(self, module_name: str):
        env = dict(os.environ, TRITON_INTERPRET="1")
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by close())
        code = f"import interpreter_worker as w; w.serve({module_name!r})"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            env=env, text=True, cwd=str(TESTS.parent),
        )

    def run(self, case: str, **kwargs) -> None:
        self.proc.stdin.write(json.dumps({"case": case, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"interpreter worker died:\n{self.log.read()[-5000:]}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise AssertionError(f"in the interpreter worker:\n{reply['error']}")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def worker_fixture(module_name: str):
    """A module-scoped pytest fixture: the worker serving ``module_name``'s cases (the
    test is skipped where Triton is not installed)."""
    import pytest

    @pytest.fixture(scope="module")
    def worker():
        pytest.importorskip("triton")
        w = InterpreterWorker(module_name)
        yield w
        w.close()

    return worker
