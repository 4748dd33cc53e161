"""The checked program IR: configuration, definitions and instantiated layer DAGs.

Frozen attrs classes; spans are keyword-only and excluded from equality. Passes return new
objects with :func:`attrs.evolve` instead of mutating.
"""

from __future__ import annotations

import math
from typing import Any, cast

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import CheckError, DhelixError
from dhelix.dsl.core.mesh import MESH_AXES, Mesh
from dhelix.dsl.core.options import option
from dhelix.dsl.core.schedule import Lowered
from dhelix.dsl.core.span import Span, span_field
from dhelix.dsl.core.wording import did_you_mean

Shape = tuple[int, ...]  # (rows, features); a weight of grouped GEMMs has three

#: The fold kinds of the language and the chunks per rank (v) each gives; ``loop`` takes v as
#: its argument (None here). The one definition: the checker of fold statements and of a
#: pipeline's ``for`` clause, the fold pass and the command-line overrides read it.
FOLD_KINDS: dict[str, int | None] = {"none": 1, "u": 2, "loop": None, "bidir": 2}

#: The folds that place more than one copy of the model, and how many: ``bidir`` (DualPipe)
#: places two, one running down the ranks and one back up; every other fold places one.
FOLD_COPIES: dict[str, int] = {"bidir": 2}

#: The communication kinds whose collectives SI may hide (a strands block's ``overlap``).
OVERLAP_KINDS = tuple(axis for axis in MESH_AXES if axis != "pp")  # pp's transfers are the pipeline's



#: A value the planner chooses: ``chunk … by auto``, ``train { launch = auto }``.
AUTO = "auto"
#: The parameter of a GEMM chunked along its outputs: (index, parts) of its weight's columns.
COLUMNS = "columns"
#: The parameter of a GEMM chunked along its outputs at the stages of its ZeRO-3 weight
#: gather (``chunk fc1 along outputs by stages``): (part, first, columns) — part 0 computes
#: on the columns the gather's first stage (over ``dp.<first>``) brought, part 1 on the rest,
#: of the whole weight's ``columns`` (its pieces are column blocks: :attr:`Op.column_pieces`).
STAGED = "staged"

@attrs.frozen
class Model:
    """The model block: integer settings in source order, dtype and the layer DAG's name."""

    name: str
    settings: tuple[tuple[str, int], ...]
    dtype: str
    layer: str
    span: Span | None = span_field()

    def get(self, key: str, default: int | None = None) -> int | None:
        """The integer setting ``key`` or ``default``."""
        return dict(self.settings).get(key, default)

    def setting(self, key: str) -> int:
        """The integer setting ``key``, which the model has: a required one (the checker
        refuses a model without it) or one looked up after checking; KeyError otherwise."""
        return dict(self.settings)[key]


@attrs.frozen
class Cluster:
    """The cluster block: its size, the hardware profile it names and where that name is
    written (``profile_span``, where an error about the profile file points)."""

    nodes: int
    gpus_per_node: int
    profile: str | None
    #: The topology of its levels block (:attr:`dhelix.dsl.core.mesh.Mesh.levels`); ().
    levels: tuple[tuple[str, int], ...] = ()
    span: Span | None = span_field()
    profile_span: Span | None = span_field()


