"""A lower bound of the rest of a plan, built from step bounds on the strands' fixed ops.

The search (:func:`dsl.planner.pairing._shortest`) prunes a step when its bound plus a bound
of the rest of the plan exceeds a total some plan reaches. The rest bound of the busiest
lane is loose where one lane carries almost all the work (a MoE layer's all-to-alls): what a
plan pays on top of that lane comes from *which* steps can share it, step by step.

This module relaxes the search's own problem and solves the relaxation exactly, once,
backwards: drop every moving op (wgrads, the router) from both strands, so each strand is
the chain of its fixed ops and a state is (fixed forward ops done, fixed backward ops
done); a step runs an interval of each chain, and costs its :class:`SegmentBound` (the
pair's bound with both intervals non-empty, where the pairing rules allow them together, a
solo bound with one empty). Every plan of the real search maps onto a path of the
relaxation that costs no more, because

* a step's bound never grows when ops leave it, so long as their OEF classes stay (lane work,
  the chain through dependencies and lane order, communication and hence the launch gap only
  shrink; what overlap can save grows with the OEFs, never with the work): each interval here
  keeps the OEF classes of all its strand's moving ops, and the bound is at most the step's cost;
* a pair that the rules allow stays allowed without some of its ops (every rule asks for an
  op on each side);
* a pair whose one side holds only moving ops becomes a solo step, whose bound is at most
  the pair's; a step of moving ops only becomes no step;
* the real strands' windows and segment caps only remove paths.

So ``rest[a][c]``, the relaxation's least cost from (a, c) to the end, is a lower bound of
any completion of a real state with a and c fixed ops done.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs

from dhelix.dsl.core.program import Op

INF = float("inf")


class _Chain:
    """One strand's fixed ops in order, with every interval's bound (ops a … b-1):
    ``bound[a][b]`` (the cost's, with the OEF classes of the strand's moving ops added, since
    a real step may hold them), its ``plain[a][b]`` part (lanes and chain, no overlap term),
    ``solo[a][b]`` and ``traits[a][b]`` (pairing facts)."""

    def __init__(self, ops: Sequence[Op], moving: Sequence[Op], bound_of: Callable, traits_of: Callable):
        n = len(ops)
        extra = bound_of(tuple(moving)).kinds if moving else None
        self.bound: list[list[Any]] = [[None] * (n + 1) for _ in range(n + 1)]  # SegmentBound above the diagonal
        self.plain = [[0.0] * (n + 1) for _ in range(n + 1)]
        self.solo = [[0.0] * (n + 1) for _ in range(n + 1)]
        self.traits = [[None] * (n + 1) for _ in range(n + 1)]
        self.gap = None
        for a in range(n):
            for b in range(a + 1, n + 1):
                bound = bound_of(tuple(ops[a:b]))
                if extra is not None:
                    bound = attrs.evolve(bound, kinds=tuple(k | x for k, x in zip(bound.kinds, extra, strict=True)))
                self.bound[a][b], self.gap = bound, bound.launch_gap
                self.plain[a][b] = max(*bound.lanes, bound.path)
                self.solo[a][b] = bound.solo()
                self.traits[a][b] = traits_of(ops[a:b])


def fixed_chain_rest(forward: Sequence[Op], backward: Sequence[Op], moving: tuple[Sequence[Op], Sequence[Op]],
                     bound_of: Callable, traits_of: Callable, allows: Callable) -> list[list[float]]:
    """``rest[a][c]``: the least total of the relaxation above from ``a`` fixed forward ops
    and ``c`` fixed backward ops done to the end (``forward`` and ``backward``: each strand's
    fixed ops in their order; ``moving``: each strand's moving ops). ``bound_of(ops)`` is the
    cost's ``segment_bound``;
    ``traits_of(ops)`` and ``allows(f_traits, b_traits)`` are the pairing rules."""
    fwd, bwd = _Chain(forward, moving[0], bound_of, traits_of), _Chain(backward, moving[1], bound_of, traits_of)
    nf, nb = len(forward), len(backward)
    rest = [[INF] * (nb + 1) for _ in range(nf + 1)]
    rest[nf][nb] = 0.0
    gap = fwd.gap or bwd.gap
    for a in range(nf, -1, -1):
        for c in range(nb, -1, -1):
            if a == nf and c == nb:
                continue
            best = INF
            for a2 in range(a + 1, nf + 1):  # forward alone
                best = min(best, fwd.solo[a][a2] + rest[a2][c])
            for c2 in range(c + 1, nb + 1):  # backward alone
                best = min(best, bwd.solo[c][c2] + rest[a][c2])
            rest[a][c] = _paired(fwd, bwd, a, c, best, rest, gap, allows)
    return rest


def _paired(fwd: _Chain, bwd: _Chain, a: int, c: int, best: float, rest: list[list[float]], gap,
            allows: Callable) -> float:
    """``best`` lowered by any step pairing forward ops a … with backward ops c …. A longer
    interval's plain bound (lanes, chain, launch gap) is never smaller and the full bound is
    never below it, so each loop stops once the plain bound alone reaches best."""
    nf, nb = len(fwd.solo) - 1, len(bwd.solo) - 1
    for a2 in range(a + 1, nf + 1):
        if fwd.plain[a][a2] >= best:
            break
        f, ft, row = fwd.bound[a][a2], fwd.traits[a][a2], rest[a2]
        fl, fp = f.lanes, f.path
        for c2 in range(c + 1, nb + 1):
            bt = bwd.traits[c][c2]
            if not allows(ft, bt):
                break  # a longer interval holds the same ops and more: never allowed either
            b = bwd.bound[c][c2]
            bl = b.lanes
            plain = max(fl[0] + bl[0], fl[1] + bl[1], fl[2] + bl[2], fp, b.path) + gap.seconds(f.comm + b.comm)
            if plain >= best:
                break
            value = f.pair(b) + row[c2]
            if value < best:
                best = value
    return best
