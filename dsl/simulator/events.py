"""The step simulator: a discrete-event run of one training step over every pipeline rank.

One representative DP/TP replica is simulated: every TP rank of a pipeline rank runs the same
operators on equal shards, and every DP replica runs the same timeline, so p pipeline ranks
stand for the whole cluster. Each rank has three lanes (compute, local, cross) and runs its
lowered action list in order:

* **F / B / W** cost the sum over the stage's layers of the single-strand layer times
  (:mod:`dsl.simulator.costs`; B without a split is dgrad + wgrad, with a split B is all but the
  wgrads and W the wgrads), plus the embedding on the first stage and the LM head on the last.
* **SI(F, B)** costs the plan's ``total`` per layer pair. Its forward and backward chunks
  usually hold the same number of layers n, so the block is n pairs; otherwise the first
  min(n_f, n_b) layers pair up and the excess runs alone after them. The embedding and LM-head
  work of the two stages runs alone, before the pairs (the B stage's LM head backward, the F
  stage's embedding) or after them. With ``si=False`` the block runs its F, then its B.
* **SEND** occupies the sender's pp lane (in program order) from when the producing action
  has finished; the matching **RECV** completes when the transfer arrives, and the action
  after it waits for that. Sends are eager, so the order of :func:`validate.dry_run` settles
  every time in one pass.
* **DP gradient sync**: every layer's gradients form a bucket that is ready when the stage's
  last backward pass (B, or W when split) has finished that layer, the LM head's with the final
  norm's when its last backward has (``train { grad_reduce = backward }``, the default; with
  ``step``, and for the embedding always, when the rank's last action has finished: what the
  interpreter does); buckets reduce-scatter (ZeRO-1) or all-reduce over the gradient
  group's lane in ready order, fitting into the lane's idle gaps between pipeline sends. Then the
  gradient norm is all-reduced over the world, which no rank leaves before the last rank's gradients
  are averaged, then the optimizer runs on the compute lane (with ``train { optimizer_check = post }``
  it copies its states and runs at once, the norm in flight, :mod:`.optimizer_check`), and with
  ZeRO-1 the updated weights are all-gathered once both have ended. Nothing of
  the next step overlaps these, except with ``train { param_gather = forward }``: then one
  all-gather per layer and model end (Megatron's ``--overlap-param-gather``, Centauri's
  model level) is booked at the start of the step, on the group's lane (the pipeline's sends
  there queue behind them) in the order the rank's actions first run those forwards, and
  each layer's first forward waits for its own (the steady state: the previous step's
  optimizer issued them as it ended).

Memory follows :mod:`dsl.simulator.memory` at layer granularity. Reported per rank: busy time, layer /
pipeline / data-parallel communication with the part exposed, model states and the peak of
live activations; per step: time, tokens/s, TFLOPS/GPU and MFU (Megatron's FLOP count), and
the bubble ratio ``1 - Σ busy / (p · pipeline make-span)``.

One module, though over 500 lines, because it is one thing: the discrete-event run of one step
over every rank and the figures it tallies (what each piece costs is :mod:`dsl.simulator.costs`;
the result, :mod:`dsl.simulator.simulation`).
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
from typing import Callable

import attrs

from dhelix.dsl.planner.costmodel import collective_time, megatron_flops_per_iteration
from dhelix.dsl.passes.fsdp import is_fsdp, replicas_substituted
from dhelix.dsl.simulator.memory import HOST_STATE_BYTES, MemoryTimeline, ModelStates, model_states
from dhelix.dsl.simulator.optimizer_check import copy_seconds, norm_sync_seconds, post_validated
from dhelix.dsl.planner.paircost import PairCost
from dhelix.dsl.core.plan import Plan
from dhelix.dsl.core.program import Program
from dhelix.dsl.core.schedule import Action, Interleaved, Transfer
from dhelix.dsl.simulator.costs import (NOTHING, Group, StepCosts, cost_of, gradient_syncs, offloads,
                                        optimizer_seconds, step_costs)
from dhelix.dsl.simulator.host_cores import cores_bound
from dhelix.dsl.simulator.host_memory import host_refusal
from dhelix.dsl.simulator.lane import Lane
from dhelix.dsl.simulator.pairtrace import pair_events
from dhelix.dsl.simulator.pieces import Expander, Piece
# The SI pairs' plans and the result types are imported from here by the commands and tools.
from dhelix.dsl.simulator.si_pairs import (block_orders, block_scheduler, has_si, interleaves,  # noqa: F401
                                           planned_pairs, require_profile, schedule_plan)
from dhelix.dsl.simulator.simulation import RankStats, Simulation
from dhelix.dsl.core.timeline import CounterSample, TraceEvent
from dhelix.dsl.passes.validate import dry_run, transfer_key



#: The run orders of the schedules simulated last, by id (each kept with its schedule, so
#: that an id is not reused while it is here): a search simulates each many times.
_ORDERS: collections.OrderedDict[int, tuple] = collections.OrderedDict()
_ORDERS_KEPT = 256


def _run_order(lowered) -> list[tuple[int, Action, bool, tuple | None]]:
    """(rank, action, whether it is a transfer, its transfer key) of every action of
    ``lowered`` in its dry run's order (:func:`~dhelix.dsl.passes.validate.dry_run`)."""
    found = _ORDERS.get(id(lowered))
    if found is not None and found[0] is lowered:
        _ORDERS.move_to_end(id(lowered))
        return found[1]
    order = []
    for rank, step in dry_run(lowered):
        action = lowered.actions[rank][step]
        transfer = isinstance(action, Transfer)
        order.append((rank, action, transfer, transfer_key(lowered, rank, action) if transfer else None))
    _ORDERS[id(lowered)] = (lowered, order)
    if len(_ORDERS) > _ORDERS_KEPT:
        _ORDERS.popitem(last=False)
    return order


