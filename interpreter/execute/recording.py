"""What a rank records about its time: trace events, time blocked on communication, memory.

:class:`Recorder` keeps what ran (for the Chrome trace), how long the thread waited for
communication (exposed communication) and the peak of live activation bytes;
:class:`TimedComm` wraps a communicator so that every collective is recorded, and
:func:`timed` wraps one Pending (a pipeline receive) the same way.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
from torch.autograd import _profiler_enabled
from torch.profiler import record_function

from dhelix.interpreter.ops.comm import UNNAMED, Communicator, Pending


class Recorder:
    """What one rank ran: trace events ``(name, lane, start_s, duration_s)`` when
    ``trace`` is on, the seconds spent blocked on communication, the peak of live
    activation bytes. ``cuda``: timings need a device synchronisation to mean anything,
    so host-side waits are not counted as exposed time there. ``memory_probe``: whether the
    executor samples the live activation bytes (:attr:`probe`; off, :attr:`peak_bytes` stays 0)."""

    def __init__(self, trace: bool = False, cuda: bool = False, memory_probe: bool = True):
        self.trace, self.cuda, self.memory_probe = trace, cuda, memory_probe
        self.events: list[tuple[str, str, float, float]] = []
        #: Seconds blocked on collectives (TP/SP, DP, …) and on pipeline receives (which
        #: include the pipeline bubble: the peer had not sent yet).
        self.waited = {"collective": 0.0, "p2p": 0.0}
        self.peak_bytes = 0
        self.origin = time.perf_counter()
        #: Returns the live activation bytes; sampled after every layer (set by the executor).
        self.probe: Callable[[], int] | None = None

    @property
    def naming(self) -> bool:
        """Whether spans' names are read (tracing, or a torch.profiler running): callers
        build a detailed name only then."""
        return self.trace or _profiler_enabled()

    def span(self, name: str, lane: str = "compute"):
        """Time the body as ``name`` on ``lane`` (and mark it for torch.profiler)."""
        # record_function costs tens of microseconds even with no profiler to see it, and
        # spans open per layer and per segment pair: only mark when one is running, and with
        # neither a trace nor a profiler the body runs in an empty context.
        profiled = _profiler_enabled()
        if not (self.trace or profiled):
            return UNNAMED
        return self._span(name, lane, profiled)

    @contextlib.contextmanager
    def _span(self, name: str, lane: str, profiled: bool):
        marker = record_function(name) if profiled else UNNAMED
        with marker:
            start = time.perf_counter()
            try:
                yield
            finally:
                if self.trace:
                    self.event(name, lane, start, time.perf_counter())

    def event(self, name: str, lane: str, start: float, stop: float) -> None:
        """Record an event between two ``perf_counter`` readings (kept only when tracing)."""
        if self.trace:
            self.events.append((name, lane, start - self.origin, stop - start))

    def blocked(self, name: str, lane: str, issued: float, start: float, stop: float,
                kind: str = "collective") -> None:
        """The thread waited from ``start`` to ``stop`` for communication issued at ``issued``
        (``kind``: collective or p2p)."""
        if not self.cuda:
            self.waited[kind] += stop - start
        self.event(name, lane, issued, stop)

    def memory(self) -> None:
        """Sample the live activation bytes (through :attr:`probe`) into the peak."""
        if self.probe is not None:
            self.peak_bytes = max(self.peak_bytes, self.probe())


class _TimedPending(Pending):
    """A Pending whose wait is recorded as blocked time on its lane."""

    def __init__(self, inner: Pending, recorder: Recorder, name: str, lane: str, issued: float,
                 kind: str = "collective"):
        super().__init__(inner, None, lambda _: inner.wait())
        self._meta = (recorder, name, lane, issued, kind)
        self._recorded = False

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        result = super().wait()
        if not self._recorded:
            recorder, name, lane, issued, kind = self._meta
            recorder.blocked(name, lane, issued, start, time.perf_counter(), kind)
            self._recorded = True
        return result


def timed(pending: Pending, recorder: Recorder, name: str, lane: str, kind: str = "collective") -> Pending:
    """``pending`` wrapped so that waiting for it is recorded as ``kind`` (issued now)."""
    return _TimedPending(pending, recorder, name, lane, time.perf_counter(), kind)


class TimedComm(Communicator):
    """A communicator that records every collective of ``inner`` in ``recorder``: a
    synchronous one as blocked time, an asynchronous one from issue to the end of its wait."""

    def __init__(self, inner: Communicator, recorder: Recorder):
        self.inner, self.recorder = inner, recorder
        self.rank, self.mesh = inner.rank, inner.mesh
        self._op: str | None = None
        self._lanes: dict[str, str] = {}

    @property
    def names_ops(self) -> bool:
        """Whether :meth:`op_named` names anything: only when tracing."""
        return self.recorder.trace

    def op_named(self, name: str):
        """Name the events of the collectives issued in the block after the program's op
        ``name`` (``rs1``, as in the plan), instead of the collective's kind and axis (only
        when tracing: nothing else reads the names)."""
        return self._named(name) if self.recorder.trace else UNNAMED

    @contextlib.contextmanager
    def _named(self, name: str):
        outer, self._op = self._op, name
        try:
            yield
        finally:
            self._op = outer

    def lane_of(self, axis: str) -> str:
        """The lane (local or cross) of ``axis``'s process groups (found once per axis)."""
        lane = self._lanes.get(axis)
        if lane is None:
            lane = self._lanes[axis] = "local" if self.mesh is None else self.mesh.lane(axis)
        return lane

    def _run(self, name: str, axis: str, async_op: bool, method, *args):
        # ``method(*args)``: the inner communicator's collective, called here (no closure
        # made per collective: one runs per layer op or so).
        recorder = self.recorder
        if not recorder.trace:
            if async_op:
                # Without a trace nothing reads an asynchronous collective's issue time, only
                # how long its wait blocks: no clock read at its issue.
                out = method(*args)
                if out.done():  # complete at its issue (a size-1 group, a stand-in's inline lane)
                    return out
                return _TimedPending(out, recorder, name, self.lane_of(axis), 0.0)
            if self.size(axis) == 1:
                return method(*args)
            # A synchronous one blocks for its whole time (Recorder.blocked without an event,
            # which only a trace keeps: no name or lane to find).
            issued = time.perf_counter()
            out = method(*args)
            if not recorder.cuda:
                recorder.waited["collective"] += time.perf_counter() - issued
            return out
        if self.size(axis) == 1:
            return method(*args)
        issued = time.perf_counter()
        out = method(*args)
        label = self._op or f"{name}.{axis}"  # (the event's name: only a trace reads it)
        if async_op:
            return _TimedPending(out, recorder, label, self.lane_of(axis), issued)
        recorder.blocked(label, self.lane_of(axis), issued, issued, time.perf_counter())
        return out

    @property
    def completes_at_issue(self) -> bool:
        """Whether the inner communicator's collectives are complete at their issue."""
        return self.inner.completes_at_issue

    def issuer(self, kind: str, axis: str, async_op: bool, bare: bool = False):
        """:meth:`~dhelix.interpreter.ops.comm.Communicator.issuer`, recorded as the
        collective methods record it: without a trace an asynchronous one is the inner
        communicator's own (complete at its issue, or a Pending whose wait is timed); else
        through :meth:`_run`."""
        if self.recorder.trace or not async_op:
            method = getattr(self, kind)
            return lambda x: method(x, axis, async_op=async_op)
        inner = self.inner.issuer(kind, axis, True, bare)
        if self.inner.completes_at_issue:
            return inner
        recorder, lane = self.recorder, self.lane_of(axis)

        def issue(x):
            out = inner(x)
            if not isinstance(out, Pending) or out.done():  # complete at its issue: no wait to time
                return out
            return _TimedPending(out, recorder, kind, lane, 0.0)
        return issue

    def all_gather(self, x, axis, async_op=False):
        return self._run("all_gather", axis, async_op, self.inner.all_gather, x, axis, async_op)

    def reduce_scatter(self, x, axis, async_op=False):
        return self._run("reduce_scatter", axis, async_op, self.inner.reduce_scatter, x, axis, async_op)

    def all_reduce(self, x, axis, op="sum", async_op=False):
        return self._run("all_reduce", axis, async_op, self.inner.all_reduce, x, axis, op, async_op)

    def reduce(self, x, axis, root, async_op=False):
        return self._run("reduce", axis, async_op, self.inner.reduce, x, axis, root, async_op)

    def broadcast(self, x, axis, root, async_op=False):
        return self._run("broadcast", axis, async_op, self.inner.broadcast, x, axis, root, async_op)

    def all_to_all(self, x, axis, in_splits=None, out_splits=None, async_op=False):
        return self._run("all_to_all", axis, async_op, self.inner.all_to_all, x, axis, in_splits, out_splits,
                         async_op)

    def send(self, x, dst, async_op=False):
        return self._run("send", "pp", async_op, self.inner.send, x, dst, async_op)

    def recv(self, shape, dtype, src, async_op=False):
        return self._run("recv", "pp", async_op, self.inner.recv, shape, dtype, src, async_op)

    def post_p2p(self, transfers) -> list:
        return self.inner.post_p2p(transfers)
