"""Starting the local ranks of a run: processes joined in one world, watched by the launcher.

:func:`run_local` starts one process per rank on this machine (the embedded default: no
cluster needed; forked from a forkserver that imported torch once, :func:`rank_context`) and
hosts the world's TCP store itself, so that whatever happens to a rank it
can read what the ranks left there. It watches them and stops the rest as soon as one fails,
so a bad run ends with one :class:`~.failure.RankFailure` naming the rank that caused it,
never a hang (which rank is the cause: :mod:`.failure`).

SIGTERM and SIGHUP to the launcher are forwarded to the ranks, which are stopped; the launcher
then raises :class:`LauncherStopped` (the command exits 128 + the signal). A rank dies with
its launcher even if that is killed outright (:func:`die_with_launcher`). Rank 0's result comes
back through a pipe. What a rank does is the ``work`` function given (``work(options, device,
heartbeat)``, e.g. :func:`.train.train`; :data:`.join.Work`), run inside the joined world by
:func:`.join.run_rank`; it returns a picklable result on global rank 0 and None elsewhere.
Under torchrun the calling process is one rank (:mod:`.join`).

The one place where the interpreter prints is :func:`_rank_process`, the top of a spawned
rank, and only when the launcher's store cannot take its error (the launcher is gone). This
module imports torch only when it starts a world.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import time
from typing import TYPE_CHECKING

from dhelix.dsl.core.errors import DhelixError

from .failure import CAUSE_PREFIX, FAILURE_PREFIX, await_own_cause, failure_cause, secondary, settle
from .join import Work, run_rank
from .store import client

if TYPE_CHECKING:
    from dhelix.interpreter.training.train import RunOptions

class LauncherStopped(Exception):
    """The launcher received ``signum`` (SIGTERM, SIGHUP): its ranks were stopped; the
    command exits with 128 + ``signum``, as a process killed by it would."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


#: Signals that stop the launcher; forwarded to its ranks, which are then stopped.
STOP_SIGNALS = ("SIGTERM", "SIGHUP")
#: prctl(2)'s option naming a thread (linux/prctl.h).
PR_SET_NAME = 15


def run_local(options: "RunOptions", nproc: int, work: Work):
    """Start ``nproc`` local ranks running ``work``, watch them and return rank 0's result.

    The launcher hosts the world's TCP store, so it can read the ranks' heartbeats and
    failure reports whatever happens to them. Raises RankFailure naming the rank that caused
    a failure (the others are stopped); on KeyboardInterrupt, or LauncherStopped for SIGTERM
    or SIGHUP (forwarded to the ranks), stops them all and propagates. A rank dies with the
    launcher even when the launcher is killed outright (:func:`die_with_launcher`)."""
    store = _launcher_store(options.timeout)
    context = rank_context()
    receiver, sender = context.Pipe(duplex=False)
    # Only the launcher writes to the lifeline: a rank reads EOF the moment the launcher is gone.
    lifeline, alive = context.Pipe(duplex=False)
    address = ("127.0.0.1", store.port)
    # Pickled here, unpickled by the rank only once it dies with us: unpickling imports what
    # the work needs (torch among it, unless preloaded), during which a killed launcher would
    # orphan it. The environment goes along: a forkserver's ranks would otherwise see the
    # environment of when the server started.
    payload = pickle.dumps((work, options, dict(os.environ)))
    procs = [context.Process(target=_rank_process, name=f"dhelix-rank{rank}",
                             args=(payload, rank, nproc, address, lifeline, sender if rank == 0 else None))
             for rank in range(nproc)]
    with _stop_signals_raise():
        try:
            for proc in procs:
                proc.start()
            sender.close()  # rank 0 holds the only writing end: EOF once it is gone
            lifeline.close()  # the ranks hold the reading ends
            failure, result = watch(procs, receiver)
        except (KeyboardInterrupt, LauncherStopped) as exc:
            stop(procs, signum=getattr(exc, "signum", None))
            raise
        finally:
            receiver.close()
    if failure is None:
        alive.close()
        return result
    try:
        settle(procs, failure)
        await_own_cause(procs, store)
        raise failure_cause(procs, failure, store, options.timeout)
    finally:
        stop(procs)
        alive.close()


#: What the forkserver imports once, so that ranks forked from it start with torch and the
#: training loop loaded instead of importing them each (seconds per rank); first the guard
#: that makes it die with its launcher, before the long imports. ``torch._dynamo`` is what
#: torch's optimizers import when the first one is made (1.4 s a rank on a 2-core machine,
#: more than half of a tiny run's rank time); the rest are what :func:`train` imports.
PRELOAD = ["dhelix.interpreter.launch.forkserver_guard", "torch", "torch.distributed", "torch._dynamo",
           "dhelix.interpreter.training.train", "dhelix.interpreter.execute.executor",
           "dhelix.interpreter.verify.harness", "dhelix.interpreter.training.checkpoint"]