@attrs.define
class _Tally:
    """What one rank has added up so far in the step (seconds, bytes)."""

    busy: float = 0.0
    layer_comm: float = 0.0
    layer_exposed: float = 0.0
    pp_comm: float = 0.0
    pp_exposed: float = 0.0
    sends: int = 0
    send_bytes: float = 0.0


@attrs.frozen(kw_only=True)
class _Finish:
    """The end of one rank's step: gradient sync, optimizer, weight gather."""

    end: float
    dp_comm: float
    dp_exposed: float
    optimizer: float
    states: ModelStates


class _Run:
    """The state of one simulation while it steps through the ranks' actions."""

    def __init__(self, program: Program, costs: StepCosts, si: bool, zero1: bool, trace: bool = True,
                 detail: Plan | None = None, post: bool = False):
        self.program, self.costs, self.zero1, self.trace = program, costs, zero1, trace
        #: Post-validation: the optimizer does not wait for the gradient norm's all-reduce.
        self.post = post
        self.norm_seconds = norm_sync_seconds(program)
        #: Per rank, when its gradients are averaged and the seconds of its gradient syncs
        #: (:meth:`_synced`, once per rank: it books the lanes).
        self._sync_done: dict[int, tuple[float, float]] = {}
        #: The plan whose segment pairs the trace draws inside SI blocks (None: not drawn).
        self.detail = detail
        #: ZeRO-3: the layers' gradients are reduce-scattered inside the layer DAGs (their
        #: cost is in the layer pieces), only the model's ends sync after the pipeline.
        self.fsdp = is_fsdp(program)
        assert program.lowered is not None, "a validated model"
        self.lowered = program.lowered
        p = self.lowered.ranks
        self.expander = Expander(program, costs, si)
        self.free_at = [0.0] * p  # when each compute lane is next free
        self.lanes = [{"local": Lane(), "cross": Lane()} for _ in range(p)]
        self.last_end = [0.0] * p  # end of the rank's latest compute action
        self.pending: list[list] = [[] for _ in range(p)]  # transfers the next action waits for
        self.arrivals: dict = {}  # transfer key -> (arrival, produced)
        self.grads: list[dict] = [{} for _ in range(p)]  # (stage, slot) -> (ready, dense, expert)
        #: (stage, slot) -> when each of its backwards finished (ZeRO-2 reduces after each).
        self.micro_ready: list[dict] = [{} for _ in range(p)]
        self.memory = [MemoryTimeline() for _ in range(p)]
        self.tally = [_Tally() for _ in range(p)]
        self.events: list[TraceEvent] = []
        #: ZeRO-1's weight all-gather under the next forward: per rank, chunk -> {weights
        #: (Piece.weights) -> when they have arrived} (popped by the chunk's first forward),
        #: and the seconds spent gathering and waited for.
        self.overlap_gather = zero1 and program.train is not None and program.train.param_gather == "forward"
        #: Hybrid sharding's replica all-reduce substituted (reduce-scatter, then all-gather).
        self.replicas_sliced = replicas_substituted(program)
        self.gathered: list[dict[int, dict]] = [{} for _ in range(p)]
        self.gather_comm, self.gather_exposed = [0.0] * p, [0.0] * p
        #: (slot, dense, expert) -> seconds of its gradient syncs (:meth:`_reduction_seconds`).
        self._sync_seconds: dict[tuple, float] = {}

    def run(self) -> None:
        """Step every action in an order where each RECV follows its SEND."""
        if self.overlap_gather:
            for rank in range(self.lowered.ranks):
                self._book_gathers(rank)
        for rank, action, _, key in _run_order(self.lowered):
            if isinstance(action, Transfer):
                self._transfer(rank, action, key)
            else:
                self._compute(rank, action)

    def _transfer(self, rank: int, action: Transfer, key: tuple | None) -> None:
        if action.kind == "RECV":
            self.pending[rank].append(key)
            return
        seconds, lane = self.costs.p2p_seconds, self.costs.pp_lane
        start = self.lanes[rank][lane].in_order(self.last_end[rank], seconds)
        self.arrivals[key] = (start + seconds, self.last_end[rank])
        tally = self.tally[rank]
        tally.pp_comm += seconds
        tally.sends += 1
        tally.send_bytes += self.costs.p2p_bytes
        if self.trace:
            self.events.append(TraceEvent(rank, lane, str(action), start, seconds, {
                "kind": "SEND", "data": action.data, "microbatch": action.microbatch, "chunk": action.chunk,
                "peer": action.peer, "bytes": self.costs.p2p_bytes}))

    def _book_gathers(self, rank: int) -> None:
        """The all-gathers of ``rank``'s updated weights from the start of the step
        (``param_gather = forward``): one per layer (and per model end), chunk by chunk in
        the order the rank first runs their forwards, as Megatron's per-bucket gathers."""
        costs, profile, params = self.costs, self.program.profile, self.costs.params
        first_use = []
        for action in self.lowered.actions[rank]:
            chunk = _forward_chunk(action)
            if chunk is not None and chunk not in first_use:
                first_use.append(chunk)
        for chunk in first_use:
            index = self.lowered.stage_of(rank, chunk)
            assert index is not None, "a validated schedule runs forwards on its placement's slots"
            layers = len(self.program.placement.stages[index].layers)
            slots = ([("embedding", params.embedding, 0.0)] if self.lowered.is_first(index) else []) + \
                [(i, params.layer_dense, params.layer_expert) for i in range(layers)] + \
                ([("head", params.head, 0.0)] if self.lowered.is_last(index) else [])
            arrivals = {}
            for slot, dense, expert in slots:
                ready = 0.0
                for elements, group in ((dense, costs.dense_group), (expert, costs.expert_group)):
                    if elements and group.size > 1:
                        size = elements * costs.weight_bytes
                        seconds = collective_time("all_gather", size, group.size, group.lane, profile, group.per_node)
                        begin = self.lanes[rank][group.lane].in_order(0.0, seconds)
                        ready = max(ready, begin + seconds)
                        self.gather_comm[rank] += seconds
                        what = f"layer {self.program.placement.stages[index].first_layer + slot}" \
                            if isinstance(slot, int) else slot
                        self.events.append(TraceEvent(rank, group.lane, f"all_gather weights {what}", begin, seconds,
                                                      {"kind": "DP", "bytes": size, "group": group.size,
                                                       "overlapped": "next forward"}))
                arrivals[slot] = ready
            self.gathered[rank][chunk] = arrivals

    def _compute(self, rank: int, action) -> None:
        free = self.free_at[rank]
        start = free
        # A chunk's first forward waits for each layer's weights (param_gather = forward).
        chunk = _forward_chunk(action)
        gates, waited = (self.gathered[rank].pop(chunk, {}) if chunk is not None else {}), 0.0
        if self.pending[rank]:
            arrived = [self.arrivals[key] for key in self.pending[rank]]
            ready = max(start, max(a for a, _ in arrived))
            produced = max(p for _, p in arrived)
            # Only the wait past the data's production is the transfer's fault; waiting for the
            # producer itself is pipeline bubble.
            self.tally[rank].pp_exposed += max(0.0, ready - max(start, produced))
            start = ready
            self.pending[rank] = []
        kind, fstage, bstage = self._stages(rank, action)
        now = start
        tally, memory, grads = self.tally[rank], self.memory[rank], self.grads[rank]
        comm = exposed = 0.0
        pieces = self.expander.pieces(kind, fstage, bstage)
        if not gates and not (self.detail is not None and self.trace):
            now, comm, exposed = self._pieces_run(rank, pieces, now, bstage)
            pieces = ()  # (run: the loop below, for gates and pair events, has none left)
        for layer, piece in enumerate(pieces):
            if piece.weights in gates:
                arrived = gates.pop(piece.weights)
                waited += max(0.0, arrived - now)
                now = max(now, arrived)
            memory.change(now, piece.alloc)
            if self.detail is not None and self.trace and piece.paired:
                # The plan's pairs end the piece (a full recomputation runs before them).
                seconds = min(self.detail.total, piece.work.seconds)
                self.events += pair_events(rank, self.detail, now + piece.work.seconds - seconds, seconds, layer)
            now += piece.work.seconds
            memory.change(now, -piece.free)
            comm, exposed = comm + piece.work.comm, exposed + piece.work.exposed
            if piece.grads is not None:
                slot, dense, expert = piece.grads
                grads[(bstage, slot)] = (now, dense, expert)
                self.micro_ready[rank].setdefault((bstage, slot), []).append(now)
        tally.layer_comm += comm
        tally.layer_exposed += exposed
        tally.busy += now - start - waited
        self.gather_exposed[rank] += waited
        self.free_at[rank] = self.last_end[rank] = now
        if self.trace:
            args = _action_args(action, kind, fstage, bstage)
            if self.detail is not None and comm > 0:
                args |= {"layer_comm_s": comm, "layer_comm_exposed_s": exposed}
            self.events.append(TraceEvent(rank, "compute", str(action), start, now - start, args))

    def _pieces_run(self, rank: int, pieces, now: float, bstage) -> tuple[float, float, float]:
        """The loop of :meth:`_compute` over ``pieces`` from ``now`` where no weights gate
        them and no pair events are drawn: the same steps in the same order, with what each
        reads looked up once. (end, layer communication, its exposed part)."""
        steps = self.memory[rank].steps  # MemoryTimeline.change's appends, a piece's zero changes left out alike
        grads, micro_ready = self.grads[rank], self.micro_ready[rank]
        comm = exposed = 0.0
        for piece in pieces:
            if piece.alloc:
                steps.append((now, piece.alloc))
            work = piece.work
            now += work.seconds
            if piece.free:
                steps.append((now, -piece.free))
            comm += work.comm
            exposed += work.exposed
            if piece.grads is not None:
                slot, dense, expert = piece.grads
                grads[(bstage, slot)] = (now, dense, expert)
                micro_ready.setdefault((bstage, slot), []).append(now)
        return now, comm, exposed

    def _stages(self, rank: int, action):
        return self.lowered.stages_run(rank, action)

    # ------------------------------------------------------------ after the pipeline

    def finish(self, rank: int) -> _Finish:
        """Gradient sync, norm, optimizer and (ZeRO-1) weight gather of ``rank``; its figures."""
        ready, dp_comm = self._synced(rank)
        # The norm is known once every rank has joined its all-reduce (every rank's gradients averaged).
        known = max(self._synced(r)[0] for r in range(self.lowered.ranks)) + self.norm_seconds
        if self.trace and self.norm_seconds:
            lane = "cross" if self.program.mesh is not None and self.program.mesh.world > \
                self.program.mesh.gpus_per_node else "local"
            self.events.append(TraceEvent(rank, lane, "all_reduce grad norm", known - self.norm_seconds,
                                          self.norm_seconds, {"kind": "norm", "bytes": 8}))
        shard, optimizer = self._optimizer(rank)
        copy = copy_seconds(shard, self.program) if self.post else 0.0
        start = ready if self.post else max(ready, known)
        if copy:
            self.events.append(TraceEvent(rank, "compute", "optimizer state copy", start, copy,
                                          {"kind": "optimizer", "params": shard}))
        self.events.append(TraceEvent(rank, "compute", "optimizer" + (" (host)" if offloads(self.program) else ""),
                                      start + copy, optimizer, {"kind": "optimizer", "params": shard}))
        end = max(start + copy + optimizer, known)  # (post: published once the norm has said so)
        for size, seconds, group in self._weight_gathers(rank):
            begin = self.lanes[rank][group.lane].fit(end, seconds)
            self.events.append(TraceEvent(rank, group.lane, "all_gather weights", begin, seconds,
                                          {"kind": "DP", "bytes": size, "group": group.size}))
            end, dp_comm = begin + seconds, dp_comm + seconds
        states = self.states(rank)
        # The tail past the last action less the optimizer and the wait for the norm: the syncs' exposed part.
        waited = max(0.0, known - (ready + copy + optimizer)) if self.post else max(0.0, known - ready)
        tail = end - self.last_end[rank] - optimizer - copy - waited
        exposed = min(dp_comm, max(0.0, tail)) + self.gather_exposed[rank]
        return _Finish(end=end, dp_comm=dp_comm + self.gather_comm[rank], optimizer=optimizer + copy, states=states,
                       dp_exposed=exposed)

    def _synced(self, rank: int) -> tuple[float, float]:
        """(when ``rank``'s gradients are averaged and its compute lane free, seconds of its
        gradient syncs), its syncs booked on its lanes the first time."""
        done = self._sync_done.get(rank)
        if done is None:
            done = self._sync_done[rank] = self._book_syncs(rank)
        return done

    def _book_syncs(self, rank: int) -> tuple[float, float]:
        ready_after, dp_comm = 0.0, 0.0
        names = self._slot_names()
        early = self.program.train is None or self.program.train.grad_reduce == "backward"
        lanes, last_end = self.lanes[rank], self.last_end[rank]
        if self.lowered.copies > 1:
            # Fold bidir: the twin rank's gradients are added after the last action, before
            # any data-parallel sync (the interpreter's Executor._sum_copies).
            early = False
            last_end = ready_after = self._book_copy_sum(rank)
        syncs: dict[tuple, list] = {}  # (stage, slot) -> its collectives (ZeRO-2: one per micro-batch)
        for (stage, slot), (ready, dense, expert) in self._reductions(rank):
            # After the rank's last action: everything with grad_reduce = step, and the embedding's.
            if not early or slot == "embedding":
                ready = max(ready, last_end)
            todo = syncs.get((stage, slot))
            if todo is None:
                todo = syncs[stage, slot] = self._syncs(slot, dense, expert)
            for collective, size, group, seconds in todo:
                start = lanes[group.lane].fit(max(ready, ready_after), seconds)
                ready_after, dp_comm = start + seconds, dp_comm + seconds
                if self.trace:
                    self.events.append(TraceEvent(rank, group.lane, f"{collective} {names(stage, slot)}", start,
                                                  seconds, {"kind": "DP", "bytes": size, "group": group.size}))
        return max(self.free_at[rank], ready_after), dp_comm

    def _book_copy_sum(self, rank: int) -> float:
        """Fold bidir: book the exchange of ``rank``'s gradients with its twin (pipeline rank
        p - 1 - r, the other holder of its stages), both ways at once on the pipeline lane
        after its last action; returns when it ends. Counted as pipeline communication."""
        dense, expert = self._local_params(rank)
        size = (dense + expert) * self.costs.grad_bytes
        seconds = collective_time("p2p", size, 2, self.costs.pp_lane, self.program.profile)
        start = self.lanes[rank][self.costs.pp_lane].fit(self.last_end[rank], seconds)
        self.tally[rank].pp_comm += seconds
        self.tally[rank].pp_exposed += seconds  # (after the last action: nothing to hide behind)
        if self.trace:
            self.events.append(TraceEvent(rank, self.costs.pp_lane, "exchange gradients with the twin copy", start,
                                          seconds, {"kind": "copies", "bytes": size, "group": 2}))
        return start + seconds

    def _syncs(self, slot, dense: float, expert: float) -> list[tuple[str, float, Group, float]]:
        """(collective, bytes, group, seconds) of each data-parallel sync of the gradients of
        ``slot`` (``dense`` and ``expert`` parameters), in order (:func:`gradient_syncs`)."""
        return gradient_syncs(self.costs, self.program.profile, slot, dense, expert, zero1=self.zero1,
                              fsdp=self.fsdp, replicas_sliced=self.replicas_sliced)

    def _optimizer(self, rank: int) -> tuple[float, float]:
        """(parameters, seconds) of ``rank``'s optimizer step (a shard of its parameters
        under ZeRO-1)."""
        costs = self.costs
        dense, expert = self._local_params(rank)
        shard_dense = dense / costs.dense_group.size if self.zero1 else dense
        shard_expert = expert / costs.expert_group.size if self.zero1 else expert
        return shard_dense + shard_expert, optimizer_seconds(self.program, shard_dense + shard_expert, costs.dtype)

    def _weight_gathers(self, rank: int) -> list[tuple[float, float, Group]]:
        """(bytes, seconds, group) of each all-gather of ``rank``'s updated weights after its
        optimizer, in order (ZeRO-1 with param_gather = step; none otherwise)."""
        if not self.zero1 or self.overlap_gather:
            return []
        costs, profile = self.costs, self.program.profile
        dense, expert = self._local_params(rank)
        layer_dense = dense - self._end_params(rank) if self.fsdp else 0.0
        pieces = ((layer_dense / costs.shard_group.size, costs.replicate_group),) \
            if self.replicas_sliced and costs.shard_group is not None else ()
        gathers = []
        for elements, group in ((dense - layer_dense, costs.dense_group), (expert, costs.expert_group), *pieces):
            if elements and group.size > 1:
                size = elements * costs.weight_bytes
                gathers.append((size, collective_time("all_gather", size, group.size, group.lane, profile,
                                                      group.per_node), group))
        return gathers

    def floor(self, rank: int, work: float, reductions: float = 0.0) -> float:
        """A lower bound of ``rank``'s end (:meth:`finish`) when its actions compute for
        ``work`` seconds and its gradient reductions take ``reductions`` seconds: its last
        action ends no earlier, and the embedding's gradients sync after it; the reductions
        run one after another (each starts once the one before has ended), so they end no
        earlier than their sum; then the gradient norm is all-reduced and the optimizer runs
        (post-validated: the copy and the optimizer beside the norm), then (ZeRO-1,
        param_gather = step) the weights are gathered, each after the one before."""
        costs, group = self.costs, self.costs.dense_group
        end = work
        if costs.params.embedding and group.size > 1 and self._holds_stage(rank, 0):
            size = costs.params.embedding * costs.grad_bytes
            end += collective_time("reduce_scatter" if self.zero1 else "all_reduce", size, group.size, group.lane,
                                   self.program.profile, group.per_node)
        end = max(end, reductions)
        shard, optimizer = self._optimizer(rank)
        if self.post:
            end += max(copy_seconds(shard, self.program) + optimizer, self.norm_seconds)
        else:
            end += self.norm_seconds + optimizer
        return end + sum(seconds for _, seconds, _ in self._weight_gathers(rank))

    def _holds_stage(self, rank: int, index: int) -> bool:
        return any(self.lowered.stage_of(rank, chunk) == index for chunk in range(self.lowered.chunks))

    def states(self, rank: int) -> ModelStates:
        """The model states ``rank`` holds (its parameters, gradients and optimizer states;
        post-validated, its optimizer states twice: the copy a rollback restores)."""
        states = self._states(rank)
        if self.post and self.norm_seconds:  # (offloaded, the copy is the host's)
            shard = self._optimizer(rank)[0]
            return attrs.evolve(states, optimizer=2 * states.optimizer,
                                host=states.host + HOST_STATE_BYTES * shard * offloads(self.program) / 100)
        return states

    def _states(self, rank: int) -> ModelStates:
        costs = self.costs
        dense, expert = self._local_params(rank)
        if self.fsdp:  # ZeRO-3 runs with ep = 1: the experts are sharded as the layers' other weights
            dense, expert = dense + expert, 0.0
        layer_dense = dense - self._end_params(rank) if self.fsdp else 0.0
        zero2 = self.program.train is not None and self.program.train.zero == 2
        return model_states(dense, expert, costs.dtype, zero1=self.zero1, dense_group=costs.dense_group.size,
                            expert_group=costs.expert_group.size, fsdp_dense=layer_dense,
                            fsdp_group=costs.shard_group.size if costs.shard_group else 0,
                            grads_sharded=dense - self._end_params(rank, head=False) if zero2 else 0.0,
                            expert_grads_sharded=zero2, offload=offloads(self.program))

    def untimed(self, shared: dict | None = None) -> list[tuple[float, float, float]]:
        """(compute seconds, peak of live activations, seconds of gradient reductions) of
        every rank, without timing its actions: the peak is what :meth:`run` books
        (MemoryTimeline.peak's value), since a rank's allocations and frees follow its
        actions' order whatever their durations; the reductions are :meth:`finish`'s
        (:meth:`_reduction_seconds`). ``shared``: what each action does (its _Changes) by
        action, and the ranks' work and peaks by schedule, from runs whose expanders have
        this one's :meth:`~dhelix.dsl.simulator.pieces.Expander.key`."""
        keys, rows = self.lowered.computation_indices
        shared = {} if shared is None else shared
        known = []
        for key in keys:
            changes = shared.get(key)
            if changes is None:
                changes = shared[key] = _Changes.of(self.expander.pieces(*key))
            known.append(changes)
        # The ranks' work and peaks follow from the changes and the schedule alone: a
        # schedule walked before with these changes (kept with them, so its id stays its
        # own) is not walked again.
        walked = shared.get(("walked", id(self.lowered)))
        if walked is None or walked[0] is not self.lowered:
            whole = all(changes.whole for changes in known)
            walked = shared["walked", id(self.lowered)] = (self.lowered, [
                (whole and self._untimed_whole(row, known)) or self._untimed_row(row, known) for row in rows])
        figures = walked[1]
        # So do the gradient slots each rank reduces, and how often.
        counted = shared.get(("reduced", id(self.lowered)))
        if counted is None or counted[0] is not self.lowered:
            counted = shared["reduced", id(self.lowered)] = (self.lowered, [
                self._reduced(row, keys, known) for row in rows])
        return [(work, peak, self._reduction_seconds(reduced))
                for (work, peak), reduced in zip(figures, counted[1], strict=True)]

    @staticmethod
    def _reduced(row: tuple[int, ...], keys, known: list[_Changes]) -> list[tuple]:
        """(slot, backwards, dense, expert) of each gradient slot of each backward stage a
        rank whose computations are ``row`` (indices into ``keys`` and ``known``) completes,
        in the order it first does: how many backwards complete it, its parameters."""
        counts: dict[tuple, list] = {}
        for index, repeats in collections.Counter(row).items():  # a rank repeats few computations
            bstage = keys[index][2]
            for slot, dense, expert in known[index].grads:
                entry = counts.setdefault((bstage, slot), [0, dense, expert])
                entry[0] += repeats
        return [(slot, count, dense, expert) for (_, slot), (count, dense, expert) in counts.items()]

    def _reduction_seconds(self, reduced: list[tuple]) -> float:
        """Seconds of the gradient reductions :meth:`finish` books for a rank that completes
        the gradient slots ``reduced`` (:meth:`_reduced`): one per layer slot of each
        backward stage, or under ZeRO-2 one per backward of it, each :meth:`_syncs`."""
        per_microbatch = self.program.train is not None and self.program.train.zero == 2
        total = 0.0
        for slot, count, dense, expert in reduced:
            seconds = self._sync_seconds.get((slot, dense, expert))
            if seconds is None:
                seconds = self._sync_seconds[slot, dense, expert] = sum(
                    sync[3] for sync in self._syncs(slot, dense, expert))
            total += (count if per_microbatch and isinstance(slot, int) else 1) * seconds
        return total

    @staticmethod
    def _untimed_whole(row: tuple[int, ...], known: list[_Changes]) -> tuple[float, float] | None:
        """:meth:`_untimed_row` of a rank whose every change is whole bytes, in C loops: the
        work summed in order, the running peak the highest live bytes before an action plus
        its rise; None when the live bytes leave the range where whole numbers add exactly."""
        work = functools.reduce(operator.add, [known[i].work for i in row], 0.0)
        before = list(itertools.accumulate([known[i].net for i in row], initial=0.0))
        if max(before) >= 2.0 ** 52 or min(before) <= -(2.0 ** 52):
            return None
        return work, max(itertools.chain((0.0,), map(operator.add, before, [known[i].rise for i in row])))

    @staticmethod
    def _untimed_row(row: tuple[int, ...], known: list[_Changes]) -> tuple[float, float]:
        """(compute seconds, peak of live activations) of a rank's computations ``row``
        (indices into ``known``, their changes), step by step."""
        work = live = best = 0.0
        for index in row:
            changes = known[index]
            work += changes.work
            if changes.whole and live == int(live) and live < 2.0 ** 52:
                # Whole bytes add exactly in any order, so the running peak is the max.
                best = max(best, live + changes.rise)
                live += changes.net
                continue
            for delta in changes.deltas:  # MemoryTimeline.peak's rule, step by step
                live += delta
                if live > best + 1e-6:
                    best = live
        return work, best

    def _reductions(self, rank: int) -> list:
        """((stage, slot), (ready, dense, expert)) of each gradient reduction of ``rank``, by
        ready time: one per slot, or under ZeRO-2 one per backward of each layer (each
        micro-batch's gradients reduce-scattered after its backward)."""
        per_microbatch = self.program.train is not None and self.program.train.zero == 2
        items = []
        for (stage, slot), (ready, dense, expert) in self.grads[rank].items():
            readies = self.micro_ready[rank][(stage, slot)] if per_microbatch and isinstance(slot, int) else [ready]
            name = str(slot)
            items += [((at, stage, name), (stage, slot), (at, dense, expert)) for at in readies]
        items.sort()  # by ready time, then stage and slot's name
        return [item[1:] for item in items]

    def _end_params(self, rank: int, head: bool = True) -> float:
        """Parameters of the model's ends (embedding, LM head and final norm) on ``rank``;
        the embedding's only without ``head``."""
        params, low = self.costs.params, self.lowered
        stages = [index for chunk in range(low.chunks) if (index := low.stage_of(rank, chunk)) is not None]
        return (params.embedding if any(low.is_first(s) for s in stages) else 0) \
            + (params.head if head and any(low.is_last(s) for s in stages) else 0)

    def _local_params(self, rank: int) -> tuple[float, float]:
        pairs = [self._chunk_params(rank, chunk) for chunk in range(self.lowered.chunks)]
        return sum(d for d, _ in pairs), sum(e for _, e in pairs)

    def _chunk_params(self, rank: int, chunk: int) -> tuple[float, float]:
        """(dense, expert) parameters of ``rank``'s stage at ``chunk`` (0 when it has none)."""
        params = self.costs.params
        index = self.lowered.stage_of(rank, chunk)
        if index is None:
            return 0.0, 0.0
        layers = len(self.program.placement.stages[index].layers)
        dense = layers * params.layer_dense + (params.embedding if self.lowered.is_first(index) else 0) \
            + (params.head if self.lowered.is_last(index) else 0)
        return dense, layers * params.layer_expert

    def _slot_names(self):
        stages = self.program.placement.stages

        def name(stage: int, slot) -> str:
            if isinstance(slot, int):
                return f"grads layer {stages[stage].first_layer + slot}"
            return f"grads {'LM head' if slot == 'head' else slot}"

        return name

    def rank_stats(self, rank: int) -> RankStats:
        """The figures of ``rank`` once :meth:`run` is done (runs :meth:`finish`)."""
        done = self.finish(rank)
        peak, when = self.memory[rank].peak()
        tally = self.tally[rank]
        return RankStats(rank=rank, busy=tally.busy, pipeline_end=self.last_end[rank], end=done.end,
                         layer_comm=tally.layer_comm, layer_exposed=tally.layer_exposed,
                         pp_comm=tally.pp_comm, pp_exposed=tally.pp_exposed, sends=tally.sends,
                         send_bytes=tally.send_bytes, dp_comm=done.dp_comm, dp_exposed=done.dp_exposed,
                         optimizer=done.optimizer, states=done.states, activations=peak,
                         activations_at=when)


