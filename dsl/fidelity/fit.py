"""A profile fitted to measured runs, and its leave-one-out error.

The knobs (:data:`KNOBS`) are the profile numbers a published step time can pin down: the
fractions of peak that GEMMs, attention and streaming kernels reach, the fixed time per
kernel, and the bandwidth fractions collectives reach inside a node and across nodes. The fit
minimises a robust loss of the log errors ``ln(predicted / measured)`` (:func:`loss`: squared
below 2 %, linear above, so the mean |error| that matters is what it lowers and a run the knobs
cannot explain does not drag the others) by Levenberg–Marquardt steps on finite-difference
Jacobians (each evaluation simulates every run), inside each knob's bounds; a knob none of the
runs moves stays as it was.

**Leave-one-out.** Each run's error when the fit does not see it, computed from the full fit's
Jacobian: the step that the other runs alone would take from the fitted point, then the
left-out run's residual extrapolated along it (one Gauss–Newton step: exact where the model
is linear in the knobs near the fit, a close estimate otherwise; refitting from scratch per run
costs as many fits as runs).

**Speed.** A fit simulates every run some forty times; a long pipelined run is simulated at two
smaller micro-batch counts and extrapolated (:meth:`Case.predicted_s` with ``fast``: the step is
linear in the micro-batches once the pipeline is full — equal to the full simulation on every
published run to 1e-5). The fitted errors reported are the full simulations'.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import attrs

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.fidelity.predict import Case
from dhelix.dsl.frontend.profiles import Profile

_STREAMING = ("norm", "add", "activation")
#: No GEMM library reaches the dense peak: cuBLAS's best large GEMMs measure 80-90 % of it on
#: A100 and H100 (NVIDIA's Matrix Multiplication Background guide; Hopper's GEMMs are power
#: limited). A fit that wants more is explaining something else with the GEMMs.
GEMM_CEILING = 0.9
#: A knob is fitted only where at least this many runs exercise what it prices
#: (:func:`identifiable`): fewer would fit their assumptions, not the hardware.
MIN_RUNS_PER_KNOB = 5


@attrs.frozen
class Knob:
    """One fitted number of a profile: how to read and write it, and its bounds."""

    name: str
    what: str
    get: Callable[[Profile], float]
    put: Callable[[Profile, float], Profile]
    low: float
    high: float
    log: bool = True  # fitted in log space (a fraction); else linearly (a time)


def _achieved(classes: Sequence[str]):
    def put(profile: Profile, value: float) -> Profile:
        achieved = dict(profile.achieved)
        for cls in classes:
            achieved[cls] = value
        return attrs.evolve(profile, achieved=achieved)
    return put


def _efficiency(lane: str) -> tuple[Callable[[Profile], float], Callable[[Profile, float], Profile]]:
    def get(profile: Profile) -> float:
        return profile.collectives["all_gather"].efficiency_on(lane)

    def put(profile: Profile, value: float) -> Profile:
        out = {}
        for name, model in profile.collectives.items():
            lanes = {other: model.efficiency_on(other) for other in ("local", "cross")}
            lanes[lane] = value
            out[name] = attrs.evolve(model, lanes=lanes)
        return attrs.evolve(profile, collectives=out)
    return get, put


def _overhead(profile: Profile, value: float) -> Profile:
    return attrs.evolve(profile, kernels=attrs.evolve(profile.kernels, overhead_us=value))


KNOBS = {
    "gemm": Knob("gemm", "achieved.gemm: fraction of peak of large GEMMs",
                 lambda p: p.achieved["gemm"], _achieved(("gemm",)), 0.05, GEMM_CEILING),
    "gemm_fp8": Knob("gemm_fp8", "achieved.gemm_fp8: fraction of the fp8 peak of fp8 GEMMs",
                     lambda p: p.achieved.get("gemm_fp8", p.achieved["gemm"]), _achieved(("gemm_fp8",)), 0.05,
                     GEMM_CEILING),
    "attention": Knob("attention", "achieved.attention: fraction of peak of attention",
                      lambda p: p.achieved["attention"], _achieved(("attention",)), 0.05, 1.0),
    "streaming": Knob("streaming", "achieved.norm/add/activation: fraction of HBM bandwidth",
                      lambda p: p.achieved["norm"], _achieved(_STREAMING), 0.05, 1.0),
    "overhead": Knob("overhead", "kernels.overhead_us: fixed µs per kernel",
                     lambda p: p.kernels.overhead_us, _overhead, 0.0, 200.0, log=False),
    "local": Knob("local", "collectives' bandwidth fraction inside a node", *_efficiency("local"), 0.05, 1.0),
    "cross": Knob("cross", "collectives' bandwidth fraction across nodes", *_efficiency("cross"), 0.05, 1.0),
}
DEFAULT_KNOBS = ("gemm", "overhead", "local", "cross")


def identifiable(knobs: Sequence[str], cases: Sequence[Case]) -> tuple[str, ...]:
    """The ``knobs`` that at least :data:`MIN_RUNS_PER_KNOB` of ``cases`` exercise: ``gemm``
    needs runs whose GEMMs are not fp8, ``gemm_fp8`` runs whose are, ``attention`` runs with
    flash attention (materialized attention is priced as GEMMs and streams); the others price
    what every run has."""
    def uses(knob: str, case: Case) -> bool:
        program = case.program
        assert program.model is not None, "a checked model"
        fp8 = program.model.dtype == "fp8"
        if knob == "gemm":
            return not fp8
        if knob == "gemm_fp8":
            return fp8
        if knob == "attention":
            return case.on(program.profile).kernels.attention == "flash"
        return True
    return tuple(k for k in knobs if sum(uses(k, c) for c in cases) >= MIN_RUNS_PER_KNOB)


class FitError(DhelixError):
    """Runs that cannot be fitted (none predictable, or a knob that does not exist)."""


@attrs.frozen
class Fit:
    """The result: fitted values, errors before and after, leave-one-out errors per run."""

    profile: Profile
    knobs: tuple[str, ...]
    values: dict = attrs.field(hash=False)  # knob -> fitted value
    start: dict = attrs.field(hash=False)  # knob -> value before
    cases: tuple[Case, ...]
    before: tuple[float, ...]  # error (predicted / measured - 1) per run, start profile
    after: tuple[float, ...]  # the same, fitted profile
    loo: tuple[float, ...]  # leave-one-out error per run
    evaluations: int


class Held:
    """Cases simulated under any profile; the evaluations counted."""

    def __init__(self, cases: Sequence[Case]):
        self.cases = list(cases)
        self.measured = [case.measured_s for case in self.cases]
        self.evaluations = 0

    def log_errors(self, profile: Profile) -> list[float]:
        """``ln(predicted / measured)`` of every case under ``profile``."""
        self.evaluations += 1
        return [math.log(case.predicted_s(profile, fast=True) / case.measured_s) for case in self.cases]


def _coordinates(knob: Knob, value: float) -> float:
    return math.log(max(value, 1e-9)) if knob.log else value / 10.0


def _value(knob: Knob, x: float) -> float:
    value = math.exp(x) if knob.log else 10.0 * x
    return min(max(value, knob.low), knob.high)


def _apply(profile: Profile, knobs: Sequence[Knob], xs: Sequence[float]) -> Profile:
    for knob, x in zip(knobs, xs, strict=True):
        profile = knob.put(profile, _value(knob, x))
    return profile


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a x = b`` by Gaussian elimination with partial pivoting (a small dense system)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-300:
            continue
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] if abs(m[i][i]) > 1e-300 else 0.0 for i in range(n)]


#: The pseudo-Huber scale of the fit's loss: errors much smaller than it count squared, larger
#: ones by their size (a run the knobs cannot explain pulls the fit no harder than its error).
ROBUST_SCALE = 0.02


def loss(res: Sequence[float]) -> float:
    """The fit's loss: ``Σ δ²(√(1 + (r/δ)²) - 1)`` over the log errors ``r`` (pseudo-Huber,
    δ = :data:`ROBUST_SCALE`): least squares near zero, the mean |error| the goal measures
    further out."""
    d = ROBUST_SCALE
    return sum(d * d * (math.sqrt(1 + (r / d) ** 2) - 1) for r in res)


def _step(jac: list[list[float]], res: list[float], damping: float, rows: Sequence[int]) -> list[float]:
    """The Levenberg–Marquardt step over ``rows`` for :func:`loss`, as iteratively reweighted
    least squares (weight ``1 / √(1 + (r/δ)²)``): ``(JᵀWJ + λ·diag(JᵀWJ)) δ = -JᵀWr``."""
    k = len(jac[0])
    weights = {i: 1.0 / math.sqrt(1 + (res[i] / ROBUST_SCALE) ** 2) for i in rows}
    jtj = [[sum(weights[i] * jac[i][a] * jac[i][b] for i in rows) for b in range(k)] for a in range(k)]
    jtr = [sum(weights[i] * jac[i][a] * res[i] for i in rows) for a in range(k)]
    for a in range(k):
        jtj[a][a] += damping * (jtj[a][a] or 1e-12) + 1e-12
    return [-x for x in _solve(jtj, jtr)]


def fit_profile(cases: Sequence[Case], profile: Profile, knobs: Sequence[str] = DEFAULT_KNOBS,
                iterations: int = 8, progress: Callable[[str], None] | None = None) -> Fit:
    """Fit ``knobs`` of ``profile`` to ``cases`` (module docstring). Raises FitError for an
    unknown knob or when there is no case."""
    unknown = [name for name in knobs if name not in KNOBS]
    if unknown:
        raise FitError(f"unknown knob(s): {', '.join(unknown)}", notes=[f"knobs: {', '.join(KNOBS)}"])
    chosen = [KNOBS[name] for name in knobs]
    if not cases:
        raise FitError("no measured run to fit to")
    held = Held(cases)
    xs = [_coordinates(k, k.get(profile)) for k in chosen]
    start_res = held.log_errors(profile)
    res, damping, rows = start_res, 1e-3, range(len(held.cases))
    jac = None
    for iteration in range(iterations):
        jac = _jacobian(held, profile, chosen, xs, res)
        cost = loss(res)
        while True:
            delta = _step(jac, res, damping, rows)
            trial = [_coordinates(k, _value(k, x + d)) for k, x, d in zip(chosen, xs, delta, strict=True)]
            trial_res = held.log_errors(_apply(profile, chosen, trial))
            if loss(trial_res) < cost:
                xs, res, damping = trial, trial_res, max(damping / 3, 1e-6)
                break
            damping *= 4
            if damping > 1e4:
                break
        if progress:
            progress(f"iteration {iteration + 1}: mean |log error| {sum(abs(r) for r in res) / len(res):.4f}")
        if damping > 1e4 or cost - loss(res) < 1e-7 * max(cost, 1e-12):
            break
    jac = _jacobian(held, profile, chosen, xs, res)
    loo = []
    for i in range(len(held.cases)):
        others = [j for j in rows if j != i]
        delta = _step(jac, res, 1e-6, others) if others else [0.0] * len(chosen)
        moved = [_coordinates(k, _value(k, x + d)) - x for k, x, d in zip(chosen, xs, delta, strict=True)]
        loo.append(math.exp(res[i] + sum(g * d for g, d in zip(jac[i], moved, strict=True))) - 1.0)
    fitted = _apply(profile, chosen, xs)
    after = tuple(case.predicted_s(fitted) / case.measured_s - 1 for case in held.cases)  # exact, not extrapolated
    return Fit(fitted, tuple(knobs), {k.name: k.get(fitted) for k in chosen}, {k.name: k.get(profile) for k in chosen},
               tuple(held.cases), tuple(math.exp(r) - 1 for r in start_res), after, tuple(loo), held.evaluations)


def _jacobian(held: Held, profile: Profile, knobs: Sequence[Knob], xs: list[float],
              res: list[float]) -> list[list[float]]:
    """d ln(predicted) / d x per run and knob, by one-sided differences (backwards at an
    upper bound)."""
    columns = []
    for index, knob in enumerate(knobs):
        h = 0.02
        moved = list(xs)
        moved[index] = xs[index] + h
        if _value(knob, moved[index]) == _value(knob, xs[index]):
            h = -h
            moved[index] = xs[index] + h
        step = _coordinates(knob, _value(knob, moved[index])) - xs[index]
        if step == 0:
            columns.append([0.0] * len(res))
            continue
        shifted = held.log_errors(_apply(profile, knobs, moved))
        columns.append([(s - r) / step for s, r in zip(shifted, res, strict=True)])
    return [[columns[k][i] for k in range(len(knobs))] for i in range(len(res))]
