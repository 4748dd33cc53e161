"""Small gloo worlds for tests: spawn ranks that each run a module-level function of a test
module, and read back what they computed."""

from __future__ import annotations

import pickle
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(fn, world: int, *args, timeout: float = 60.0) -> None:
    """Spawn ``world`` processes running ``fn(rank, world, port, *args)``; fail the test
    (after killing them) if they have not finished within ``timeout`` seconds."""
    port = free_port()
    context = mp.start_processes(fn, args=(world, port, *args), nprocs=world, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world} ranks did not finish within {timeout} s")


def _gloo_rank(rank: int, world: int, port: int, compute, out_dir: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        results = compute(rank, world)
        with open(f"{out_dir}/rank{rank}.pkl", "wb") as out:
            pickle.dump(results, out)
    finally:
        dist.destroy_process_group()


def gloo_results(compute, world: int, out_dir: Path, timeout: float = 120.0) -> list:
    """Run ``compute(rank, world)`` (a module-level function) on ``world`` gloo ranks and
    return what each rank returned, by rank."""
    run_ranks(_gloo_rank, world, compute, str(out_dir), timeout=timeout)
    ranks = []
    for rank in range(world):
        with open(out_dir / f"rank{rank}.pkl", "rb") as results:
            ranks.append(pickle.load(results))
    return ranks


def assert_steps_match(checks, count: int, tol: float) -> None:
    """``count`` step checks, each with loss, gradient and update within ``tol`` of the
    single-process reference."""
    assert len(checks) == count
    for check in checks:
        assert check.loss_diff <= tol, str(check)
        assert check.grad_diff <= tol, str(check)
        assert check.update_diff <= tol, str(check)