def _forward_chunk(action) -> int | None:
    """The chunk whose forward ``action`` runs (an F, or an SI block's forward), else None."""
    if isinstance(action, Interleaved):
        return action.fwd.chunk
    return action.chunk if getattr(action, "kind", None) == "F" else None


def _action_args(action, kind: str, fstage: int, bstage: int) -> dict:
    if isinstance(action, Interleaved):
        return {"kind": "SI", "forward": str(action.fwd), "backward": str(action.bwd),
                "microbatch": [action.fwd.microbatch, action.bwd.microbatch],
                "chunk": [action.fwd.chunk, action.bwd.chunk], "stage": [fstage, bstage]}
    return {"kind": kind, "microbatch": action.microbatch, "chunk": action.chunk, "stage": fstage}


# ---------------------------------------------------------------- the entry points

@attrs.frozen
class _Changes:
    """What the pieces of one action do, untimed: their compute seconds, the nonzero changes
    of live bytes in order (what MemoryTimeline.change books), their sum and the highest
    running sum; ``whole`` when every change is a whole number of bytes (below 2**52); the
    gradients they finish (each piece's ``grads``)."""

    work: float
    deltas: tuple[float, ...]
    net: float
    rise: float
    whole: bool
    grads: tuple[tuple, ...] = ()

    @classmethod
    def of(cls, pieces: tuple[Piece, ...]) -> "_Changes":
        deltas = tuple(d for piece in pieces for d in (piece.alloc, -piece.free) if d)
        running = rise = 0.0
        for delta in deltas:
            running += delta
            rise = max(rise, running)
        whole = all(d == int(d) and abs(d) < 2.0 ** 52 for d in deltas)
        return cls(sum(piece.work.seconds for piece in pieces), deltas, running, rise, whole,
                   tuple(piece.grads for piece in pieces if piece.grads is not None))


