"""The operator library: what a layer DAG may apply, with signatures and shape rules.

Every tensor inside a layer is a per-GPU 2-D activation ``[tokens, features]``. An operator
takes tensors, integer expressions, mesh axes (``tp``, ``cp``, ``ep``…) and flags
(``causal``); its shape rule returns the output shape or raises :class:`ShapeMismatch`
naming the argument at fault. ``kind`` is ``compute`` or ``comm``; ``op_class`` groups
operators for the planner's constraints (``forbid attention.bwd with gemm``).
"""

from __future__ import annotations

from typing import Callable

import attrs

from dhelix.dsl.core.mesh import MESH_AXES  # noqa: F401 (the axes an op's axis argument names)

Shape = tuple[int, int]

TENSOR, INT, AXIS, FLAG = "tensor", "int", "axis", "flag"


class ShapeMismatch(Exception):
    """Raised by a shape rule: ``arg`` is the index of the offending argument."""

    def __init__(self, message: str, arg: int, notes: tuple[str, ...] = ()):
        super().__init__(message)
        self.message, self.arg, self.notes = message, arg, notes


@attrs.frozen
class Param:
    """One parameter of an operator signature."""

    name: str
    kind: str  # tensor | int | axis | flag
    optional: bool = False
    choices: tuple[str, ...] = ()  # for flags


@attrs.frozen
class OpSpec:
    """An operator: its signature, kind, class and shape rule."""

    name: str
    params: tuple[Param, ...]
    kind: str  # compute | comm
    op_class: str
    infer: Callable[[list], Shape]
    weight: Callable[[list], tuple[int, ...] | None] = lambda args: None
    doc: str = ""

    def usage(self) -> str:
        """The signature as a user writes it, e.g. ``gemm(x, in_features, out_features)``."""
        parts = [f"[{p.name}]" if p.optional else p.name for p in self.params]
        return f"{self.name}({', '.join(parts)})"


def _same(args):
    return args[0]


def _gemm(args):
    (tokens, features), in_f, out_f = args[0], args[1], args[2]
    if features != in_f:
        raise ShapeMismatch(f"gemm input has {features} features but in_features is {in_f}", 1,
                            (f"the input is [{tokens}, {features}]",))
    _positive(out_f, 2, "out_features")
    if _gemm_bias(args) not in (0, 1):
        raise ShapeMismatch(f"bias = {args[3]}: write bias = 1 for a bias (or leave it out)", 3)
    return (tokens, out_f)


def _gemm_bias(args) -> int:
    """A gemm's ``bias`` argument: 1 adds a bias (its weight's last row), 0 or absent none."""
    return args[3] if len(args) > 3 and args[3] is not None else 0


def gemm_weight_shape(in_features: int, out_features: int, bias: bool) -> tuple[int, int]:
    """The weight of a gemm: ``[in, out]``, with one more row (the bias) when it has one."""
    return (in_features + int(bias), out_features)


def _grouped_gemm(args):
    _positive(args[3], 3, "local_experts")
    return _gemm(args[:3])


def _positive(value: int, arg: int, what: str) -> None:
    if value <= 0:
        raise ShapeMismatch(f"{what} must be positive, got {value}", arg)


def _attention(args):
    (tokens, features), heads, kv_heads = args[0], args[1], args[2]
    _positive(heads, 1, "heads")
    _positive(kv_heads, 2, "kv_heads")
    if heads % kv_heads:
        raise ShapeMismatch(f"{heads} query heads are not a multiple of {kv_heads} kv heads", 2,
                            ("grouped-query attention shares each kv head among heads/kv_heads queries",))
    width = heads + 2 * kv_heads
    if features % width:
        raise ShapeMismatch(f"qkv has {features} features, not a multiple of heads + 2*kv_heads = {width}",
                            0, ("the qkv projection must produce (heads + 2*kv_heads) * head_dim features",))
    head_dim = features // width
    rope = args[5] if len(args) > 5 else None
    if rope is not None:
        _positive(rope, 5, "rope")
        if head_dim % 2:
            raise ShapeMismatch(f"rotary embeddings turn pairs of features, but head_dim is {head_dim}", 5,
                                ("give heads and hidden with an even hidden / heads",))
    _check_rope_scaling(args[6:10], rope is not None)
    return (tokens, heads * head_dim)


