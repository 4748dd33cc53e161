"""Starting the ranks of a run: local processes joined in one world, or torchrun's.

:func:`run_local` starts one process per rank on this machine (the embedded default: no
cluster needed; forked from a forkserver that imported torch once, :func:`rank_context`) and
hosts the world's TCP store itself, so that whatever happens to a rank it
can read what the ranks left there. It watches them and stops the rest as soon as one fails,
so a bad run ends with one :class:`RankFailure` naming the rank that caused it, never a hang:

- a rank killed by a signal, or one that crashed, is the cause; its peers' "connection reset
  by peer" that follows is not reported;
- then the first error a rank met of its own (rank, action, schedule grid; a full disk under
  an output), which it leaves in the store, rather than a peer's "connection closed by peer"
  that followed from it (:func:`lost_a_peer`): the launcher waits a moment for that report
  when the first rank to exit only lost a peer;
- else a rank that stopped making progress (stopped, hung) is named from the heartbeats every
  rank publishes in the store (:mod:`.heartbeat`), with the action it was in, once the others'
  collectives time out (``RunOptions.timeout``);
- else the first failing rank's error.

SIGTERM and SIGHUP to the launcher are forwarded to the ranks, which are stopped; the launcher
then raises :class:`LauncherStopped` (the command exits 128 + the signal). A rank dies with
its launcher even if that is killed outright (:func:`die_with_launcher`). Rank 0's result comes
back through a pipe. What a rank does is the ``work`` function given (``work(options, device,
heartbeat)``, e.g. :func:`.train.train`), run inside the joined world; it returns a picklable
result on global rank 0 and None elsewhere. Under torchrun (``RANK`` and ``WORLD_SIZE`` set,
:func:`torchrun_rank`) the calling process is one rank and :func:`run_rank` runs it in place.

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
from typing import TYPE_CHECKING, Callable

import attrs

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.core.lifetime import die_with_parent

from dhelix.interpreter.training.summary import describe_mesh

from .store import client, env_address, host_env_store

if TYPE_CHECKING:
    from dhelix.interpreter.training.train import RunOptions

#: What a rank runs in the joined world: ``work(options, device, heartbeat)`` → its result on
#: global rank 0 (picklable: it travels to the parent), None elsewhere; it calls
#: ``heartbeat.beat(step, index, action)`` as it moves on (:class:`.heartbeat.Heartbeat`).
#: Module-level, so that a spawned rank can unpickle it.
Work = Callable[["RunOptions", object, object], object]


class RankFailure(DhelixError):
    """A rank of a run failed: it died (``exitcode``, negative for a signal), stopped making
    progress, or raised an error; ``report`` is that rank's own rendered error, shown instead
    of ``message`` when there is one (it has the file location and the schedule grid)."""

    def __init__(self, message: str, *, rank: int = -1, exitcode: int | None = None, report: str = "",
                 notes=(), secondary: bool = False, cause: str = ""):
        super().__init__(message, notes=notes)
        self.rank, self.exitcode, self.report = rank, exitcode, report
        #: The class name of the rank's own error behind ``report`` (NonFiniteError, …), so
        #: that the command line can add its remedy; "" when unknown.
        self.cause = cause
        #: True when another rank reports this failure: this rank failed only because a peer
        #: did (a closed connection, a timeout).
        self.secondary = secondary

    def render(self) -> str:
        if not self.report:
            return super().render()
        return "\n".join([self.report, *(f"  note: {note}" for note in self.notes)])


class LauncherStopped(Exception):
    """The launcher received ``signum`` (SIGTERM, SIGHUP): its ranks were stopped; the
    command exits with 128 + ``signum``, as a process killed by it would."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


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

#: Signals that stop the launcher; forwarded to its ranks, which are then stopped.
STOP_SIGNALS = ("SIGTERM", "SIGHUP")
FAILURE_PREFIX = "dhelix/failure/"
#: Beside a rank's failure: ``own <time>`` for an error of its own, ``peer <time>`` for one it
#: met only because a peer failed (the launcher reports the first own error).
CAUSE_PREFIX = "dhelix/cause/"
#: How long the launcher waits for an error of a rank's own once the first rank to fail only
#: lost a peer (the rank that failed first may still be cleaning up and reporting).
OWN_CAUSE_WAIT_S = 5.0
#: What torch.distributed's errors say when a peer went away or did not answer in time.
PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out",
             "timeout", "connection refused", "socket closed", "end of file")
#: After a rank fails with an error of its own, how long to wait for a peer's death to show
#: up (a rank killed by a signal makes its peers fail too, a few milliseconds later).
SETTLE_S = 0.5
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
        _settle(procs, failure)
        _await_own_cause(procs, store)
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


def _settle(procs, failure: tuple[int, int]) -> None:
    """After a rank failed with its own error (exit code 1), give a peer that was killed the
    moment to show it: its death, not the error it caused, is the cause to report."""
    from multiprocessing.connection import wait

    if failure[1] != 1:
        return
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        alive = [proc.sentinel for proc in procs if proc.exitcode is None]
        if not alive or any(proc.exitcode not in (None, 0, 1) for proc in procs):
            return
        wait(alive, timeout=max(0.0, deadline - time.monotonic()))


