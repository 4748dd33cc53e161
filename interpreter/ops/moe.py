"""MoE token dispatch and combine over an expert-parallel group (Megatron's all-to-all
token dispatcher, NOTES §3.4).

With ``E`` experts over an ep group of ``P`` ranks, rank ``j`` of the group holds the
``L = E / P`` consecutive experts ``[j·L, (j+1)·L)`` (the grouped GEMM weights' ep shard).
``permute`` leaves this rank's routed rows sorted by global expert, so the rows bound for
rank ``j`` are one contiguous block. The stdlib ``moe`` layer's two ``all_to_all(ep)`` ops
then run here:

* **dispatch** (the all_to_all after ``permute``): first a small all_to_all of the
  per-expert row counts, so each rank learns how many rows every source sends for each of
  its local experts (a ``[P, L]`` table); then the variable-size all_to_all of the rows with
  those in/out splits. The rows arrive grouped by source, each source's block grouped by
  local expert; a gather re-groups them by local expert (source order inside each expert:
  Megatron's "sort chunks by local expert"), which is the layout ``grouped_gemm`` reads,
  and ``routing["counts"]`` becomes the rows per *local* expert.
* **combine** (the all_to_all before ``unpermute``): the exact inverse: un-sort back to
  source-major order, then the all_to_all with the dispatch's splits swapped, so every row
  returns to the rank and position it came from.

The backward of each is the transpose of its forward, i.e. the other direction over the
same :class:`EpLayout` (a permutation's transpose is its inverse, an all_to_all's is the
all_to_all with swapped splits): the gradient of combine is dispatched, the gradient of
dispatch is combined. Routing is exact — no capacity factor, no dropped or padded tokens —
so the splits really vary with the router's choices.

Host-device synchronisation. The rows per expert are known on the device, where the router
ran; the token all_to_all's split sizes and the grouped GEMM's row blocks are shapes, which
the host must know before it can issue them (NCCL's variable all_to_all takes its splits as
host integers, a GEMM per expert its rows). With routing exact there is no static bound to
use instead short of padding every expert's block to every routed row (ep times the
all_to_all's bytes and the experts' GEMM rows): so a MoE layer's forward reads its counts
back once — :func:`to_host`, the only place that does — and nothing else in a layer waits
for the device. With ep > 1 that one read takes the exchanged count table and this rank's
own counts together, after the counts' all_to_all is queued (:func:`plan_layout`); the row
order the dispatch gathers by is computed on the device from that table, the host reading
only its sums. With ep = 1 the grouped GEMM reads this rank's counts. A full recomputation's
replay of the forward reads them once more, to check it routed as the first run did. The
backward reads nothing back: it reuses the forward's layout. The read cannot move out of an
SI block: the counts are the output of the router that block's forward runs.
"""

from __future__ import annotations

import attrs
import torch

from dhelix.dsl.core.program import LayerDag

from .comm import Pending

DISPATCH, COMBINE = "dispatch", "combine"
#: The Op.params key carrying the direction of an ep all_to_all (set by :func:`a2a_roles`).
ROLE = "ep_role"


@attrs.frozen
class EpLayout:
    """How one layer run's routed rows travel: ``send[j]`` rows go to group member ``j``,
    ``recv[j]`` come from it; ``sort`` gathers the received (source-major) rows into
    local-expert-major order and ``unsort`` is its inverse; ``local_counts`` are the rows
    per local expert after the sort."""

    send: list[int]
    recv: list[int]
    sort: torch.Tensor
    unsort: torch.Tensor
    local_counts: list[int]


def to_host(counts: torch.Tensor) -> list:
    """``counts`` (integers on the device) as Python ints: the one host-device
    synchronisation of a MoE layer's forward (see the module docstring); nothing else here
    reads a tensor back."""
    return counts.tolist()


def a2a_roles(fwd: LayerDag, bwd: LayerDag) -> dict[str, str]:
    """The direction (:data:`DISPATCH` or :data:`COMBINE`) of every ep all_to_all of the
    forward DAG ``fwd`` and of its backward in ``bwd``, by op name.

    A forward all_to_all that reads a ``permute`` dispatches, one read by an ``unpermute``
    combines; its backward op runs the other direction. Raises NotImplementedError for an
    ep all_to_all in any other place (no layout to exchange by)."""
    producers = {op.name: op for op in fwd.ops}
    roles = {}
    for op in fwd.ops:
        if op.op != "all_to_all" or op.axis != "ep":
            continue
        source = producers.get(op.inputs[0])
        readers = [o for o in fwd.ops if op.name in o.inputs]
        if source is not None and source.op == "permute":
            roles[op.name] = DISPATCH
        elif readers and all(o.op == "unpermute" for o in readers):
            roles[op.name] = COMBINE
        else:
            raise NotImplementedError(f"all_to_all {op.name} over ep neither reads a permute (dispatch) "
                                      "nor feeds an unpermute (combine): no token layout to exchange by")
    for op in bwd.ops:
        if op.forward in roles and op.op == "all_to_all":
            roles[op.name] = COMBINE if roles[op.forward] == DISPATCH else DISPATCH
    return roles


