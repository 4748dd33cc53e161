"""Turn what `dhelix profile` timed into a hardware profile (no torch here: the interpreter's
profiler measures, this module derives).

The measurements (:class:`Timings`, medians in µs pooled over every rank and repetition):

* ``ops``: each op of the forward and backward layer DAGs alone, collectives synchronous;
* ``issued``: each collective issued asynchronously and waited for at once (the SI lanes' way);
* ``pairs``: a forward op and a backward op co-executed as the SI executor runs a pair
  (collectives issued first and asynchronously, compute on the compute lane, then the
  barrier), for compute × comm and comm × comm; ``stretched``: the compute op's own time
  inside a compute × comm pair;
* ``sweep``: all_gathers of growing size on one group of each lane the mesh has.

What is derived, and how (every number of the written profile says which in its comment):

* **Compute rates.** Each compute op's FLOPs and bytes come from the cost model
  (:func:`~dhelix.dsl.planner.costmodel.op_flops`, ``op_bytes``). ``peak_tflops[dtype]`` is
  the fastest compute-bound op's FLOP rate and ``hbm_gbps`` the fastest memory-bound op's
  byte rate; ``achieved[class]`` is the median of the class's ops relative to those. So the
  cost model prices ops it did not measure (other shapes, other programs on the machine).
* **Time between ops.** ``kernels.overhead_us``: the timed pass of the whole layer outside
  its collectives less its compute ops' times alone, per compute op (:func:`_between_ops`);
  the written ``measured.ops`` of a compute op include it, and the cost model adds it to
  every compute op it prices.
* **Links.** Per lane, the ring model ``t = α(g-1) + S(g-1)/g / B`` fitted to the sweep by
  least squares on relative errors (small and large messages count alike).
* **Collectives.** Per lane, an all_reduce, a reduce_scatter and a p2p timed on the sweep's
  group: each one's price by the fitted link over its time is its efficiency
  (:func:`_efficiencies`); the link takes the fastest one's bandwidth.
* **Launch gap.** ``fixed_us`` is the median extra time of a collective issued
  asynchronously over the same collective run synchronously; no share of the comm time is
  separated (``comm_fraction`` 0).
* **Overlap.** A measured pair's OEF is the paper's Eq. 1 on the pair without its launch
  gap, ``(T_f + T_b - (P - gap)) / min(T_f, T_b)``, clamped to the schema's [-1, 2]; each
  becomes an ``oef.pairs`` override by op name, the class OEFs are the medians per class,
  and the pair's time is kept as a ``measured.pairs`` entry. ``slowdown`` is the median
  stretch of a compute op while a collective runs beside it.

Values the program cannot measure (a lane its mesh lacks, an op class its layer lacks,
compute with compute, which the executor never overlaps) are copied from a base profile
and marked ``[from <base>]``.
"""

from __future__ import annotations

import statistics
from math import ceil, floor, log10
from typing import Collection, Mapping, Sequence

import attrs

from dhelix.dsl.core.oplib import END_OPS, LAYER_PASS, OPTIMIZER_STEP
from dhelix.dsl.core.program import Op, Program
from dhelix.dsl.frontend.kernel_terms import Kernels
from dhelix.dsl.frontend.profilecheck import ends_signature, mesh_sizes, op_signature
from dhelix.dsl.frontend.profile_reader import OEF_HIGH, OEF_LOW
from dhelix.dsl.frontend.profiles import (COMPUTE_BOUND, MEMORY_BOUND, OEF_CLASSES, Collective, LaunchGap, Link, Measured,
                                          MeasuredPair, Profile)
from dhelix.dsl.planner.costmodel import achieved_class, collective_time, op_bytes, op_flops, optimizer_bytes_per_param

_CLASS = {"compute": "comp", "local": "intra", "cross": "inter"}
_ORDER = ("comp", "intra", "inter")


