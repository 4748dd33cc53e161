"""The strand-interleaving plan of one layer pair: what the DP pairing search returns.

A plan co-executes the forward pass of one strand's layer with the backward pass of the
other strand's layer as a list of *segment pairs*, separated by cross-strand barriers. A pair
holds a contiguous piece of each strand's operator sequence; either piece may be empty (that
strand's ops then run alone). The simulator and the interpreter consume the pairs in order;
renderers draw them; :func:`format_plan` prints the table and :func:`plan_to_json` the data.

Times are in the cost model's unit (``Plan.unit``, seconds by default).

Communication hidden (``Plan.comm_hidden``) is defined as in the paper's Table 7: of the
communication time (the solo times of the comm ops, summed), the part that does not show in
the plan's make-span beyond the computation run alone is hidden; kernel slowdown and launch
gaps count as visible::

    exposed = clamp(total - compute_time, 0, comm_time)      hidden = comm_time - exposed

where ``compute_time`` is the solo time of each strand's compute ops, summed over strands.
"""

from __future__ import annotations

import attrs

from dhelix.dsl.core.mesh import COMM_LANES
from dhelix.dsl.core.table import format_table


@attrs.frozen
class PlanOp:
    """One operator as the plan table needs it: strand, kind, lane, axis, and whether the
    strands block let it move."""

    name: str
    strand: str  # forward | backward
    kind: str  # compute | comm
    lane: str  # compute | local | cross
    axis: str | None = None
    moving: bool = False


@attrs.frozen
class SegmentPair:
    """A forward segment co-executed with a backward segment (either may be empty).

    ``time`` is the predicted make-span of the pair; ``alone`` the time of running its two
    segments one after the other (their solo times summed).
    """

    forward: tuple[str, ...]
    backward: tuple[str, ...]
    time: float
    alone: float


@attrs.frozen
class SearchStats:
    """How big the searched space was: legal orders and prefixes per strand, the moving
    ops' window per strand (None: unbounded), the segment-length bound and the number of
    pair-cost evaluations."""

    forward_orders: int
    backward_orders: int
    forward_prefixes: int
    backward_prefixes: int
    forward_window: int | None
    backward_window: int | None
    max_segment: int | None
    pair_evaluations: int
    #: Moves of the local search (:mod:`~dhelix.dsl.planner.refine`) that improved the
    #: bounded search's plan (its steps may then exceed ``max_segment``).
    local_moves: int = 0

    @property
    def exhaustive(self) -> bool:
        """Whether the search covered every legal order and segmentation: segments of any
        length and no window on the moving ops (no faster plan exists then)."""
        return self.max_segment is None and self.forward_window is None and self.backward_window is None


@attrs.frozen(kw_only=True)
class Plan:
    """The SI plan of a (forward layer, backward layer) pair; see the module docstring."""

    forward_layer: str
    backward_layer: str
    forward_order: tuple[str, ...]
    backward_order: tuple[str, ...]
    ops: tuple[PlanOp, ...]
    pairs: tuple[SegmentPair, ...]
    total: float
    sequential: float
    compute_time: float
    comm_time: float
    rules: tuple[str, ...]
    stats: SearchStats
    unit: str = "s"

    @property
    def speedup(self) -> float:
        """Sequential time over the plan's predicted time."""
        return self.sequential / self.total if self.total > 0 else 1.0

    @property
    def comm_exposed(self) -> float:
        """Communication time that still shows in the make-span (see the module docstring)."""
        return min(max(self.total - self.compute_time, 0.0), self.comm_time)

    @property
    def comm_hidden(self) -> float:
        """Communication time hidden behind computation."""
        return self.comm_time - self.comm_exposed

    @property
    def comm_hidden_fraction(self) -> float:
        """``comm_hidden / comm_time`` (0 without communication)."""
        return self.comm_hidden / self.comm_time if self.comm_time > 0 else 0.0

    def op(self, name: str) -> PlanOp:
        """The PlanOp called ``name`` (KeyError if the plan has none)."""
        return {op.name: op for op in self.ops}[name]


def lanes_of(plan: Plan, pair: SegmentPair) -> dict[str, tuple[str, ...]]:
    """The pair's ops by lane, as the table prints them: forward compute, backward compute,
    then one entry per communication lane (both strands, forward first)."""
    out: dict[str, tuple[str, ...]] = {}
    ops = {op.name: op for op in plan.ops}
    out["fwd compute"] = tuple(n for n in pair.forward if ops[n].lane == "compute")
    out["bwd compute"] = tuple(n for n in pair.backward if ops[n].lane == "compute")
    for lane in COMM_LANES:
        out[lane] = tuple(n for n in pair.forward + pair.backward if ops[n].lane == lane)
    return out


def _scale(unit: str) -> tuple[float, str]:
    # Layer times are milliseconds; seconds print as ms so the table stays readable.
    return (1e3, "ms") if unit == "s" else (1.0, unit)


