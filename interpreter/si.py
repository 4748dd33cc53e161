"""Strand-interleaved (SI) blocks, the three lanes, and what a rank records about its time.

An SI block co-executes the forward layer chain of one micro-batch (strand β) with the
backward layer chain of another (strand α) on one rank. Layer k of the forward chain is
paired with layer k of the backward chain (the backward chain runs the model in reverse, so
with fold u both travel the same way through the ranks); each layer pair runs the
:data:`SegmentPlan` of its DAGs: an ordered list of (forward op names, backward op names)
segment pairs, either side possibly empty, covering both DAGs once. A *cross-strand
barrier* after each pair waits for every collective either strand left in flight.

Lanes. Compute runs on the calling thread (CPU) or the current CUDA stream, which is the
default stream, so every tensor is allocated there. Collectives are issued with
``async_op=True``: on gloo each process group progresses on its own background thread, on
NCCL each group has its own stream that the process group orders after the compute stream
with an event at issue and before it at ``wait()``. A group is in the local or the cross
lane according to :meth:`~dhelix.dsl.core.mesh.Mesh.lane`, so one lane's collectives never
queue behind the other's. Inside a pair the executor alternates between the strands op by
op, so a collective one strand issues proceeds while the other strand computes; on CPU the
barrier blocks the thread, on CUDA it only orders the streams.

:class:`Recorder` keeps what ran (for the Chrome trace), how long the thread waited for
communication (exposed communication) and the peak of live activation bytes;
:class:`TimedComm` wraps a communicator so that every collective is recorded.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Sequence

import torch
from torch.autograd import _profiler_enabled
from torch.profiler import record_function

from dhelix.dsl.core.oplib import is_wgrad
from dhelix.dsl.core.program import LayerDag, Op

from .comm import Communicator, Pending

#: An SI plan for one layer pair: ``((forward op names, backward op names), ...)``.
SegmentPlan = tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]
PlanFn = Callable[[LayerDag, LayerDag], SegmentPlan]


# -- plans ------------------------------------------------------------------------------

def sequential_plan(fwd: LayerDag, bwd: LayerDag) -> SegmentPlan:
    """One pair of all forward ops, then one of all backward ops: no interleaving."""
    return ((tuple(op.name for op in fwd.ops), ()), ((), tuple(op.name for op in bwd.ops)))


def op_by_op_plan(fwd: LayerDag, bwd: LayerDag) -> SegmentPlan:
    """Forward op i paired with backward op i in each DAG's listed (topological) order,
    the longer DAG's remaining ops alone: the finest interleaving, legal for any DAGs."""
    pairs = []
    for i in range(max(len(fwd.ops), len(bwd.ops))):
        pairs.append((tuple(op.name for op in fwd.ops[i:i + 1]), tuple(op.name for op in bwd.ops[i:i + 1])))
    return tuple(pairs)


PLANS: dict[str, PlanFn] = {"sequential": sequential_plan, "op_by_op": op_by_op_plan}


def planned_pairs(program) -> SegmentPlan:
    """The planner's SI plan of ``program``'s layer pair as its schedule runs it (without
    the wgrads when W is split off). Needs the program's hardware profile; raises the
    planner's DhelixError otherwise. Imported lazily: the planner is optional here."""
    from dhelix.dsl.simulator.events import schedule_plan

    return tuple((tuple(pair.forward), tuple(pair.backward)) for pair in schedule_plan(program).pairs)


def has_si_blocks(lowered) -> bool:
    """Whether a lowered schedule has SI blocks (else no plan is needed)."""
    from dhelix.dsl.core.schedule import Interleaved

    return any(isinstance(action, Interleaved) for row in lowered.actions for action in row)


def fixed_plan(pairs: SegmentPlan) -> PlanFn:
    """A PlanFn returning ``pairs`` for every layer pair (all layers share one DAG)."""
    return lambda fwd, bwd: pairs


