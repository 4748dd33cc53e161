"""Time the ops of a program's layer, alone and in pairs, on this rank (`dhelix profile`).

The paper's offline profiling (§4.2, Table 2), done on the machine and mesh at hand with the
interpreter's own kernels and communicators:

* **Ops alone.** Every op of the forward and the derived backward layer DAG at the
  program's shard shapes: compute kernels on the compute lane, each collective on its real
  process group (tp, cp, ep …) and so on its lane. A collective is timed synchronously and,
  separately, issued asynchronously and waited for at once (what the SI lanes do; the
  difference is the launch gap). A compute op runs once untimed, then
  :data:`BACK_TO_BACK` times in a row, timed together: warm, as a layer's ops run one after
  the other (timed once after other measurements, a small op on a CPU rank came out 1.3-1.5x
  slower than its run executes it). Every timed collective of the layer (here and in the
  pairs) and of the sweep comes right after an untimed run of itself (the end ops' are timed
  within their op, as they run): it is timed on a busy link, as SI
  keeps its lanes busy (a link that lends credit after idling would otherwise look faster
  than it runs in a block; see :func:`_prime`).
* **Pairs.** Every forward op beside every backward op where one of them communicates
  (compute × comm both ways, comm × comm on one lane or across lanes), co-executed as an SI
  pair runs them: the collectives issued asynchronously first, the compute op on the compute
  lane (the calling thread on CPU, the current stream on CUDA), then the barrier. The compute
  op's own time inside the pair is kept too (its slowdown beside communication).
* **The layer pass.** One whole forward and backward of the layer as a run executes it
  (:meth:`LayerBench.layer_pass`), less its collectives as timed in it (:mod:`.clocked_comm`):
  over its compute ops' times alone, the host's time between ops.
* **The optimizer.** One AdamW step over this rank's weights of one layer, as the run's
  optimizer takes it (gradient copy, the norm for clipping, the update), without the dp
  synchronisation the simulator prices on its own lane: the streaming rate of the update.
* **Link sweep.** all_gathers of 4 KiB to 8 MiB per rank on one group of each lane the
  mesh has, for the link bandwidth and latency; on the same group an all_reduce, a
  reduce_scatter and a send to the next rank at 1 and 8 MiB, for each one's efficiency
  against the all_gather.

Every measurement is repeated (``warmup`` untimed rounds, then ``repeats`` timed ones); each
round runs all measurements in a new shuffled order, so neither a slow moment nor the state the
previous measurement left behind skews one op. Each rank returns its samples;
:func:`dhelix.dsl.planner.calibrate.pool` takes the medians.

Ops run on two :class:`KeptRun` layer states (the forward strand and the backward strand,
as in an SI block) that keep every tensor, so any op can run again on the same inputs.
Every rank runs the same measurements in the same order (collectives must match); before a
measurement with communication the world meets at a barrier so that the peers start
together. On CUDA, times are CUDA events on the compute stream (the waits order it after
the communication streams); on CPU, ``perf_counter``.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Callable, Sequence

import attrs
import torch
import torch.distributed as dist

from dhelix.dsl.core.program import Op, Program

from dhelix.dsl.core.oplib import END_OPS, LAYER_PASS, OPTIMIZER_STEP
from dhelix.dsl.passes.fsdp import is_fsdp, shard_axis

from dhelix.interpreter.ops.comm import AXES, Communicator, Pending
from dhelix.interpreter.ops.fsdp import FlatShards
from dhelix.interpreter.execute.layer_exec import LayerPlan, LayerRun
from dhelix.interpreter.execute.model_ends import EmbedRun, HeadRun
from dhelix.interpreter.ops.weights import EMBEDDING, FINAL_NORM, LM_HEAD, WeightPlan, torch_dtype
from dhelix.interpreter.measure.clocked_comm import ClockedComm

#: Bytes per rank of the link sweep's all_gathers.
SWEEP_BYTES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)
#: The other collectives timed on each swept group, and at which of the sweep's sizes (bytes
#: per rank): their time against the all_gather the link is fitted to is each one's
#: efficiency. A backend need not run them alike: over gloo on the emulated two-node link an
#: all_reduce or a send carried its bytes 1.5 times as fast as an all_gather.
KINDS = ("all_reduce", "reduce_scatter", "p2p")
KIND_BYTES = (1 << 20, 8 << 20)
#: Runs of a compute op per timed sample, back to back after an untimed one (see :func:`_solo`).
BACK_TO_BACK = 4
#: On CPU ranks, runs of a layer collective back to back after its timed one, for the CPU time
#: one costs the process (see :func:`_cpu_per_call`).
CPU_BURST = 8
#: Passes of the whole layer per timed sample, back to back after an untimed one: on the
#: emulated link a single pass's time outside its collectives varied 2x between profiles.
PASSES = 2
#: Elements per row of the sweep's tensors.
SWEEP_WIDTH = 256


class KeptRun(LayerRun):
    """A LayerRun that never releases a tensor: after one whole forward and backward, any
    op can run again on the same inputs (it overwrites its output with an equal one)."""

    def __init__(self, plan: LayerPlan, weights, comm: Communicator):
        super().__init__(plan, weights, comm)
        # Saved tensors are dropped when their count of backward users reaches 0: never.
        self._saved_left = Counter({name: 1 << 60 for name in plan.saved_users})
        self._routing: dict | None = None

    def run_once(self, x: torch.Tensor, grad: torch.Tensor) -> None:
        """Run the whole forward on ``x`` and backward from ``grad``, then keep the MoE
        routing they settled on: a permute run again recomputes the same routing but
        overwrites the per-local-expert counts the dispatch set, so they are put back."""
        self.forward(x)
        self.backward(grad)
        self._routing = dict(self.routing)

    def forward_op(self, op: Op, async_op: bool = False) -> None:
        super().forward_op(op, async_op)
        self._restore_routing()

    def backward_op(self, op: Op, async_op: bool = False) -> None:
        super().backward_op(op, async_op)
        self._restore_routing()

    def _restore_routing(self) -> None:
        if self._routing is not None:
            self.routing.clear()
            self.routing.update(self._routing)

    def _full_grad(self, name: str) -> torch.Tensor:
        return self.full_grads[name]  # kept too: a ZeRO-3 reduce-scatter runs again

    releases = False

    def _release(self, names, left, store, keep) -> None:
        """Keep every tensor (LayerRun drops one when its last reader has run): the profiler
        runs ops again and again on the same inputs."""

    def settle(self, op: Op, forward: bool) -> None:
        """Wait for what ``op`` (a forward op when ``forward``) left in flight."""
        if forward:
            self._act(op.name)
            return
        grads = self.bgrads.get(op.name, {})
        for value, grad in list(grads.items()):
            if isinstance(grad, Pending):
                grads[value] = grad.wait()


class Clock:
    """Marks and intervals: ``perf_counter`` on CPU, CUDA events on the current stream.
    With ``cpu_time``, on CPU the process's CPU time instead (``process_time``, every thread):
    the work of a compute op, which other processes taking turns on the cores do not lengthen
    (the wall time of a burst they preempt does); the same as the wall time on an idle core."""

    def __init__(self, device: torch.device, cpu_time: bool = False):
        self.cuda = device.type == "cuda"
        self._now = time.process_time if cpu_time and not self.cuda else time.perf_counter

    def mark(self):
        """A point in time (on CUDA, an event recorded on the current stream)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self._now()

    def us(self, start, stop) -> float:
        """Microseconds from mark ``start`` to mark ``stop`` (waits for ``stop`` on CUDA)."""
        if self.cuda:
            stop.synchronize()
            return start.elapsed_time(stop) * 1e3
        return (stop - start) * 1e6