@attrs.frozen
class Train:
    """The train block: micro-batch size and count per step; the seed of weights and data
    and the default step count of `dhelix run`; the training data (a path as written,
    relative to the program file; None: seeded random tokens), evaluation every
    ``eval_every`` steps and ``warmup`` steps of learning-rate warm-up; the ZeRO stage of the
    optimizer (0: states replicated, 1: sharded over data parallelism) and the activation
    recomputation (none, or full: each layer keeps its input and runs its forward again
    before its backward). ZeRO stage 3 (FSDP) shards the layers' weights and gradients over
    data parallelism too: the autodiff stage adds their all-gathers and reduce-scatters to
    the layer DAGs (:mod:`dhelix.dsl.passes.fsdp`). ``data_span`` is where an error about
    the data points, ``zero_span`` where one about the ZeRO stage does. ``run`` holds the
    values the block writes for the run's options (seed, steps, …, the train keys of
    :data:`~dhelix.dsl.core.options.OPTIONS` that the ranks read), which `run`'s command
    line overrides; the compiler never reads them."""

    micro_batch: int
    microbatches: int
    data: str | None = None
    zero: int = option("zero").default
    recompute: str = option("recompute").default
    #: When ZeRO-1's weight all-gather runs: "step" (after the optimizer) or "forward" (under
    #: the next step's forward, each chunk's weights waited for before its first forward).
    param_gather: str = option("param_gather").default
    #: ZeRO-3's shard group size under hybrid sharding (HSDP); None: the whole dp group.
    shard: int | None = None
    #: Micro-batches launched together per model chunk (the pipelines' ``g``): a number,
    #: "auto" (the planner chooses, Centauri's Eq. 2) or None (p).
    launch: int | str | None = None
    #: When the data-parallel gradient reduction runs: "backward" (each layer's as soon as
    #: the step's last backward of it has finished) or "step" (all after the last backward).
    grad_reduce: str = option("grad_reduce").default
    #: Micro-batches launched together per model chunk in the backward (the pipelines'
    #: ``gb``, Eq. 2's L2 where ``launch`` is L1): a number, "auto" or None (``launch``'s).
    launch_backward: int | str | None = None
    #: Whether the SI blocks of the schedule co-execute their strands: "on", "off" (each
    #: runs its F, then its B) or None (not written: on).
    si: str | None = None
    run: tuple[tuple[str, object], ...] = ()
    #: With ``recompute = full``: how many leading layers of each model chunk recompute
    #: (Megatron's ``--recompute-num-layers`` with ``--recompute-method block``); the chunk's
    #: other layers keep their activations. None: every layer.
    recompute_layers: int | None = None
    #: The layers of the first pipeline stage (the embedding's) and of the last (the LM
    #: head's), the other stages splitting the rest evenly (Megatron's
    #: ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``);
    #: None: an equal share.
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    #: Where the optimizer's fp32 master weights and AdamW moments live: "none" (on the
    #: device) or "optimizer" (in host memory: each step the rank's averaged gradients go
    #: device -> host, AdamW runs on the host CPU, the updated weights go host -> device;
    #: ZeRO-Offload's offload_optimizer, FSDP's CPUOffload, Megatron-LM's optimizer CPU offload).
    offload: str = "none"
    #: With ``offload = optimizer``: the percent of each of the optimizer's parts whose states
    #: live on the host (Megatron-LM's offload fraction); None: all of them.
    offload_percent: int | None = None
    span: Span | None = span_field()
    data_span: Span | None = span_field()
    zero_span: Span | None = span_field()
    shard_span: Span | None = span_field()
    launch_span: Span | None = span_field()
    launch_backward_span: Span | None = span_field()
    #: Where an error about the stages' sizes points (the first of ``first_stage_layers``
    #: and ``last_stage_layers`` written).
    stages_span: Span | None = span_field()
    #: Where an error about ``offload`` points.
    offload_span: Span | None = span_field()

    def setting(self, key: str):
        """The value the block writes for the run option of train key ``key``; None when
        it does not write it."""
        return dict(self.run).get(key)

    @property
    def seed(self) -> int:
        """The seed of the weights and the data (0 when not written)."""
        seed = self.setting("seed")
        return 0 if seed is None else seed

    @property
    def steps(self) -> int | None:
        return self.setting("steps")

    @property
    def eval_every(self) -> int | None:
        return self.setting("eval_every")

    @property
    def warmup(self) -> int:
        warmup = self.setting("warmup")
        return 0 if warmup is None else warmup

    @property
    def interleaves(self) -> bool:
        """Whether SI blocks co-execute their strands (``si`` is not ``off``)."""
        return self.si != "off"

    @property
    def stage_ends(self) -> tuple[int | None, int | None]:
        """(layers of the first pipeline stage, of the last); None where not written."""
        return self.first_stage_layers, self.last_stage_layers

    @property
    def offloads(self) -> bool:
        """Whether the optimizer's states live in host memory (``offload = optimizer``)."""
        return self.offload != "none"

    @property
    def offload_share(self) -> int:
        """The percent of the optimizer's states in host memory: 0 without offload, else
        ``offload_percent`` (100 when not written)."""
        if not self.offloads:
            return 0
        return 100 if self.offload_percent is None else self.offload_percent

    def recomputes(self, position: int) -> bool:
        """Whether the layer at ``position`` of its model chunk (0: the chunk's first, in
        model order) recomputes as ``recompute`` says before its backward: every layer
        unless ``recompute_layers`` limits full recomputation to the chunk's first ones (the
        one place that rule lives: the simulator and the ranks both ask here)."""
        if self.recompute == "none":
            return False
        return self.recompute_layers is None or position < self.recompute_layers

    def recomputed_of(self, count: int) -> int:
        """How many layers of a model chunk of ``count`` layers recompute (:meth:`recomputes`)."""
        if self.recompute == "none":
            return 0
        return count if self.recompute_layers is None else min(count, self.recompute_layers)