def check_plan(plan: SegmentPlan, fwd: LayerDag, bwd: LayerDag, optional=frozenset()) -> None:
    """Raise ValueError unless ``plan`` runs every op of ``fwd`` and ``bwd`` exactly once,
    each after the ops of its own DAG that it reads. Ops named in ``optional`` (the wgrads
    of a schedule that runs them in W actions) may be left out."""
    for dag, side in ((fwd, 0), (bwd, 1)):
        order = [name for pair in plan for name in pair[side]]
        known = {op.name: op for op in dag.ops}
        required = set(known) - set(optional)
        if len(order) != len(set(order)) or not required <= set(order) <= set(known):
            missing = sorted(required - set(order))
            extra = sorted(name for name in set(order) if order.count(name) > 1 or name not in known)
            raise ValueError(f"the SI plan does not cover the {dag.direction} DAG once: missing "
                             f"{missing or 'none'}, repeated or unknown {extra or 'none'}")
        done = {dag.input}
        for name in order:
            late = [x for x in known[name].inputs if x not in done and x in known]
            if late:
                raise ValueError(f"the SI plan runs {name} before {', '.join(late)}, which it reads")
            done.add(name)


def backward_ops(bwd: LayerDag, split: bool) -> tuple[Op, ...]:
    """The ops a B action runs: all of them, or without the weight gradients when the
    schedule splits them into W actions."""
    return tuple(op for op in bwd.ops if not (split and is_wgrad(op)))


# -- recording ----------------------------------------------------------------------------

class Recorder:
    """What one rank ran: trace events ``(name, lane, start_s, duration_s)`` when
    ``trace`` is on, the seconds spent blocked on communication, the peak of live
    activation bytes. ``cuda``: timings need a device synchronisation to mean anything,
    so host-side waits are not counted as exposed time there."""

    def __init__(self, trace: bool = False, cuda: bool = False):
        self.trace, self.cuda = trace, cuda
        self.events: list[tuple[str, str, float, float]] = []
        #: Seconds blocked on collectives (TP/SP, DP, …) and on pipeline receives (which
        #: include the pipeline bubble: the peer had not sent yet).
        self.waited = {"collective": 0.0, "p2p": 0.0}
        self.peak_bytes = 0
        self.origin = time.perf_counter()
        #: Returns the live activation bytes; sampled after every layer (set by the executor).
        self.probe: Callable[[], int] | None = None

    @contextlib.contextmanager
    def span(self, name: str, lane: str = "compute"):
        """Time the body as ``name`` on ``lane`` (and mark it for torch.profiler)."""
        # record_function costs tens of microseconds even with no profiler to see it, and
        # spans open per layer and per segment pair: only mark when one is running.
        marker = record_function(name) if _profiler_enabled() else contextlib.nullcontext()
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

    def lane_of(self, axis: str) -> str:
        """The lane (local or cross) of ``axis``'s process groups."""
        return "local" if self.mesh is None else self.mesh.lane(axis)

    def _run(self, name: str, axis: str, async_op: bool, call):
        if self.size(axis) == 1:
            return call()
        issued = time.perf_counter()
        out = call()
        if async_op:
            return _TimedPending(out, self.recorder, f"{name}.{axis}", self.lane_of(axis), issued)
        self.recorder.blocked(f"{name}.{axis}", self.lane_of(axis), issued, issued, time.perf_counter())
        return out

    def all_gather(self, x, axis, async_op=False):
        return self._run("all_gather", axis, async_op, lambda: self.inner.all_gather(x, axis, async_op))

    def reduce_scatter(self, x, axis, async_op=False):
        return self._run("reduce_scatter", axis, async_op,
                         lambda: self.inner.reduce_scatter(x, axis, async_op))

    def all_reduce(self, x, axis, op="sum", async_op=False):
        return self._run("all_reduce", axis, async_op, lambda: self.inner.all_reduce(x, axis, op, async_op))

    def all_to_all(self, x, axis, in_splits=None, out_splits=None, async_op=False):
        return self._run("all_to_all", axis, async_op,
                         lambda: self.inner.all_to_all(x, axis, in_splits, out_splits, async_op))

    def send(self, x, dst, async_op=False):
        return self._run("send", "pp", async_op, lambda: self.inner.send(x, dst, async_op))

    def recv(self, shape, dtype, src, async_op=False):
        return self._run("recv", "pp", async_op, lambda: self.inner.recv(shape, dtype, src, async_op))


# -- running layer chains -----------------------------------------------------------------

