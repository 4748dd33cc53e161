"""Strand-interleaved (SI) blocks: running the layer chains of one or two strands.

An SI block co-executes the forward layer chain of one micro-batch with the backward layer
chain of another, of the other strand (β's forward beside α's backward, or α's beside β's:
the roles alternate), on one rank. Layer k of the forward chain is
paired with layer k of the backward chain (the backward chain runs the model in reverse, so
with fold u both travel the same way through the ranks); each layer pair runs the
:data:`~.si_plan.SegmentPlan` of its DAGs (:mod:`.si_plan`) segment pair by segment pair,
each pair's ops in the order :mod:`.pair_order` gives: collectives issued as soon as their
inputs exist, compute that unlocks a collective soonest first, a collective waited for only
by the op that reads it. Between layer pairs, each strand's next layer's first collective
is issued as soon as this layer's result exists — the forward output, the backward input
gradient — (:class:`~.pair_order.BlockOrder`), and
on one CPU thread the backward's wgrads are held and run where an op would wait
(:class:`Filler`): the two places where a layer-by-layer plan leaves the thread waiting are
the layer pair's opening, where both strands need a collective first.

Lanes. Compute runs on the calling thread (CPU) or the current CUDA stream, which is the
default stream, so every tensor is allocated there. Collectives are issued with
``async_op=True``. On gloo each process group progresses on its own background thread. On
NCCL each group has its own stream, and the process group itself gives the event ordering
the lanes need: at issue its stream waits for an event recorded on the compute stream (the
input exists), and ``wait()`` makes the compute stream wait for the collective's event
without blocking the thread. A group is in the local or the cross lane according to
:meth:`~dhelix.dsl.core.mesh.Mesh.lane`, so one lane's collectives never queue behind the
other's.

The model's ends follow the same rule: a forward chain's ``begin`` leaves the embedding's
tp reduction in flight, and its ``end`` (run before the block's barrier) computes the LM head's
forward and at once its backward, whose reduction stays in flight until the micro-batch's
backward chain begins and its first layer op reads it (the final norm's backward runs on that
read); the embedding backward's gather is waited for only after the next action (nothing
reads it before the optimizer).

The cross-strand barrier (:func:`settle`: wait for every collective a run left in flight)
comes at the end of every SI block. Between segment pairs it is kept only on CUDA
(``barrier``): there both strands' kernels are queued on streams ahead of the GPU, and the
barrier (a stream wait, no thread blocks) is what makes a pair co-execute as the planner
priced it — its three lanes starting together, nothing spilling into the next pair — and
keeps the buffers of a pair's collectives from overlapping the next pair's allocations.
On one CPU thread compute runs in the order it is issued, so the issue order alone
realises the pairing, and no plan needs the barrier: not for results (an op waits for the
collective it reads), not for deadlock freedom (every rank of a group issues and waits in
the same static order), and for memory only in that a collective's buffers live until its
reader runs instead of until its pair ends — the collectives in flight across a pair
boundary; at a layer boundary every reader of the layer has run and the layer's result has
been waited for (a collective that only a split-off wgrad reads excepted), so the memory
sampled there is unchanged — but for the wgrads the :class:`Filler` still holds (at most one
layer pair's) and the next layers' leads, issued before the boundary.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from dhelix.dsl.core.oplib import is_wgrad
from dhelix.dsl.core.program import Op

from dhelix.interpreter.ops.comm import Pending
from dhelix.dsl.planner.pair_order import BlockOrder, InFlight, Issue, order_pair
from .layer_calls import LayerCalls
from .pair_calls import compile_alone, compile_pair
from .recording import Recorder


def settle(run) -> None:
    """The cross-strand barrier for one LayerRun: wait for every collective it left in flight."""
    landed = False
    acts = run.acts
    for name, value in list(acts.items()):
        if isinstance(value, Pending):
            acts[name] = value.wait()
            landed = True
    for grads in run.bgrads.values():
        for name, value in list(grads.items()):
            if isinstance(value, Pending):
                grads[name] = value.wait()
                landed = True
    if landed:  # its live tensors changed (the memory probe recounts them; else it need not)
        run.version += 1


class Flat:
    """An :class:`~.pair_order.Issue` resolved once, for the hot path: its strand, op,
    whether it is a lead (``ahead``), a collective (``comm``) or a wgrad the :class:`Filler`
    may hold, its op's distinct dependencies and its name (``F.op``), all plain attributes;
    ``call``: the op compiled (:class:`~.layer_calls.LayerCalls`), None: the run's method
    runs it."""

    __slots__ = ("strand", "forward", "op", "ahead", "comm", "wgrad", "deps", "name", "call", "reads_held", "plain")

    def __init__(self, issue: Issue, calls: LayerCalls | None = None):
        self.strand, self.op, self.ahead, self.comm = issue.strand, issue.op, issue.ahead, issue.comm
        self.forward = issue.strand == "F"
        self.wgrad = issue.strand == "B" and not issue.comm and is_wgrad(issue.op)
        self.deps = tuple(dict.fromkeys(issue.op.deps))
        self.name = issue.name
        self.call = calls.of(self.forward, issue.op.name, issue.comm) if calls is not None else None
        #: Whether the op may read a wgrad the :class:`Filler` holds (a ZeRO-3 gradient
        #: scatter reads its weight's); unknown without ``calls``: it may.
        self.reads_held = not self.forward and (calls is None or not calls.wgrads.isdisjoint(self.deps))
        #: Whether :func:`run_pair` may just call it on its layer pair's run, where no op
        #: blocks: compiled, not a lead, not a wgrad a filler holds, reading none it holds.
        self.plain = self.call is not None and not self.ahead and not self.wgrad and not self.reads_held


def flat(issues: Sequence[Issue], calls: LayerCalls | None = None) -> tuple[Flat, ...]:
    """``issues`` resolved (:class:`Flat`), once (resolved already: as they are), with
    ``calls``' compiled ops when given (then always resolved anew)."""
    if calls is None and isinstance(issues, tuple) and (not issues or isinstance(issues[0], Flat)):
        return issues
    return tuple(issue if isinstance(issue, Flat) and calls is None else Flat(issue, calls) for issue in issues)


