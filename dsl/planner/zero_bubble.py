"""A zero-bubble scheduler that writes a pipeline: the zero-bubble paper's heuristic.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR'24, §3.1) schedule F, B and W of one stage
per rank from their times (T_F, T_B, T_W, and the transfer time T_comm) and a per-rank limit on
the activations held: warm up with as many forwards as the limit allows before the first
backward comes back, then keep the critical path busy — a backward as soon as it can run, a
forward while the limit allows — and fill each gap at least T_W long with a waiting weight
gradient (W never delays a B); the weight gradients left run at the end. Memory is counted as
the paper counts it: a micro-batch holds 1 (its forward's activations) from F to B and
``w_share`` of that (M_W / (M_B + M_W): the inputs only its weight gradient reads) from B to
W; a forward runs only while that stays within the limit, and a rank the limit holds back runs
a waiting W to free memory. The paper refines the result with an ILP; this module does not,
and instead runs the greedy with a few W policies (fill gaps of at least T_W; of any size;
only at the end) and keeps the shortest, timed as
:func:`~dhelix.dsl.passes.unittime.timed_run` times it (ties to the earlier policy). The
heuristic, not an exact search: it scales to any p and m within the language's limits, an
exact search does not past a handful of micro-batches; tests compare it with a brute force
over every order for small p and m.

The result is per-rank orders of ``F``, ``B`` and ``W`` (micro-batches in order, as a dhelix
pipeline numbers them), written as a ``.dhx`` pipeline for fold none by
:func:`pipeline_text`: ``require`` of its p and m, then each rank's order run-length coded
under a rank selector, so it is checked, lowered and validated like any other pipeline.
"""

from __future__ import annotations

import heapq
from fractions import Fraction

import attrs

from dhelix.dsl.passes.unittime import Costs

#: How the greedy fills a gap with a weight gradient: at least T_W long, any gap, never.
W_POLICIES = ("fit", "any", "end")


@attrs.frozen
class Generated:
    """A generated schedule: the sizes, the memory limit and the share a W keeps, the costs
    it was made for, the W policy that won, and per rank the order of its actions (``"F"``,
    ``"B"``, ``"W"``)."""

    ranks: int
    microbatches: int
    limit: int
    costs: Costs
    policy: str
    orders: tuple[tuple[str, ...], ...]
    w_share: Fraction = Fraction(0)


def generate(ranks: int, microbatches: int, costs: Costs, limit: int, w_share: Fraction = Fraction(0)) -> Generated:
    """The heuristic's schedule for ``ranks`` pipeline ranks (fold none) and ``microbatches``,
    holding at most ``limit`` micro-batches' activations per rank (``limit`` >= 1), a
    micro-batch between its B and its W counting ``w_share`` (0 <= ``w_share`` < 1; a caller
    bug otherwise: ValueError). The shortest of the W policies under ``costs``."""
    w_share = Fraction(w_share)
    if ranks < 1 or microbatches < 1 or limit < 1 or not 0 <= w_share < 1:
        raise ValueError(f"ranks {ranks}, micro-batches {microbatches} and limit {limit} must be >= 1, "
                         f"and the W share {w_share} in [0, 1)")
    best: tuple[Generated, Fraction] | None = None
    for policy in W_POLICIES:
        orders, span = _greedy(ranks, microbatches, costs, limit, policy, w_share)
        if best is None or span < best[1]:
            best = (Generated(ranks, microbatches, limit, costs, policy, orders, w_share), span)
    assert best is not None, "W_POLICIES is not empty"
    return best[0]


def held(order: tuple[str, ...], w_share: Fraction = Fraction(0)) -> Fraction:
    """The most activations a rank running ``order`` holds, in micro-batches: 1 from each F to
    its B, ``w_share`` from the B to its W."""
    nf = nb = nw = 0
    peak = Fraction(0)
    for kind in order:
        nf, nb, nw = nf + (kind == "F"), nb + (kind == "B"), nw + (kind == "W")
        peak = max(peak, (nf - nb) + w_share * (nb - nw))
    return peak