def settle(run) -> None:
    """The cross-strand barrier for one LayerRun: wait for every collective it left in flight."""
    run.version += 1  # its live tensors change (the memory probe recounts them)
    for name, value in list(run.acts.items()):
        if isinstance(value, Pending):
            run.acts[name] = value.wait()
    for grads in run.bgrads.values():
        for name, value in list(grads.items()):
            if isinstance(value, Pending):
                grads[name] = value.wait()


def run_pair(fwd_run, fwd_ops: Sequence[Op], bwd_run, bwd_ops: Sequence[Op], recorder: Recorder,
             label: str) -> None:
    """Run one segment pair: alternate between the strands op by op, collectives in
    flight, then the barrier. Either run may be None when its segment is empty."""
    queues = [(fwd_run.forward_op if fwd_run else None, list(fwd_ops)),
              (bwd_run.backward_op if bwd_run else None, list(bwd_ops))]
    with recorder.span(label):
        turn, index = 0, [0, 0]
        while index[0] < len(queues[0][1]) or index[1] < len(queues[1][1]):
            if index[turn] >= len(queues[turn][1]):
                turn = 1 - turn
            run, ops = queues[turn]
            op = ops[index[turn]]
            run(op, async_op=op.kind == "comm")
            index[turn] += 1
            turn = 1 - turn
        for layer in (fwd_run, bwd_run):
            if layer is not None:
                settle(layer)


class LayerChain:
    """One strand of a block: a list of LayerRuns in the order they run, started by
    ``begin()`` (returns the first layer's input or output gradient) and finished by
    ``end(value)`` (takes the last layer's output or input gradient). ``ops`` are the ops of
    each layer run, in DAG order (the forward DAG, or the backward DAG without wgrads for a
    split B)."""

    def __init__(self, runs: list, ops: Sequence[Op], begin: Callable, end: Callable, forward: bool):
        self.runs, self.ops, self.begin, self.end, self.forward = runs, tuple(ops), begin, end, forward

    def start(self, run, value) -> None:
        """Give ``run`` its input (forward) or its output gradient (backward)."""
        run.start(value) if self.forward else run.start_backward(value)

    def result(self, run):
        """The layer's output (forward) or its input gradient (backward)."""
        return run.output() if self.forward else run.input_grad()


def run_alone(chain: LayerChain, recorder: Recorder, label: str) -> None:
    """Run a chain without a partner strand, every collective synchronous, in DAG order."""
    value = chain.begin()
    for k, run in enumerate(chain.runs):
        chain.start(run, value)
        with recorder.span(f"{label}.layer{k}"):
            step = run.forward_op if chain.forward else run.backward_op
            for op in chain.ops:
                step(op)
        recorder.memory()
        value = chain.result(run)
    chain.end(value)


def run_interleaved(fwd: LayerChain, bwd: LayerChain, plan: SegmentPlan, recorder: Recorder,
                    label: str) -> None:
    """Run an SI block: the chains' ``begin`` parts (embedding, loss gradient), then layer
    pair k = (forward layer k, backward layer k) segment pair by segment pair, each
    followed by the barrier, then the ``end`` parts. ``plan`` names ops of the forward DAG
    and the backward DAG; backward ops not in ``bwd.ops`` (wgrads of a split B) are left
    for the W action. A layer without a partner (chains of unequal length) runs its plan
    side alone."""
    fwd_ops = {op.name: op for op in fwd.ops}
    bwd_ops = {op.name: op for op in bwd.ops}
    x, grad = fwd.begin(), bwd.begin()
    for k in range(max(len(fwd.runs), len(bwd.runs))):
        frun = fwd.runs[k] if k < len(fwd.runs) else None
        brun = bwd.runs[k] if k < len(bwd.runs) else None
        if frun is not None:
            fwd.start(frun, x)
        if brun is not None:
            bwd.start(brun, grad)
        for index, (fnames, bnames) in enumerate(plan):
            fseg = [fwd_ops[name] for name in fnames] if frun is not None else []
            bseg = [bwd_ops[name] for name in bnames if name in bwd_ops] if brun is not None else []
            if fseg or bseg:
                run_pair(frun, fseg, brun, bseg, recorder, f"{label}.layer{k}.pair{index}")
        recorder.memory()
        if frun is not None:
            x = fwd.result(frun)
        if brun is not None:
            grad = bwd.result(brun)
    fwd.end(x)
    bwd.end(grad)