@attrs.frozen
class SweepPoint:
    """One size of the link sweep: a collective (an all_gather unless ``kind`` says) over
    ``axis`` (``group`` ranks on ``lane``) of ``full_bytes`` (S of the ring model), taking ``us``."""

    lane: str
    axis: str
    group: int
    full_bytes: float
    us: float
    #: The collective (the sweep's all_gather; the others at two of its sizes, for their
    #: efficiencies): S is the gathered bytes, an all_reduce's or reduce_scatter's input, a
    #: p2p's message.
    kind: str = "all_gather"


@attrs.frozen
class Timings:
    """What was measured, in µs (see the module docstring); pair keys are (fwd op, bwd op)."""

    ops: Mapping[str, float]
    issued: Mapping[str, float] = attrs.field(factory=dict)
    pairs: Mapping[tuple[str, str], float] = attrs.field(factory=dict)
    stretched: Mapping[tuple[str, str], float] = attrs.field(factory=dict)
    sweep: tuple[SweepPoint, ...] = ()
    #: The other collectives on the sweep's groups (:attr:`SweepPoint.kind`).
    kinds: tuple[SweepPoint, ...] = ()
    #: Per kind (ops, pairs, …): the median over its keys of the samples' interquartile range
    #: over their median, where a key has 4 samples or more (how much repeats disagree).
    spread: Mapping[str, float] = attrs.field(factory=dict)


@attrs.frozen
class Stamp:
    """Where and how the timings were taken (written into the ``measured:`` section)."""

    source: str
    machine: str
    torch: str
    backend: str
    date: str
    command: str
    repeats: int
    memory_gb: float | None = None  # device memory per rank (GPU memory, or RAM ÷ local ranks)


def pool(ranks: Sequence[Mapping[str, Mapping]]) -> Timings:
    """The Timings of every rank's samples: ``ranks[i][kind][key]`` is a list of µs for
    ``kind`` in ops, issued, pairs, stretched, for ``sweep`` keyed by (lane, axis, group,
    full bytes) and for ``kinds`` by (lane, axis, group, full bytes, collective). Each value
    is the median over all ranks' samples of its key."""
    merged: dict[str, dict] = {kind: {} for kind in ("ops", "issued", "pairs", "stretched", "sweep", "kinds")}
    for rank in ranks:
        for kind, samples in rank.items():
            for key, values in samples.items():
                merged[kind].setdefault(key, []).extend(values)
    medians = {kind: {key: statistics.median(values) for key, values in samples.items()}
               for kind, samples in merged.items()}
    sweep = tuple(SweepPoint(lane, axis, group, size, us)
                  for (lane, axis, group, size), us in sorted(medians.pop("sweep").items()))
    kinds = tuple(SweepPoint(lane, axis, group, size, us, kind)
                  for (lane, axis, group, size, kind), us in sorted(medians.pop("kinds").items()))
    spread = {}
    for kind, samples in merged.items():
        ranges = [_relative_iqr(values) for values in samples.values() if len(values) >= 4]
        if ranges:
            spread[kind] = statistics.median(ranges)
    return Timings(**medians, sweep=sweep, kinds=kinds, spread=spread)


def _relative_iqr(values: Sequence[float]) -> float:
    q1, _, q3 = statistics.quantiles(values, n=4)
    middle = statistics.median(values)
    return (q3 - q1) / middle if middle > 0 else 0.0


#: Repeats that disagree by more than this (interquartile range over median) make the
#: figures derived from them noise; a pair's OEF is a small difference of such times.
NOISY_SPREAD = 0.2


def noise(timings: Timings, classes: Mapping[str, float], measured: Collection[str] | None = None) -> list[str]:
    """Why the figures derived from ``timings`` (OEF ``classes`` among them) are noise, one
    line per reason, or [] when nothing says so: repeats of the ops or pairs that disagree by
    more than :data:`NOISY_SPREAD`, and OEF classes below 0 (a pair slower than its two ops
    one after the other: contention for the cores, or noise). Only the classes in
    ``measured`` (:func:`measured_classes`; None: all) are judged: a class copied from the
    base profile says nothing about these timings."""
    found = [f"repeated {kind} timings disagree by {100 * spread:.0f}% (interquartile range over median)"
             for kind, spread in sorted(timings.spread.items()) if kind in ("ops", "pairs") and spread > NOISY_SPREAD]
    negative = [f"{cls} {value:g}" for cls, value in classes.items()
                if value < 0 and (measured is None or cls in measured)]
    if negative:
        found.append(f"OEF below 0 ({', '.join(negative)}): pairs ran slower than their ops one after the other")
    return found