class Compiled(tuple):
    """Resolved issues (:class:`Flat`) of a segment pair or of a layer run alone, with
    ``code``: them compiled into one function (:mod:`.pair_calls`; None: not compiled)."""

    code: Callable | None = None


def compiled(issues: Sequence[Issue], calls: LayerCalls | None, alone: bool = False) -> tuple[Flat, ...]:
    """``issues`` resolved with ``calls``' compiled ops (:func:`flat`), and compiled whole: a
    segment pair (:func:`~.pair_calls.compile_pair`) or, ``alone``, one layer's ops run alone
    (:func:`~.pair_calls.compile_alone`); without ``calls``, only resolved."""
    if calls is None:
        return flat(issues)
    made = Compiled(flat(issues, calls))
    made.code = (compile_alone if alone else compile_pair)(made, calls)
    return made


class FlatOrder:
    """A :class:`~.pair_order.BlockOrder` whose segment pairs are resolved into
    :class:`Flat` issues once per kind of layer pair (the flags of
    :meth:`~.pair_order.BlockOrder.pairs`), not on every layer of every block; with
    ``calls``, their ops compiled."""

    def __init__(self, order: BlockOrder, calls: LayerCalls | None = None):
        self.order, self.barrier, self.calls = order, order.barrier, calls
        self._pairs: dict[tuple, tuple] = {}

    def pairs(self, *flags, **named) -> tuple[tuple[int, tuple[Flat, ...]], ...]:
        """:meth:`BlockOrder.pairs <.pair_order.BlockOrder.pairs>`, resolved (and compiled)."""
        key = (flags, tuple(named.items()))  # (as given: the one caller names them in one order)
        found = self._pairs.get(key)
        if found is None:
            found = self._pairs[key] = tuple((index, compiled(issues, self.calls))
                                             for index, issues in self.order.pairs(*flags, **named))
        return found


def _run(run, issue: Flat, recorder: Recorder) -> None:
    # One op of ``issue``'s strand on ``run``; when tracing, an event on the compute lane
    # named ``F.op``/``B.op`` (for a collective: its issue).
    if issue.call is not None and not recorder.trace:
        issue.call(run)
        return
    step = run.forward_op if issue.forward else run.backward_op
    if recorder.trace:
        start = time.perf_counter()
        step(issue.op, issue.comm)
        recorder.event(issue.name, "compute", start, time.perf_counter())
    else:
        step(issue.op, issue.comm)


