"""The action executor: runs one rank's lowered action list, one training step at a time.

Each stage — a (rank, chunk) slot of the placement — owns the layers of its range; stage 0
also embeds the tokens and the last stage also runs the final norm, the LM head and the
loss. Actions, dispatched by kind through :data:`HANDLERS`:

* ``F`` runs the stage's forward layer chain for one micro-batch and keeps every layer's
  saved tensors until the backward;
* ``B`` runs the backward chain: the whole backward, or, when the schedule splits it, only
  the data-gradient chain (the layers stay alive for the W);
* ``W`` runs every weight-gradient op of the stage's layers for that micro-batch;
* ``SI`` co-executes an F and a B segment pair by segment pair (:mod:`.si`), or runs them
  one after the other when strand interleaving is off;
* ``SEND``/``RECV`` queue point-to-point transfers, posted together before the next
  computation (:mod:`.pipeline_comm`).

Values move between stages through a mailbox keyed like the compiler's transfers (data,
micro-batch, producing stage), whether the next stage is on this rank or a RECV brings it.
The loss is the mean token cross-entropy of the rank's micro-batches, so each head
backward is scaled by ``1 / (microbatches · tokens)`` — the reference's averaging. The head's
backward needs nothing but that scale and its forward, so it runs right after the forward
(its tp reduction left in flight until the micro-batch's backward reads it): the reduction
flies while the rest of that action, and whatever comes before the backward, runs.

Under fold bidir (two model copies, rank r holding stage r of one and p - 1 - r of the other)
each copy's first stage embeds and its last computes the loss, and at the step's end every
rank adds its twin's gradients (pipeline rank p - 1 - r, the other holder of its stages) into
its own before the optimizer takes them (:meth:`Executor._sum_copies`).

A failure in any action raises :class:`ExecutionError` naming the rank, the action in its
text form and the schedule grid with that action marked.

One module, though over 500 lines, because it is one class: the :class:`Executor` and the
handler table its actions dispatch through; what it drives lives beside it (:mod:`.layer_exec`,
:mod:`.si`, :mod:`.pipeline_comm`, :mod:`.recording`).
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch

from dhelix.dsl.core.errors import ScheduleError
from dhelix.dsl.core.program import Program
from dhelix.dsl.core.schedule import Compute, Interleaved, Transfer, format_grid

from dhelix.interpreter.ops.comm import AXES, Communicator, Pending, resolve
from dhelix.interpreter.ops.fsdp import FlatShards
from .layer_calls import LayerCalls
from .layer_exec import GradStore, LayerPlan, LayerRun, count_storages
from .model_ends import EmbedRun, HeadRun
from .sequential import sum_partial_grads
from dhelix.dsl.planner.pair_order import BlockOrder
from .pipeline_comm import PipelineComm, RECV_AHEAD
from dhelix.interpreter.verify.reference import Batch
from dhelix.interpreter.ops.ring_attention import local_micro
from .recording import Recorder, TimedComm, timed
from .si import (Filler, FlatOrder, LayerChain, check_orders, compiled, run_alone, run_interleaved,
                 run_scheduled)
from dhelix.dsl.planner.si_plan import PlanFn, sequential_plan
from dhelix.dsl.simulator.runplan import ExecFacts
from dhelix.interpreter.ops.weights import (EMBEDDING, FINAL_NORM, LM_HEAD, WeightPlan, param_name, tie_grads,
                                             torch_dtype)


class ExecutionError(ScheduleError):
    """An action that failed on a rank: the rank, the action, the cause and the grid."""


@attrs.define
class StageState:
    """One stage on this rank: its layers' weights and gradients (by op name, one dict per
    layer in model order) and the live state of the micro-batches in flight."""

    index: int
    layers: range
    first: bool
    last: bool
    weights: list[dict]
    grads: list[dict] = attrs.field(factory=list)
    runs: dict[int, list[LayerRun]] = attrs.field(factory=dict)
    embeds: dict[int, EmbedRun] = attrs.field(factory=dict)
    heads: dict[int, HeadRun] = attrs.field(factory=dict)
    #: The head's input gradient per micro-batch, computed right after its forward: a
    #: Pending while its tp reduction is in flight.
    head_grads: dict[int, object] = attrs.field(factory=dict)


@attrs.frozen
class StepHooks:
    """What the executor calls during a step, given by its optimizer
    (:meth:`~dhelix.interpreter.training.optim.DistributedAdamW.hooks`): ``param_ready(names)``
    before a forward reads parameters ``names``, ``grad_ready(grads)`` with a layer's final
    gradients (returns the names it takes), ``main_grads()`` when a step starts; None: not
    called."""

    param_ready: Callable[[tuple[str, ...]], None] | None = None
    grad_ready: Callable[[dict[str, torch.Tensor]], set[str]] | None = None
    #: ``main_grads()`` at the start of a step that hands its gradients over: zeroed
    #: gradients to add into, by parameter name (those it names are never allocated anew).
    main_grads: Callable[[], dict[str, torch.Tensor]] | None = None


def action_kind(action) -> str:
    """The dispatch key of a lowered action: F, B, W, SI, SEND or RECV."""
    if isinstance(action, Interleaved):
        return "SI"
    return action.kind


class Executor:
    """Runs the lowered schedule of ``program`` for this rank (``comm.rank``).

    ``seed`` seeds the weights (:class:`~.weights.WeightPlan`); ``si`` turns strand
    interleaving on; ``plan_for(fwd, bwd)`` gives the SI plan of a layer pair (checked once);
    ``pair_barrier`` says whether SI blocks wait for every collective after each segment pair
    (None: on CUDA only, see :mod:`.si`);
    ``use_tags`` says whether point-to-point messages carry tags (gloo) — without tags the
    schedule's transfers must be in matching order on both sides; ``on_action(step, index)``
    is called before each action (a test hook). Weights live in :attr:`params` by parameter
    name; the optimizer updates them in place. ``optimizer``, when given, builds the
    optimizer of those parameters from the executor at the end of its construction (e.g.
    ``functools.partial(for_executor, zero1=True)``, :func:`~.optim.for_executor`): the
    executor keeps it (:attr:`optimizer`) and takes its :class:`StepHooks`. ``param_ready(names)``, when set, is called
    before a forward reads parameters ``names`` (each layer's, the model ends'): ZeRO-1's
    gathers under the forward wait there (:meth:`~.optim.DistributedAdamW.ready`).
    ``grad_ready(grads)``, when set, is given a layer's final gradients of the step (by
    parameter name, partial sums over tp and cp) once the step's last backward of that layer
    has finished (under ZeRO-2 after each backward of it, those it takes then dropped), at a
    point of the action list that is the same on every rank (see
    :meth:`_layer_done`), and returns the names it takes: the data-parallel reduction under
    the backward (:meth:`~.optim.DistributedAdamW.reduce`), which then also sums them over
    tp and cp. ``reference`` is the reference model's DAGs (a run's
    :attr:`~dhelix.dsl.simulator.runplan.RunPlan.reference`; see :class:`~.weights.WeightPlan`).
    ``issue_order`` is the issue orders of ``plan_for``'s pairs the RunPlan computed
    (:meth:`~dhelix.dsl.simulator.runplan.SegmentPairs.issue_order`; None: ordered here).
    ``facts`` is what the executor reads of the program — the B and W actions' ops, selective
    recomputation's drops, ``plan_for``'s pairs checked, the transfers' keys and their
    order between ranks — as the RunPlan derived it in the
    command (:class:`~dhelix.dsl.simulator.runplan.ExecFacts`); None: derived here.
    """

    def __init__(self, program: Program, comm: Communicator, *, seed: int = 0, device="cpu",
                 si: bool = True, plan_for: PlanFn = sequential_plan, use_tags: bool = True,
                 recorder: Recorder | None = None, on_action: Callable | None = None,
                 pair_barrier: bool | None = None, block_orders: dict | None = None,
                 reference: tuple | None = None, init: str | None = None,
                 optimizer: Callable[["Executor"], object] | None = None, issue_order: BlockOrder | None = None,
                 stand_in_weights: bool = False, facts: ExecFacts | None = None):
        self.program, self.lowered = program, program.lowered
        self.device, self.dtype, self.si = torch.device(device), torch_dtype(program), si
        self.recorder = recorder or Recorder()
        #: The memory probe, sampled after every layer (off when the recorder says so).
        self.recorder.probe = self.live_bytes if self.recorder.memory_probe else None
        self.comm = TimedComm(comm, self.recorder)
        self.pp = comm.index("pp")
        self.actions = self.lowered.actions[self.pp]
        #: Each action's dispatch key (:func:`action_kind`), found once.
        self.kinds = tuple(action_kind(action) for action in self.actions)
        # init: a Hugging Face checkpoint folder; stand_in_weights: each shard drawn alone (--as-rank)
        self.weights = WeightPlan(program, seed, reference, hf=init, stand_in=stand_in_weights)
        self.index = {axis: comm.index(axis) for axis in AXES}
        self.layer_plan = LayerPlan.build(program.forward, program.backward, program.train.micro_batch)
        # The RunPlan's facts (derived once, in the command), else derived here from plan_for.
        facts = facts if facts is not None else ExecFacts.of(program, plan_for)
        self.b_ops, self.w_ops = facts.backward_ops, facts.weight_ops
        #: Selective recomputation: the forward ops whose outputs each layer drops until its backward.
        self.selective = facts.selective
        #: Every layer op compiled once into a call (:mod:`.layer_calls`); None when tracing
        #: (the runs' methods name each op's events). Without the memory probe a collective
        #: complete at its issue leaves its result itself, not a Pending.
        self.calls = None if self.recorder.trace else LayerCalls(self.layer_plan, self.comm,
                                                                 bare=self.recorder.probe is None)
        #: The issue orders of a forward and of a backward layer run alone (F, B), made once.
        self.alone = (compiled(facts.alone[0], self.calls, alone=True), compiled(facts.alone[1], self.calls, alone=True))
        #: The RunPlan's facts (what ZeRO-3 and the optimizer read of the program too).
        self.facts = facts
        self.plan = facts.pairs
        barrier = self.device.type == "cuda" if pair_barrier is None else pair_barrier
        #: The block scheduler's orders by (forward layers, backward layers): SI blocks run
        #: whole in that order (:func:`.si.run_scheduled`) instead of pair by pair; None.
        self.block_orders = block_orders
        if block_orders is not None:
            check_orders(block_orders, program.forward.ops, self.b_ops,
                         {len(stage.layers) for stage in program.placement.stages})
        #: The issue orders of the plan's segment pairs: the RunPlan's (``issue_order``,
        #: :meth:`~dhelix.dsl.simulator.runplan.SegmentPairs.issue_order`), else ordered here.
        self.si_order = issue_order if issue_order is not None else BlockOrder.build(
            self.plan, program.forward.ops, self.b_ops, barrier, (program.forward.output, program.backward.output))
        if issue_order is not None and (issue_order.plan != self.plan or issue_order.barrier != barrier):
            raise ValueError("the issue orders given are of another SI plan or pair barrier than this executor's")
        #: :attr:`si_order` with its segment pairs resolved once for the hot path.
        self.si_flat = FlatOrder(self.si_order, self.calls)
        if not use_tags and facts.fifo:
            raise ValueError("this backend matches messages in order, but the schedule's transfers "
                             f"are not in the same order on both sides: {facts.fifo[0]}")
        #: What each SEND and RECV of this rank carries (data, micro-batch, producing stage).
        self.transfer_keys = dict(facts.transfer_keys[self.pp])
        self.p2p = PipelineComm(self.comm, self.lowered, use_tags,
                                lambda pending, transfer: self._timed_recv(pending, transfer))
        #: This rank's RECV actions in order: each is posted :data:`RECV_AHEAD` RECVs before
        #: its turn (:meth:`_post_receives`).
        self.receives = [action for action, kind in zip(self.actions, self.kinds, strict=True) if kind == "RECV"]
        self.params: dict[str, torch.Tensor] = {}
        #: ZeRO-3: which parameters are dp pieces (:mod:`.fsdp`).
        self.flat = FlatShards.of(program, comm, facts.fsdp, facts.shard_axis)
        self.stages = {chunk: self._stage(chunk) for chunk in range(self.lowered.chunks)
                       if self.lowered.stage_of(self.pp, chunk) is not None}
        self.on_action = on_action
        self.steps_run = 0
        self._grads: dict[str, torch.Tensor] = {}
        # What one step keeps while it runs, made fresh by each step (_reset): its batch, the
        # values between stages, the model ends' gradients, ...
        self.batch: Batch | None = None
        self.mailbox: dict[tuple, object] = {}
        self.end_grads: dict[str, torch.Tensor] = {}
        #: ... the deferred collectives (waited for after the next action), how many were
        #: issued and settled so far, and the layers done whose ZeRO-3 pieces wait for the first
        #: ``after`` of them: (after, their gradients), ...
        self.deferred: list[Pending] = []
        self.issued = self.settled = 0
        self.pieces_done: list[tuple[int, Callable[[], dict]]] = []
        #: ... the embedding-gradient gathers not yet issued (see :meth:`_opened`), the embedding
        #: forwards issued ahead of their action by (stage, micro-batch), the action running, ...
        self.postponed: list[Callable[[], Pending]] = []
        self.prefetched: dict[tuple[int, int], Pending] = {}
        self.index_now = 0
        #: ... the receives posted ahead of their RECV, how many RECVs were posted and reached, ...
        self.posted: dict[Transfer, Pending] = {}
        self.receives_posted = self.receives_reached = 0
        #: ... the backwards finished per (stage, layer) and the gradients grad_ready took, ...
        self.done_counts: dict[tuple[int, int], int] = {}
        self.reduced_early: set[str] = set()
        #: ZeRO-2: the parameters whose full gradients were dropped once handed over.
        self.dropped: set[str] = set()
        #: ... the backward wgrads SI blocks hold to run where the thread would wait (one CPU
        #: thread; the last layer pair's carried from one block into the next), and the loss.
        self.filler = Filler(self.recorder, not self.comm.completes_at_issue)
        self.scale = 0.0
        self.loss_sum = torch.zeros((), dtype=self.dtype, device=self.device)
        #: ... and whether this step hands its gradients to ``grad_ready`` (not an evaluation's).
        self.handing = True
        #: The optimizer of :attr:`params` (None: none given), built last: it reads the
        #: executor's parameters and groups; its hooks are the executor's.
        self.optimizer = optimizer(self) if optimizer is not None else None
        hooks = self.optimizer.hooks() if self.optimizer is not None else StepHooks()
        self.param_ready, self.grad_ready, self.main_grads = hooks.param_ready, hooks.grad_ready, hooks.main_grads

    # -- set-up ------------------------------------------------------------------------

    def _stage(self, chunk: int) -> StageState:
        index = self.lowered.stage_of(self.pp, chunk)
        stage = self.program.placement.stages[index]
        if (stage.rank, stage.chunk) != (self.pp, chunk):
            raise ValueError(f"the lowered schedule puts stage {index} on r{self.pp}.{chunk}, "
                             f"the placement on r{stage.rank}.{stage.chunk}")
        weights = []
        for layer in stage.layers:
            shards = self.weights.layer_weights(layer, self.index, self.dtype, self.device)
            if self.flat.enabled:  # ZeRO-3: this rank keeps its dp piece of each
                shards = {op: self.flat.add(param_name(layer, op), w) for op, w in shards.items()}
            self.params.update({param_name(layer, op): w for op, w in shards.items()})
            weights.append(shards)
        state = StageState(index, stage.layers, self.lowered.is_first(index), self.lowered.is_last(index), weights)
        ends = ((EMBEDDING,) if state.first else ()) + ((FINAL_NORM, LM_HEAD) if state.last else ())
        for name in ends:
            self.params[name] = self.weights.shard(name, self.index, self.dtype).to(self.device)
        return state

    def param_groups(self) -> list[tuple[str, ...]]:
        """This rank's parameter names in the groups a forward reads together (the embedding,
        each layer's weights, the final norm with the LM head), in the order the schedule's
        forwards first read them: ZeRO-1's gather buckets under ``param_gather = forward``."""
        chunks = []
        for action in self.actions:
            chunk = action.fwd.chunk if isinstance(action, Interleaved) else \
                action.chunk if action_kind(action) == "F" else None
            if chunk is not None and chunk not in chunks:
                chunks.append(chunk)
        groups = []
        for chunk in chunks:
            stage = self.stages[chunk]
            groups += [(EMBEDDING,)] if stage.first else []
            groups += [tuple(param_name(layer, op) for op in weights)
                       for layer, weights in zip(stage.layers, stage.weights, strict=True)]
            groups += [(FINAL_NORM, LM_HEAD)] if stage.last else []
        return groups

    def partial_sums(self) -> dict[str, tuple[str, ...]]:
        """The axes over which each of this rank's parameters' gradients is a partial sum
        (tp for the weights replicated over sequence-parallel tokens, cp for every one);
        parameters without any are left out."""
        return {name: self.weights.spec(name).grad_sum for name in self.params if self.weights.spec(name).grad_sum}

    def _layer_done(self, stage: StageState, layer: int) -> None:
        """The backward of stage-relative ``layer`` for one micro-batch has finished, wgrads
        included. Called at static points of the action list — a layer's end in a chain run
        alone or with the barrier, the end of the layer pair after its own when the SI block
        holds its wgrads (:class:`~.si.Filler`, which may run them earlier, at a moment that
        differs between ranks), the flush of what a block carried, a W — so that the
        reductions ``grad_ready`` starts are issued in the same order on every rank."""
        if self.grad_ready is None or not self.handing or self.lowered.copies > 1:
            return  # (two model copies: handed over at the step's end, once the copies' sum is taken)
        if self.pieces_done:  # the pieces of the layers done before this one: their last
            # reduce-scatters have had this layer's backward beside them
            self._settle_deferred(max(after for after, _ in self.pieces_done))
        key = (stage.index, layer)
        self.done_counts[key] = self.done_counts.get(key, 0) + 1
        last = self.done_counts[key] >= len(self.lowered.microbatches_of(stage.index))
        if not last and not self.program.train.zero == 2:
            return
        index, grads = stage.layers[layer], stage.grads[layer]

        def final(pieces: bool) -> dict:
            return {param_name(index, op): grads[op] if op in grads else torch.zeros_like(w)
                    for op, w in stage.weights[layer].items() if (param_name(index, op) in self.flat) == pieces}
        taken = self.grad_ready(final(False))
        self.reduced_early |= taken
        if self.program.train.zero == 2:
            # ZeRO-2: this micro-batch's gradients are being reduce-scattered (the optimizer
            # copied them into its flat buffer): the full tensors are dropped, the next
            # micro-batch's backward allocates its own, so no full gradient outlives a layer's
            # backward; the optimizer keeps the reduced 1/dp slices (its gradient parts).
            for op in [op for op in grads if param_name(index, op) in taken]:
                del grads[op]
            self.dropped |= taken
            if not last:
                return
        if self.flat.enabled:
            # ZeRO-3 pieces are summed into their gradients as their reduce-scatters land:
            # handed over once the last of them has, at the next layer done or action's end.
            self.pieces_done.append((self.issued, lambda: final(True)))
        if stage.last and layer == len(stage.layers) - 1 and not self.weights.tied:
            # (A tied LM head's gradient is summed with the embedding's at the step's end first.)
            # Every backward chain here has read its head gradient in this layer, which ran
            # the final norm's backward: the LM head's and the norm's are final too.
            ends = self.grad_ready({name: self.end_grads[name] for name in (FINAL_NORM, LM_HEAD)})
            self.reduced_early |= ends
            if self.program.train.zero == 2:  # ZeRO-2: dropped as the layers' are
                for name in ends:
                    del self.end_grads[name]
                self.dropped |= ends

    def _ready(self, *names: str) -> None:
        if self.param_ready is not None:
            self.param_ready(names)

    def _timed_recv(self, pending: Pending, transfer: Transfer) -> Pending:
        # The receive's name (its action's text form) is read only by a trace: built only then.
        name = str(transfer) if self.recorder.trace else "recv"
        return timed(pending, self.recorder, name, self.comm.lane_of("pp"), "p2p")

    # -- a step ------------------------------------------------------------------------

    def step(self, batch: Batch, hand_over: bool = True) -> torch.Tensor:
        """Run the action list once on ``batch`` (this DP replica's micro-batches, as many as
        the schedule's m). Returns the loss, the same on every rank: the mean token
        cross-entropy over the micro-batches of every DP replica. Gradients are then in
        :meth:`grads` (complete over tp and cp, not yet averaged over dp; but for those
        ``grad_ready`` took, which its reduction completes). ``hand_over`` False gives
        ``grad_ready`` nothing (an evaluation: its gradients are dropped)."""
        if batch.inputs.shape[0] != self.lowered.microbatches:
            raise ValueError(f"the schedule runs {self.lowered.microbatches} micro-batches, "
                             f"the batch has {batch.inputs.shape[0]}")
        self._reset(batch, hand_over)
        with torch.no_grad():
            for index, (action, kind) in enumerate(zip(self.actions, self.kinds, strict=True)):
                self.index_now = index
                if self.on_action is not None:
                    self.on_action(self.steps_run, index)
                try:
                    self._dispatch(action, kind)
                except Exception as exc:
                    raise self._failure(index, action, exc) from exc
            self.filler.flush()
            self._issue_postponed()
            self.p2p.drain()
            self._settle_deferred(self.issued)
            self._finish()
        self.steps_run += 1
        return self._global_loss()

    def _dispatch(self, action, kind: str) -> None:
        if kind == "SEND" or kind == "RECV":
            HANDLERS[kind](self, action)
            return
        self.p2p.flush()
        earlier = self.issued
        with self.recorder.span(str(action) if self.recorder.naming else kind):
            if kind != "SI":  # what an SI block carried or postponed waits only for the next SI block
                self.filler.flush()
                self._issue_postponed()
            HANDLERS[kind](self, action)
            # What earlier actions left in flight has had this whole action beside it.
            self._settle_deferred(earlier)
        self.recorder.memory()

    def _settle_deferred(self, issued: int) -> None:
        # Wait for the deferred collectives among the first ``issued`` of the step (the
        # embedding gradients' gathers, ZeRO-3's reduce-scatters: nothing reads them before
        # the optimizer, so they overlap the action after theirs), then hand over the ZeRO-3
        # pieces of the layers done whose last reduce-scatters are among them.
        if issued <= self.settled and not self.pieces_done:  # (most actions: nothing to do)
            return
        count = max(0, issued - self.settled)
        done, self.deferred = self.deferred[:count], self.deferred[count:]
        for pending in done:
            pending.wait()
        self.settled += count
        ready = [grads for after, grads in self.pieces_done if after <= self.settled]
        self.pieces_done = [(after, grads) for after, grads in self.pieces_done if after > self.settled]
        for grads in ready:
            self.reduced_early |= self.grad_ready(grads())

    def _issue_postponed(self) -> None:
        # Issue the embedding gradients' gathers an SI block's end postponed (see _opened).
        if not self.postponed:
            return
        postponed, self.postponed = self.postponed, []
        for issue in postponed:
            self.deferred.append(issue())
            self.issued += 1

    def _opened(self) -> None:
        """Called by an SI block once its first layer pair has run (the collectives of its
        opening have arrived): issue the embedding gradients' gathers the previous block's end
        postponed, and the next action's embedding forward (its tp reduction left in flight for
        that action's first layer), so that their transfers fly beside this block's compute,
        not in the next block's opening beside the collectives both strands wait for there.
        The same static point on every rank: the collectives' order stays common."""
        self._issue_postponed()
        following = next((a for a in self.actions[self.index_now + 1:] if not isinstance(a, Transfer)), None)
        kind = action_kind(following) if following is not None else None
        action = following.fwd if kind == "SI" else following if kind == "F" else None
        if action is None or not self.stages[action.chunk].first:
            return
        stage, mb = self.stages[action.chunk], action.microbatch
        if (stage.index, mb) not in self.prefetched:
            self.prefetched[(stage.index, mb)] = self._embed(stage, mb)

    def _embed(self, stage: StageState, mb: int):
        # The embedding's forward for micro-batch ``mb``: a Pending of its tp reduction.
        self._ready(EMBEDDING)
        start, sp = self.weights.vocab_start(self.index), self.weights.sequence_parallel
        stage.embeds[mb] = EmbedRun(self.params[EMBEDDING], self.comm, start, sp, self.end_grads)
        return stage.embeds[mb].forward(self._micro(mb)[0], async_op=True)

    def _defer(self, pending: Pending) -> None:
        # A ZeRO-3 gradient reduce-scatter: waited for after the next action, as the
        # embedding's gathers are, or earlier to hand its layer's pieces over (the list is
        # replaced as it is settled).
        self.deferred.append(pending)
        self.issued += 1

    def _reset(self, batch: Batch, hand_over: bool = True) -> None:
        """Start a step on ``batch``: every per-step attribute (declared in ``__init__``) fresh."""
        self.batch, self.handing = batch, hand_over
        main = self.main_grads() if hand_over and self.main_grads is not None else {}
        self.mailbox, self.end_grads = {}, GradStore.seeded(main, (EMBEDDING, FINAL_NORM, LM_HEAD))
        self.deferred, self.issued, self.settled, self.pieces_done = [], 0, 0, []
        self.postponed, self.prefetched, self.index_now = [], {}, 0
        self.posted, self.receives_posted, self.receives_reached = {}, 0, 0
        self._post_receives()
        self.done_counts, self.reduced_early, self.dropped = {}, set(), set()
        self.filler = Filler(self.recorder, not self.comm.completes_at_issue)
        tokens = batch.inputs[0].numel()
        self.scale = 1.0 / (self.lowered.microbatches * tokens)
        self.loss_sum = torch.zeros((), dtype=self.dtype, device=self.device)
        for stage in self.stages.values():
            stage.grads = [GradStore.seeded(main, stage.weights[i], prefix=param_name(layer, ""))
                           for i, layer in enumerate(stage.layers)]
            stage.runs, stage.embeds, stage.heads, stage.head_grads = {}, {}, {}, {}

    def _finish(self) -> None:
        leftovers = [(stage.index, m) for stage in self.stages.values() for m in stage.runs]
        if leftovers or self.mailbox:
            raise ValueError(f"the step ended with live micro-batches {leftovers} and unsent "
                             f"values {sorted(self.mailbox)}")
        grads = self._collect_grads()
        sum_partial_grads(self.weights, {name: g for name, g in grads.items() if name not in self.reduced_early},
                          self.comm)
        if self.lowered.copies > 1:
            self._sum_copies(grads)
        if self.weights.tied:  # both copies take the sum, before the optimizer reduces them over dp
            tie_grads(grads)

    def _sum_copies(self, grads: dict[str, torch.Tensor]) -> None:
        """Fold bidir: add the gradients of the twin pipeline rank p - 1 - r into ``grads`` (in
        place; a parameter without a gradient gets the twin's), so that both copies of every
        stage take the same sum, as a data-parallel pair's. Rank r holds stage r of copy 0 and
        stage p - 1 - r of copy 1, its twin the same stages of the other copies: the same
        parameters, so one fp32 message each way carries them all (fp32 whatever each
        gradient's dtype, so that the two sides' messages agree even where one side has no
        gradient yet; a bf16 value survives the round trip exactly). Both add the same two
        numbers (mine + twin's on one, twin's + mine on the other: equal), so the copies stay
        bit for bit identical through the optimizer's update."""
        twin = self.comm.group_ranks("pp")[self.lowered.ranks - 1 - self.pp]
        if twin == self.comm.rank:
            raise ValueError("fold bidir pairs pipeline rank r with p - 1 - r: p must be even")
        names = sorted(self.params)
        for name in names:
            if name not in grads:
                grads[name] = torch.zeros_like(self.params[name])
        flat = torch.cat([grads[name].reshape(-1).float() for name in names])
        sent = self.comm.send(flat, twin, async_op=True)
        theirs = self.comm.recv(flat.shape, flat.dtype, twin, async_op=True).wait().to(flat.device)
        sent.wait()
        for name, part in zip(names, theirs.split([grads[name].numel() for name in names]), strict=True):
            grads[name].add_(part.view_as(grads[name]).to(grads[name].dtype))

    def _collect_grads(self) -> dict[str, torch.Tensor]:
        grads = dict(self.end_grads)
        for stage in self.stages.values():
            for layer, layer_grads in zip(stage.layers, stage.grads, strict=True):
                grads.update({param_name(layer, op): g for op, g in layer_grads.items()})
        self._grads = grads
        return grads

    def grads(self) -> dict[str, torch.Tensor]:
        """This rank's gradient of every parameter in :attr:`params` after :meth:`step`
        (zeros for a weight no token reached), but for those ZeRO-2 dropped (:attr:`dropped`:
        handed to the optimizer after each backward, which holds their reduced slices)."""
        return {name: self._grads.get(name, torch.zeros_like(p)) for name, p in self.params.items()
                if name not in self.dropped}

    def _global_loss(self) -> torch.Tensor:
        # Only the last stage has a loss; tp ranks hold the same value, cp ranks the losses
        # of their own tokens, so sum over pp and cp and average over dp.
        loss = (self.loss_sum * self.scale).reshape(1).clone()
        self.comm.all_reduce(loss, "pp")
        self.comm.all_reduce(loss, "cp")
        self.comm.all_reduce(loss, "dp")
        return loss[0] / self.comm.size("dp")

    def _failure(self, index: int, action, exc: Exception) -> ExecutionError:
        if isinstance(exc, ExecutionError):
            return exc
        rank = self.comm.rank
        message = (f"rank {rank} (pipeline rank {self.pp}) failed in {action}, step {index} of its "
                   f"list, training step {self.steps_run}: {type(exc).__name__}: {exc}")
        return ExecutionError(message, getattr(action, "span", None),
                              ["the grid shows pipeline ranks (rows) and their actions; the failing "
                               "one is marked >…<"], grid=format_grid(self.lowered, {self.pp: index}))

    # -- chains ------------------------------------------------------------------------

    def _micro(self, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        # With cp > 1 this rank holds only its chunks of each sequence (load-balanced layout).
        ids, targets = local_micro(self.batch, microbatch, self.comm.size("cp"), self.index["cp"])
        return ids.to(self.device), targets.to(self.device)

    def forward_chain(self, action: Compute) -> LayerChain:
        """The forward chain of F ``action``: embedding or received input, the stage's
        layers, then the loss or the mailbox."""
        stage, mb = self.stages[action.chunk], action.microbatch
        if mb in stage.runs:
            raise ValueError(f"micro-batch {mb} already runs forward on stage {stage.index}")
        train = self.program.train
        full = train.recompute == "full"
        # The train block says which layers of the chunk recompute (recompute_layers: its first ones).
        runs = [LayerRun(self.layer_plan, w, self.comm, g, recompute=full and train.recomputes(k), defer=self._defer,
                         selective=self.selective)
                for k, (w, g) in enumerate(zip(stage.weights, stage.grads, strict=True))]
        stage.runs[mb] = runs
        start = self.weights.vocab_start(self.index)
        sp = self.weights.sequence_parallel

        def begin():
            if stage.first:  # its tp reduction stays in flight until layer 0 reads it
                prefetched = self.prefetched.pop((stage.index, mb), None)
                return prefetched if prefetched is not None else self._embed(stage, mb)
            return resolve(self.mailbox.pop(("F", mb, stage.index - 1)))

        def end(x):
            x = resolve(x)
            if runs:  # the value goes on from here, not from the run
                runs[-1].hand_on_output()
            if stage.last:
                self._ready(FINAL_NORM, LM_HEAD)
                head = HeadRun(self.params[FINAL_NORM], self.params[LM_HEAD], self.comm, start, sp, self.end_grads,
                               norm_params=self.weights.norm_params)
                stage.heads[mb] = head
                self.loss_sum += head.forward(x, self._micro(mb)[1])
                stage.head_grads[mb] = head.backward(self.scale, async_op=True)
            else:
                self.mailbox[("F", mb, stage.index)] = x

        before = None
        if self.param_ready is not None:
            names = [tuple(param_name(layer, op) for op in w) for layer, w in zip(stage.layers, stage.weights,
                                                                                  strict=True)]
            before = lambda k: self.param_ready(names[k])  # noqa: E731
        return LayerChain(runs, self.layer_plan.fwd.ops, begin, end, forward=True, before=before, alone=self.alone[0])

    def backward_chain(self, action: Compute) -> LayerChain:
        """The backward chain of B ``action``: loss gradient or received gradient, the
        stage's layers in reverse, then the embedding or the mailbox."""
        stage, mb = self.stages[action.chunk], action.microbatch
        runs = stage.runs[mb] if self.lowered.split else stage.runs.pop(mb)

        def begin():
            if stage.last:  # computed after the forward; its tp reduction in flight until read
                stage.heads.pop(mb)
                return stage.head_grads.pop(mb)
            return resolve(self.mailbox.pop(("B", mb, stage.index + 1)))

        def end(grad):
            if stage.first:  # its gather goes out after the next SI block's opening (_opened)
                embed, grad = stage.embeds.pop(mb), resolve(grad)
                self.postponed.append(lambda: embed.backward(grad, async_op=True))
            else:
                self.mailbox[("B", mb, stage.index)] = grad

        # A split B leaves the wgrads to the W (run_weight reports the layers done).
        done = None if self.lowered.split else (lambda position: self._layer_done(stage, len(runs) - 1 - position))
        return LayerChain(list(reversed(runs)), self.b_ops, begin, end, forward=False, done=done,
                          alone=self.alone[1])

    # -- handlers ----------------------------------------------------------------------

    def run_forward(self, action: Compute) -> None:
        """F: the forward chain alone."""
        run_alone(self.forward_chain(action), self.recorder, self._label(action))

    def run_backward(self, action: Compute) -> None:
        """B: the backward chain alone (without the wgrads when they are split off)."""
        run_alone(self.backward_chain(action), self.recorder, self._label(action))

    def run_weight(self, action: Compute) -> None:
        """W: every weight-gradient op of the stage's layers; frees the micro-batch."""
        stage = self.stages[action.chunk]
        for layer, run in enumerate(stage.runs.pop(action.microbatch)):
            for op in self.w_ops:
                run.backward_op(op)
            self._layer_done(stage, layer)

    def run_si(self, action: Interleaved) -> None:
        """SI: the two chains co-executed by the plan, or one after the other when SI is off."""
        if not self.si:
            self.run_forward(action.fwd)
            self.run_backward(action.bwd)
            return
        fwd, bwd = self.forward_chain(action.fwd), self.backward_chain(action.bwd)
        if self.block_orders is not None:
            order = self.block_orders[(len(fwd.runs), len(bwd.runs))]
            run_scheduled(fwd, bwd, order, self.recorder, self._label(action),
                          (self.program.forward.output, self.program.backward.output), self._opened, self.calls)
            return
        run_interleaved(fwd, bwd, self.si_flat, self.recorder, self._label(action), self.filler, self._opened)

    def _label(self, action) -> str:
        # The action's text form names its spans, built only when something reads them.
        return str(action) if self.recorder.naming else ""

    def run_send(self, action: Transfer) -> None:
        """SEND: queue the value the previous action left in the mailbox."""
        key = self.transfer_keys[action]
        self.p2p.send(resolve(self.mailbox.pop(key)), action, key)

    def run_recv(self, action: Transfer) -> None:
        """RECV: the receive, posted ahead (:meth:`_post_receives`); the consuming action
        finds it in the mailbox."""
        self.receives_reached += 1
        self._post_receives()
        self.mailbox[self.transfer_keys[action]] = self.posted.pop(action)

    def _post_receives(self) -> None:
        """Post the receives of this rank's RECVs up to the one :data:`RECV_AHEAD` past the
        last reached, in order (sent with the next batch of transfers,
        :meth:`PipelineComm.flush`). A point-to-point message crosses only once its receive
        is posted: a receive posted at its RECV, right before the action that reads it, leaves
        the whole transfer in that action's way. Only on a backend with tags (gloo, whose
        transfers run on their own threads): NCCL runs a rank's sends and receives to a peer
        in the order posted, on one stream, so a receive posted ahead of a send its sender
        waits for would hang both; there each receive is posted at its RECV."""
        shape = self.program.forward.input_shape
        ahead = RECV_AHEAD if self.p2p.use_tags else 0
        while self.receives_posted < min(len(self.receives), self.receives_reached + ahead):
            action = self.receives[self.receives_posted]
            self.posted[action] = self.p2p.recv(shape, self.dtype, self.device, action, self.transfer_keys[action])
            self.receives_posted += 1

    # -- memory ------------------------------------------------------------------------

    def live_bytes(self) -> int:
        """Bytes of the activations, saved tensors and gradients alive for micro-batches in
        flight (each storage counted once; weights and weight gradients excluded)."""
        # Sampled after every layer: each run, embedding and head keeps its own count until
        # it changes (a tenth of a step went to walking every tensor in flight each time).
        seen: dict[int, int] = {}
        for stage in self.stages.values():
            for runs in stage.runs.values():
                for run in runs:
                    seen.update(run.storages())
            for end in stage.embeds.values():
                seen.update(end.storages())
            for end in stage.heads.values():
                seen.update(end.storages())
        if self.mailbox:
            count_storages(self.mailbox.values(), seen)
        return sum(seen.values())


#: Action kind → handler(executor, action).
HANDLERS: dict[str, Callable] = {
    "F": Executor.run_forward,
    "B": Executor.run_backward,
    "W": Executor.run_weight,
    "SI": Executor.run_si,
    "SEND": Executor.run_send,
    "RECV": Executor.run_recv,
}
