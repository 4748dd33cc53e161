"""Starting the ranks of a run: local processes joined in a gloo world, or torchrun's.

:func:`run_local` spawns one process per rank on this machine (the embedded default: no
cluster needed), watches them and stops the rest as soon as one fails, so a bad run ends with
a :class:`RankFailure` naming the rank, never a hang; rank 0's result comes back through a
pipe. What a rank does is the ``work`` function given (``work(options, device)``, e.g.
:func:`.train.train`), run inside the joined world; it returns a picklable result on global
rank 0 and None elsewhere. Under torchrun (``RANK`` and ``WORLD_SIZE`` set, :func:`torchrun_rank`) the calling
process is one rank and :func:`run_rank` runs it in place. Collectives time out after
``RunOptions.timeout`` seconds, so a dead peer cannot block the others for ever.

The one place where the interpreter prints is :func:`_rank_process`, the top of a spawned
rank: its failure (the rank, the action, the schedule grid) goes to standard error, which
the child shares with the command, because that is the channel that survives the child's
end — the parent only learns the exit code. This module imports torch only inside a rank.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Callable

from dhelix.dsl.core.errors import DhelixError

from .summary import describe_mesh

if TYPE_CHECKING:
    from .train import RunOptions

#: What a rank runs in the joined world: ``work(options, device)`` → its result on global
#: rank 0 (picklable: it travels to the parent), None elsewhere. Module-level, so that a
#: spawned rank can unpickle it.
Work = Callable[["RunOptions", object], object]


class RankFailure(DhelixError):
    """A rank of a run failed: it died (``exitcode``, negative for a signal) or a collective
    failed under it because a peer did (``exitcode`` None)."""

    def __init__(self, message: str, *, rank: int, exitcode: int | None = None):
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode


def quiet_numpy_warning() -> None:
    """Silence torch's import-time warning about a missing NumPy (the interpreter does not
    use NumPy); call it before the first import of torch in a process."""
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def torchrun_rank(program) -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun, else None. Raises
    DhelixError when torchrun's world is not the size of ``program``'s mesh."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = program.mesh.world
    if int(os.environ["WORLD_SIZE"]) != world:
        raise DhelixError(f"the mesh has {world} ranks ({describe_mesh(program.mesh)}) but torchrun "
                          f"started {os.environ['WORLD_SIZE']}",
                          notes=["start torchrun with nnodes × nproc-per-node equal to the mesh size"])
    return int(os.environ["RANK"]), world


# -- the local world -------------------------------------------------------------------------

def run_local(options: "RunOptions", nproc: int, work: Work):
    """Start ``nproc`` local ranks running ``work``, watch them and return rank 0's result.
    Raises RankFailure for the first rank that exits non-zero (the others are stopped); a
    KeyboardInterrupt stops them all and propagates."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    init = f"tcp://127.0.0.1:{_free_port()}"
    receiver, sender = context.Pipe(duplex=False)
    procs = [context.Process(target=_rank_process, name=f"dhelix-rank{rank}",
                             args=(work, options, rank, nproc, init, sender if rank == 0 else None))
             for rank in range(nproc)]
    for proc in procs:
        proc.start()
    sender.close()  # rank 0 holds the only writing end: EOF once it is gone
    try:
        failure, result = watch(procs, receiver)
    except KeyboardInterrupt:
        stop(procs)
        raise
    finally:
        receiver.close()
    if failure is not None:
        rank, code = failure
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise RankFailure(f"rank {rank} {how}; stopped the other {nproc - 1} rank(s)", rank=rank, exitcode=code)
    return result


def watch(procs, receiver) -> tuple[tuple[int, int] | None, object]:
    """Wait for every process, reading rank 0's result from ``receiver`` as it comes (a
    large result fills the pipe: rank 0 cannot exit before it is read). As soon as one
    process exits non-zero, stop the others. Returns ((its rank, its exit code) or None,
    the result or None)."""
    from multiprocessing.connection import wait

    alive = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    result, reading = None, True
    while alive:
        for ready in wait([*alive, *([receiver] if reading else [])], timeout=1.0):
            if ready is receiver:
                result, reading = _receive(receiver), False
                continue
            rank = alive.pop(ready)
            procs[rank].join()
            if procs[rank].exitcode != 0:
                stop(procs)
                return (rank, procs[rank].exitcode), None
    if reading and receiver.poll():  # sent just before rank 0 exited
        result = _receive(receiver)
    return None, result


def _receive(receiver):
    try:
        return receiver.recv()
    except EOFError:  # rank 0 ended without a result: its exit code says why
        return None


def stop(procs, grace: float = 3.0) -> None:
    """Terminate the processes still running; kill those that outlive ``grace`` seconds."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_process(work: Work, options: "RunOptions", rank: int, world: int, init: str, results) -> None:
    """The body of a spawned rank: run ``work``, send rank 0's result to the parent through
    ``results``; on failure report it on standard error and exit 1 (see the module
    docstring for why this rank prints)."""
    try:
        result = run_rank(options, rank, world, init, work)
    except DhelixError as exc:
        print(exc.render(), file=sys.stderr)
        sys.exit(1)
    if results is not None:
        results.send(result)
        results.close()


# -- one rank ---------------------------------------------------------------------------------

def run_rank(options: "RunOptions", rank: int, world: int, init: str, work: Work):
    """Join the world as ``rank`` (``init``: a tcp:// address or ``env://``), run ``work``,
    leave; returns its result (on global rank 0; None elsewhere). ``options`` gives the
    backend, the seed and the collective timeout. Raises what ``work`` raises (the
    executor's DhelixError: rank, action, schedule grid) and RankFailure when a collective
    fails because a peer did."""
    from datetime import timedelta

    quiet_numpy_warning()
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if options.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    torch.manual_seed(options.seed)
    dist.init_process_group(options.backend, init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=options.timeout))
    try:
        return work(options, device)
    except (RuntimeError, ValueError) as exc:  # a peer's failure seen through a collective
        raise RankFailure(f"rank {rank}: {type(exc).__name__}: {exc}", rank=rank) from None
    finally:
        dist.destroy_process_group()