def _unfinished_inputs(run, issue: Flat) -> bool:
    """Whether an input of ``issue``'s op on ``run`` is a collective still in flight (running
    the op now would block the thread on it): a forward op's inputs are values, a backward
    op's maps of them."""
    if issue.forward:
        acts = run.acts
        for name in issue.deps:
            value = acts.get(name)
            if isinstance(value, Pending) and not value.done():
                return True
        return False
    bgrads = run.bgrads
    for name in issue.deps:
        value = bgrads.get(name)
        if value:
            for item in value.values():
                if isinstance(item, Pending) and not item.done():
                    return True
    return False


class Filler:
    """The backward strand's weight-gradient ops of an SI block, held back from their place
    in the plan and run while the thread would otherwise block on a collective — on one CPU
    thread, where a wait blocks every lane of compute. A wgrad feeds nothing of its layer
    but the weight's gradient (a ZeRO-3 reduce-scatter of it excepted, which runs it first),
    so where it runs changes no result and no collective's place in the issue order, which
    stays static and the same on every rank. A layer pair opens with both strands waiting
    for a collective that depends on the previous layer pair's last ones; the wgrads the
    previous backward layer held are what can run then. Each run's held wgrads run in the
    order the plan lists them (chunks of one weight add into one gradient: the sum's order
    stays fixed), and only once the run's backward has started (a recomputing run's replay,
    whose forward collectives must stay in place, comes first). Held ops are run at the
    latest at the end of the layer pair after their own (:meth:`flush`), so they keep at most
    one layer's saved tensors alive a layer longer. The block's last layer pair's are carried
    (:meth:`carry`) into the next SI block, whose opening waits for the collectives of both
    strands' ``begin`` (the embedding's and the LM head's reductions) with nothing else to
    compute; they run there, at the latest after its first layer pair, and before any other
    action or the step's end (the executor's :meth:`flush`)."""

    def __init__(self, recorder: Recorder, blocking: bool = True):
        self.recorder = recorder
        #: Whether an op may find a collective it reads still in flight (False: every one is
        #: complete at its issue, :attr:`~dhelix.interpreter.ops.comm.Communicator.completes_at_issue`,
        #: and nothing would ever run in a wait).
        self.blocking = blocking
        self.held: list[tuple[int, object, Issue]] = []  # (layer pair, its backward run, the wgrad)
        #: What :meth:`carry` was told to call once the carried ops have run.
        self.carried: list[Callable[[], None]] = []

    def take(self, layer: int, run, issue: Flat) -> bool:
        """Hold ``issue`` (an op of layer pair ``layer`` on ``run``) instead of running it in
        place, when it is a wgrad this filler may move; whether it did."""
        if issue.wgrad and run.backward_started:
            self.held.append((layer, run, issue))
            return True
        return False

    def before(self, run, issue: Flat) -> None:
        """Run what must or can run before ``issue`` on ``run``: the held ops it reads (with
        those of the run held before them), then, while it would block on a collective,
        each run's first held op whose own inputs have arrived, the oldest first (holding
        nothing, nothing to run: the op goes at once)."""
        if not self.held:
            return
        deps = issue.deps
        if issue.reads_held:  # (held ops are wgrads of backward runs: a forward op reads none)
            mine, last = [], -1
            for held in self.held:
                if held[1] is run:
                    if held[2].op.name in deps:
                        last = len(mine)
                    mine.append(held)
            for held in mine[:last + 1]:
                self._run(held)
        while self.blocking and _unfinished_inputs(run, issue):  # (the common case: nothing would block)
            firsts = {}  # each run's first held op, oldest first
            for held in self.held:
                firsts.setdefault(id(held[1]), held)
            ready = next((h for h in firsts.values() if not _unfinished_inputs(h[1], h[2])), None)
            if ready is None:
                return
            self._run(ready)

    def flush(self, before_layer: int | None = None) -> None:
        """Run the held ops of layer pairs before ``before_layer`` (all of them: None), which
        include every carried one (layer -1), then call what :meth:`carry` was given."""
        held = self.held
        if held:  # (taken off the list first: running a held op never touches the filler)
            if before_layer is None:
                due, self.held = held, []
            else:
                due = [h for h in held if h[0] < before_layer]
                if due:
                    self.held = [h for h in held if h[0] >= before_layer]
            for _, run, issue in due:
                _run(run, issue, self.recorder)
        if self.carried:
            carried, self.carried = self.carried, []
            for call in carried:
                call()

    def carry(self, then: Callable[[], None] | None = None) -> None:
        """At a block's end: keep the held ops for the next block, as ops of the layer pair
        before its first (run at the latest after that first pair); call ``then`` once they
        have all run (at that static point, whether they ran there or earlier)."""
        self.held = [(-1, run, issue) for _, run, issue in self.held]
        if then is not None:
            self.carried.append(then)

    def _run(self, held) -> None:
        self.held.remove(held)
        _run(held[1], held[2], self.recorder)


