"""The layer-sized steps an action of a rank is made of (:class:`Piece`): their work, the
activation bytes each allocates and frees, the gradients it completes; :class:`Expander`
turns an action into them for the step simulator (:mod:`dsl.simulator.events`)."""

from __future__ import annotations

import attrs

from dhelix.dsl.passes.fsdp import is_fsdp
from dhelix.dsl.simulator.memory import (gathered_bytes, head_activations, head_transients, interleaved,
                                         layer_activations, recomputed, selectively_recomputed)
from dhelix.dsl.core.program import Program
from dhelix.dsl.simulator.costs import StepCosts, Work


@attrs.frozen
class Piece:
    """A layer-sized step of an action: its work, the activation bytes allocated at its start
    and freed at its end, the gradient slot (``stage``-relative) it completes and the weights
    whose forward it runs (a layer index, ``embedding`` or ``head``; what an overlapped
    ZeRO-1 weight gather must have delivered before it starts)."""

    work: Work
    alloc: float = 0.0
    free: float = 0.0
    grads: tuple | None = None  # (slot name, dense elements, expert elements)
    weights: int | str | None = None
    #: An SI layer pair priced by the plan (its ``again`` recomputation first): what
    #: :mod:`pairtrace` draws as segment pairs.
    paired: bool = False