#: Llama 3's RoPE scaling (``rope_type`` "llama3"), all four or none: the frequencies of
#: wavelengths above ``rope_original / rope_low_freq`` are divided by ``rope_factor``, those
#: below ``rope_original / rope_high_freq`` kept, those between blended.
ROPE_SCALING = ("rope_factor", "rope_low_freq", "rope_high_freq", "rope_original")


def _check_rope_scaling(values, rope: bool) -> None:
    given = [v for v in values if v is not None]
    if not given:
        return
    first = 6 + next(i for i, v in enumerate(values) if v is not None)
    if not rope:
        raise ShapeMismatch("RoPE scaling needs rotary embeddings: give rope = θ too", first)
    if len(given) != len(ROPE_SCALING):
        raise ShapeMismatch(f"Llama 3's RoPE scaling takes all of {', '.join(ROPE_SCALING)}", first)
    for offset, value in enumerate(values):
        _positive(value, 6 + offset, ROPE_SCALING[offset])
    if values[2] <= values[1]:
        raise ShapeMismatch("rope_high_freq must exceed rope_low_freq", 8)


def _norm(args):
    if len(args) > 1 and args[1] is not None:
        _positive(args[1], 1, "inv_eps")
    return args[0]


def _swiglu(args):
    tokens, features = args[0]
    if features % 2:
        raise ShapeMismatch(f"swiglu needs an even feature count (gate and up halves), got {features}", 0)
    return (tokens, features // 2)


def _add(args):
    if args[0] != args[1]:
        raise ShapeMismatch(f"add of [{args[0][0]}, {args[0][1]}] and [{args[1][0]}, {args[1][1]}]", 1,
                            ("both operands of add must have the same shape",))
    return args[0]


def _all_gather(args):
    (tokens, features), (_, size) = args[0], args[1]
    return (tokens * size, features)


def _reduce_scatter(args):
    (tokens, features), (axis, size) = args[0], args[1]
    if tokens % size:
        raise ShapeMismatch(f"reduce_scatter of {tokens} tokens over {axis} = {size} does not divide", 0)
    return (tokens // size, features)


def _router(args):
    _positive(args[1], 1, "experts")
    return (args[0][0], args[1])


def _permute(args):
    (tokens, features), (score_tokens, _), top_k = args
    if score_tokens != tokens:
        raise ShapeMismatch(f"router scores cover {score_tokens} tokens but the input has {tokens}", 1)
    _positive(top_k, 2, "top_k")
    return (tokens * top_k, features)


def _unpermute(args):
    (tokens, features), (score_tokens, _), top_k = args
    _positive(top_k, 2, "top_k")
    if tokens != score_tokens * top_k:
        raise ShapeMismatch(f"unpermute of {tokens} routed tokens, but the scores route "
                            f"{score_tokens} tokens x top_k {top_k} = {score_tokens * top_k}", 0)
    return (score_tokens, features)


_X = Param("x", TENSOR)
_AXIS = Param("axis", AXIS)
#: A norm's epsilon as its reciprocal (the language's numbers are integers): 1e-6 is 1000000.
_INV_EPS = Param("inv_eps", INT, optional=True)


def _spec(name, params, kind, op_class, infer, weight=lambda a: None, doc=""):
    return OpSpec(name, tuple(params), kind, op_class, infer, weight, doc)


OPS: dict[str, OpSpec] = {op.name: op for op in [
    _spec("rmsnorm", [_X, _INV_EPS], "compute", "norm", _norm, lambda a: (a[0][1],),
          "RMSNorm over features; epsilon 1 / inv_eps (default 1e-5)"),
    _spec("layernorm", [_X, _INV_EPS], "compute", "norm", _norm, lambda a: (2, a[0][1]),
          "LayerNorm (scale and bias); epsilon 1 / inv_eps (default 1e-5)"),
    _spec("gemm", [_X, Param("in_features", INT), Param("out_features", INT), Param("bias", INT, optional=True)],
          "compute", "gemm", _gemm, lambda a: gemm_weight_shape(a[1], a[2], bool(_gemm_bias(a))),
          "x @ W, W sharded as written; bias = 1: x @ W + b, b the weight's last row"),
    _spec("attention", [Param("qkv", TENSOR), Param("heads", INT), Param("kv_heads", INT),
                        Param("mask", FLAG, choices=("causal", "full")),
                        Param("ring", AXIS, optional=True), Param("rope", INT, optional=True),
                        *(Param(name, INT, optional=True) for name in ROPE_SCALING)],
          "compute", "attention", _attention,
          doc="scaled dot-product attention with GQA; a ring over `ring` (cp) when its size > 1; "
              "rotary position embeddings of base `rope` on q and k when given, with Llama 3's "
              "scaling when the four rope_* sizes are given"),
    _spec("swiglu", [_X], "compute", "activation", _swiglu, doc="silu(gate) * up over two halves"),
    _spec("gelu", [_X], "compute", "activation", _same),
    _spec("add", [Param("a", TENSOR), Param("b", TENSOR)], "compute", "add", _add,
          doc="residual add (bias-dropout-add)"),
    _spec("all_gather", [_X, _AXIS], "comm", "all_gather", _all_gather, doc="gather tokens over axis"),
    _spec("reduce_scatter", [_X, _AXIS], "comm", "reduce_scatter", _reduce_scatter,
          doc="sum over axis, scatter tokens"),
    _spec("all_reduce", [_X, _AXIS], "comm", "all_reduce", _same,
          doc="sum over axis, every rank gets the sum (Megatron TP without SP; partition may "
              "substitute reduce_scatter + all_gather)"),
    _spec("all_to_all", [_X, _AXIS], "comm", "all_to_all", _same, doc="exchange routed tokens"),
    _spec("send", [_X, _AXIS], "comm", "send", _same, doc="point-to-point to the next rank of axis"),
    _spec("recv", [_X, _AXIS], "comm", "recv", _same, doc="point-to-point from the previous rank"),
    _spec("router", [_X, Param("experts", INT)], "compute", "router", _router,
          lambda a: (a[0][1], a[1]), "MoE gate: scores per expert"),
    _spec("permute", [_X, Param("scores", TENSOR), Param("top_k", INT)], "compute", "permute",
          _permute, doc="replicate each token top_k times, grouped by expert"),
    _spec("grouped_gemm", [_X, Param("in_features", INT), Param("out_features", INT),
                           Param("local_experts", INT)], "compute", "gemm", _grouped_gemm,
          lambda a: (a[3], a[1], a[2]), "one GEMM per local expert"),
    _spec("unpermute", [_X, Param("scores", TENSOR), Param("top_k", INT)], "compute", "permute",
          _unpermute, doc="weighted sum of each token's top_k expert outputs"),
]}

#: Layout operators the partition pass makes (a layer never writes them): ``slice`` takes
#: chunk ``index`` of ``parts`` of a tensor along ``dim`` (0 tokens, 1 features), ``concat``
#: joins ``parts`` chunks back; ``rest`` and ``merge`` split a chain at the stages of a
#: group-partitioned all_gather (``chunk ag1 + qkv by stages``): which rank blocks the first
#: stage brings depends on the rank (its node, or its place on the node), so they ask the
#: communicator at run time. Along tokens a tensor gathered over a group holds ``blocks``
#: rank blocks (one per rank, in rank order) and a chunk takes its share of every block, so
#: that the chunks of a collective are collectives of chunks. Shapes come from the pass.
LAYOUT_OPS = {"slice": "chunk index of parts along dim", "concat": "parts chunks joined along dim",
              "rest": "the rank blocks a group-partitioned gather's first stage did not bring",
              "merge": "the first stage's blocks and the rest put back in rank order",
              "others": "the blocks of every rank group but this rank's (by stages3)",
              "pick": "the input whose root is this rank (after reduces of distinct roots)"}

#: Table 2's scalable substitutions of a reduce_scatter and an all_gather (``substitute rs1
#: as reduce``, ``substitute ag1 as broadcast``): one rooted collective per rank of the
#: group, rank j the root of the j-th, over rank block j of the tokens. The partition pass
#: makes them (a layer never writes them); their ``root`` parameter is the root's index in
#: the group. A ``reduce`` leaves the sum on its root and zeros elsewhere (so that as a
#: broadcast's transpose it gives each rank only its own gradient), a ``broadcast`` the
#: root's input everywhere; each is the other's transpose.
DISTINCT_ROOTS = {"reduce_scatter": "reduce", "all_gather": "broadcast"}
#: The collective a rooted collective of :data:`DISTINCT_ROOTS` is one part of.
ROOTED_PART_OF = {rooted: whole for whole, rooted in DISTINCT_ROOTS.items()}
ROOT = "root"


#: How each operator's dimensions split (Centauri Table 3), for the partition pass: ``OD``
#: (an outer dimension: chunks are independent), ``CD`` (a contracted dimension: chunks give
#: partial sums that need a reduction) or ``ND`` (not divisible: every output reads the
#: whole dimension), with the reason for CD and ND. A layer tensor is [tokens, features].
#: ``outputs`` is a GEMM's output features, the columns of its weight (``y = x W``): OD for
#: the GEMM alone (each chunk reads the whole input and its own columns of the weight), so a
#: chunk there splits the weight too, and under ZeRO-3 its all-gather (Centauri's workload
#: partition of FSDP's collectives).
OD, CD, ND = "OD", "CD", "ND"
PARTITION_DIMS = ("tokens", "features", "outputs")
OUTPUTS = PARTITION_DIMS[2]
_TOKEN_WISE = ("rmsnorm", "layernorm", "gemm", "swiglu", "gelu", "add", "router",
               "all_gather", "reduce_scatter", "all_reduce")
_TOKEN_MIXING = {
    "attention": "attention mixes the tokens of a sequence",
    "permute": "permute routes tokens to experts by the scores of all of them",
    "unpermute": "unpermute gathers each token's expert outputs from the routed tokens",
    "grouped_gemm": "grouped_gemm runs over each expert's block of routed tokens",
    "all_to_all": "all_to_all exchanges routed tokens by their counts",
    "send": "send and recv carry a whole activation", "recv": "send and recv carry a whole activation",
}
_FEATURE_SPLITS = {
    "gemm": (CD, "gemm contracts its input features"),
    "grouped_gemm": (CD, "grouped_gemm contracts its input features"),
    "router": (CD, "router contracts its input features"),
    "rmsnorm": (ND, "rmsnorm normalises over the features (the hidden dimension)"),
    "layernorm": (ND, "layernorm normalises over the features (the hidden dimension)"),
    "swiglu": (ND, "swiglu pairs the gate half of the features with the up half"),
    "attention": (ND, "attention splits its features into q, k and v heads"),
    "gelu": (OD, ""), "add": (OD, ""), "all_gather": (OD, ""), "reduce_scatter": (OD, ""),
    "all_reduce": (OD, ""), "permute": (OD, ""), "unpermute": (OD, ""), "all_to_all": (ND, "all_to_all "
    "exchanges whole routed rows"), "send": (OD, ""), "recv": (OD, ""),
}

_OUTPUT_SPLITS = {
    "grouped_gemm": "grouped_gemm's weights are split by expert over ep",
    "router": "router's top-k reads every expert's score",
}


def dimension_split(op: str, dim: str) -> tuple[str, str]:
    """How operator ``op`` splits along ``dim`` (one of PARTITION_DIMS): (OD | CD | ND, why)."""
    if dim == "tokens":
        if op in _TOKEN_WISE:
            return OD, ""
        return ND, _TOKEN_MIXING.get(op, f"{op} is not token-wise")
    if dim == OUTPUTS:
        if op == "gemm":
            return OD, ""
        return ND, _OUTPUT_SPLITS.get(op, f"only a gemm's output features are the columns of its weight; {op} "
                                          "has no such weight")
    return _FEATURE_SPLITS.get(op, (ND, f"{op} has no feature split"))


# -- derived backward kinds -------------------------------------------------------------------

#: Operators with a weight whose backward autodiff splits in two: ``.dgrad`` (the input
#: gradient) and ``.wgrad`` (the weight gradient, which feeds nothing else in the layer and
#: so may move). Every other operator gets one ``.bwd`` (a norm's computes both gradients).
SPLIT_OPS = frozenset({"gemm", "grouped_gemm", "router"})

#: The model's work outside its layers, as `dhelix profile` times it and the simulator prices
#: it: the vocabulary-parallel embedding (lookup and its tp reduction) and the LM head (final
#: norm, gather, head GEMM, vocabulary-parallel cross-entropy), forward and backward.
END_OPS = ("embedding", "embedding.bwd", "lm_head", "lm_head.bwd")

#: The name `dhelix profile` times one optimizer step under (beside the ops; not an op).
OPTIMIZER_STEP = "optimizer"
#: The key `dhelix profile` times one whole forward and backward of the layer under (beside its
#: ops alone): the difference is the host's time between the ops (``kernels.overhead_us``).
LAYER_PASS = "layer_pass"

#: The parts of a backward: the input gradient, the weight gradient, or an op's whole backward.
DGRAD, WGRAD, BWD = "dgrad", "wgrad", "bwd"


def backward_parts(op: str) -> tuple[str, ...]:
    """The parts autodiff derives for operator ``op``: (dgrad, wgrad) for a split op, else (bwd,)."""
    return (DGRAD, WGRAD) if op in SPLIT_OPS else (BWD,)


def derived_kind(op: str, part: str) -> str:
    """The ``Op.op`` of part ``part`` of operator ``op``'s backward (``gemm_wgrad``, ``rmsnorm_bwd``)."""
    return f"{op}_{part}"


def part_of(kind: str) -> str | None:
    """The backward part (dgrad | wgrad | bwd) an ``Op.op`` computes; None for a forward
    operator and for a collective (a transposed collective is named like a forward one)."""
    base, _, part = kind.rpartition("_")
    return part if base and part in (DGRAD, WGRAD, BWD) else None


def base_kind(kind: str) -> str:
    """The operator an ``Op.op`` derives from: ``gemm`` for ``gemm_dgrad``, itself for a forward op."""
    return kind.rpartition("_")[0] if part_of(kind) else kind


def is_wgrad(op) -> bool:
    """Whether :class:`~dhelix.dsl.core.program.Op` ``op`` only computes a weight gradient
    (what a W action runs when the schedule splits the weight gradients off)."""
    return part_of(op.op) == WGRAD


#: Forward operators whose outputs ``train { recompute = selective }`` drops between a layer's
#: forward and its backward and computes again when the backward starts: the cheap,
#: memory-bound ones (norms, activations, adds). GEMM, attention and collective outputs,
#: which cost compute or traffic to make, are kept (torchtitan's op-level selective
#: checkpointing keeps the matmuls' outputs the same way).
SELECTIVE_RECOMPUTE = frozenset({"rmsnorm", "layernorm", "swiglu", "gelu", "add"})


def selective_drops(forward_ops, backward_ops) -> tuple[str, ...]:
    """The forward ops, in order, whose outputs selective recomputation drops: one of
    :data:`SELECTIVE_RECOMPUTE` whose output a backward op saves and whose inputs the
    backward saves too and keeps (so computing it again costs nothing to keep)."""
    saved = {name for op in backward_ops for name in op.saved}
    dropped: list[str] = []
    for op in forward_ops:
        if op.op in SELECTIVE_RECOMPUTE and op.name in saved and op.inputs \
                and all(name in saved and name not in dropped for name in op.inputs):
            dropped.append(op.name)
    return tuple(dropped)


#: The parameter (set True) of a ZeRO-3 gradient reduce-scatter whose gradient only wgrads
#: compute (:mod:`dhelix.dsl.passes.fsdp`): it goes with them when W is split off.
WEIGHT_PASS = "weight_pass"


#: The parameter (set True) of the node-local stage of a group-partitioned all_gather or
#: reduce_scatter that runs with the group's rank blocks grouped by place on the node
#: rather than in the group's order (:mod:`dhelix.dsl.passes.partition`): a gather across
#: nodes first leaves the blocks intra-major and the node-local gather puts them back in
#: order after it; a reduce-scatter inside the node first reorders them before it (the
#: adjoint: a collective's transpose keeps the parameter). Over a declared topology
#: (``cluster { levels { … } }``) it names the stages' sub-axes in the order the blocks lie,
#: outermost first, instead of True: after an all_gather's last stage the blocks go from that
#: order to the group's, before a reduce_scatter's first stage from the group's to that order.
REGROUP = "regroup"

#: The parameter naming the level (``island``) whose link a stage of a group partition over
#: a declared topology crosses: the profile's ``links.<level>`` prices it where it has one.
LINK = "link"


def in_weight_pass(op) -> bool:
    """Whether ``op`` runs in a split schedule's W action rather than its B: a wgrad, or the
    reduce-scatter of a gradient that only wgrads compute."""
    return is_wgrad(op) or (WEIGHT_PASS, True) in op.params
