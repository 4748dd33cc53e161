"""ZeRO-3 / FSDP at run time: the dp shards of the layer weights and their collectives.

Under ``train { zero = 3 }`` with dp > 1 (:func:`dhelix.dsl.passes.fsdp.is_fsdp`; with cp > 1
read dp as the dp × cp group ``dp.cp`` throughout) each rank
keeps, of every layer weight, the tensor- and pipeline-parallel shard it would hold
otherwise (:mod:`.weights`) flattened, zero-padded to a multiple of dp and cut into dp equal
pieces: piece ``i`` lives on dp rank ``i`` (PyTorch FSDP's flat sharding). The layer DAGs
name the traffic (:mod:`dhelix.dsl.passes.fsdp`): a ``param_gather`` op all-gathers the
pieces into the weight before an op reads it, a ``grad_scatter`` op reduce-scatters a
micro-batch's weight gradient into this rank's piece, where the micro-batches' pieces add up.
A gemm chunked along its outputs (``chunk fc1 along outputs by 2``) has its weight cut per
column block: each block is flattened, padded and cut into dp pieces on its own, and a rank's
piece is its pieces of the blocks one after the other (:func:`piece`, :func:`block_of`), so
each chunk's gather and reduce-scatter moves its block only.

The optimizer then updates pieces only (:mod:`.optim`: their gradients are summed over dp
already); checks and checkpoints gather them back (:meth:`FlatShards.gather`).

Under hybrid sharding (``train { shard = K }``, HSDP) the same holds over ``dp.shard``, the
groups of ``K`` consecutive dp ranks: ``K`` pieces, gathered and reduce-scattered inside the
group; the optimizer all-reduces the pieces' gradients over ``dp.replicate`` (the ranks
holding the same piece) before it updates them.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F

from dhelix.dsl.core.mesh import REPLICATE, SHARD
from dhelix.dsl.core.program import Program
from dhelix.dsl.passes.fsdp import padded_elements

from .blocks import regrouped
from .comm import Communicator, Pending


class FlatShards:
    """Which of a rank's parameters are ZeRO-3 pieces, and how to cut and join them.

    ``enabled``: the program shards (ZeRO-3, dp > 1); the weights are cut into ``pieces``
    pieces over ``axis`` (``dp``, or ``dp.shard`` under hybrid sharding) and ``index`` is this
    rank's position there; :attr:`shapes` maps each sharded parameter's name to the shape of
    the (tensor-parallel) shard it is a piece of, as :meth:`add` records them."""

    def __init__(self, enabled: bool, pieces: int, index: int, axis: str = "dp",
                 columns: Mapping[str, int] | None = None, by_columns: frozenset = frozenset()):
        self.enabled, self.pieces, self.index, self.axis = enabled, pieces, index, axis
        self.shapes: dict[str, tuple[int, ...]] = {}
        #: Weights (by op name) chunked along their outputs, and into how many column blocks:
        #: each block is flattened, padded and cut on its own, and a piece is the blocks'
        #: pieces one after the other, so a chunk's gather moves its columns only.
        self.columns = dict(columns or {})
        #: Weights (by op name) chunked along their outputs at their gather's stages: a
        #: piece is a block of columns (:func:`column_piece`).
        self.by_columns = frozenset(by_columns)

    @classmethod
    def of(cls, program: Program, comm: Communicator, enabled: bool, axis: str) -> "FlatShards":
        """The (still empty) layout of ``program`` on this rank: its layer weights dp pieces
        over ``axis`` where ``enabled`` (the RunPlan's ExecFacts say: ZeRO-3 with dp > 1)."""
        ops = program.forward.ops if program.forward is not None else ()
        columns = {op.weight_name: op.columns[1] for op in ops if op.weight and op.columns}
        staged = frozenset(op.weight_name for op in ops if op.weight and op.staged)
        return cls(enabled, comm.size(axis), comm.index(axis), axis, columns, staged)

    def blocks(self, name: str) -> int:
        """How many column blocks parameter (or layer op) ``name``'s pieces are made of."""
        return self.columns.get(_op_of(name), 1)

    def _piece(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if _op_of(name) in self.by_columns:
            return column_piece(tensor, self.pieces, self.index)
        return piece(tensor, self.pieces, self.index, self.blocks(name))

    @property
    def replicated_over(self) -> str | None:
        """The axis over which the pieces' gradients are still all-reduced: ``dp.replicate``
        under hybrid sharding, else None (the reduce-scatter over dp summed them)."""
        return f"dp.{REPLICATE}" if self.axis == f"dp.{SHARD}" else None

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def add(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Record parameter ``name`` (this rank's tensor-parallel shard ``tensor``) as sharded
        and return this rank's piece of it (a new contiguous tensor)."""
        self.shapes[name] = tuple(tensor.shape)
        return self._piece(name, tensor)

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``tensor`` if ``name`` is sharded, else ``tensor``."""
        return self._piece(name, tensor) if name in self.shapes else tensor

    def gather(self, comm: Communicator, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` by name with every sharded one gathered over :attr:`axis` and shaped
        back (collective over that axis; the others are passed through)."""
        out = dict(tensors)
        for name in sorted(set(tensors) & set(self.shapes)):
            flat, shape, blocks = comm.all_gather(tensors[name].contiguous(), self.axis), self.shapes[name], \
                self.blocks(name)
            if _op_of(name) in self.by_columns:
                out[name] = from_column_pieces(flat, shape, self.pieces)
                continue
            if blocks == 1:
                out[name] = unflatten(flat, shape)
                continue
            # Rank r's piece is [block 0's piece r | block 1's piece r | …].
            by_block = flat.view(self.pieces, blocks, -1).transpose(0, 1)
            block_shape = (*shape[:-1], shape[-1] // blocks)
            out[name] = torch.cat([unflatten(b.reshape(-1), block_shape) for b in by_block], dim=-1)
        return out


def _op_of(name: str) -> str:
    """The layer op of parameter ``name`` (``layers.3.fc1`` → ``fc1``), or ``name``."""
    return name.split(".", 2)[2] if name.startswith("layers.") else name


def column_piece(tensor: torch.Tensor, dp: int, index: int) -> torch.Tensor:
    """Piece ``index`` of ``dp`` of a weight cut into column blocks (``chunk G along outputs
    by stages``): its block ``index`` of columns, flattened (the columns must divide)."""
    return tensor.chunk(dp, dim=-1)[index].contiguous().reshape(-1)


def column_pieces(tensor: torch.Tensor, dp: int) -> torch.Tensor:
    """Every :func:`column_piece` of ``tensor`` one after the other (what a gather gives)."""
    return torch.cat([block.reshape(-1) for block in tensor.chunk(dp, dim=-1)])


def from_column_pieces(flat: torch.Tensor, shape: tuple[int, ...], dp: int) -> torch.Tensor:
    """The columns that ``flat``, :func:`column_piece` pieces of a weight of ``shape`` cut
    into ``dp`` blocks one after the other, hold, side by side (all ``dp`` of them: the weight)."""
    rows, width = math.prod(shape[:-1]), shape[-1] // dp
    count = flat.numel() // (rows * width)
    return flat.view(count, rows, width).permute(1, 0, 2).reshape(*shape[:-1], count * width)


def padded_flat(tensor: torch.Tensor, dp: int) -> torch.Tensor:
    """``tensor`` flattened and zero-padded to a multiple of ``dp`` elements."""
    flat = tensor.reshape(-1)
    total = padded_elements(tuple(tensor.shape), dp)
    return F.pad(flat, (0, total - flat.numel())) if total != flat.numel() else flat


def piece(tensor: torch.Tensor, dp: int, index: int, blocks: int = 1) -> torch.Tensor:
    """Piece ``index`` of ``dp`` of ``tensor`` flattened and zero-padded to a multiple of dp;
    with ``blocks`` > 1, of each of its ``blocks`` column blocks, one after the other."""
    if blocks > 1:
        return torch.cat([piece(b, dp, index) for b in tensor.chunk(blocks, dim=-1)])
    flat = padded_flat(tensor, dp)
    width = flat.numel() // dp
    return flat[index * width:(index + 1) * width].clone()


def block_of(mine: torch.Tensor, columns: tuple[int, int] | None) -> torch.Tensor:
    """The part of a rank's piece ``mine`` that is column block ``columns`` = (index, blocks)
    of the weight (:func:`piece`), or ``mine`` for a weight kept whole (None)."""
    if columns is None:
        return mine
    index, blocks = columns
    width = mine.numel() // blocks
    return mine.narrow(0, index * width, width)


def unflatten(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of ``shape`` at the start of the gathered, padded ``flat``."""
    return flat[:math.prod(shape)].view(shape)


def gather_weight(shard: torch.Tensor, comm: Communicator, shape: tuple[int, ...], async_op: bool,
                  axis: str = "dp", first_stage: bool = False, regroup: bool = False, pieces: int = 0):
    """The weight of ``shape`` from every dp rank's piece (a Pending of it with ``async_op``),
    gathered over ``axis``: ``dp``, or a stage of ``group weights`` (``dp.inter``,
    ``dp.intra``). The first of two stages (``first_stage``; ``shard`` is this rank's piece)
    gives its sub-group's pieces, flat; the second (``shard`` is that) gives the weight, its
    pieces put back in dp order when they came grouped by place on the node (``regroup``,
    :func:`~.blocks.regrouped`). ``pieces`` > 0: the weight is cut into that many column
    blocks (:func:`column_piece`), put side by side."""
    gathered = comm.all_gather(shard, axis, async_op=async_op)

    def finish(flat: torch.Tensor) -> torch.Tensor:
        if regroup:
            flat = regrouped(flat, comm, axis, gathered=True)
        if first_stage:
            return flat
        return from_column_pieces(flat, shape, pieces) if pieces else unflatten(flat, shape)
    return gathered.then(finish) if isinstance(gathered, Pending) else finish(gathered)


def scatter_grad(grad: torch.Tensor, comm: Communicator, async_op: bool, axis: str = "dp",
                 whole: bool = True, regroup: bool = False, pieces: int | None = None, by_columns: bool = False):
    """This rank's piece of ``grad`` summed over dp (a Pending of it with ``async_op``),
    reduce-scattered over ``axis``: ``dp``, or a stage of ``group weights`` (``dp.intra``,
    ``dp.inter``; or ``dp.shard``). ``whole``: ``grad`` is the full gradient (flattened and
    padded here to a multiple of ``pieces``, default dp), not the first stage's output;
    ``regroup``: the pieces go grouped by place on the node first
    (:func:`~.blocks.regrouped`), as a reduce-scatter inside the node before the nodes must;
    ``by_columns``: the pieces are column blocks (:func:`column_piece`)."""
    count = pieces or comm.size("dp")
    flat = grad if not whole else column_pieces(grad, count) if by_columns else padded_flat(grad, count)
    if regroup:
        flat = regrouped(flat, comm, axis, gathered=False)
    return comm.reduce_scatter(flat, axis, async_op=async_op)
