"""Seeded weights built from the layer DAG, and how each one is sharded over the mesh.

Every parameter is generated FULL (unsharded) from its own seed, derived from the run's
seed, the layer index and the op name, so a rank's shard and the reference model's full
weight are the same numbers whatever the mesh. Parameter names are ``layers.<i>.<op>`` for
layer weights and ``embedding``, ``final_norm``, ``lm_head`` for the model's ends.

How a weight splits is read off the DAG (the program's forward DAG against the same layer
instantiated without model parallelism, the reference DAGs of the run's
:class:`~dhelix.dsl.simulator.runplan.RunPlan`):

* a ``gemm`` whose input comes from an ``all_gather`` over tp is **column-parallel**: the
  output features are split. The full output is a concatenation of *blocks* that are each
  split in tp equal pieces, rank i taking piece i of every block, so a shard keeps the
  layout its consumer expects:

  - read by ``attention``: blocks ``[Q | K | V]`` of ``heads*d``, ``kv_heads*d``,
    ``kv_heads*d`` columns (head-major inside each). Rank i gets query heads
    ``[i*h/tp, (i+1)*h/tp)`` and kv heads ``[i*kv/tp, (i+1)*kv/tp)`` — exactly the kv heads
    those query heads read under GQA (query head j reads kv head ``j // (h/kv)``);
  - read by ``swiglu``: blocks ``[gate | up]``, so each rank pairs its gate and up columns;
  - otherwise one block;

* a ``gemm`` whose output goes to a ``reduce_scatter`` over tp is **row-parallel**: the
  input features are split in contiguous pieces (matching the head-major attention output
  or the column-parallel activation it reads);
* ``grouped_gemm`` weights ``[experts, in, out]`` split their experts over ep;
* norms, the router and everything else are replicated;
* the embedding ``[vocab, hidden]`` and the LM head ``[hidden, vocab]`` split the
  vocabulary over tp (Megatron's vocabulary-parallel layers).

Tied embeddings (the model setting ``tie_embeddings = 1``: the LM head is the embedding's
transpose, as Hugging Face's ``tie_word_embeddings``) are run as Megatron runs them: the LM
head is a copy of the embedding (the same numbers, transposed: the same shard on each tp
rank), and the two gradients are summed into both before anything reduces or reads them
(:func:`tie_grads`), so the two copies take the same update and stay equal; the global norm
counts the embedding once. The two must be on one pipeline rank (pp = 1, or fold u, whose
rank 0 holds the first and the last layers): the check says so otherwise.

A replicated weight used on sequence-parallel (tp-split) tokens gets a partial gradient on
each tp rank; its :attr:`ShardSpec.grad_sum` names ``tp``, the axis over which the executor
sums it (Megatron all-reduces the norm gradients the same way). With context parallelism
every weight is replicated over cp and each cp rank sees its own tokens, so every
``grad_sum`` also names ``cp`` (Megatron reduces over the DP × CP group) — but for the layer
weights under ZeRO-3, whose reduce-scatters run over the dp × cp group. Summing over dp is the
optimizer's business and is not recorded here (expert weights, split over ep, are summed over
the dp / ep replicas of their shard only: :meth:`WeightPlan.ep_sharded`).
"""

from __future__ import annotations

import hashlib
from typing import Mapping

import attrs
import torch

from dhelix.dsl.core.mesh import Mesh
from dhelix.dsl.core.program import LayerDag, Op, Program
from dhelix.dsl.passes.fsdp import is_fsdp
from dhelix.dsl.passes.runcheck import reads_tp_collective, tp_readers
from dhelix.dsl.frontend.modelcheck import TIE_SETTING

EMBEDDING, FINAL_NORM, LM_HEAD = "embedding", "final_norm", "lm_head"
#: The torch dtype of each dtype of :data:`dhelix.dsl.core.dtypes.DTYPES` that runs here
#: (fp8 is costed by the planner but not executed).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_MATRICES = ("gemm", "router", "grouped_gemm", "lm_head")


class ShardingError(ValueError):
    """A program whose weights this interpreter cannot shard (it names the op and why)."""


def param_name(layer: int, op: str) -> str:
    """The name of the weight of op ``op`` in layer ``layer`` (0-based, model order)."""
    return f"layers.{layer}.{op}"


def tied_embeddings(program: Program) -> bool:
    """Whether ``program``'s LM head is its embedding's transpose (``tie_embeddings = 1``)."""
    return program.model.get(TIE_SETTING, 0) == 1


def tie_grads(grads: dict) -> None:
    """Sum the gradients of the tied embedding and LM head into both, in place (``grads``
    keyed by parameter name; nothing when it does not hold both)."""
    if EMBEDDING in grads and LM_HEAD in grads:
        total = grads[EMBEDDING] + grads[LM_HEAD].t()
        grads[EMBEDDING].copy_(total)
        grads[LM_HEAD].copy_(total.t())


