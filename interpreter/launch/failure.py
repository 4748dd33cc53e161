"""Why a world failed: of its ranks' failures, the one to report, as one :class:`RankFailure`.

- a rank killed by a signal, or one that crashed, is the cause; its peers' "connection reset
  by peer" that follows is not reported;
- then the first error a rank met of its own (rank, action, schedule grid; a full disk under
  an output), which it leaves in the store (:data:`FAILURE_PREFIX`, :data:`CAUSE_PREFIX`),
  rather than a peer's "connection closed by peer" that followed from it (:func:`lost_a_peer`):
  the launcher waits a moment for that report when the first rank to exit only lost a peer
  (:func:`await_own_cause`);
- else a rank that stopped making progress (stopped, hung) is named from the heartbeats every
  rank publishes in the store (:mod:`.heartbeat`), with the action it was in, once the others'
  collectives time out (``RunOptions.timeout``);
- else the first failing rank's error.

The local launcher (:mod:`.spawn`) reads the causes from the store it hosts
(:func:`failure_cause`); a torchrun rank blames a stalled peer itself (:func:`blame_stalled`).
"""

from __future__ import annotations

import signal
import time

from dhelix.dsl.core.errors import DhelixError

from .store import client


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


def settle(procs, failure: tuple[int, int]) -> None:
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


def await_own_cause(procs, store) -> None:
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


def secondary(exc: DhelixError, rank: int) -> bool:
    """Whether another rank reports ``exc``, met on ``rank``: a lost peer (``secondary``), or
    an error every rank meets alike (``reported_by_rank_0``, e.g. a non-finite loss) away from
    global rank 0."""
    return getattr(exc, "secondary", False) or getattr(exc, "reported_by_rank_0", False) and rank != 0


def lost_a_peer(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an error it was raised from) is torch.distributed saying that a
    peer went away or did not answer in time: a consequence of another rank's failure."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeError) and any(words in str(exc).lower() for words in PEER_LOST):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def blame_stalled(exc: DhelixError, address: tuple[str, int], world: int, prefix: str = "") -> DhelixError:
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