@attrs.frozen
class FoldSpec:
    """``fold none`` (v = 1), ``fold u`` (v = 2), ``fold loop(v)`` or ``fold bidir`` (v = 2,
    two model copies)."""

    kind: str
    v: int
    span: Span | None = span_field()

    @classmethod
    def of(cls, kind: str, v: int | None = None, *, span=None) -> "FoldSpec":
        """The spec of the known fold ``kind``; ``v`` is loop's chunk count, None for the
        others (which fix theirs). A caller checks the kind first: ValueError otherwise."""
        count = FOLD_KINDS.get(kind) if v is None else v
        if kind not in FOLD_KINDS or (FOLD_KINDS[kind] is None) != (v is not None) or count is None:
            raise ValueError(f"no fold {kind} with v = {v}")
        return cls(kind, count, span=span)

    @property
    def copies(self) -> int:
        """How many copies of the model the fold places (2 for bidir, else 1)."""
        return FOLD_COPIES.get(self.kind, 1)

    @property
    def text(self) -> str:
        """The fold as written: ``none``, ``u`` or ``loop(3)``."""
        return self.kind if FOLD_KINDS[self.kind] is not None else f"{self.kind}({self.v})"


def fold_kinds_text(argument: str = "v") -> str:
    """The fold kinds for a message, ``none, u, loop(v)``, with ``argument`` for loop's."""
    return ", ".join(k if v is not None else f"{k}({argument})" for k, v in FOLD_KINDS.items())


def unknown_fold(kind: str, span, error: type[DhelixError] = CheckError) -> DhelixError:
    """The error for a fold ``kind`` that is not in FOLD_KINDS, with a "did you mean" note."""
    return error(f"unknown fold '{kind}'", span,
                 did_you_mean(kind, FOLD_KINDS) + [f"folds are: {fold_kinds_text()}"])


@attrs.frozen
class Strands:
    """Strand-pairing constraints; defaults when the program has no strands block (then
    ``span`` is None). Built by the checker; the strands pass checks that each written
    selector names operators of the layer."""

    overlap: tuple[str, ...] = OVERLAP_KINDS
    comm_with_comm: bool = True
    movable: tuple[s.Selector, ...] = (s.Selector(("wgrad",)),)
    forbid: tuple[tuple[s.Selector, s.Selector], ...] = ()
    span: Span | None = span_field()