def exchange(x: torch.Tensor, ctx):
    """The ep all_to_all of ``x`` in the direction ``ctx.params[ROLE]``; ``ctx`` is a
    :class:`~.kernels.KernelCtx` whose ``routing`` holds this layer run's counts and layout.
    Returns a tensor, or a Pending when ``ctx.async_op``."""
    role = ctx.params.get(ROLE)
    if role is None:
        raise NotImplementedError(f"an all_to_all over {ctx.axis} = {ctx.comm.size(ctx.axis)} that is "
                                  "no MoE dispatch or combine is not executed")
    layout = ctx.routing.get("ep")
    if layout is None:
        if role != DISPATCH:
            raise RuntimeError("MoE combine before any dispatch in this layer run")
        layout = ctx.routing["ep"] = plan_layout(ctx.routing["counts"], ctx.comm, ctx.axis, x.device)
        ctx.routing["counts"] = layout.local_counts  # what grouped_gemm reads
    elif role == DISPATCH and ctx.routing["counts"] is not layout.local_counts:
        # The forward again (full recomputation): permute has routed the same tokens the same
        # way and set their global counts; the first run's layout holds, no counts to exchange.
        _same_routing(to_host(ctx.routing["counts"]), layout)
        ctx.routing["counts"] = layout.local_counts
    if role == DISPATCH:
        return dispatch(x, layout, ctx.comm, ctx.axis, ctx.async_op)
    return combine(x, layout, ctx.comm, ctx.axis, ctx.async_op)


def _same_routing(counts: list[int], layout: EpLayout) -> None:
    """Raise unless ``counts`` (rows per global expert) send what ``layout`` sends."""
    local = len(counts) // len(layout.send)
    send = [sum(counts[j * local:(j + 1) * local]) for j in range(len(layout.send))]
    if send != layout.send:
        raise RuntimeError(f"the recomputed forward routed the tokens differently ({send} rows to the ep ranks, "
                           f"first {layout.send}): the router's inputs or weights changed between the forward "
                           "and its recomputation")


def plan_layout(counts: torch.Tensor, comm, axis: str, device) -> EpLayout:
    """The EpLayout of rows sorted by global expert with ``counts`` rows per expert (all
    ``E`` of them, int64 on the device): exchanges the counts over ``axis`` (a small
    synchronous all_to_all, as Megatron's dispatcher does before the token all_to_all), then
    reads both tables back at once (:func:`to_host`)."""
    size = comm.size(axis)
    if counts.numel() % size:
        raise ValueError(f"{counts.numel()} experts do not split over {axis} = {size}")
    local = counts.numel() // size
    mine = counts.to(device=device, dtype=torch.int64).view(size, local)
    # Row j of the received table: the rows member j sends for each of my local experts.
    table = comm.all_to_all(mine.reshape(-1), axis).view(size, local)
    host = to_host(torch.cat((mine, table)))
    send = [sum(row) for row in host[:size]]
    recv = [sum(row) for row in host[size:]]
    local_counts = [sum(column) for column in zip(*host[size:])]
    sort = _expert_major(table, sum(recv))
    unsort = torch.empty_like(sort).scatter_(0, sort, torch.arange(sort.numel(), device=sort.device))
    return EpLayout(send, recv, sort, unsort, local_counts)


def _expert_major(table: torch.Tensor, rows: int) -> torch.Tensor:
    """The received row of each position when the ``rows`` rows received (source-major:
    member j's block, inside it by local expert e, ``table[j, e]`` rows each) are gathered
    local-expert-major (expert e's rows from every member in member order), computed on the
    device: ``rows``, known on the host, sizes the result without reading anything back."""
    size, local = table.shape
    blocks = table.reshape(-1)
    first = (blocks.cumsum(0) - blocks).view(size, local).t().reshape(-1)  # each (e, j) block's first row received
    lengths = table.t().reshape(-1)  # the blocks in the order gathered
    block = torch.repeat_interleave(torch.arange(size * local, device=table.device), lengths, output_size=rows)
    placed = lengths.cumsum(0) - lengths  # each block's first position in the gathered order
    return first[block] + torch.arange(rows, device=table.device) - placed[block]


def dispatch(x: torch.Tensor, layout: EpLayout, comm, axis: str, async_op: bool = False):
    """Rows of ``x`` (grouped by destination member) to their experts' ranks, received rows
    sorted by local expert."""
    out = comm.all_to_all(x, axis, layout.send, layout.recv, async_op=async_op)
    if isinstance(out, Pending):
        return out.then(lambda rows: rows.index_select(0, layout.sort))
    return out.index_select(0, layout.sort)


def combine(y: torch.Tensor, layout: EpLayout, comm, axis: str, async_op: bool = False):
    """The inverse of :func:`dispatch`: rows sorted by local expert back to the ranks and
    positions they were dispatched from."""
    return comm.all_to_all(y.index_select(0, layout.unsort), axis, layout.recv, layout.send,
                           async_op=async_op)