class LayerBench:
    """The program's layer on this rank, ready to run any op again: the forward strand's
    ops on one kept state, the backward strand's on another (both run once in full)."""

    def __init__(self, program: Program, comm: Communicator, device: torch.device, seed: int = 0,
                 reference=None):
        self.forward_names = {op.name for op in program.forward.ops}
        dtype = torch_dtype(program)
        plan = LayerPlan.build(program.forward, program.backward, program.train.micro_batch)
        index = {axis: comm.index(axis) for axis in AXES}
        weights = WeightPlan(program, seed, reference).layer_weights(0, index, dtype, device)
        flat = FlatShards.of(program, comm, is_fsdp(program), shard_axis(program))
        if flat.enabled:  # ZeRO-3: the layer keeps dp pieces, gathered by its ops
            weights = {name: flat.add(name, w) for name, w in weights.items()}
        generator = torch.Generator().manual_seed(seed + comm.rank)
        self.runs = (KeptRun(plan, weights, comm), KeptRun(plan, weights, comm))
        shape = program.forward.input_shape
        for run in self.runs:
            run.run_once(*(torch.randn(shape, generator=generator, dtype=dtype).to(device) for _ in range(2)))
        self._plan, self._weights, self._comm = plan, weights, comm
        self._inputs = tuple(torch.randn(shape, generator=generator, dtype=dtype).to(device) for _ in range(2))
        self._grads: dict[str, torch.Tensor] = {}  # the passes' gradients accumulate, as micro-batches' do

    def layer_pass(self, clock: "Clock") -> Callable[[], dict]:
        """The timed forward and backward of the whole layer as a run executes them (a fresh
        :class:`LayerRun` that releases what it no longer needs, collectives synchronous),
        less its collectives as they took in the pass (:class:`ClockedComm`): its time over its
        compute ops' times alone is the host's time between ops (:data:`LAYER_PASS`). One
        untimed pass, then :data:`PASSES` timed back to back, their mean."""
        timed = ClockedComm(self._comm, clock.mark)

        def one() -> None:
            layer = LayerRun(self._plan, self._weights, timed, grads=self._grads)
            x, grad = self._inputs
            layer.forward(x)
            layer.backward(grad)

        def run() -> dict:
            one()  # untimed: warm, as the layer's ops alone are timed (see _solo)
            timed.spans.clear()
            start = clock.mark()
            for _ in range(PASSES):
                one()
            whole = clock.us(start, clock.mark())
            return {"us": (whole - sum(clock.us(*span) for span in timed.spans)) / PASSES}

        return run

    def issue(self, op: Op, async_op: bool) -> None:
        """Run ``op`` on its strand's state; a collective with ``async_op`` stays in flight."""
        if op.name in self.forward_names:
            self.runs[0].forward_op(op, async_op=async_op)
        else:
            self.runs[1].backward_op(op, async_op=async_op)

    def wait(self, op: Op) -> None:
        """Wait for whatever ``op`` left in flight (the cross-strand barrier for one op)."""
        forward = op.name in self.forward_names
        self.runs[0 if forward else 1].settle(op, forward)