def run_pair(fwd_run, bwd_run, issues: Sequence[Issue], recorder: Recorder, label: str,
             barrier: bool, filler: Filler | None = None, layer: int = 0,
             ahead: Callable[[str], object] | None = None) -> None:
    """Run one segment pair: its ops in the order ``issues`` gives (:mod:`.pair_order`),
    every collective asynchronous; then, with ``barrier``, wait for every collective either
    run left in flight. A run may be None when ``issues`` holds none of its ops. With a
    ``filler``, the backward layer's wgrads go to it (``layer``: the layer pair's index)
    and it runs held ones where an op would block. ``ahead(strand)`` gives the strand's next
    layer's run (started) for the ops ``issues`` issues ahead of it (its lead). When tracing,
    each op is an event on the compute lane, recorded when it runs."""
    led = {}  # the next layers' runs, by strand, when this pair issues their leads
    trace = recorder.trace
    # Where no op can block (every collective complete at its issue, or no filler to run
    # held ops in a wait) and nothing is traced, a plain op needs no check: it is called;
    # the pair compiled whole (:mod:`.pair_calls`) runs as this loop would.
    plain = not trace and (filler is None or not filler.blocking)
    code = getattr(issues, "code", None) if plain else None
    with recorder.span(label):
        if code is not None and code(fwd_run, bwd_run, filler, layer, ahead, led):
            issues = ()
        for issue in flat(issues):
            if plain and issue.plain:
                issue.call(fwd_run if issue.forward else bwd_run)
                continue
            if issue.ahead:
                run = led[issue.strand] = ahead(issue.strand)
            else:
                run = fwd_run if issue.forward else bwd_run
            if filler is not None:  # Filler.take and Filler.before, their cheap cases inline
                if issue.wgrad and run.backward_started:
                    filler.held.append((layer, run, issue))
                    continue
                if filler.held and (issue.reads_held or filler.blocking):
                    filler.before(run, issue)
            call = issue.call
            if call is not None and not trace:
                call(run)
            elif trace:
                _run(run, issue, recorder)
            elif issue.forward:
                run.forward_op(issue.op, issue.comm)
            else:
                run.backward_op(issue.op, issue.comm)
        if barrier:
            for layer_run in (fwd_run, bwd_run, *led.values()):
                if layer_run is not None:
                    settle(layer_run)


class LayerChain:
    """One strand of a block: a list of LayerRuns in the order they run, started by
    ``begin()`` (returns the first layer's input or output gradient) and finished by
    ``end(value)`` (takes the last layer's output or input gradient). ``ops`` are the ops of
    each layer run, in DAG order (the forward DAG, or the backward DAG without wgrads for a
    split B)."""

    def __init__(self, runs: list, ops: Sequence[Op], begin: Callable, end: Callable, forward: bool,
                 before: Callable[[int], None] | None = None, done: Callable[[int], None] | None = None,
                 alone: tuple[Issue, ...] | None = None):
        self.runs, self.ops, self.begin, self.end, self.forward = runs, tuple(ops), begin, end, forward
        #: The order of :attr:`ops` when the chain runs alone (:func:`alone_order`), computed
        #: once by whoever makes chains of these ops; None: ordered by :func:`run_alone`.
        self.alone = alone
        #: Called with a layer's position in :attr:`runs` before it starts (the executor
        #: waits there for the layer's weights when their gather runs under the forward).
        self.before = before
        #: Called with a layer's position once all of its ops have run (a backward's wgrads
        #: included), at a point of the block's order that is the same on every rank.
        self.done = done

    def finished(self, positions) -> None:
        """Report the layers at ``positions`` done (see :attr:`done`)."""
        if self.done is not None:
            for position in positions:
                self.done(position)

    def start(self, run, value) -> None:
        """Give ``run`` its input (forward) or its output gradient (backward)."""
        if self.before is not None:
            self.before(self.runs.index(run))
        run.start(value) if self.forward else run.start_backward(value)

    def result(self, run):
        """The layer's output (forward) or its input gradient (backward)."""
        return run.output() if self.forward else run.input_grad()


