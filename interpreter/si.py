"""Strand-interleaved (SI) blocks: running the layer chains of one or two strands.

An SI block co-executes the forward layer chain of one micro-batch (strand β) with the
backward layer chain of another (strand α) on one rank. Layer k of the forward chain is
paired with layer k of the backward chain (the backward chain runs the model in reverse, so
with fold u both travel the same way through the ranks); each layer pair runs the
:data:`~.si_plan.SegmentPlan` of its DAGs (:mod:`.si_plan`). A *cross-strand barrier*
after each pair waits for every collective either strand left in flight.

Lanes. Compute runs on the calling thread (CPU) or the current CUDA stream, which is the
default stream, so every tensor is allocated there. Collectives are issued with
``async_op=True``: on gloo each process group progresses on its own background thread, on
NCCL each group has its own stream that the process group orders after the compute stream
with an event at issue and before it at ``wait()``. A group is in the local or the cross
lane according to :meth:`~dhelix.dsl.core.mesh.Mesh.lane`, so one lane's collectives never
queue behind the other's. Inside a pair the executor alternates between the strands op by
op, so a collective one strand issues proceeds while the other strand computes; on CPU the
barrier blocks the thread, on CUDA it only orders the streams.
"""

from __future__ import annotations

from typing import Callable, Sequence

from dhelix.dsl.core.program import Op

from .comm import Pending
from .recording import Recorder
from .si_plan import SegmentPlan
# launch.py (being split elsewhere) still imports these and Recorder from here; they live in
# .si_plan and .recording now: drop this line once it imports them from there.
from .si_plan import PLANS, fixed_plan, has_si_blocks, planned_pairs  # noqa: F401


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