def measured_classes(ops: Sequence[Op], timings: Timings) -> set[str]:
    """The OEF classes ``timings`` measure (a pair of ``ops`` timed, both its ops timed
    above 0): what :func:`derive_profile` takes from the timings and not from its base."""
    by_name = {op.name: op for op in ops}
    return {_pair_class(by_name[f], by_name[b]) for f, b in timings.pairs
            if f in by_name and b in by_name and min(timings.ops.get(f, 0.0), timings.ops.get(b, 0.0)) > 0}


def derive_profile(program: Program, timings: Timings, stamp: Stamp, base: Profile,
                   name: str) -> tuple[Profile, dict[str, str]]:
    """The profile called ``name`` that ``timings`` of ``program`` measure, with the notes
    (dotted key path -> source comment) for :func:`~dhelix.dsl.frontend.profile_writer.render_profile`.
    ``base`` supplies what the program cannot measure. Assumes ``timings.ops`` times every
    op of the program's forward and backward DAGs."""
    assert program.forward is not None and program.backward is not None and program.model is not None \
        and program.mesh is not None, "a checked model"
    ops = program.forward.ops + program.backward.ops
    dtype, seq = program.model.dtype, program.model.get("seq")
    notes: dict[str, str] = {}
    peak, hbm, achieved = _compute_rates(ops, timings.ops, dtype, seq, base, notes)
    between = _between_ops(ops, timings.ops, notes)
    compute = {op.name for op in ops if op.kind == "compute"}
    links, fitted = _links(timings.sweep, base, notes)
    gap = _launch_gap(ops, timings, notes)
    classes, pairs, slowdown = _overlap(ops, timings, gap.fixed_us, base, notes)
    links, collectives = _efficiencies(timings.kinds, links, fitted, base, notes)
    measured = Measured(
        dtype=dtype, source=stamp.source,
        ops={name: _round(timings.ops[name] + (between if name in compute else 0.0), 3)
             for name in [op.name for op in ops] + list(END_OPS) if name in timings.ops},
        pairs=tuple(MeasuredPair((f,), (b,), _round(us, 3)) for (f, b), us in timings.pairs.items()),
        stamp={"machine": stamp.machine, "torch": stamp.torch, "backend": stamp.backend, "date": stamp.date,
               "command": stamp.command},
        repeats=stamp.repeats, mesh=mesh_sizes(program.mesh),
        shapes={op.name: op_signature(op) for op in ops} | {name: ends_signature(program) for name in END_OPS
                                                            if name in timings.ops})
    notes["measured.ops"] = ("[measured] each op alone, µs (median over ranks and repeats)"
                             + (f"; a layer op's with the {between:g} µs between ops (kernels.overhead_us)" if between else ""))
    notes["measured.pairs"] = "[measured] a forward op beside a backward op, as an SI pair runs them, µs"
    description = (f"measured on {stamp.machine} ({stamp.backend}, torch {stamp.torch}) "
                   f"for {stamp.source}")
    profile = Profile(name=name, description=description, peak_tflops={dtype: peak}, hbm_gbps=hbm,
                      achieved=achieved, links=links, collectives=collectives, oef_classes=classes,
                      oef_pairs=pairs, slowdown=slowdown, launch_gap=gap, measured=measured,
                      memory_gb=stamp.memory_gb if stamp.memory_gb is not None else base.memory_gb,
                      kernels=Kernels(overhead_us=between))
    notes["memory_gb"] = ("[measured] device memory per rank" if stamp.memory_gb is not None
                          else f"[from {base.name}] not measured")
    return attrs.evolve(profile, optimizer_gbps=_optimizer_rate(program, timings, notes)), notes