def rank_context():
    """The multiprocessing context local ranks start in: a forkserver that has imported
    :data:`PRELOAD` once (each rank is a fork of it: no re-import of torch per rank) where the
    platform has one (Linux, macOS), else spawn. Either way a rank starts from a fresh
    interpreter's state, never a fork of the launcher (its threads, the store). The server is
    started here, named the launcher in its environment alone, so that it dies with this
    process (:mod:`~dhelix.interpreter.launch.forkserver_guard`; only from the main thread,
    whose end the kernel's parent-death signal follows)."""
    import multiprocessing
    import threading
    from multiprocessing import forkserver

    from dhelix.interpreter.launch.forkserver_guard import LAUNCHER_PID

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    os.environ.pop(LAUNCHER_PID, None)
    if threading.current_thread() is threading.main_thread():
        os.environ[LAUNCHER_PID] = str(os.getpid())
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(LAUNCHER_PID, None)
    return context


def warm_up_ranks() -> None:
    """Start the forkserver of :func:`rank_context` now, so that its imports run while the
    command still compiles the program (a no-op where ranks are spawned, or when it runs)."""
    rank_context()


def _launcher_store(timeout: float):
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)


class _stop_signals_raise:
    """While active (main thread only), SIGTERM and SIGHUP raise LauncherStopped in the
    launcher, so that it can forward them and stop its ranks instead of orphaning them."""

    def __enter__(self):
        self.saved = {}
        for name in STOP_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:  # not on this platform
                continue
            try:
                self.saved[signum] = signal.signal(signum, self._raise)
            except ValueError:  # not the main thread: signals are not ours to handle
                break
        return self

    def __exit__(self, *exc):
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)

    @staticmethod
    def _raise(signum, frame):
        raise LauncherStopped(signum)


def watch(procs, receiver) -> tuple[tuple[int, int] | None, object]:
    """Wait for every process, reading rank 0's result from ``receiver`` as it comes (a
    large result fills the pipe: rank 0 cannot exit before it is read). Returns as soon as
    one process exits non-zero: ((its rank, its exit code) or None, the result or None)."""
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
                return (rank, procs[rank].exitcode), None
    if reading and receiver.poll():  # sent just before rank 0 exited
        result = _receive(receiver)
    return None, result


def _receive(receiver):
    try:
        return receiver.recv()
    except EOFError:  # rank 0 ended without a result: its exit code says why
        return None


def stop(procs, grace: float = 3.0, signum: int | None = None) -> None:
    """Stop the processes still running: send ``signum`` (default SIGTERM), kill those that
    outlive ``grace`` seconds (a stopped process only dies of SIGKILL)."""
    for proc in procs:
        if proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signum or signal.SIGTERM)
                os.kill(proc.pid, signal.SIGCONT)  # a stopped rank takes the signal now
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def die_with_launcher(lifeline) -> None:
    """End this rank the moment its launcher is gone, even killed outright: ``lifeline`` is
    the reading end of a pipe only the launcher writes to, so it reads EOF then. (A rank
    forked by the forkserver is not the launcher's child, and the forkserver outlives the
    launcher while ranks run, so a parent-death signal would not do.)"""
    import threading

    def watch() -> None:
        try:
            lifeline.recv()
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="dhelix-launcher-watch", daemon=True).start()


def name_process(name: str) -> None:
    """Show this process as ``name`` (15 bytes at most) in ps, top and /proc/PID/comm, on
    Linux; a no-op elsewhere."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def _rank_process(payload: bytes, rank: int, world: int, address: tuple[str, int], lifeline,
                  results) -> None:
    """The body of a spawned rank: die with the launcher, unpickle ``payload`` (the work and
    its options), run the work, send rank 0's result to the parent through ``results``. On
    failure, leave the rendered error in the store for the launcher (which reports the cause,
    not every consequence) and exit 1; print it when the store cannot take it (see the
    module docstring for why this rank prints)."""
    die_with_launcher(lifeline)
    work, options, environment = pickle.loads(payload)
    os.environ.clear()
    os.environ.update(environment)
    name_process(f"dhelix-rank{rank}")
    # torch's C++ warnings (a store poll that timed out) repeat what the launcher reports.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher, which stops us
    try:
        result = run_rank(options, rank, world, work, address=address)
    except DhelixError as exc:
        try:
            store = client(address, timeout=5.0)
            store.set(f"{FAILURE_PREFIX}{rank}", exc.render())
            kind = "peer" if secondary(exc, rank) else "own"
            store.set(f"{CAUSE_PREFIX}{rank}", f"{kind} {time.time()!r} {type(exc).__name__}")
        except Exception:  # the launcher's store is gone: our own stderr is all that is left
            print(exc.render(), file=sys.stderr)
        sys.stderr.flush()
        # Not sys.exit: the interpreter's clean-up would wait on communication with the
        # peer that failed (seconds of a dead job); everything worth keeping is reported.
        os._exit(1)
    if results is not None:
        results.send(result)
        results.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Done, and the result is with the launcher: leave without the interpreter's clean-up,
    # whose C++ static destructors sometimes abort ("terminate called without an active
    # exception", SIGABRT) on a torch.distributed thread still running, failing a finished run.
    os._exit(0)