def _greedy(p: int, m: int, costs: Costs, limit: int, policy: str,
            w_share: Fraction) -> tuple[tuple[tuple[str, ...], ...], Fraction]:
    """One run of the list scheduler: (per-rank orders, make-span)."""
    f_end: list[list[Fraction | None]] = [[None] * m for _ in range(p)]  # when F of micro-batch j ends on rank r
    b_end: list[list[Fraction | None]] = [[None] * m for _ in range(p)]
    done = [[0, 0, 0] for _ in range(p)]  # F, B, W run so far
    orders: list[list[str]] = [[] for _ in range(p)]
    free = [Fraction(0)] * p
    c = costs.transfer
    queue = [(Fraction(0), r) for r in range(p)]  # (time the rank decides, rank)
    span = Fraction(0)
    while queue:
        now, r = heapq.heappop(queue)
        nf, nb, nw = done[r]
        if nf == nb == nw == m:
            continue
        # When the next F and B of this rank can start (None: not known yet).
        f_at = None if nf == m else (Fraction(0) if r == 0 else _plus(f_end[r - 1][nf], c))
        b_at = None
        if nb < nf:
            b_at = f_end[r][nb] if r == p - 1 else _plus(b_end[r + 1][nb], c)
        fits = (nf - nb) + w_share * (nb - nw) + 1 <= limit  # room for one more forward
        kind = None
        if b_at is not None and b_at <= now:
            kind = "B"
        elif f_at is not None and f_at <= now and fits:
            kind = "F"
        elif nw < nb:
            upcoming = [t for t in (b_at, f_at if fits else None) if t is not None]
            gap = min(upcoming) - now if upcoming else None
            stuck = w_share > 0 and f_at is not None and f_at <= now  # a W frees what the limit holds back
            if (nf == nb == m or stuck or policy == "any"
                    or (policy == "fit" and (gap is None or gap >= costs.w))):
                kind = "W"
        if kind is None:  # wait for the next thing this rank needs, or for another rank to move
            later = [t for t in (b_at, f_at) if t is not None and t > now]
            later += [t for t, _ in queue if t > now]
            heapq.heappush(queue, (min(later) if later else now + costs.f, r))
            continue
        end = now + {"F": costs.f, "B": costs.b, "W": costs.w}[kind]
        index = "FBW".index(kind)
        if kind == "F":
            f_end[r][nf] = end
        elif kind == "B":
            b_end[r][nb] = end
        done[r][index] += 1
        orders[r].append(kind)
        free[r] = end
        span = max(span, end)
        heapq.heappush(queue, (end, r))
    return tuple(tuple(order) for order in orders), span


def _plus(time, delay):
    return None if time is None else time + delay


def pipeline_text(generated: Generated, name: str, header: str = "") -> str:
    """``generated`` as a ``.dhx`` pipeline named ``name`` for fold none, ``header`` (comment
    lines) first: it requires its p and m, and runs each rank's order under a selector that
    is 1 on that rank and 0 elsewhere, with runs of a repeated group of actions written as a
    repeat."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += [f"pipeline {name} for none {{",
              f"  require p == {generated.ranks}",
              f"  require m == {generated.microbatches}"]
    for rank, order in enumerate(generated.orders):
        lines.append(f"  # rank {rank}: in flight at most {_in_flight(order)}"
                     + (f", {float(held(order, generated.w_share)):.3g} with what its Ws keep" if generated.w_share else ""))
        lines.append(f"  repeat 1 - min(1, (r - {rank}) * (r - {rank})) {{")
        lines += [f"    {part}" for part in _runs(order)]
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _in_flight(order: tuple[str, ...]) -> int:
    live = peak = 0
    for kind in order:
        live += {"F": 1, "B": -1}.get(kind, 0)
        peak = max(peak, live)
    return peak


def _runs(order: tuple[str, ...], longest: int = 4) -> list[str]:
    """``order`` as statements: at each place the repeated group (of up to ``longest``
    actions) covering the most actions, ``repeat N { … }``, or one action."""
    out, i = [], 0
    while i < len(order):
        best = (1, 1)  # (group length, repeats)
        for size in range(1, longest + 1):
            group = order[i:i + size]
            count = 1
            while tuple(order[i + count * size:i + (count + 1) * size]) == group:
                count += 1
            if len(group) == size and count > 1 and size * count > best[0] * best[1]:
                best = (size, count)
        size, count = best
        body = " ".join(order[i:i + size])
        out.append(f"repeat {count} {{ {body} }}" if count > 1 else body)
        i += size * count
    return out