def _causes(store, world: int) -> dict[int, tuple[str, float, str]]:
    """The failures the ranks reported: rank → (``own`` or ``peer``, when, the error's class)."""
    found = {}
    for rank in range(world):
        key = f"{CAUSE_PREFIX}{rank}"
        if store.check([key]):
            kind, when, *name = store.get(key).decode().split()
            found[rank] = (kind, float(when), name[0] if name else "")
    return found


def _await_own_cause(procs, store) -> None:
    """While every reported failure is a lost peer and some rank still runs (and none of those
    is hung: its heartbeat stale), wait (up to :data:`OWN_CAUSE_WAIT_S`) for the rank that
    failed of its own to report: it may have closed its connections before its report
    reached the store."""
    from multiprocessing.connection import wait

    from .heartbeat import read_beats, stalled_rank

    deadline = time.monotonic() + OWN_CAUSE_WAIT_S
    while time.monotonic() < deadline:
        if any(kind == "own" for kind, *_ in _causes(store, len(procs)).values()):
            return
        alive = [proc.sentinel for proc in procs if proc.exitcode is None]
        stalled = stalled_rank(read_beats(store, len(procs)), len(procs))
        if not alive or stalled is not None and procs[stalled[0]].exitcode is None:
            return  # nothing left to report, or a hung rank: the cause is known
        wait(alive, timeout=0.1)


def _last_position(store, world: int, rank: int) -> list[str]:
    """A note on where ``rank`` (killed, or crashed outside Python) was: its last heartbeat,
    published at most a heartbeat interval before it died (none before its first action)."""
    from .heartbeat import read_beats

    try:
        beat = read_beats(store, world).get(rank)
    except (RuntimeError, OSError, ValueError):  # the store cannot say: the report goes without it
        return []
    if beat is None or beat.index < 0:
        return []
    return [f"its last heartbeat, {max(0.0, time.time() - beat.alive):.1f} s before this report, had it {beat.where()}"]


def failure_cause(procs, first: tuple[int, int], store, timeout: float) -> RankFailure:
    """The RankFailure to report for a failed local run: a rank killed by a signal, else one
    that crashed (exit code other than 1), else the first error a rank reported of its own
    (not a lost peer), else one whose heartbeat stopped (a hung rank the others timed out
    waiting for), else the first rank's error, read from ``store``."""
    from .heartbeat import read_beats, stalled_rank

    codes = {rank: proc.exitcode for rank, proc in enumerate(procs) if proc.exitcode not in (None, 0)}
    others = f"stopped the other {len(procs) - 1} rank(s)"
    followers = ["the other ranks' errors (connection reset by peer, timeouts) follow from it and are not shown"]
    for rank, code in sorted(codes.items(), key=lambda item: (item[1] >= 0, item[1] == 1, item[0])):
        notes = _last_position(store, len(procs), rank) + (followers if len(codes) > 1 else [])
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            return RankFailure(f"rank {rank} was killed by signal {-code} ({name}); {others}", rank=rank,
                               exitcode=code, notes=notes)
        if code != 1:
            return RankFailure(f"rank {rank} exited with code {code}; {others}", rank=rank, exitcode=code,
                               notes=notes)
    causes = _causes(store, len(procs))
    own = sorted((when, rank) for rank, (kind, when, _) in causes.items() if kind == "own")
    stalled = None if own else stalled_rank(read_beats(store, len(procs)), len(procs))
    if stalled is not None:
        rank, what = stalled
        return RankFailure(f"rank {rank} {what}; the others waited for it until their collective timeout of "
                           f"{timeout:g} s; {others}", rank=rank)
    rank = own[0][1] if own else first[0]
    key = f"{FAILURE_PREFIX}{rank}"
    report = store.get(key).decode() if store.check([key]) else ""
    code = codes.get(rank, first[1])
    notes = [others] if report and len(procs) > 1 else []
    if own and len(causes) > 1:
        notes.append(followers[0])
    return RankFailure(f"rank {rank} exited with code {code}; {others}", rank=rank, exitcode=code,
                       report=report, notes=notes, cause=causes[rank][2] if rank in causes else "")


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


# -- one rank ---------------------------------------------------------------------------------