def alone_order(ops: Sequence[Op], forward: bool) -> tuple[Issue, ...]:
    """The issue order of one layer's ``ops`` (forward or backward) run without a partner
    strand: :func:`~.pair_order.order_pair` of one strand."""
    return order_pair(*((ops, ()) if forward else ((), ops)), InFlight())


def run_alone(chain: LayerChain, recorder: Recorder, label: str) -> None:
    """Run a chain without a partner strand. Each layer's ops go in the order
    :func:`alone_order` gives (the chain's :attr:`~LayerChain.alone` when it has one): every
    collective issued asynchronously as soon as its inputs exist and waited for only by the
    op that reads it, so the strand's own compute that does not depend on it (a backward's
    wgrads) runs beside it — the single-strand overlap the simulator's solo times assume.
    Nothing is left in flight at a layer's end. ``label`` names the layers' spans (only
    built when something records them)."""
    issues = flat(chain.alone if chain.alone is not None else alone_order(chain.ops, chain.forward))
    # The layer's ops compiled whole (:func:`~.pair_calls.compile_alone`), when they were.
    code = getattr(issues, "code", None) if not recorder.trace else None
    value = chain.begin()
    named = recorder.naming
    for k, run in enumerate(chain.runs):
        chain.start(run, value)
        with recorder.span(f"{label}.layer{k}" if named else label):
            step = run.forward_op if chain.forward else run.backward_op
            for issue in () if code is not None and code(run) else issues:
                call = issue.call
                if call is not None:
                    call(run)
                else:
                    step(issue.op, issue.comm)
            settle(run)
        chain.finished((k,))
        recorder.memory()
        value = chain.result(run)
    chain.end(value)


def run_interleaved(fwd: LayerChain, bwd: LayerChain, order: BlockOrder, recorder: Recorder,
                    label: str, filler: Filler | None = None, opened: Callable[[], None] | None = None) -> None:
    """Run an SI block: the chains' ``begin`` parts (embedding, loss gradient), then layer
    pair k = (forward layer k, backward layer k) segment pair by segment pair in ``order``
    (built from the plan over ``fwd.ops`` and ``bwd.ops``; a barrier after each pair when
    ``order.barrier``), the barrier, then the ``end`` parts. A layer without a partner
    (chains of unequal length) runs its side of the plan alone. Without the barrier (one CPU
    thread), the backward's wgrads run where the thread would wait: ``filler`` (the step's,
    holding what earlier blocks carried; a fresh one when None), which carries the last
    layer pair's into the next block. ``opened`` is called once the first layer pair has run
    (what the executor issues there flies beside the rest of the block)."""
    if not isinstance(order, FlatOrder):
        order = FlatOrder(order)
    x, grad = fwd.begin(), bwd.begin()
    if order.barrier:
        filler = None
    elif filler is None:
        filler = Filler(recorder)
    chains = {"F": fwd, "B": bwd}
    started = {"F": set(), "B": set()}  # runs started ahead of their layer pair (their lead issued)
    reported = 0  # the backward layers reported done (their held wgrads run by then)
    named = recorder.naming
    # Whether a compiled segment pair may run without run_pair (:mod:`.pair_calls`): nothing
    # traced or named, no barrier, no op that can block; its issues then are Compiled.
    whole = (not named and not order.barrier and order.calls is not None
             and (filler is None or not filler.blocking))
    for k in range(max(len(fwd.runs), len(bwd.runs))):
        frun = fwd.runs[k] if k < len(fwd.runs) else None
        brun = bwd.runs[k] if k < len(bwd.runs) else None
        if frun is not None and k not in started["F"]:
            fwd.start(frun, x)
        if brun is not None and k not in started["B"]:
            bwd.start(brun, grad)
        current = {"F": frun, "B": brun}

        def ahead(strand, k=k, current=current):
            chain = chains[strand]
            if k + 1 not in started[strand]:
                started[strand].add(k + 1)
                chain.start(chain.runs[k + 1], chain.result(current[strand]))
            return chain.runs[k + 1]

        for index, issues in order.pairs(frun is not None, brun is not None, led=k in started["F"],
                                         lead_next=frun is not None and k + 1 < len(fwd.runs),
                                         back_led=k in started["B"],
                                         back_lead_next=brun is not None and k + 1 < len(bwd.runs)):
            # run_pair's compiled case, called straight away: no span to open, no barrier after.
            code = issues.code if whole else None
            if code is not None and code(frun, brun, filler, k, ahead, {}):
                continue
            run_pair(frun, brun, issues, recorder, f"{label}.layer{k}.pair{index}" if named else label,
                     order.barrier, filler, k, ahead)
        if filler is not None:
            filler.flush(before_layer=k)  # the layer pairs before this one have run whole
        done = min(k + (filler is None), len(bwd.runs))
        bwd.finished(range(reported, done))
        reported = max(reported, done)
        if k == 0 and opened is not None:
            opened()
        if frun is not None:
            x = fwd.result(frun)
        if brun is not None:
            grad = bwd.result(brun)
        recorder.memory()
    if filler is not None:  # the last layer's held wgrads, and its report, go to the next block
        rest = range(reported, len(bwd.runs))
        filler.carry(lambda: bwd.finished(rest))
    fwd.end(x)  # before the barrier: the collectives the end issues (the head's) fly beside it
    for run in fwd.runs + bwd.runs:
        settle(run)
    bwd.end(grad)