def _between_ops(ops: Sequence[Op], times: Mapping[str, float], notes: dict) -> float:
    """The host's µs between two ops of the layer (``kernels.overhead_us``): the timed pass
    of the whole layer outside its collectives (:data:`~dhelix.dsl.core.oplib.LAYER_PASS`)
    less its compute ops' times alone, over its compute ops (the cost model adds it to each
    compute op); 0 when the pass was not timed or took no longer than its ops. (The pass
    leaves its collectives out as they took in it: timed alone, a collective can differ from
    the same one in the pass by more than the layer's whole host time.)

    Each op is timed alone, back to back with itself: that is the kernel's time. A run pays
    more per op: the framework's dispatch and the interpreter's own work between kernels
    (looking up inputs, releasing what no later op reads, recording memory), which on a CPU
    rank or a GPU whose kernels are short is of the order of the kernels themselves."""
    compute = [op for op in ops if op.kind == "compute"]
    whole = times.get(LAYER_PASS)
    if whole is None or not compute:
        notes["kernels.overhead_us"] = "[measured] no layer pass timed: none"
        return 0.0
    alone = sum(times[op.name] for op in compute)
    between = max(0.0, (whole - alone) / len(compute))
    notes["kernels.gemm_tile"] = "[default] unused without kernels.sms: the GEMM rates are measured"
    notes["kernels.attention"] = "[default] one fused kernel, as the interpreter runs it"
    notes["kernels.loss"] = "[default] the interpreter's vocab-parallel cross-entropy"
    notes["kernels.overhead_us"] = (f"[measured] a pass of the layer outside its collectives ({whole / 1e3:.3g} ms) "
                                    f"less its {len(compute)} compute ops alone ({alone / 1e3:.3g} ms), over them")
    return _round(between, 2)


def _optimizer_rate(program: Program, timings: Timings, notes: dict) -> float | None:
    """The optimizer's streaming rate (GB/s) from the timed AdamW step over one layer's
    weights, or None when it was not timed (the simulator then uses the memory rate)."""
    us = timings.ops.get(OPTIMIZER_STEP)
    assert program.forward is not None and program.model is not None, "a checked model"
    params = sum(program.forward.weight_elements())
    if not us or not params:
        return None
    moved = params * optimizer_bytes_per_param(program.model.dtype)
    rate = moved / (us * 1e-6) / 1e9
    notes["optimizer_gbps"] = (f"[measured] one AdamW step over a layer's {params:,} parameters "
                               f"({program.model.dtype}): {us / 1e3:.3g} ms")
    return _round(rate, 4)


# ---------------------------------------------------------------- compute

def _compute_rates(ops: Sequence[Op], times: Mapping[str, float], dtype: str, seq, base: Profile,
                   notes: dict) -> tuple[float, float, dict]:
    """(peak TFLOP/s, HBM GB/s, achieved fractions) from the compute ops' times."""
    flop_rates: dict[str, list] = {}  # class -> [(rate, op name)]
    byte_rates: dict[str, list] = {}
    for op in ops:
        seconds = times[op.name] * 1e-6
        if op.kind != "compute" or seconds <= 0:
            continue
        cls = achieved_class(op, base)
        if cls in COMPUTE_BOUND:
            flops = op_flops(op, seq=seq)
            if flops > 0:
                flop_rates.setdefault(cls, []).append((flops / seconds, op.name))
        else:
            moved = op_bytes(op, dtype, seq=seq)
            if moved > 0:
                byte_rates.setdefault(cls, []).append((moved / seconds, op.name))
    peak = _fastest(flop_rates, 1e12, "peak_tflops." + dtype, "GFLOP/s", 1e9, notes) \
        or _base_value(base.peak_tflops.get(dtype, max(base.peak_tflops.values())), base,
                       f"peak_tflops.{dtype}", "no compute-bound op was timed", notes)
    hbm = _fastest(byte_rates, 1e9, "hbm_gbps", "GB/s", 1e9, notes) \
        or _base_value(base.hbm_gbps, base, "hbm_gbps", "no memory-bound op was timed", notes)
    achieved = {}
    for cls in COMPUTE_BOUND + MEMORY_BOUND:
        rates, scale = (flop_rates, peak * 1e12) if cls in COMPUTE_BOUND else (byte_rates, hbm * 1e9)
        if cls in rates:
            fractions = [rate / scale for rate, _ in rates[cls]]
            achieved[cls] = min(1.0, max(1e-4, _round(statistics.median(fractions), 4, sig=True)))
            of = "peak_tflops" if cls in COMPUTE_BOUND else "hbm_gbps"
            notes[f"achieved.{cls}"] = f"[measured] median of {len(fractions)} op(s) over {of}"
        else:
            achieved[cls] = _base_value(base.achieved[cls], base, f"achieved.{cls}",
                                        f"no {cls} op in the layer", notes)
    return peak, hbm, achieved