@attrs.frozen(kw_only=True)
class GradFlow:
    """How a backward op takes part in the flow of gradients: recorded by autodiff, read by
    the interpreter (one owner of the rules; the runtime does not re-derive them).

    ``upstream`` is the backward value holding the gradient of the forward op's output that
    this op reads: the layer's gradient input (``d<out>``), the backward op that produced and
    summed that gradient, or, for a ring step after the first, the previous step (whose
    output is the ring's state); None when the forward output feeds nothing differentiable
    (its gradient is zero). ``produces`` lists the forward values whose gradient (one
    contribution each) the op's output holds: empty for a wgrad and for a ring step that
    only passes the ring on. ``accumulates`` pairs each forward value whose contributions
    this op sums with the other producers it adds (the fused accumulation of a value read
    by several forward ops). ``weight`` names the forward op whose weight gradient the op
    computes (a wgrad, or a norm's whole backward), None for none.
    """

    upstream: str | None
    produces: tuple[str, ...] = ()
    accumulates: tuple[tuple[str, tuple[str, ...]], ...] = ()
    weight: str | None = None


@attrs.frozen
class Op:
    """One operator of an instantiated layer DAG (forward or derived backward).

    ``inputs`` name the ops (or the layer input) whose outputs it consumes; for backward
    ops they are the gradient producers, ``saved`` names the forward tensors it reads and
    ``grad`` says which gradients it reads and produces (None for a forward op).
    """

    name: str
    op: str  # library op (gemm) or derived kind (gemm_dgrad, norm_bwd, …)
    kind: str  # compute | comm
    op_class: str
    inputs: tuple[str, ...]
    in_shapes: tuple[Shape, ...]
    shape: Shape
    weight: tuple[int, ...] | None = None
    axis: str | None = None
    group_size: int = 1
    lane: str = "compute"  # compute | local | cross
    #: Ranks of the op's group on each node when the group spans nodes (1 otherwise): how
    #: many GPUs' shares of a node's cross-node links its rings get (costmodel.ring_bandwidth).
    per_node: int = 1
    movable: bool = False
    forward: str | None = None  # the forward op a backward op derives from
    saved: tuple[str, ...] = ()
    params: tuple[tuple[str, object], ...] = ()
    grad: GradFlow | None = None
    #: The written op this one is a chunk of (the partition pass); it shares that op's
    #: weight, which stays keyed by the written name.
    origin: str | None = None
    #: Ops that must run before this one although it reads no value of theirs as an input:
    #: under ZeRO-3 the all-gather of its weight, or the gradients a weight's reduce-scatter
    #: sends (:mod:`dhelix.dsl.passes.fsdp`).
    waits: tuple[str, ...] = ()
    span: Span | None = span_field()

    @property
    def weight_name(self) -> str:
        """The name the op's weight (and its gradient) is kept under: its origin's, else its own."""
        return self.origin or self.name

    @property
    def columns(self) -> tuple[int, int] | None:
        """(index, parts) of a GEMM chunked along its outputs: it holds columns ``index`` of
        ``parts`` of its origin's weight (``weight`` is those columns' shape); else None."""
        return cast("tuple[int, int] | None", dict(self.params).get(COLUMNS))

    @property
    def staged(self) -> tuple[int, str, int] | None:
        """(part, first stage, whole columns) of a GEMM chunked along its outputs at its
        weight gather's stages (:data:`STAGED`); else None."""
        return cast("tuple[int, str, int] | None", dict(self.params).get(STAGED))

    @property
    def unit_weight(self) -> tuple[int, ...] | None:
        """The shape of what ZeRO-3 gathers as one for this op (:attr:`weight_unit`): its
        ``weight``, or the whole weight of a chunk at its gather's stages (:attr:`staged`)."""
        if self.weight is None or self.staged is None:
            return self.weight
        return (*self.weight[:-1], self.staged[2])

    @property
    def weight_unit(self) -> str:
        """What ZeRO-3 gathers and reduce-scatters as one for this forward op: a chunk along
        outputs' block of columns (``fc1.c0``), else the whole weight (:attr:`weight_name`)."""
        return f"{self.weight_name}.c{self.columns[0]}" if self.columns else self.weight_name

    @property
    def deps(self) -> tuple[str, ...]:
        """Every op this one runs after: its inputs, then what it ``waits`` for."""
        return self.inputs + self.waits if self.waits else self.inputs