class EndsBench:
    """The model's end ops on this rank (:data:`END_OPS`): the vocabulary-parallel embedding
    and the LM head with its cross-entropy, on one micro-batch of random tokens, as the
    executor runs them on the first and the last pipeline stage."""

    def __init__(self, program: Program, comm: Communicator, device: torch.device, seed: int = 0,
                 reference=None):
        plan = WeightPlan(program, seed, reference)
        index = {axis: comm.index(axis) for axis in AXES}
        dtype = torch_dtype(program)
        self.comm, self.start, self.sp = comm, plan.vocab_start(index), plan.sequence_parallel
        self.embedding, self.norm, self.head = (plan.shard(name, index, dtype).to(device)
                                                for name in (EMBEDDING, FINAL_NORM, LM_HEAD))
        generator = torch.Generator().manual_seed(seed + 1 + comm.rank)
        tokens, vocab = dict(program.env)["tokens"], program.model.get("vocab")
        self.ids, self.targets = (torch.randint(vocab, (tokens,), generator=generator).to(device) for _ in range(2))
        self.x = torch.randn(program.forward.input_shape, generator=generator, dtype=dtype).to(device)

    def runner(self, name: str, clock: "Clock") -> Callable[[], dict]:
        """The timed run of end op ``name``; a backward first runs its forward, untimed."""
        backward = name.endswith(".bwd")

        def run() -> dict:
            if name.startswith("embedding"):
                piece = EmbedRun(self.embedding, self.comm, self.start, self.sp, {})
                if backward:
                    piece.forward(self.ids)
                start = clock.mark()
                piece.backward(self.x) if backward else piece.forward(self.ids)
            else:
                piece = HeadRun(self.norm, self.head, self.comm, self.start, self.sp, {})
                if backward:
                    piece.forward(self.x, self.targets)
                start = clock.mark()
                piece.backward(1.0) if backward else piece.forward(self.x, self.targets)
            return {"us": clock.us(start, clock.mark())}

        return run