@attrs.frozen
class Untimed:
    """What :func:`untimed` tells of a step without simulating it: each pipeline rank's peak
    memory (bytes), exactly as :func:`simulate` reports it (``RankStats.memory``), and a lower
    bound of its step time (seconds; the simulation's step is never shorter, up to rounding)."""

    memory: tuple[float, ...]
    floor: float
    #: Each pipeline rank's host bytes per GPU (an offloaded optimizer's: ``RankStats.states.host``).
    host: tuple[float, ...] = ()


def untimed(program: Program, costs: StepCosts, *, si: bool = True, zero1: bool = False,
            memo: dict | None = None, optimizer_check: str | None = None) -> Untimed:
    """The :class:`Untimed` figures of ``program`` priced by ``costs`` (as :func:`simulate`
    with ``costs``): what a search needs to rule out a choice over the device memory, or
    slower than its best, before simulating it. The peak follows the actions' order (the SI
    blocks' pieces as ``costs`` has them: ``layer.pair`` set, layer pairs); the bound is the
    slowest rank's compute work, then what must follow its last action (:meth:`_Run.floor`).
    ``memo``: a dict kept across calls to share, between programs whose actions expand
    alike (:meth:`~dhelix.dsl.simulator.pieces.Expander.key`: the layer costs, stage sizes
    and activation bytes, by value), what each action does and each schedule's walk (it
    keeps the schedules it walked); ``optimizer_check`` as :func:`simulate`."""
    require_profile(program)
    zero1 = zero1 or (program.train is not None and program.train.zero >= 1)
    si = si and interleaves(program)
    run = _Run(program, costs, si, zero1, trace=False, post=post_validated(program, optimizer_check))
    shared = None if memo is None else memo.setdefault(run.expander.key(), {})
    figures = run.untimed(shared)
    states = [run.states(rank) for rank in range(run.lowered.ranks)]
    return Untimed(tuple(state.total + figures[rank][1] for rank, state in enumerate(states)),
                   max(run.floor(rank, figures[rank][0], figures[rank][2]) for rank in range(len(states))),
                   tuple(state.host for state in states))


