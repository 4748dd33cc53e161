"""Helpers of the interpreter tests: small gloo worlds (spawn ranks that each run a
module-level function of a test module, read back what they computed), running one layer op by
op, and comparing with the single-process reference."""

from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dhelix.interpreter.execute.layer_exec import LayerRun

#: fp32 tolerance of every comparison with the single-process reference.
TOL = 1e-5


def join(rank: int, world: int, port: int, timeout: float = 60.0) -> None:
    """Join, as ``rank``, the gloo world whose TCP store :func:`run_ranks` hosts at ``port``
    (the test process holds the port from before the ranks start to after they end: two worlds
    starting at once, on two test workers, never race for one port)."""
    store = dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))


def _forked_rank(rank: int, environment: dict, fn, *args) -> None:
    """A rank forked from the forkserver: this test's environment (not the one of when the
    server started), then ``fn(rank, *args)``."""
    os.environ.clear()
    os.environ.update(environment)
    fn(rank, *args)


def run_ranks(fn, world: int, *args, timeout: float = 60.0) -> None:
    """Start ``world`` processes running ``fn(rank, world, port, *args)`` (``port``: the TCP
    store they :func:`join` by, hosted here until they end); fail the test
    (after killing them) if they have not finished within ``timeout`` seconds. The ranks are
    forked from the forkserver `dhelix run` uses (:func:`spawn.rank_context`: torch imported
    once for the session, not once per rank), spawned where there is none."""
    from dhelix.interpreter.launch.spawn import rank_context

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
    method = rank_context().get_start_method()
    context = mp.start_processes(_forked_rank, args=(dict(os.environ), fn, world, store.port, *args), nprocs=world,
                                 join=False, start_method=method)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world} ranks did not finish within {timeout} s")


def _gloo_rank(rank: int, world: int, port: int, compute, out_dir: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # ranks share the machine's cores
    join(rank, world, port)
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


def assert_close(got, want, what: str, tol: float = TOL) -> None:
    """Fail naming ``what`` when the tensors differ by more than ``tol`` anywhere."""
    diff = (got - want).abs().max().item()
    assert diff <= tol, f"{what}: max abs diff {diff:.3g}"


def drive_layer(layer_plan, weights, comm, x, dout, async_comm=False, backward_order=None):
    """Run one layer's forward DAG on this rank's rows ``x`` and its backward on ``dout`` op by
    op (collectives async when ``async_comm``); returns (output, input gradient, weight
    gradients, the LayerRun)."""
    run = LayerRun(layer_plan, weights, comm)
    run.start(x)
    for op in layer_plan.fwd.ops:
        run.forward_op(op, async_op=async_comm and op.kind == "comm")
    out = run.output()
    run.start_backward(dout)
    for op in backward_order or layer_plan.bwd.ops:
        run.backward_op(op, async_op=async_comm and op.kind == "comm")
    return out, run.input_grad(), run.grads, run