class OptimizerBench:
    """One AdamW step of the run's optimizer (:class:`~.optim.DistributedAdamW`, clipping on)
    over a copy of this rank's weights of one layer and random gradients, on a one-rank
    communicator: the dp synchronisation is not part of it (the simulator prices it apart)."""

    def __init__(self, program: Program, comm: Communicator, device: torch.device, seed: int = 0,
                 reference=None):
        from dhelix.interpreter.ops.comm import SingleRankComm
        from dhelix.interpreter.training.optim import AdamWConfig, DistributedAdamW

        index = {axis: comm.index(axis) for axis in AXES}
        params = WeightPlan(program, seed, reference).layer_weights(0, index, torch_dtype(program), device)
        generator = torch.Generator().manual_seed(seed + 2 + comm.rank)
        self.grads = {name: torch.randn(w.shape, generator=generator, dtype=w.dtype).to(device)
                      for name, w in params.items()}
        self.optimizer = DistributedAdamW(params, SingleRankComm(), config=AdamWConfig(clip=1.0),
                                          weights={name: 1.0 for name in params})

    def runner(self, clock: "Clock") -> Callable[[], dict]:
        """The timed step (its norm is a world all-reduce, as in the run: every rank takes it)."""
        def run() -> dict:
            start = clock.mark()
            self.optimizer.step(self.grads, lr=1e-6)
            return {"us": clock.us(start, clock.mark())}

        return run


@attrs.frozen
class Measurement:
    """One thing to time: ``kind`` (ops, issued, pairs, sweep, kinds), the key its samples go
    under, whether the world meets first, and ``run() -> {kind: µs}``."""

    kind: str
    key: object
    meet: bool
    run: Callable[[], dict]