def peak_memory(program: Program, cost: PairCost | None = None) -> float:
    """The peak memory (bytes) of ``program``'s busiest rank, as :func:`simulate` reports
    it, without planning its SI layer pairs or timing its step: :func:`untimed` with the
    pairs at no time (a rank's allocations follow its actions' order, not their durations)."""
    costs = step_costs(program, None, cost or cost_of(program))
    if interleaves(program) and has_si(program):
        costs = attrs.evolve(costs, layer=attrs.evolve(costs.layer, pair=NOTHING))
    return max(untimed(program, costs).memory)


def host_states(program: Program, cost: PairCost | None = None) -> tuple[float, ...]:
    """Each pipeline rank's host bytes per GPU (an offloaded optimizer's states and staging
    buffers, as :func:`simulate` reports them in ``RankStats.states.host``), without simulating."""
    costs = step_costs(program, None, cost or cost_of(program))
    if interleaves(program) and has_si(program):
        costs = attrs.evolve(costs, layer=attrs.evolve(costs.layer, pair=NOTHING))
    return untimed(program, costs).host


def simulate(program: Program, plan: Plan | None = None, *, si: bool = True, zero1: bool = False,
             cost: PairCost | None = None, costs: StepCosts | None = None, label: str = "",
             scheduled: bool = False, blocks: Callable | None = None, trace: bool = True,
             detail: bool = False, optimizer_check: str | None = None) -> Simulation:
    """Simulate one training step of a validated ``program`` (with a profile).

    ``plan`` prices the SI blocks (planned with :func:`schedule_plan` when the schedule has
    SI blocks and none is given); ``si=False`` runs every SI block as its F then its B, as
    does the program's ``train { si = off }`` (``si`` can only turn SI off);
    ``zero1`` shards the optimizer states over the gradient-sync group, as does the program's
    ``train { zero = 1 }`` (``zero1`` can only add the sharding). ``scheduled`` prices
    every SI block whole by the block scheduler (what ``dhelix run --si-plan scheduled``
    runs) instead of layer pair by layer pair with the plan (not with ``costs``, whose
    ``layer.block`` says); ``blocks(forward layers, backward layers)`` gives those
    schedules ready-made (a run's :class:`~dhelix.dsl.simulator.runplan.BlockOrders`), and
    implies ``scheduled``. ``costs`` replaces
    the :func:`sim_costs.step_costs` of the program, for what-if studies (free pipeline
    transfers, no LM head, …); its ``layer.pair`` then prices the SI blocks. ``trace=False``
    leaves out the per-action trace events and the memory counters (a search pricing many
    programs needs the figures only); ``detail=True`` adds the SI blocks' segment pairs and
    the collectives they hide (:mod:`pairtrace`; with the plan, not ``scheduled``) and each
    action's layer communication (``layer_comm_s``, ``layer_comm_exposed_s``) to the trace.
    ``optimizer_check`` (sync or post, a run's ``--optimizer-check``; None: the train
    block's) says whether the optimizer waits for the gradient norm (:mod:`.optimizer_check`).
    Returns the :class:`Simulation`; raises DhelixError
    for a program without a profile, and for one whose offloaded optimizer states exceed a
    node's host memory (:func:`~dhelix.dsl.simulator.host_memory.host_refusal`).
    """
    require_profile(program)
    si = si and interleaves(program)
    if costs is None:
        cost = cost or cost_of(program)
        if si and plan is None and has_si(program):
            plan = schedule_plan(program, cost)
        costs = step_costs(program, plan if si else None, cost)
        if si and (scheduled or blocks is not None) and has_si(program):
            blocks = blocks or block_scheduler(program, cost)
            costs = attrs.evolve(costs, layer=attrs.evolve(costs.layer, block=blocks))
    zero1 = zero1 or (program.train is not None and program.train.zero >= 1)
    priced_by_plan = si and plan is not None and costs.layer.block is None and costs.layer.pair is not None
    run = _Run(program, costs, si, zero1, trace, detail=plan if detail and priced_by_plan else None,
               post=post_validated(program, optimizer_check))
    run.run()
    ranks = tuple(run.rank_stats(rank) for rank in range(run.lowered.ranks))
    refusal = host_refusal(program, [r.states.host for r in ranks])
    if refusal is not None:  # (an offloaded optimizer the nodes' host memory cannot hold)
        raise refusal
    model, mesh, train, lowered = program.model, program.mesh, program.train, run.lowered
    assert model is not None and mesh is not None and train is not None, "a validated model"
    sequences = mesh.size("dp") * train.microbatches * train.micro_batch
    counters = tuple(CounterSample(rank, "activations", time, {"GB": live / 1e9})
                     for rank in range(len(ranks)) for time, live in run.memory[rank].samples()) if trace else ()
    return Simulation(
        label=label, program=model.name, pipeline=lowered.name, fold=program.placement.kind,
        shape=(lowered.ranks, lowered.microbatches, lowered.chunks), si=si and has_si(program), zero1=zero1,
        ranks=ranks, tokens=float(sequences * model.setting("seq")),
        flops=megatron_flops_per_iteration(model, sequences), world=mesh.world,
        peak_flops=program.profile.peak_flops(model.dtype), events=tuple(run.events), counters=counters,
        fsdp=run.fsdp, gather_under_forward=run.overlap_gather, shard=mesh.dp_shard if run.fsdp else 0,
        zero=max(train.zero, int(zero1)), offload=train.offload_share,
        cores_bound=cores_bound(program.profile.cores, ranks, mesh.world))