def _fastest(rates: dict, unit: float, path: str, shown: str, shown_unit: float, notes: dict) -> float | None:
    """The highest rate of ``rates`` in ``unit``, rounded up to 4 significant digits (so
    every op's fraction of it stays <= 1), with its note; None without rates."""
    best = max((entry for entries in rates.values() for entry in entries), default=None)
    if best is None:
        return None
    notes[path] = f"[measured] the fastest op, {best[1]}: {best[0] / shown_unit:.4g} {shown}"
    return _round(best[0] / unit, 4, sig=True, up=True)


def _base_value(value: float, base: Profile, path: str, why: str, notes: dict) -> float:
    notes[path] = f"[from {base.name}] not measured: {why}"
    return value


# ---------------------------------------------------------------- links and launch gap

def _links(sweep: Sequence[SweepPoint], base: Profile, notes: dict) -> tuple[dict, frozenset[str]]:
    """Per lane, the link the sweep's points fit; the base's link for a lane without points.
    Also the lanes whose link was fitted."""
    links = {}
    fitted_lanes = set()
    for lane in ("local", "cross"):
        points = [p for p in sweep if p.lane == lane]
        fitted = _fit_ring(points) if points else None
        if fitted is None:
            links[lane] = base.links[lane]
            why = "the mesh has no group on this lane" if not points else "the sweep did not resolve it"
            notes[f"links.{lane}"] = f"[from {base.name}] not measured: {why}"
            continue
        alpha, bandwidth = fitted
        fitted_lanes.add(lane)
        links[lane] = Link(_round(bandwidth / 1e9, 4, sig=True), _round(alpha * 1e6, 2))
        first = points[0]
        notes[f"links.{lane}"] = (f"[measured] ring fit of {len(points)} all_gather sizes over {first.axis} "
                                  f"({first.group} ranks), {_size(points[0].full_bytes)}-{_size(points[-1].full_bytes)}")
    for level in [name for name in base.links if name not in links]:  # a topology level's: not swept
        links[level] = base.links[level]
        notes[f"links.{level}"] = f"[from {base.name}] not measured: the sweep times the local and cross lanes"
    return links, frozenset(fitted_lanes)