@attrs.frozen
class LayerDag:
    """A layer's operators in a topological order (the written order where it is one)."""

    name: str
    direction: str  # forward | backward
    input: str
    input_shape: Shape
    output: str
    ops: tuple[Op, ...]
    elided: tuple[str, ...] = ()  # collectives over a size-1 axis, replaced by their input

    def op(self, name: str) -> Op:
        """The op called ``name`` (KeyError if absent: callers check names first)."""
        return {o.name: o for o in self.ops}[name]

    def weight_elements(self) -> tuple[int, int]:
        """(dense, expert) weight elements of one layer on one rank, from the ops' ``weight``
        shapes; the chunks of a partitioned op share its weight, counted once (along outputs
        each holds its own columns, counted each); expert
        weights are the grouped GEMMs'."""
        weighted = {op.weight_unit: op for op in self.ops if op.weight}
        expert = sum(math.prod(op.weight or ()) for op in weighted.values() if op.op == "grouped_gemm")
        return sum(math.prod(op.unit_weight or ()) for op in weighted.values()) - expert, expert


@attrs.frozen
class Program:
    """A whole checked file with its imports.

    ``model`` is None for a library file (layers and pipelines only); then the
    configuration fields are None too and no pass after check changes it.
    """

    files: tuple[str, ...]
    layers: tuple[s.LayerDef, ...]
    pipelines: tuple[s.PipelineDef, ...]
    model: Model | None = None
    cluster: Cluster | None = None
    mesh: Mesh | None = None
    train: Train | None = None
    fold: FoldSpec | None = None
    pipeline: s.PipelineDef | None = None
    #: profiles.Profile named by the cluster block (typed Any: frontend is a floor above core).
    profile: Any = None
    strands: Strands = Strands()
    partition: s.PartitionDef | None = None  # the partition block, applied by the partition pass
    #: The counts the planner chose for the partition block's ``by auto`` chunk statements
    #: ((index among the chunk statements, count), …); empty: not chosen (chains whole).
    chunk_counts: tuple[tuple[int, int | str], ...] = ()
    #: The sub-group the planner chose to run first for each collective of a group statement
    #: without ``first`` ((name, "inter" | "intra"), …; ``weights`` for ZeRO-3's gathers).
    group_orders: tuple[tuple[str, str], ...] = ()
    #: The half of each GEMM's backward the planner chose to run first ("dgrad" | "wgrad";
    #: None: not chosen) when the partition block does not say (dsl.passes.priority).
    backward_first: str | None = None
    #: The collectives of ``substitute X as auto`` statements the planner chose to substitute
    #: (Table 2's scalable form for their kind); one left out stays whole (pruned).
    substituted: tuple[str, ...] = ()
    #: The pipelines' ``g`` the planner chose for ``train { launch = auto }`` (None: not chosen).
    launch: int | None = None
    #: The pipelines' ``gb`` the planner chose for ``train { launch_backward = auto }``.
    launch_backward: int | None = None
    env: tuple[tuple[str, int], ...] = ()  # the names layer expressions see, set by the shapes pass
    forward: LayerDag | None = None  # set by the shapes pass
    backward: LayerDag | None = None  # set by the autodiff pass
    placement: Any = None  # fold.Placement (passes: a floor above core), set by the fold pass
    lowered: Lowered | None = None  # set by the lower pass

    def layer(self, name: str) -> s.LayerDef | None:
        """The layer definition called ``name``, if any."""
        return next((layer for layer in self.layers if layer.name == name), None)