def format_plan(plan: Plan) -> str:
    """The plan as text: a header with the layers, rules and search size, one row per
    segment pair (its ops by lane, predicted time, time alone) and a summary with the
    sequential time, the speedup and the communication hidden."""
    factor, unit = _scale(plan.unit)
    columns = ("fwd compute", "bwd compute", *COMM_LANES)  # the keys of lanes_of
    header = ["#", *columns, f"time {unit}", f"alone {unit}"]
    numeric = {0, len(header) - 2, len(header) - 1}  # right-align the index and the times
    rows = []
    for k, pair in enumerate(plan.pairs, 1):
        lanes = lanes_of(plan, pair)
        cells = [", ".join(lanes[name]) or "-" for name in columns]
        rows.append([str(k), *cells, f"{pair.time * factor:.3f}", f"{pair.alone * factor:.3f}"])
    stats = plan.stats
    lines = [
        f"plan {plan.forward_layer} forward x {plan.backward_layer} backward: "
        f"{len(plan.forward_order)} + {len(plan.backward_order)} ops in {len(plan.pairs)} segment pairs",
        "rules: " + "; ".join(plan.rules),
        f"search: {stats.forward_orders} x {stats.backward_orders} legal orders "
        f"({stats.forward_prefixes} x {stats.backward_prefixes} prefixes, "
        f"moving window {_window(stats.forward_window)} / {_window(stats.backward_window)}), "
        f"segments of at most {stats.max_segment or 'any number of'} ops"
        f"{_local_moves(stats)}, "
        f"{stats.pair_evaluations} pair costs",
        "",
        *format_table(header, rows, right=numeric),
        "",
        f"predicted {plan.total * factor:.3f} {unit}, sequential {plan.sequential * factor:.3f} {unit}, "
        f"speedup {plan.speedup:.3f}x",
        f"communication {plan.comm_time * factor:.3f} {unit}: hidden {plan.comm_hidden * factor:.3f} {unit} "
        f"({100 * plan.comm_hidden_fraction:.1f}%), exposed {plan.comm_exposed * factor:.3f} {unit}",
    ]
    return "\n".join(lines) + "\n"


def optimality_line(plan: Plan, known=None) -> str:
    """One line on how far the plan can be from the fastest: ``known`` (an
    :class:`~dhelix.dsl.planner.certify.Optimality`) where it was worked out, else what the
    plan's own search says."""
    factor, unit = _scale(plan.unit)
    stats = plan.stats
    if stats.exhaustive:
        return "optimal: the search covered every legal order and segmentation"
    if known is None:
        bounds = ([f"segments of at most {stats.max_segment} ops"] if stats.max_segment else []) + \
            [f"the moving ops within {w} fixed ops" for w in {stats.forward_window, stats.backward_window} if w is not None]
        return f"optimality: not checked (a bounded search: {', '.join(bounds)}{_local_moves(stats)})"
    if known.exact and not known.faster(plan):
        return "optimal: a search over every legal order and segmentation (segments of any length) finds no faster plan"
    if known.exact:
        return (f"not optimal: segments of any length give {known.fastest * factor:.3f} {unit} "
                f"({100 * (1 - known.fastest / plan.total):.1f}% faster)")
    if known.floor is None:
        return "optimality: not proven (a measured profile's times give no lower bound to prove it by)"
    return (f"optimality: no plan over any order and segmentation beats {known.floor * factor:.3f} {unit} "
            f"(a relaxation's bound), so this one is within {100 * (plan.total / known.floor - 1):.1f}% of the fastest")


def _local_moves(stats: SearchStats) -> str:
    """", then N local moves" where the local search improved the plan, else ""."""
    moves = stats.local_moves
    return f", then {moves} local move{'s' if moves != 1 else ''}" if moves else ""


def _window(window: int | None) -> str:
    return "unbounded" if window is None else f"{window} fixed ops"


def plan_to_json(plan: Plan) -> dict:
    """The plan as JSON-ready data with a fixed key order (and the derived speedup and
    communication figures), for the simulator, the interpreter and golden files."""
    return {
        "forward_layer": plan.forward_layer,
        "backward_layer": plan.backward_layer,
        "unit": plan.unit,
        "forward_order": list(plan.forward_order),
        "backward_order": list(plan.backward_order),
        "ops": [attrs.asdict(op) for op in plan.ops],
        "pairs": [attrs.asdict(pair) | {"forward": list(pair.forward), "backward": list(pair.backward)}
                  for pair in plan.pairs],
        "total": plan.total,
        "sequential": plan.sequential,
        "speedup": plan.speedup,
        "compute_time": plan.compute_time,
        "comm_time": plan.comm_time,
        "comm_hidden": plan.comm_hidden,
        "comm_exposed": plan.comm_exposed,
        "rules": list(plan.rules),
        "stats": attrs.asdict(plan.stats),
    }


def plan_from_json(data: dict) -> Plan:
    """The Plan that :func:`plan_to_json` wrote (derived figures are recomputed)."""
    pairs = tuple(SegmentPair(tuple(p["forward"]), tuple(p["backward"]), p["time"], p["alone"])
                  for p in data["pairs"])
    return Plan(forward_layer=data["forward_layer"], backward_layer=data["backward_layer"],
                forward_order=tuple(data["forward_order"]), backward_order=tuple(data["backward_order"]),
                ops=tuple(PlanOp(**op) for op in data["ops"]), pairs=pairs, total=data["total"],
                sequential=data["sequential"], compute_time=data["compute_time"],
                comm_time=data["comm_time"], rules=tuple(data["rules"]),
                stats=SearchStats(**data["stats"]), unit=data["unit"])