def _efficiencies(points: Sequence[SweepPoint], links: dict, fitted: frozenset[str], base: Profile,
                  notes: dict) -> tuple[dict, dict[str, Collective]]:
    """The links and each collective's efficiency on them: per measured lane, each timed
    collective's time as the fitted link prices it (efficiency 1) over its measured time,
    both beyond the latency term (:func:`_bandwidth_ratio`), the median over its sizes. The
    lane's bandwidth becomes the fastest collective's, so every efficiency is at most 1: the
    all_gather the link was fitted to, and a collective not timed, keep the fit's price. A
    lane whose link was not fitted (not in ``fitted``) keeps 1."""
    collectives = {kind: Collective(model.model, 1.0) for kind, model in base.collectives.items()}
    probe = attrs.evolve(base, links=links, collectives=collectives)
    lanes: dict[str, dict[str, float]] = {}
    for lane in ("local", "cross"):
        timed = [p for p in points if p.lane == lane and p.kind in collectives]
        if not timed or lane not in fitted:
            continue
        ratio = {}
        for kind in sorted({p.kind for p in timed}):
            found = [_bandwidth_ratio(p, probe) for p in timed if p.kind == kind]
            if any(r is not None for r in found):
                ratio[kind] = statistics.median(r for r in found if r is not None)
        if not ratio:
            continue
        fastest = max(1.0, *ratio.values())
        link = links[lane]
        links[lane] = Link(_round(link.bw_gbps * fastest, 4, sig=True), link.latency_us)
        lanes[lane] = {kind: max(0.001, _round(ratio.get(kind, 1.0) / fastest, 3)) for kind in collectives}
        first = timed[0]
        notes[f"links.{lane}"] += (f"; the bandwidth of the fastest collective timed (x{fastest:.3g} the all_gather's)"
                                   if fastest > 1 else "")
        notes[f"collectives.{lane}"] = (
            f"{', '.join(f'{kind} {ratio[kind]:.3g}' for kind in ratio)} of the all_gather fit's price over "
            f"{first.axis} ({first.group} ranks), {_size(min(p.full_bytes for p in timed))}-"
            f"{_size(max(p.full_bytes for p in timed))}")
    if not lanes:
        notes["collectives"] = "[derived] the links are fitted with all_gather; the others follow the ring conventions"
        return links, collectives
    notes["collectives"] = ("[measured] efficiency: a collective's time as the fitted link prices it over its time "
                            "timed; " + "; ".join(f"{lane}: {notes.pop(f'collectives.{lane}')}" for lane in lanes))
    return links, {kind: Collective(model.model, 1.0, {lane: lanes[lane][kind] if lane in lanes else 1.0
                                                       for lane in ("local", "cross")})
                   for kind, model in collectives.items()}


def _bandwidth_ratio(point: SweepPoint, probe: Profile) -> float | None:
    """How much faster ``point``'s collective moved its bytes than ``probe`` prices it: the
    priced time beyond the latency term over the measured time beyond it (an efficiency
    scales the bandwidth, not the latency); None when it took no longer than the latency."""
    latency = collective_time(point.kind, 0.0, point.group, point.lane, probe)
    priced = collective_time(point.kind, point.full_bytes, point.group, point.lane, probe) - latency
    spent = point.us * 1e-6 - latency
    return priced / spent if spent > 0 and priced > 0 else None


