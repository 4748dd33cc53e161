"""The checked program IR: configuration, definitions and instantiated layer DAGs.

Frozen attrs classes; spans are keyword-only and excluded from equality. Passes return new
objects with :func:`attrs.evolve` instead of mutating.
"""

from __future__ import annotations

import attrs

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.mesh import Mesh
from dhelix.dsl.core.span import span_field

Shape = tuple[int, int]


@attrs.frozen
class Model:
    """The model block: integer settings in source order, dtype and the layer DAG's name."""

    name: str
    settings: tuple[tuple[str, int], ...]
    dtype: str
    layer: str
    span: object = span_field()

    def get(self, key: str, default: int | None = None) -> int | None:
        """The integer setting ``key`` or ``default``."""
        return dict(self.settings).get(key, default)


@attrs.frozen
class Cluster:
    nodes: int
    gpus_per_node: int
    profile: str | None
    span: object = span_field()


@attrs.frozen
class Train:
    """The train block: micro-batch size and count per step; the seed of weights and data
    and the default step count of `dhelix run`."""

    micro_batch: int
    microbatches: int
    seed: int = 0
    steps: int | None = None
    span: object = span_field()


@attrs.frozen
class FoldSpec:
    """``fold none`` (v = 1), ``fold u`` (v = 2) or ``fold loop(v)``."""

    kind: str
    v: int
    span: object = span_field()


@attrs.frozen
class Strands:
    """Strand-pairing constraints; defaults when the program has no strands block."""

    overlap: tuple[str, ...] = ("tp", "cp", "ep")
    comm_with_comm: bool = True
    movable: tuple[s.Selector, ...] = (s.Selector(("wgrad",)),)
    forbid: tuple[tuple[s.Selector, s.Selector], ...] = ()


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
    movable: bool = False
    forward: str | None = None  # the forward op a backward op derives from
    saved: tuple[str, ...] = ()
    params: tuple[tuple[str, object], ...] = ()
    grad: GradFlow | None = None
    span: object = span_field()


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


@attrs.frozen
class Program:
    """A whole checked file with its imports.

    ``model`` is None for a library file (layers and pipelines only); then the
    configuration fields are None too and no DAG is instantiated.
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
    profile: object = None  # profiles.Profile named by the cluster block
    strands: Strands = Strands()
    env: tuple[tuple[str, int], ...] = ()
    forward: LayerDag | None = None
    backward: LayerDag | None = None
    placement: object = None  # fold.Placement, set by the fold pass
    lowered: object = None  # schedule.Lowered, set by the lower pass

    def layer(self, name: str) -> s.LayerDef | None:
        """The layer definition called ``name``, if any."""
        return next((layer for layer in self.layers if layer.name == name), None)
