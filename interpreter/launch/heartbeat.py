"""Heartbeats through the rendezvous store: which rank stopped making progress, and where.

When a rank hangs (stopped, stuck in a kernel, swapped out), every other rank blocks in a
collective and the first to time out would be blamed. To name the right one, each rank runs a
:class:`Heartbeat`: the training loop calls :meth:`Heartbeat.beat` before every action (a
cheap assignment), and a daemon thread publishes, every :data:`INTERVAL` seconds, the rank's
position (training step, action index and text) with two wall-clock times — when the position
last changed (progress) and when it was published (liveness) — under ``dhelix/heartbeat/<rank>``
in the world's TCP store. A stopped process publishes nothing, so its liveness goes stale while
the blocked ranks' stays fresh: :func:`stalled_rank` picks the rank silent for longest.

The thread has a store client of its own (a TCPStore client is not shared between threads).
Times are ``time.time()``: ranks on different hosts compare them, so hosts should keep their
clocks in sync (NTP), as clusters do; staleness is judged in whole seconds.
"""

from __future__ import annotations

import json
import threading
import time

import attrs

#: Seconds between two publications of a rank's heartbeat.
INTERVAL = 0.5
#: A heartbeat older than this many seconds means the rank no longer runs.
STALE_AFTER = 4 * INTERVAL + 1.0
PREFIX = "dhelix/heartbeat/"


@attrs.frozen(kw_only=True)
class Beat:
    """A rank's last published position: training ``step``, ``index`` of the action in its
    list and the action's text; ``progress`` when it last moved on, ``alive`` when it was
    published (seconds since the epoch)."""

    rank: int
    step: int
    index: int
    action: str
    progress: float
    alive: float

    def where(self) -> str:
        """``in F3.1 (action 7 of its list) of training step 2``, or before the first action."""
        if self.index < 0:
            return "before its first action (while the world formed)"
        return f"in {self.action} (action {self.index} of its list) of training step {self.step}"


class Heartbeat:
    """Publishes this ``rank``'s position to ``store`` (a TCPStore client of its own) every
    :data:`INTERVAL` seconds from a daemon thread, from :meth:`start` to :meth:`stop`."""

    def __init__(self, store, rank: int):
        self.store, self.rank = store, rank
        self._position: tuple[int, int, object] = (0, -1, "")
        self._moved = time.time()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._publish_loop, name="dhelix-heartbeat", daemon=True)

    def beat(self, step: int, index: int, action: object) -> None:
        """Record that this rank begins ``action`` (its ``index`` in the list) of training
        ``step``; the text of ``action`` is formed only when published."""
        self._position, self._moved = (step, index, action), time.time()

    def start(self) -> "Heartbeat":
        """Start publishing; returns self."""
        self._publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop publishing (the last heartbeat stays in the store)."""
        self._stopped.set()

    def _publish_loop(self) -> None:
        while not self._stopped.wait(INTERVAL):
            try:
                self._publish()
            except Exception:  # the store is gone: the run is ending, nothing left to tell
                return

    def _publish(self) -> None:
        step, index, action = self._position
        self.store.set(f"{PREFIX}{self.rank}", json.dumps(
            {"step": step, "index": index, "action": str(action), "progress": self._moved, "alive": time.time()}))


def read_beats(store, world: int) -> dict[int, Beat]:
    """Every published heartbeat of ranks ``0 … world-1`` in ``store`` (a rank that never
    published is missing)."""
    beats = {}
    for rank in range(world):
        key = f"{PREFIX}{rank}"
        if not store.check([key]):
            continue
        record = json.loads(store.get(key))
        beats[rank] = Beat(rank=rank, **record)
    return beats


def stalled_rank(beats: dict[int, Beat], world: int, now: float | None = None) -> tuple[int, str] | None:
    """(rank, what it was doing) for the rank that stopped running: the one whose heartbeat
    is stale for longest (a rank that never published counts as stale since the start). None
    when every heartbeat is fresh: then no rank stopped, and the first failure is the cause."""
    now = time.time() if now is None else now
    silent = {rank: now - beats[rank].alive if rank in beats else float("inf") for rank in range(world)}
    rank = max(silent, key=lambda r: (silent[r], -r))
    if silent[rank] < STALE_AFTER:
        return None
    if rank not in beats:
        return rank, "stopped making progress as it started: it never sent a heartbeat"
    beat = beats[rank]
    return rank, (f"stopped making progress {beat.where()}: no heartbeat for {silent[rank]:.0f} s "
                  f"(stopped, or stuck outside Python)")