def run_scheduled(fwd: LayerChain, bwd: LayerChain, order: Sequence[tuple[str, int, str]], recorder: Recorder,
                  label: str, outputs: tuple[str, str], opened: Callable[[], None] | None = None,
                  calls: LayerCalls | None = None) -> None:
    """Run an SI block in the block scheduler's order (:mod:`dhelix.dsl.planner.blockorder`):
    ``order`` lists every op of both chains as (strand, layer, op name), each after its
    producers, the strands free to drift apart across layers. A layer starts (its input or
    output gradient given, its weights waited for) just before its first op; a backward
    layer is reported done after its last. Every collective is issued asynchronously and
    waited for by the op that reads it; nothing is left in flight at the block's end. There
    is no barrier between ops on CUDA either (the order, not segment pairs, is what the
    model priced). ``outputs`` name the ops producing a layer's output and its input
    gradient; ``opened`` is called once both strands' first layers have run them (their
    openings' collectives have arrived); ``calls``: the ops compiled (None: the runs' methods)."""
    chains = {"F": fwd, "B": bwd}
    by_name = {strand: {op.name: Flat(Issue(strand=strand, op=op), calls) for op in chain.ops}
               for strand, chain in chains.items()}
    value = {"F": fwd.begin(), "B": bwd.begin()}
    left = {(strand, layer): 0 for strand, layer, _ in order}
    for strand, layer, _ in order:
        left[(strand, layer)] += 1
    started: set[tuple[str, int]] = set()
    firsts = {(strand, 0, output) for (strand, chain), output in zip(chains.items(), outputs) if chain.runs}
    with recorder.span(f"{label}.block"):
        for strand, layer, name in order:
            chain, key = chains[strand], (strand, layer)
            run = chain.runs[layer]
            if key not in started:
                started.add(key)
                chain.start(run, value[strand] if layer == 0 else chain.result(chain.runs[layer - 1]))
            _run(run, by_name[strand][name], recorder)
            if (strand, layer, name) in firsts:
                firsts.discard((strand, layer, name))
                if not firsts and opened is not None:
                    opened()
            left[key] -= 1
            if left[key]:
                continue
            if strand == "B":
                chain.finished((layer,))
            recorder.memory()
    fwd.end(chain_result(fwd, value["F"]))
    for run in fwd.runs + bwd.runs:
        settle(run)
    bwd.end(chain_result(bwd, value["B"]))


def chain_result(chain: LayerChain, first):
    """A chain's last layer's result (``first``, its begin's value, when it has no layer)."""
    return chain.result(chain.runs[-1]) if chain.runs else first


def check_orders(orders: dict, fwd_ops: Sequence[Op], bwd_ops: Sequence[Op], counts: set[int]) -> None:
    """Raise ValueError unless ``orders`` (block orders by (forward layers, backward
    layers)) has one for every pair of ``counts`` and each runs every op of its layers once:
    an order made for another program would skip ops or stop a step halfway."""
    for key in ((nf, nb) for nf in counts for nb in counts):
        if key not in orders:
            raise ValueError(f"no block order for {key[0]} forward and {key[1]} backward layers "
                             "(the orders were made for another program)")
        want = sorted([("F", layer, op.name) for layer in range(key[0]) for op in fwd_ops]
                      + [("B", layer, op.name) for layer in range(key[1]) for op in bwd_ops])
        if sorted(tuple(issue) for issue in orders[key]) != want:
            raise ValueError(f"the block order for {key[0]} forward and {key[1]} backward layers does not run "
                             "each of their ops once (it was made for another program)")

