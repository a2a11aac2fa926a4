"""Run a scenario function on every rank of a gloo process group, in spawned processes.

    results = spawn_gloo(scenarios, world=2)   # [what scenarios(0, 2) returned, what scenarios(1, 2) returned]

``scenarios(rank, world) -> dict`` must be a module-level function (it is pickled by
name into the spawned processes). Each rank saves its result with ``torch.save``; a
rank that raises writes its traceback, and a hang fails after ``timeout`` seconds
instead of blocking the suite.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback
from typing import Callable

import torch

SPAWN_TIMEOUT_S = 150


def _worker(rank: int, world: int, port: int, out_dir: str, scenarios: Callable[[int, int], dict]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share a small CPU
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        res = scenarios(rank, world)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_gloo(scenarios: Callable[[int, int], dict], world: int, timeout: float = SPAWN_TIMEOUT_S) -> list[dict]:
    """``[scenarios(r, world) for r in range(world)]``, each in its own process of one gloo group."""
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix=f"dtree_dist{world}_")
    ctx = mp.start_processes(
        _worker, args=(world, free_port(), out_dir, scenarios), nprocs=world, join=False, start_method="spawn"
    )
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while not ctx.join(timeout=5):
            if datetime.datetime.now() > deadline:
                raise TimeoutError(f"{world} ranks did not finish in {timeout} s (a hang?)")
    finally:
        for p in ctx.processes:  # only the processes this call started
            if p.is_alive():
                p.kill()
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
