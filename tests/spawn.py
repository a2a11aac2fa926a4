"""Multi-process tests on gloo: a free port, the process group, and one spawn of ``world``
ranks whose results come back through files (the processes this test started are
killed if they outlive the deadline: a hang fails the test instead of blocking CI)."""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch

SPAWN_TIMEOUT_S = 150  # a hang fails the test after this long


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: int = 60) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _run_rank(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # several ranks share a small CPU
    init_gloo(rank, world, port)
    try:
        torch.save(fn(rank, world, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        torch.distributed.destroy_process_group()


class _RankCrash(AssertionError):
    """A rank died without a Python traceback (gloo's C++ side, e.g. ``terminate called
    without an active exception`` while a 2-core CI machine runs three ranks)."""


def run_ranks(fn: Callable[..., Any], world: int, args: tuple = (), *, timeout_s: int, prefix: str) -> list:
    """``fn(rank, world, *args)`` on ``world`` spawned gloo ranks (``fn`` importable at
    module level); its return values, in rank order. A rank's traceback is the error. A
    rank that dies without one gets one more spawn on a fresh port (CI saw it once in ~6
    runs of the suite); a second crash fails the test."""
    try:
        return _run_ranks_once(fn, world, args, timeout_s=timeout_s, prefix=prefix)
    except _RankCrash as crash:
        print(f"{world} gloo ranks: {crash}; spawning them once more")
        return _run_ranks_once(fn, world, args, timeout_s=timeout_s, prefix=prefix)


def _run_ranks_once(fn: Callable[..., Any], world: int, args: tuple, *, timeout_s: int, prefix: str) -> list:
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix=prefix)
    ctx = mp.start_processes(_run_rank, args=(world, free_port(), out_dir, fn, args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while not ctx.join(timeout=5):
            if datetime.datetime.now() > deadline:
                raise TimeoutError(f"{world} ranks did not finish in {timeout_s} s (a hang?)")
    except TimeoutError:
        raise
    except Exception as failure:
        errors = [open(os.path.join(out_dir, f)).read() for f in sorted(os.listdir(out_dir)) if f.endswith(".err")]
        if not errors:
            raise _RankCrash(f"a rank died without a traceback ({failure})") from None
        raise AssertionError("\n".join(errors)) from None
    finally:
        for p in ctx.processes:  # only the processes this test started
            if p.is_alive():
                p.kill()
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def spawn_gloo(scenarios: Callable[[int, int], Any], world: int, timeout: float = SPAWN_TIMEOUT_S) -> list:
    """``[scenarios(r, world) for r in range(world)]``, each in its own process of one gloo
    group (``scenarios`` a module-level function: it is pickled by name)."""
    return run_ranks(scenarios, world, timeout_s=timeout, prefix=f"dtree_dist{world}_")