class Expander:
    """Turns an action of a rank into its Pieces (cached: they depend only on the stages)."""

    def __init__(self, program: Program, costs: StepCosts, si: bool):
        self.costs, self.si = costs, si
        assert program.lowered is not None and program.forward is not None and program.backward is not None \
            and program.model is not None, "a validated model"
        self.split = program.lowered.split
        self.stages = program.placement.stages
        self.placement = program.placement
        self.acts = layer_activations(program.forward, program.backward, program.model.dtype, self.split)
        # What a recomputing layer's forward allocates, and what its backward allocates again
        # first; a layer that does not recompute keeps ``acts`` and rebuilds nothing.
        self.kept, self.rebuilt = self.acts, 0.0
        assert program.train is not None, "a validated model"
        self.train = program.train
        recompute = program.train.recompute
        if recompute == "full":
            self.kept, self.rebuilt = recomputed(self.acts, program.forward, program.model.dtype)
        elif recompute == "selective":
            self.kept, self.rebuilt = selectively_recomputed(self.acts, program.forward, program.backward,
                                                             program.model.dtype, self.split, is_fsdp(program))
        self.head = head_activations(program, self.split)
        # What the loss holds for a moment in the head's forward and backward (memory.head_transients).
        self.head_moment = head_transients(program)
        # ZeRO-3: a running layer's gathered weight (and, backward, its full gradient).
        self.gathered = gathered_bytes(program.forward, program.model.dtype, is_fsdp(program))
        self.cache: dict[tuple, tuple[Piece, ...]] = {}

    def key(self) -> tuple:
        """What every piece depends on, by value: expanders with equal keys expand every
        action alike (a search's layouts that differ in ZeRO 0-2, ``param_gather``, data
        parallelism or micro-batch count share them)."""
        return (self.costs.layer, self.costs.heads, self.costs.params, self.si, self.split,
                tuple(len(stage.layers) for stage in self.stages), self.acts, self.kept, self.rebuilt, self.head,
                self.head_moment, self.gathered, self.train.recompute_layers)

    def pieces(self, kind: str, fstage: int | None, bstage: int | None) -> tuple[Piece, ...]:
        """Pieces of F/B/W on one stage (``fstage`` for F, ``bstage`` for B and W) or of an SI
        block (both); ``kind`` is F, B, W or SI."""
        key = (kind, fstage, bstage)
        hit = self.cache.get(key)
        if hit is None:
            if kind == "SI":
                assert fstage is not None and bstage is not None, "an SI block runs both stages"
                made = self._interleaved(fstage, bstage)
            else:
                stage = fstage if kind == "F" else bstage
                assert stage is not None, f"{kind} runs on a stage"
                made = {"F": self._forward, "B": self._backward, "W": self._weight}[kind](stage)
            self.cache[key] = hit = tuple(p for p in made if p.work.seconds or p.alloc or p.free or p.grads)
        return hit

    def _count(self, stage: int) -> int:
        return len(self.stages[stage].layers)

    def _embed_f(self, stage):
        return [Piece(self.costs.heads.embed_forward, weights="embedding")] if self.placement.is_first(stage) else []

    def _head_f(self, stage):
        last = self.placement.is_last(stage)
        moment = self.head_moment[0]
        return [Piece(self.costs.heads.head_forward, alloc=self.head.total + moment, free=moment,
                      weights="head")] if last else []

    def _head_b(self, stage):
        if not self.placement.is_last(stage):
            return []
        heads, params = self.costs.heads, self.costs.params
        moment = self.head_moment[1]
        if self.split:
            return [Piece(heads.head_backward, alloc=moment, free=self.head.at_backward + moment)]
        return [Piece(heads.head_backward + heads.head_weight, alloc=moment, free=self.head.at_backward + moment,
                      grads=("head", params.head, 0))]

    def _embed_b(self, stage):
        if not self.placement.is_first(stage):
            return []
        return [Piece(self.costs.heads.embed_backward, grads=("embedding", self.costs.params.embedding, 0))]

    def _kept(self, index: int) -> float:
        """Bytes the forward of the layer at ``index`` of its chunk keeps for its backward."""
        return self.kept.total if self.train.recomputes(index) else self.acts.total

    def _rebuilt(self, index: int) -> float:
        """Bytes the backward of the layer at ``index`` of its chunk allocates again first."""
        return self.rebuilt if self.train.recomputes(index) else 0.0

    def _layer_b(self, index: int) -> Piece:
        layer, params = self.costs.layer, self.costs.params
        held = 2 * self.gathered
        again = self.train.recomputes(index)
        alloc = self._rebuilt(index) + held
        if self.split:
            return Piece(layer.backward_input_of(again), alloc=alloc, free=self.acts.at_backward + held)
        return Piece(layer.backward_of(again), alloc=alloc, free=self.acts.at_backward + held,
                     grads=(index, params.layer_dense, params.layer_expert))

    def _layer_f(self, index: int, work: Work) -> Piece:
        return Piece(work, alloc=self._kept(index) + self.gathered, free=self.gathered, weights=index)

    def _paired(self, index: int, alloc: float, work: Work, weights) -> Piece:
        # A forward layer allocating ``alloc`` beside backward layer ``index`` (memory.interleaved),
        # which first runs ``work`` and what it recomputes; both strands' gathered weights and
        # the backward's full gradient held meanwhile.
        b = self._layer_b(index)
        work = self.costs.layer.again_of(self.train.recomputes(index)) + work
        up, down = interleaved(alloc + self._rebuilt(index), b.free - 2 * self.gathered)
        held = 3 * self.gathered
        return attrs.evolve(b, work=work, alloc=up + held, free=down + held, weights=weights,
                            paired=self.costs.layer.block is None)

    def _forward(self, stage: int) -> list[Piece]:
        count = self._count(stage)
        layers = [self._layer_f(i, self.costs.layer.forward) for i in range(count)]
        return self._embed_f(stage) + layers + self._head_f(stage)

    def _backward(self, stage: int) -> list[Piece]:
        count = self._count(stage)
        return self._head_b(stage) + [self._layer_b(i) for i in reversed(range(count))] + self._embed_b(stage)

    def _weight(self, stage: int) -> list[Piece]:
        count, params = self._count(stage), self.costs.params
        head = []
        if self.placement.is_last(stage):
            head = [Piece(self.costs.heads.head_weight, free=self.head.at_weight, grads=("head", params.head, 0))]
        return head + [Piece(self.costs.layer.weight, alloc=self.gathered, free=self.acts.at_weight + self.gathered,
                             grads=(i, params.layer_dense, params.layer_expert)) for i in reversed(range(count))]

    def _interleaved(self, fstage: int, bstage: int) -> list[Piece]:
        pair = self.costs.layer.pair
        if self.si and self.costs.layer.block is not None:
            return self._scheduled(fstage, bstage)
        if not self.si or pair is None:
            return self._forward(fstage) + self._backward(bstage)
        nf, nb = self._count(fstage), self._count(bstage)
        paired = min(nf, nb)
        # In a pair one strand's forward grows as the other's backward shrinks (memory.interleaved).
        body = [self._paired(nb - 1 - k, self._kept(k), pair, k) for k in range(paired)]
        body += [self._layer_f(k, self.costs.layer.forward) for k in range(paired, nf)]
        body += [self._layer_b(i) for i in reversed(range(nb - paired))]
        return (self._embed_f(fstage) + self._head_b(bstage) + body + self._head_f(fstage)
                + self._embed_b(bstage))

    def _scheduled(self, fstage: int, bstage: int) -> list[Piece]:
        # The block scheduler's make-span for the whole block, cut into max(nf, nb) equal
        # layer-sized pieces that allocate, free and complete gradients as the pairs of
        # _interleaved do. The order may run a layer's wgrads, and the forward's next layers,
        # up to blockorder.LAG layers off those points: memory and the dp reductions' start
        # are booked at the pairs' points, not the order's.
        nf, nb = self._count(fstage), self._count(bstage)
        assert self.costs.layer.block is not None, "scheduled SI blocks have their block scheduler"
        block = self.costs.layer.block(nf, nb)
        steps = max(nf, nb, 1)
        share = Work(block.makespan / steps, block.comm / steps, block.comm_exposed / steps)
        body = []
        for k in range(steps):
            alloc = self._kept(k) if k < nf else 0.0
            if k < nb:
                body.append(self._paired(nb - 1 - k, alloc, share, k if k < nf else None))
            else:
                body.append(self._layer_f(k, share))
        return (self._embed_f(fstage) + self._head_b(bstage) + body + self._head_f(fstage)
                + self._embed_b(bstage))