def run_rank(options: "RunOptions", rank: int, world: int, work: Work, *, address: tuple[str, int] | None = None,
             gpus_per_node: int | None = None, replan: Callable | None = None, prefix: str = "", host=None):
    """Join the world as ``rank`` through the TCP store at ``address`` (the local launcher's)
    or, without one, torchrun's ``env://`` (``MASTER_ADDR``/``MASTER_PORT``); run ``work``
    with a heartbeat (:mod:`.heartbeat`), leave; returns its result (on global rank 0; None
    elsewhere). ``options`` gives the backend, the seed and the collective timeout. Under
    torchrun with ``gpus_per_node`` (the cluster block's), the nodes the ranks run on are
    checked against it first (:mod:`.topology`), or with ``options.topology`` measured they
    decide: ``replan(options, measured gpus_per_node)`` (the command's, which compiles the
    run for them) gives the options to run. ``prefix``: the store keys of this world's, for a
    process that joins several worlds one after another on the same store (`tune --measure`
    under torchrun: one per candidate). ``host``: the ``env://`` store this process hosts
    already (:func:`.store.host_env_store`, hosted for the compile handed over by rank 0);
    None: hosted here when this rank must host it. Raises
    what ``work`` raises (the executor's DhelixError: rank, action, schedule grid) and
    RankFailure when a collective fails because a peer did."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from .heartbeat import Heartbeat

    device = _rank_device(options, rank, world)
    torch.manual_seed(options.seed)
    timeout = timedelta(seconds=options.timeout)
    torchrun = address is None
    if torchrun:
        die_with_parent(os.getppid(), prctl=False)  # torchrun's agent may start us from any thread
        address = env_address()
        if host is None:
            host = host_env_store(address, rank, options.timeout)
    # Beating before joining: a rank that hangs while the world forms is named too.
    heartbeat = Heartbeat(client(address, options.timeout, prefix), rank).start()
    try:
        measured, emulated = None, ""
        if torchrun and gpus_per_node is not None:
            from .topology import check_placement, emulated_nodes, exchange, measured_per_node

            places = exchange(client(address, options.timeout, prefix), rank, world)
            if getattr(options, "topology", "declared") == "measured":
                measured = measured_per_node(places)
                options = replan(options, measured)
            else:
                emulated = emulated_nodes(places, gpus_per_node)
                if not emulated:
                    check_placement(places, gpus_per_node)
        dist.init_process_group(options.backend, store=client(address, options.timeout, prefix), rank=rank,
                                world_size=world, timeout=timeout)
        try:
            result = work(options, device, heartbeat)
        finally:
            dist.destroy_process_group()
        if result is not None and measured is not None:
            from .topology import describe_measured

            result = attrs.evolve(result, gpus_per_node=measured,
                                  topology=describe_measured(measured, world, gpus_per_node))
        elif result is not None and emulated:
            result = attrs.evolve(result, topology=emulated)
        return result
    except (RuntimeError, ValueError) as exc:  # a peer's failure seen through a collective
        raise _blame_stalled(RankFailure(f"rank {rank}: {type(exc).__name__}: {exc}", rank=rank,
                                         secondary=lost_a_peer(exc)), address, world, prefix) from None
    except DhelixError as exc:
        if lost_a_peer(exc):
            exc.secondary = True
        raise _blame_stalled(exc, address, world, prefix) from None
    finally:
        heartbeat.stop()
        del host


def secondary(exc: DhelixError, rank: int) -> bool:
    """Whether another rank reports ``exc``, met on ``rank``: a lost peer (``secondary``), or
    an error every rank meets alike (``reported_by_rank_0``, e.g. a non-finite loss) away from
    global rank 0."""
    return getattr(exc, "secondary", False) or getattr(exc, "reported_by_rank_0", False) and rank != 0


def lost_a_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is torch.distributed saying that a
    peer went away or did not answer in time: a consequence of another rank's failure."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeError) and any(words in str(exc).lower() for words in PEER_LOST):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _rank_device(options: "RunOptions", rank: int, world: int):
    """This rank's device: its local GPU under NCCL, else the CPU with its share of the
    cores."""
    import torch

    if options.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        return device
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    return torch.device("cpu")


def _blame_stalled(exc: DhelixError, address: tuple[str, int], world: int, prefix: str = "") -> DhelixError:
    """``exc``, or — when a rank's heartbeat stopped — a RankFailure naming that rank (a
    timeout here is its consequence). Under torchrun this rank is its own reporter."""
    from .heartbeat import read_beats, stalled_rank

    try:
        stalled = stalled_rank(read_beats(client(address, 2.0, prefix), world), world)
    except Exception:  # the store went with its host: keep the error we have
        return exc
    if stalled is None:
        return exc
    rank, what = stalled
    return RankFailure(f"rank {rank} {what}", rank=rank, notes=[f"seen from this rank: {exc.message}"],
                       secondary=True)


def run_as_rank(options: "RunOptions", work: Work):
    """Run rank ``options.as_rank`` of the program's world alone in this process, in a stand-in
    world of the program's size (:mod:`dhelix.interpreter.ops.standin`): on this machine's GPU
    under ``nccl``, else on the CPU; returns what ``work`` returns (a run's result, a profile's samples)."""
    import torch
    import torch.distributed as dist

    from dhelix.interpreter.ops.standin import join_standin_world

    world = options.compiled.program.mesh.world
    if options.backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(options.seed)
    join_standin_world(options.as_rank, world)
    try:
        return work(options, device, None)
    finally:
        dist.destroy_process_group()
