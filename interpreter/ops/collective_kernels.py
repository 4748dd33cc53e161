"""The collective ops' functions: ``fn(x, ctx)`` runs an ``Op.op`` that is a collective
(all_gather, reduce_scatter, all_reduce, reduce, broadcast, all_to_all, send, recv) through
``ctx.comm`` (:mod:`.comm`). Their backward is the transposed collective, a DAG op of its own.
"""

from __future__ import annotations

from typing import Callable

from dhelix.dsl.core.oplib import REGROUP, ROOT

from .blocks import regrouped
from .comm import Pending
from .moe import exchange

def _all_gather(x, ctx):
    gathered = ctx.comm.all_gather(x, ctx.axis, async_op=ctx.async_op)
    if not ctx.params.get(REGROUP):
        return gathered

    def finish(y):
        return regrouped(y, ctx.comm, ctx.axis, gathered=True, layout=ctx.params[REGROUP])
    return gathered.then(finish) if isinstance(gathered, Pending) else finish(gathered)


def _reduce_scatter(x, ctx):
    if ctx.params.get(REGROUP):
        x = regrouped(x, ctx.comm, ctx.axis, gathered=False, layout=ctx.params[REGROUP])
    return ctx.comm.reduce_scatter(x, ctx.axis, async_op=ctx.async_op)


def _all_reduce(x, ctx):
    # The communicator reduces in place; the input may be saved or read again.
    return ctx.comm.all_reduce(x.clone(), ctx.axis, async_op=ctx.async_op)


def _reduce(x, ctx):
    # Reduces of distinct roots (a substituted reduce_scatter): the communicator sums in place.
    return ctx.comm.reduce(x.clone(), ctx.axis, ctx.params[ROOT], async_op=ctx.async_op)


def _broadcast(x, ctx):
    # Broadcasts of distinct roots (a substituted all_gather): the communicator writes in place.
    return ctx.comm.broadcast(x.clone(), ctx.axis, ctx.params[ROOT], async_op=ctx.async_op)


def _all_to_all(x, ctx):
    """MoE dispatch or combine: the identity on one rank, else :func:`.moe.exchange`
    (counts first, then the tokens with variable splits)."""
    if ctx.comm.size(ctx.axis) > 1:
        return exchange(x, ctx)
    return ctx.comm.all_to_all(x, ctx.axis, async_op=ctx.async_op)


def _send(x, ctx):
    """Send to the next rank of the axis ring; the op's value is what it sent."""
    return ctx.comm.send(x, ctx.comm.peer(ctx.axis, 1), async_op=ctx.async_op)


def _recv(x, ctx):
    """Receive a tensor shaped like ``x`` from the previous rank of the axis ring."""
    return ctx.comm.recv(x.shape, x.dtype, ctx.comm.peer(ctx.axis, -1), async_op=ctx.async_op)


def bound(kind: str, fn: Callable, ctx, bare: bool = False) -> Callable:
    """Collective op ``kind`` run by ``fn`` with ``ctx`` as a function of its input alone,
    made once: a plain gather, reduce-scatter or all-reduce is the communicator's
    :meth:`~.comm.Communicator.issuer` (``bare``: an asynchronous one complete at its issue
    may give its result itself); any other (a regrouping one, a kernel replaced) calls ``fn``."""
    if fn is COLLECTIVES.get(kind) and not ctx.params.get(REGROUP):
        if kind in ("all_gather", "reduce_scatter"):
            return ctx.comm.issuer(kind, ctx.axis, ctx.async_op, bare)
        if kind == "all_reduce":  # reduced in place: the input may be saved or read again
            issue = ctx.comm.issuer(kind, ctx.axis, ctx.async_op, bare)
            return lambda x: issue(x.clone())
    return lambda x: fn(x, ctx)


#: Collectives: ``fn(x, ctx) -> Tensor | Pending`` (a Pending when ``ctx.async_op``).
COLLECTIVES: dict[str, Callable] = {
    "all_gather": _all_gather, "reduce_scatter": _reduce_scatter, "all_reduce": _all_reduce,
    "all_to_all": _all_to_all, "reduce": _reduce, "broadcast": _broadcast,
    "send": _send, "recv": _recv,
}