def measurements(program: Program, bench: LayerBench, comm: Communicator, clock: Clock,
                 device: torch.device, ends: EndsBench | None = None,
                 optimizer: OptimizerBench | None = None) -> list[Measurement]:
    """Everything to time on this rank, in the order every rank times it (the model's end
    ops too when ``ends`` is given, the optimizer step when ``optimizer`` is). The layer's
    compute ops and its pass outside its collectives are timed in CPU time on CPU ranks that
    compute on one thread (:class:`Clock`): their work, as the simulator prices each rank on a
    core of its own. A rank computing on several threads is timed by the wall clock: its CPU
    time adds up the threads, each op's several times over."""
    fwd, bwd = program.forward.ops, program.backward.ops
    work = Clock(device, cpu_time=torch.get_num_threads() == 1)
    items = [Measurement("ops", op.name, op.kind == "comm", _solo(bench, clock if op.kind == "comm" else work, op, False))
             for op in fwd + bwd]
    items.append(Measurement("ops", LAYER_PASS, any(op.kind == "comm" for op in fwd + bwd), bench.layer_pass(work)))
    if ends is not None:
        items += [Measurement("ops", name, True, ends.runner(name, clock)) for name in END_OPS]
    if optimizer is not None:
        items.append(Measurement("ops", OPTIMIZER_STEP, True, optimizer.runner(clock)))
    items += [Measurement("issued", op.name, True, _solo(bench, clock, op, True))
              for op in fwd + bwd if op.kind == "comm"]
    items += [Measurement("pairs", (f.name, b.name), True, _pair(bench, clock, f, b))
              for f, b in pairs_to_time(fwd, bwd)]
    dtype = torch_dtype(program)
    for lane, axis in sweep_axes(program):
        group = comm.size(axis)
        for size in SWEEP_BYTES:
            rows = max(1, size // (SWEEP_WIDTH * dtype.itemsize))
            x = torch.randn(rows, SWEEP_WIDTH, dtype=dtype).to(device)
            key = (lane, axis, group, float(x.numel() * x.element_size() * group))
            items.append(Measurement("sweep", key, True, _gather(comm, clock, x, axis)))
        for size in KIND_BYTES:
            for kind in KINDS:
                x = _sweep_tensor(size, group, dtype, device)
                key = (lane, axis, group, float(x.numel() * x.element_size()), kind)
                items.append(Measurement("kinds", key, True, _collective(comm, clock, x, axis, kind)))
    return items


def _sweep_tensor(size: int, group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """About ``size`` bytes of zeros, rows :data:`SWEEP_WIDTH` wide, whole blocks for a
    reduce-scatter over ``group`` ranks (zeros: the repeated all_reduces sum into it)."""
    rows = max(group, size // (SWEEP_WIDTH * dtype.itemsize) // group * group)
    return torch.zeros(rows, SWEEP_WIDTH, dtype=dtype, device=device)


def pairs_to_time(fwd: Sequence[Op], bwd: Sequence[Op]) -> list[tuple[Op, Op]]:
    """The (forward op, backward op) pairs worth timing: those where one side communicates
    (compute × compute never overlaps: one compute lane)."""
    return [(f, b) for f in fwd for b in bwd if "comm" in (f.kind, b.kind)]


def sweep_axes(program: Program) -> list[tuple[str, str]]:
    """(lane, axis) of the group each lane's sweep runs on: the first axis on that lane that
    the layer communicates over, else the first mesh axis larger than 1 on it."""
    mesh, found = program.mesh, {}
    layer_axes = [(op.lane, op.axis) for op in program.forward.ops if op.kind == "comm" and op.axis]
    mesh_axes = [(mesh.lane(axis), axis) for axis in AXES if axis != "ep" and mesh.size(axis) > 1]
    for lane, axis in layer_axes + mesh_axes:
        found.setdefault(lane, axis)
    return [(lane, found[lane]) for lane in ("local", "cross") if lane in found]


def _prime(bench: LayerBench, op: Op) -> None:
    """Run collective ``op`` once, untimed, just before its timed run: the timed one then
    starts on a busy link, as a collective does in an SI block, whose lane is rarely idle. A
    link that lends credit after idling (a token bucket, as ``tc tbf``'s burst; some NIC and
    switch buffers) runs a collective after a pause faster than one behind another; timed
    after a pause, the 1 MiB all_gathers of the two-node benchmark came out 24 % faster than
    back to back. On a link without such credit the two are equal."""
    bench.issue(op, False)
    bench.wait(op)


def _solo(bench: LayerBench, clock: Clock, op: Op, async_op: bool) -> Callable[[], dict]:
    if op.kind != "comm":
        def compute() -> dict:
            bench.issue(op, False)  # untimed: its inputs and weights in the caches
            start = clock.mark()
            for _ in range(BACK_TO_BACK):
                bench.issue(op, False)
            return {"us": clock.us(start, clock.mark()) / BACK_TO_BACK}

        return compute

    def run() -> dict:
        _prime(bench, op)
        start = clock.mark()
        bench.issue(op, async_op)
        bench.wait(op)
        out = {"us": clock.us(start, clock.mark())}
        if not clock.cuda and not async_op:
            out["cpu"] = _cpu_per_call(bench, op)
        return out

    return run


def _cpu_per_call(bench: LayerBench, op: Op) -> float:
    """The CPU µs of this process (every thread: the collective backend's too) per run of
    collective ``op``, over :data:`CPU_BURST` runs back to back: on a CPU host, the work a
    collective gives the cores (copies through the sockets, reductions, waking threads), which
    waiting for a core does not change (its wall time it does). Back to back, so that work the
    backend does after a collective returns is counted too."""
    cpu = time.process_time()
    for _ in range(CPU_BURST):
        bench.issue(op, False)
        bench.wait(op)
    return 1e6 * (time.process_time() - cpu) / CPU_BURST


def _pair(bench: LayerBench, clock: Clock, f: Op, b: Op) -> Callable[[], dict]:
    # Collectives first, so that they run while the compute op does (an SI pair's lanes).
    ordered = sorted((f, b), key=lambda op: op.kind != "comm")

    def run() -> dict:
        for op in ordered:
            if op.kind == "comm":
                _prime(bench, op)
        start = clock.mark()
        stretched = None
        for op in ordered:
            if op.kind == "comm":
                bench.issue(op, True)
            else:
                began = clock.mark()
                bench.issue(op, False)
                stretched = (began, clock.mark())
        for op in ordered:
            bench.wait(op)
        stop = clock.mark()
        out = {"us": clock.us(start, stop)}
        if stretched is not None:
            out["stretched"] = clock.us(*stretched)
        return out

    return run


def _gather(comm: Communicator, clock: Clock, x: torch.Tensor, axis: str) -> Callable[[], dict]:
    def run() -> dict:
        comm.all_gather(x, axis)  # untimed: the timed one starts on a busy link (see _prime)
        start = clock.mark()
        comm.all_gather(x, axis)
        return {"us": clock.us(start, clock.mark())}

    return run


def _collective(comm: Communicator, clock: Clock, x: torch.Tensor, axis: str, kind: str) -> Callable[[], dict]:
    """Collective ``kind`` of ``x`` over ``axis``, timed right after an untimed run of itself:
    an all_reduce (``x`` the whole tensor S), a reduce_scatter (S the input), or ``p2p``: the
    group's ranks in pairs, the first of each sending ``x`` to the second (one way, as a
    pipeline stage sends its activations on; an odd group's last rank idles)."""
    if kind == "p2p":
        index, size = comm.index(axis), comm.size(axis)
        transfers = ([("send", x, comm.peer(axis, 1), 0)] if index % 2 == 0 and index + 1 < size
                     else [("recv", torch.empty_like(x), comm.peer(axis, -1), 0)] if index % 2 else [])

        def once() -> None:
            for work in comm.post_p2p(transfers) if transfers else ():
                if work is not None:
                    work.wait()
    else:
        issue = getattr(comm, kind)  # all_reduce or reduce_scatter

        def once() -> None:
            issue(x, axis)

    def run() -> dict:
        once()  # untimed: the timed one starts on a busy link (see _prime)
        start = clock.mark()
        once()
        return {"us": clock.us(start, clock.mark())}

    return run


def measure(items: Sequence[Measurement], repeats: int, warmup: int, meet: Callable[[], None],
            tick: Callable[[], None] = lambda: None) -> dict[str, dict]:
    """Run every measurement ``warmup + repeats`` times, round by round; returns this rank's
    samples ``{kind: {key: [µs, …]}}`` (pair compute times under ``stretched``; on CPU, a
    layer collective's CPU µs per run under ``cpu``: :func:`_cpu_per_call`). ``meet`` is
    the world barrier before a measurement that communicates; ``tick`` advances a progress bar."""
    samples: dict[str, dict] = {kind: {} for kind in ("ops", "issued", "pairs", "stretched", "sweep", "kinds", "cpu")}
    for round_ in range(warmup + repeats):
        # A new order each round, the same on every rank (collectives must match): what the
        # previous measurement left behind (idle communication threads, cold caches) then
        # varies instead of always favouring or penalising the same measurements.
        order = list(items)
        random.Random(round_).shuffle(order)
        for item in order:
            if item.meet:
                meet()
            result = item.run()
            if round_ >= warmup:
                samples[item.kind].setdefault(item.key, []).append(result["us"])
                if "stretched" in result:
                    samples["stretched"].setdefault(item.key, []).append(result["stretched"])
                if "cpu" in result:
                    samples["cpu"].setdefault(item.key, []).append(result["cpu"])
            tick()
    return samples


def barrier(device: torch.device) -> Callable[[], None]:
    """The world barrier on ``device``'s backend."""
    if device.type == "cuda":
        return lambda: dist.barrier(device_ids=[device.index])
    return dist.barrier