def torch_dtype(program: Program) -> torch.dtype:
    """The torch dtype of the program's ``dtype`` setting."""
    if program.model.dtype not in DTYPES:
        raise ShardingError(f"dtype {program.model.dtype} is not executable; use one of {', '.join(DTYPES)}")
    return DTYPES[program.model.dtype]


@attrs.frozen
class ShardSpec:
    """How one parameter is split: ``full`` shape, the split ``dim`` (None: replicated)
    over mesh ``axis``, the ``blocks`` of that dim that are split separately, the init
    ``kind`` and the axes its gradient is summed over."""

    full: tuple[int, ...]
    kind: str
    dim: int | None = None
    axis: str | None = None
    blocks: tuple[int, ...] = ()
    grad_sum: tuple[str, ...] = ()

    def take(self, full: torch.Tensor, index: int, parts: int) -> torch.Tensor:
        """Rank ``index``'s piece of ``full`` when the axis has ``parts`` ranks."""
        if self.dim is None or parts == 1:
            return full
        pieces, start = [], 0
        for block in self.blocks:
            piece = block // parts
            pieces.append(full.narrow(self.dim, start + index * piece, piece))
            start += block
        return torch.cat(pieces, dim=self.dim).contiguous()

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's piece, in axis order (inverse of take)."""
        if self.dim is None or len(shards) == 1:
            return shards[0]
        parts, cols = len(shards), []
        offsets = [0]
        for block in self.blocks:
            offsets.append(offsets[-1] + block // parts)
        for b in range(len(self.blocks)):
            cols += [s.narrow(self.dim, offsets[b], offsets[b + 1] - offsets[b]) for s in shards]
        return torch.cat(cols, dim=self.dim)

    def shard_shape(self, parts: int) -> tuple[int, ...]:
        """The shape of one piece over ``parts`` ranks."""
        if self.dim is None:
            return self.full
        shape = list(self.full)
        shape[self.dim] //= parts
        return tuple(shape)


def layer_specs(program: Program, full_fwd: LayerDag) -> dict[str, ShardSpec]:
    """The ShardSpec of every weighted op of the program's layer, by op name, against
    ``full_fwd``, the reference model's forward DAG."""
    fwd = program.forward
    specs = {}
    for op in fwd.ops:
        if op.weight is None or op.weight_name in specs:  # a partitioned op's chunks share one
            continue
        full_op = full_fwd.op(op.weight_name)
        spec = _op_spec(op, full_op, fwd, full_fwd, program.mesh)
        weight = tuple(op.unit_weight) if op.columns is None else (*op.weight[:-1], op.weight[-1] * op.columns[1])
        if spec.shard_shape(program.mesh.size(spec.axis) if spec.axis else 1) != weight:
            raise ShardingError(f"op {op.name}: weight {list(weight)} is not a {spec.kind} shard of "
                                f"the full {list(spec.full)} over {spec.axis}")
        specs[op.weight_name] = spec
    return specs


def _op_spec(op: Op, full_op: Op, fwd: LayerDag, full_fwd: LayerDag, mesh: Mesh) -> ShardSpec:
    full = tuple(full_op.weight)
    init = "matrix" if op.op in _MATRICES else op.op
    # Weights not split over tp see tp-split tokens under sequence parallelism.
    token_split = op.in_shapes[0][0] < full_op.in_shapes[0][0]
    partial = ("tp",) if token_split and mesh.size("tp") > 1 else ()
    if op.op == "grouped_gemm":
        return ShardSpec(full, init, 0, "ep", (full[0],), partial)
    if op.op != "gemm" or mesh.size("tp") == 1:
        return ShardSpec(full, init, grad_sum=partial)
    column = reads_tp_collective(fwd, op.inputs[0], "all_gather")
    row = any(reads_tp_collective(fwd, reader.name, "reduce_scatter") for reader in tp_readers(fwd, op.name))
    if column and row:
        raise ShardingError(f"gemm {op.name} both reads an all_gather and feeds a reduce_scatter over "
                            "tp: it cannot be both column- and row-parallel")
    if row:
        if dict(op.params).get("bias"):
            raise ShardingError(f"gemm {op.name} is row-parallel (it feeds a reduce_scatter over tp) and has a "
                                "bias, which every tp rank's partial sum would add once")
        return ShardSpec(full, init, 0, "tp", (full[0],))
    if column:
        return ShardSpec(full, init, 1, "tp", _column_blocks(op, full[1], fwd, full_fwd))
    if tuple(op.unit_weight) != full and op.columns is None:
        raise ShardingError(f"gemm {op.name} holds a {list(op.weight)} slice of its {list(full)} weight over tp, but "
                            "neither reads an all_gather over tp (column-parallel) nor feeds a reduce_scatter "
                            "over tp (row-parallel): the interpreter runs tensor parallelism in its "
                            "sequence-parallel form; a layer of all_reduce blocks (Megatron's without sequence "
                            "parallelism, stdlib llama_tp) runs once each all_reduce is substituted by a "
                            "reduce_scatter and an all_gather moved later (examples/tiny_llama_tp_to_sp_cpu.dhx)")
    return ShardSpec(full, init, grad_sum=partial)


def _column_blocks(op: Op, width: int, fwd: LayerDag, full_fwd: LayerDag) -> tuple[int, ...]:
    layouts = set()
    for reader in tp_readers(fwd, op.name):
        if reader.op == "attention":
            # A ring's first step reads qkv; the full layer has the unsplit attention op.
            params = dict(full_fwd.op(reader.weight_name.split(".step")[0]).params)
            heads, kv = params["heads"], params["kv_heads"]
            d = width // (heads + 2 * kv)
            layouts.add((heads * d, kv * d, kv * d))
        elif reader.op == "swiglu":
            layouts.add((width // 2, width // 2))
        else:
            layouts.add((width,))
    if len(layouts) > 1:
        raise ShardingError(f"the readers of {op.name} expect different column layouts: {sorted(layouts)}")
    return layouts.pop() if layouts else (width,)


def model_specs(program: Program) -> dict[str, ShardSpec]:
    """The ShardSpecs of the embedding, the final norm (the kind of the layer's first
    norm) and the LM head."""
    hidden, vocab = program.model.get("hidden"), program.model.get("vocab")
    norm = next((op.op for op in program.forward.ops if op.op in ("rmsnorm", "layernorm")), "rmsnorm")
    norm_shape = (hidden,) if norm == "rmsnorm" else (2, hidden)
    tp = program.mesh.size("tp")
    split = _sequence_parallel(program) and tp > 1
    return {
        EMBEDDING: ShardSpec((vocab, hidden), "embedding", 0, "tp", (vocab,)),
        FINAL_NORM: ShardSpec(norm_shape, norm, grad_sum=("tp",) if split else ()),
        LM_HEAD: ShardSpec((hidden, vocab), "matrix", 1, "tp", (vocab,)),
    }


def _sequence_parallel(program: Program) -> bool:
    env = dict(program.env)
    return program.forward.input_shape[0] < env["tokens"]


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name`` under run seed ``seed`` (stable across
    processes and Python versions, unlike ``hash``)."""
    digest = hashlib.sha256(f"dhelix/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_full(spec: ShardSpec, seed: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The full fp32 value of a parameter with ``spec``: matrices ~ N(0, 1/in), the
    embedding ~ N(0, 1), norm scales 1 + N(0, 0.1²) and biases N(0, 0.1²) (not exactly
    1 and 0, so tests exercise the norm weights). ``shape``: draw a tensor of that shape
    (one shard's) from the same distribution instead."""
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(shape or spec.full)

    def normal(*dims):
        return torch.randn(*dims, generator=gen, dtype=torch.float32)

    if spec.kind == "matrix":
        return normal(*shape) * spec.full[-2] ** -0.5
    if spec.kind == "embedding":
        return normal(*shape)
    if spec.kind == "rmsnorm":
        return 1 + 0.1 * normal(*shape)
    if spec.kind == "layernorm":
        return torch.stack((1 + 0.1 * normal(shape[1]), 0.1 * normal(shape[1])))
    raise ShardingError(f"no initialiser for weights of kind {spec.kind}")


def _partial_over_cp(specs: dict[str, ShardSpec]) -> dict[str, ShardSpec]:
    # A weight replicated over cp gets a gradient from each cp rank's tokens.
    return {name: attrs.evolve(spec, grad_sum=spec.grad_sum + ("cp",)) for name, spec in specs.items()}


class WeightPlan:
    """Every parameter of ``program``: its spec, its seeded full value and its shards.

    ``index`` arguments map a mesh axis to this rank's position in its group (as
    :meth:`Communicator.index` returns); missing axes count as 0. ``reference`` is the
    reference model's (forward, backward) DAGs, a run's
    :attr:`~dhelix.dsl.simulator.runplan.RunPlan.reference`; without it (a test's bare
    Program) they are derived from ``program`` by the dsl
    (:func:`~dhelix.dsl.passes.overrides.reference_dags`). With ``hf`` (a Hugging Face
    checkpoint folder, :mod:`.hf_weights`) the values are that checkpoint's instead of seeded
    ones, each shard read on its own.
    """

    def __init__(self, program: Program, seed: int = 0, reference: tuple[LayerDag, LayerDag] | None = None,
                 hf: str | None = None, stand_in: bool = False):
        if program.forward is None:
            raise ShardingError("the program has no model, so it has no weights")
        if reference is None:
            from dhelix.dsl.passes.overrides import reference_dags

            reference = reference_dags(program)
        self.program, self.seed = program, seed
        #: A rank run alone (``--as-rank``): each shard drawn on its own, at its shape, from the
        #: full tensor's distribution (not a slice of it: the numbers are stand-ins there, and
        #: drawing a 70B model's full tensors to keep an eighth would dominate the start).
        self.stand_in = stand_in
        #: Whether the LM head is the embedding's transpose (:func:`tied_embeddings`).
        self.tied = tied_embeddings(program)
        self.full_forward, self.full_backward = reference
        self.layer_specs = layer_specs(program, self.full_forward)
        self.model_specs = model_specs(program)
        if program.mesh.size("cp") > 1:
            # ZeRO-3's reduce-scatters over dp × cp sum the layer weights' pieces over cp already.
            if not is_fsdp(program):
                self.layer_specs = _partial_over_cp(self.layer_specs)
            self.model_specs = _partial_over_cp(self.model_specs)
        self.layers = program.model.get("layers")
        #: The vocabulary and tp sizes (:meth:`vocab_start`, asked per micro-batch), found once.
        self._vocab_tp = (program.model.get("vocab"), program.mesh.size("tp"))
        #: The parameters of the layer's first norm (its ``inv_eps``), which the final norm shares.
        self.norm_params = next((dict(op.params) for op in self.full_forward.ops
                                 if op.op in ("rmsnorm", "layernorm")), {})
        #: Whether the layer input is split over tp (then the model's ends reduce-scatter
        #: and all-gather over tp instead of all-reducing).
        self.sequence_parallel = _sequence_parallel(program)
        self.source = None
        if hf is not None:
            from .hf_weights import HFWeights

            self.source = HFWeights(hf, self)

    def spec(self, name: str) -> ShardSpec:
        """The ShardSpec of parameter ``name``."""
        if name in self.model_specs:
            return self.model_specs[name]
        return self.layer_specs[name.split(".", 2)[2]]

    def names(self, layers=None) -> list[str]:
        """Parameter names: the model's ends and every weight of ``layers`` (default all)."""
        layers = range(self.layers) if layers is None else layers
        return [EMBEDDING, FINAL_NORM, LM_HEAD] + [param_name(i, op) for i in layers for op in self.layer_specs]

    def full(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full (unsharded) value of parameter ``name``."""
        if self.source is not None:
            return self.source.full(name).to(dtype)
        if self.tied and name == LM_HEAD:
            return self.full(EMBEDDING, dtype).t().contiguous()
        if self.tied and name == EMBEDDING:  # it is the LM head too: scaled as a matrix, N(0, 1/hidden)
            spec = self.spec(name)
            return (init_full(spec, param_seed(self.seed, name)) * spec.full[1] ** -0.5).to(dtype)
        return init_full(self.spec(name), param_seed(self.seed, name)).to(dtype)

    def shard(self, name: str, index: Mapping[str, int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """This rank's piece of parameter ``name``."""
        spec = self.spec(name)
        if spec.dim is None:
            return self.full(name, dtype)
        parts = self.program.mesh.size(spec.axis)
        if self.source is not None:
            return self.source.shard(name, index.get(spec.axis, 0), parts).to(dtype)
        if self.stand_in:
            seed = param_seed(self.seed, f"{name}/{index.get(spec.axis, 0)}")
            return init_full(spec, seed, spec.shard_shape(parts)).to(dtype)
        return spec.take(self.full(name, dtype), index.get(spec.axis, 0), parts)

    def layer_weights(self, layer: int, index: Mapping[str, int], dtype=torch.float32,
                      device="cpu") -> dict[str, torch.Tensor]:
        """The weights of layer ``layer`` on this rank, keyed by op name (what LayerRun takes)."""
        return {op: self.shard(param_name(layer, op), index, dtype).to(device) for op in self.layer_specs}

    def join(self, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor of parameter ``name`` (or of its gradient) from the pieces of
        the ranks along its split axis, in axis order."""
        spec = self.spec(name)
        parts = self.program.mesh.size(spec.axis) if spec.axis else 1
        if len(shards) != parts:
            raise ValueError(f"{name} is split in {parts} pieces over {spec.axis}, got {len(shards)}")
        return spec.join(shards)

    def ep_sharded(self, names) -> list[str]:
        """Those of parameter ``names`` split over ep (the experts): their gradients are summed
        over the replicas of the same expert shard only (:mod:`.optim`)."""
        return [name for name in names if self.spec(name).axis == "ep"]

    def vocab_start(self, index: Mapping[str, int]) -> int:
        """The first vocabulary row of this rank's embedding and LM-head shards."""
        vocab, tp = self._vocab_tp
        return index.get("tp", 0) * vocab // tp