def _fit_ring(points: Sequence[SweepPoint]) -> tuple[float, float] | None:
    """(α seconds per step, B bytes/s) of ``t = α(g-1) + S(g-1)/g / B`` by least squares on
    relative errors (weights 1/t²); α >= 0. None when time does not grow with size."""
    group = points[0].group
    xs = [p.full_bytes * (group - 1) / group for p in points]
    ts = [p.us * 1e-6 for p in points]
    ws = [1.0 / (t * t) if t > 0 else 0.0 for t in ts]
    sw = sum(ws)
    if sw == 0 or len(set(xs)) < 2:
        return None
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / sw
    mt = sum(w * t for w, t in zip(ws, ts, strict=True)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    slope = sum(w * (x - mx) * (t - mt) for w, x, t in zip(ws, xs, ts, strict=True)) / sxx
    intercept = mt - slope * mx
    if intercept < 0:  # refit through the origin: no negative latency
        intercept = 0.0
        slope = sum(w * x * t for w, x, t in zip(ws, xs, ts, strict=True)) / sum(w * x * x for w, x in zip(ws, xs, strict=True))
    if slope <= 0:
        return None
    return intercept / (group - 1), 1.0 / slope


def _launch_gap(ops: Sequence[Op], timings: Timings, notes: dict) -> LaunchGap:
    """The median extra time of a collective issued asynchronously (see the module docstring)."""
    extra = [timings.issued[op.name] - timings.ops[op.name] for op in ops
             if op.kind == "comm" and op.name in timings.issued]
    fixed = _round(max(0.0, statistics.median(extra)), 2) if extra else 0.0
    notes["launch_gap.fixed_us"] = (f"[measured] median extra time of {len(extra)} collective(s) issued "
                                    "asynchronously over run synchronously" if extra else
                                    "[measured] no collective in the layer: no gap")
    notes["launch_gap.comm_fraction"] = "[derived] not separated from the fixed gap"
    return LaunchGap(fixed, 0.0)


# ---------------------------------------------------------------- overlap

def _overlap(ops: Sequence[Op], timings: Timings, gap_us: float, base: Profile,
             notes: dict) -> tuple[dict, dict, float]:
    """(OEF classes, OEF overrides by op name, slowdown σ) from the measured pairs."""
    by_name = {op.name: op for op in ops}
    per_class: dict[str, list[float]] = {}
    overrides: dict[tuple[str, str], float] = {}
    stretch, clamped = [], 0
    for (f, b), pair_us in timings.pairs.items():
        tf, tb = timings.ops[f], timings.ops[b]
        if min(tf, tb) <= 0:
            continue
        oef = _round((tf + tb - (pair_us - gap_us)) / min(tf, tb), 3)
        overrides[(f, b)] = min(OEF_HIGH, max(OEF_LOW, oef))
        clamped += overrides[(f, b)] != oef
        per_class.setdefault(_pair_class(by_name[f], by_name[b]), []).append(overrides[(f, b)])
        compute = f if by_name[f].kind == "compute" else b if by_name[b].kind == "compute" else None
        if compute is not None and (f, b) in timings.stretched:
            stretch.append(timings.stretched[(f, b)] / timings.ops[compute] - 1.0)
    classes = {}
    for cls in OEF_CLASSES:
        if cls in per_class:
            classes[cls] = _round(statistics.median(per_class[cls]), 3)
            notes[f"oef.classes.{cls}"] = f"[measured] median of {len(per_class[cls])} pair(s)"
        elif cls == "comp_comp":
            classes[cls] = 0.0
            notes[f"oef.classes.{cls}"] = "[executor] compute ops share one lane: they never overlap"
        else:
            classes[cls] = _base_value(base.oef_classes[cls], base, f"oef.classes.{cls}",
                                       "no such pair in this program", notes)
    if overrides:
        notes["oef.pairs"] = "[measured] forward op -> backward op, from measured.pairs" + (
            f"; {clamped} outside [-1, 2] clamped (timing noise)" if clamped else "")
    if stretch:
        slowdown = min(1.0, max(0.0, _round(statistics.median(stretch), 3)))
        notes["slowdown.compute_with_comm"] = f"[measured] median stretch of compute beside a collective, {len(stretch)} pair(s)"
    else:
        slowdown = _base_value(base.slowdown, base, "slowdown.compute_with_comm", "no compute x comm pair", notes)
    return classes, overrides, slowdown


def _pair_class(forward: Op, backward: Op) -> str:
    """The OEF class of a forward op beside a backward op, by their lanes (``comp_inter``)."""
    return "_".join(sorted((_CLASS[_lane(forward)], _CLASS[_lane(backward)]), key=_ORDER.index))


def _lane(op: Op) -> str:
    return "compute" if op.kind == "compute" else op.lane


# ---------------------------------------------------------------- numbers

def _round(value: float, digits: int, sig: bool = False, up: bool = False) -> float:
    """``value`` rounded to ``digits`` decimals, or significant digits with ``sig``
    (upwards with ``up``)."""
    if sig:
        if value == 0:
            return 0.0
        digits = digits - 1 - floor(log10(abs(value)))
    if up:
        scale = 10.0 ** digits
        return float(ceil(value * scale - 1e-9) / scale)
    return float(round(value, digits))


def _size(full_bytes: float) -> str:
    for unit, scale in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if full_bytes >= scale:
            return f"{full_bytes / scale:.4g} {unit}"
    return f"{full_bytes:.0f} B"
