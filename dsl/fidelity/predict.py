"""A measured run as a dhelix program, its prediction, and the error between them.

Each :class:`~dhelix.dsl.fidelity.runs.MeasuredRun` becomes a program of the stdlib's layers
(``gpt``: LayerNorm, GeLU, full multi-head attention; ``llama``: RMSNorm, SwiGLU, grouped
queries; ``moe``: ``llama``'s attention and a routed SwiGLU expert MLP), its mesh in
Megatron-LM's order (tp, cp, dp, pp innermost first; ep carved out of dp), ``one_f_one_b``
without folding or ``interleaved_1f1b`` over ``fold loop(v)``, SI off — what Megatron-LM,
NeMo and torchtitan run, with the gradients reduced in the dtype the source's system reduced them
in where it is not fp32 (``grad_reduce_dtype``). The profile is the GPU's shipped one with the source's cluster facts
(cross-node bandwidth per GPU, flash attention or not) and the device memory of the run's
GPU; :func:`predict` simulates one step of it.

Figures are compared as **iteration seconds**: a published TFLOP/s per GPU becomes seconds
by the source's FLOP count (``model``: Megatron-LM's formula, what MFU counts; ``hardware``:
that plus the forward of every layer again under full recomputation, as Narayanan et al.
2021 count), an MFU by the GPU's dense peak, tokens per second by the batch's tokens. The
error is ``predicted / measured - 1``: negative when the prediction is too fast.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Callable

import attrs

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.core.program import Program
from dhelix.dsl.fidelity.runs import MeasuredRun, interleavings
from dhelix.dsl.frontend.profiles import Profile, load_profile
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.planner.costmodel import megatron_flops_per_iteration
from dhelix.dsl.simulator.events import simulate

#: The shipped profile of each GPU a run may name (the part before the first '-').
GPU_PROFILES = {"a100": "a100", "h100": "h100", "h800": "h100", "h200": "h200", "a40": "a40", "a800": "a800"}
_LAYERS = {"gpt": "gpt", "llama": "llama", "moe": "moe"}


@attrs.frozen
class Prediction:
    """One run held to the simulator: measured and predicted iteration seconds, or why not."""

    run: MeasuredRun
    measured_s: float | None
    predicted_s: float | None
    problem: str = ""
    predicted_peak_gib: float | None = None

    @property
    def error(self) -> float | None:
        """``predicted / measured - 1`` (negative: too fast); None when either is missing."""
        if self.measured_s is None or self.predicted_s is None:
            return None
        return self.predicted_s / self.measured_s - 1.0


def profile_name(run: MeasuredRun) -> str | None:
    """The shipped profile of the run's GPU (``a100-80gb`` -> ``a100``); None without one."""
    return GPU_PROFILES.get(run.gpu.lower().split("-")[0])


def base_profile(run: MeasuredRun) -> Profile:
    """The shipped profile of the run's GPU, loaded; DhelixError for a GPU without one."""
    program_text(run)  # a run on a GPU without a shipped profile is refused there
    name = profile_name(run)
    assert name is not None, "refused by program_text"
    return load_profile(name)


def run_profile(run: MeasuredRun, profile: Profile) -> Profile:
    """``profile`` with the run's cluster facts: its source's cross-node bandwidth per GPU,
    its attention implementation, its loss's (where the source says) and its GPU's memory
    (``-40gb``)."""
    links = dict(profile.links)
    if run.source.cross_gbps_per_gpu is not None:
        links["cross"] = attrs.evolve(links["cross"], bw_gbps=run.source.cross_gbps_per_gpu)
    kernels = attrs.evolve(profile.kernels, attention="flash" if run.flash_attention else "materialized",
                           loss=run.source.loss or profile.kernels.loss)
    memory = profile.memory_gb
    for part in run.gpu.lower().split("-")[1:]:
        if part.endswith("gb") and part[:-2].isdigit():
            memory = float(part[:-2])
    hbm = run.source.hbm_gbps or profile.hbm_gbps
    return attrs.evolve(profile, links=links, kernels=kernels, memory_gb=memory, hbm_gbps=hbm)


def program_text(run: MeasuredRun) -> str:
    """The dhelix program of ``run`` (module docstring)."""
    shipped = profile_name(run)
    if shipped is None:
        raise DhelixError(f"run '{run.id}': no shipped profile for GPU '{run.gpu}'", run.span,
                          [f"GPUs: {', '.join(sorted(GPU_PROFILES))}"])
    if run.cp > 1 and run.cp_kind != "ring":
        raise DhelixError(f"run '{run.id}': {run.cp_kind} context parallelism is not modelled "
                          "(dhelix's cp is ring attention)", run.span)
    model = dict(run.model)
    family = model.pop("family")
    model.pop("name", None)
    for unmodelled in ("moe_every", "activation", "norm", "pos", "sliding_window", "swa_pattern", "capacity_factor"):
        model.pop(unmodelled, None)
    hidden, heads = model["hidden"], model["heads"]
    model.setdefault("kv_heads", heads)
    model.setdefault("ffn", 4 * hidden if family == "gpt" else model.get("ffn"))
    model["layers"] = padded_layers(run)
    settings = "  ".join(f"{key} = {value}" for key, value in model.items() if value is not None)
    gpn = min(run.source.gpus_per_node, run.gpus)
    mesh = [f"tp = {run.tp}", f"cp = {run.cp}", f"dp = {run.dp}", f"pp = {run.pp}"]
    if run.ep > 1:
        mesh.append(f"ep = {run.ep}")
    micro = run.micro_batch or 1
    microbatches = run.global_batch // (run.dp * micro)
    if microbatches * run.dp * micro != run.global_batch:
        raise DhelixError(f"run '{run.id}': global batch {run.global_batch} is not a multiple of "
                          f"dp × micro-batch = {run.dp * micro}", run.span)
    if run.vp > 1:
        fold, pipeline = f"loop({run.vp})", "interleaved_1f1b"
    else:
        fold, pipeline = "none", "one_f_one_b"
    grad = "backward" if run.grad_overlap else "step"
    recompute, zero = approximations(run)
    # ZeRO-3's layers reduce-scatter their pieces in the model's dtype already (the setting is refused there).
    reduce_dtype = run.source.grad_reduce_dtype
    reduce = f"  grad_reduce_dtype = {reduce_dtype}" if reduce_dtype is not None and zero != 3 else ""
    train = f"micro_batch = {micro}  microbatches = {microbatches}  recompute = {recompute}  zero = {zero}"
    return f"""import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model run {{
  {settings}
  dtype = {run.dtype}  layer = {_LAYERS[family]}
}}
cluster {{ nodes = {run.gpus // gpn}  gpus_per_node = {gpn}  profile = "{shipped}" }}
mesh {{ {"  ".join(mesh)} }}
train {{ {train}  grad_reduce = {grad}{reduce}  si = off }}
fold {fold}
pipeline {pipeline}
"""


def approximations(run: MeasuredRun) -> tuple[str, int]:
    """The recomputation and ZeRO stage the program runs ``run`` with, where dhelix has no
    setting that says what the source ran:

    * ``recompute: unknown`` (NeMo's and Megatron-Bridge's tables print none) as ``none``;
    * FSDP with a pipeline (ZeRO-3, pp > 1) as ZeRO-1: torchtitan and Llama 3 keep the
      gathered weights through the step's micro-batches under pipeline parallelism
      (torchtitan's ``reshard_after_forward`` is off with pp; Llama 3 sec. 3.3.2), so the
      weights are gathered once a step and the gradients reduce-scattered once, ZeRO-1's traffic,
      where dhelix's ZeRO-3 gathers every layer for every micro-batch.
    """
    recompute = "none" if run.recompute == "unknown" else run.recompute
    zero = run.zero
    if zero == 3 and run.pp > 1:
        zero = 1
    return recompute, zero


def padded_layers(run: MeasuredRun) -> int:
    """The layers the program holds: the run's, rounded up to a multiple of its stages
    (``pp × vp``). dhelix splits a model into equal stages; a source that splits its layers
    unevenly (Llama 3's 126 over 16 stages) runs at the pace of its largest stage, which the
    padded program's every stage has. The FLOPs a figure is converted with count the run's
    own layers."""
    stages = run.pp * run.vp
    return -(-run.model["layers"] // stages) * stages


def measured_seconds(run: MeasuredRun, program, profile: Profile) -> float:
    """The run's measured iteration seconds, from whichever figure it states (module
    docstring; the first of iteration_s, tflops_per_gpu, mfu, tokens per second)."""
    figures = run.measured
    if "iteration_s" in figures:
        return figures["iteration_s"]
    tokens = run.global_batch * run.model["seq"]
    if "tokens_per_s_per_gpu" in figures:
        return tokens / (figures["tokens_per_s_per_gpu"] * run.gpus)
    if "tokens_per_s" in figures:
        return tokens / figures["tokens_per_s"]
    flops = counted_flops(run, program)
    per_gpu = figures.get("tflops_per_gpu")
    if per_gpu is None:
        per_gpu = figures["mfu"] * profile.peak_tflops[run.dtype]
    return flops / (per_gpu * 1e12 * run.gpus)


def counted_flops(run: MeasuredRun, program) -> float:
    """FLOPs of one iteration as the run's source counts them (module docstring)."""
    settings = tuple((k, run.model["layers"] if k == "layers" else v) for k, v in program.model.settings)
    model = attrs.evolve(program.model, settings=settings)
    model_flops = megatron_flops_per_iteration(model, run.global_batch, swiglu=run.family != "gpt")
    if run.source.flops_convention == "model" or run.recompute != "full":
        return model_flops
    logits = 6.0 * run.global_batch * run.model["seq"] * run.model["hidden"] * run.model["vocab"]
    return model_flops + (model_flops - logits) / 3.0


@attrs.frozen
class Case:
    """One measured step a profile is held to: a checked program, its measured seconds and how
    a profile becomes the one it ran on (a published run's cluster facts; as is for a user's
    own run). ``shorter``: the same program at two smaller micro-batch counts ``(m, program)``,
    from which :meth:`predicted_s` may extrapolate (``fast``)."""

    id: str
    label: str
    program: Program = attrs.field(eq=False)  # validated
    measured_s: float
    on: Callable[[Profile], Profile] = attrs.field(eq=False, default=lambda profile: profile)
    shorter: tuple = attrs.field(eq=False, default=())
    #: The published run the case holds, as predicted (its interleaving chosen where the source
    #: tuned an unstated one); None for a user's own run.
    run: MeasuredRun | None = attrs.field(eq=False, default=None)

    def predicted_s(self, profile: Profile, fast: bool = False) -> float:
        """The simulated step seconds on ``profile`` (the case's facts applied). ``fast``:
        extrapolated linearly in the micro-batches from the two shorter programs — a pipeline's
        step grows by one stage time per micro-batch once every stage is busy, and the tail
        (gradient reduction, optimizer) does not grow — where the case has them."""
        chosen = self.on(profile)
        if not fast or not self.shorter:
            return _step(self.program, chosen)
        (m1, short1), (m2, short2) = self.shorter
        t1, t2 = _step(short1, chosen), _step(short2, chosen)
        assert self.program.train is not None, "a checked model"
        m = self.program.train.microbatches
        return t1 + (t2 - t1) * (m - m1) / (m2 - m1)


def _step(program, profile: Profile) -> float:
    return simulate(attrs.evolve(program, profile=profile), trace=False).step_time


#: A pipelined run with more micro-batches than this many times its stages gets shorter
#: twins for the fit (:attr:`Case.shorter`), at once and twice its stages (the step is linear
#: in the micro-batches from there on: equal to the full simulation to 1e-6 on every
#: published run, benchmarks/published_runs.py).
SHORTER_ABOVE = 3


def run_case(run: MeasuredRun, profile: Profile | None = None) -> Case:
    """The :class:`Case` of a published ``run`` (its profile by default the GPU's shipped
    one). Raises DhelixError for a run the program cannot express."""
    chosen = run_profile(run, profile if profile is not None else base_profile(run))
    run = _interleaved(run, chosen)
    program = attrs.evolve(check_text(program_text(run), f"{run.id}.dhx"), profile=chosen)
    shorter: tuple[tuple[int, Program], ...] = ()
    micro = run.micro_batch or 1
    assert program.train is not None, "a checked model"
    if run.pp > 1 and program.train.microbatches > SHORTER_ABOVE * run.pp:
        shorter = tuple((k * run.pp, attrs.evolve(check_text(program_text(
            attrs.evolve(run, global_batch=k * run.pp * run.dp * micro)), f"{run.id}.dhx"), profile=chosen))
            for k in (1, 2))
    return Case(run.id, run.layout(), program, measured_seconds(run, program, chosen),
                functools.partial(run_profile, run), shorter, run)


def _interleaved(run: MeasuredRun, profile: Profile) -> MeasuredRun:
    """``run`` with the chunks per rank its prediction uses: the one count it has, or, for a
    tuned schedule of unstated interleaving (:func:`~dhelix.dsl.fidelity.runs.interleavings`),
    the count that simulates fastest on ``profile`` (ties to the fewer chunks) — what the
    source's tuning would have kept. Chosen once, on the profile the case is built with: a
    fit then varies the profile, not the schedule."""
    counts = interleavings(run)
    if len(counts) == 1:
        return attrs.evolve(run, vp=counts[0]) if counts[0] != run.vp else run
    timed = []
    for vp in counts:
        candidate = attrs.evolve(run, vp=vp)
        program = attrs.evolve(check_text(program_text(candidate), f"{run.id}.dhx"), profile=profile)
        timed.append((_step(program, profile), vp, candidate))
    return min(timed, key=lambda item: item[:2])[2]


def predict(run: MeasuredRun, profile: Profile | None = None) -> Prediction:
    """Simulate ``run`` on ``profile`` (by default the GPU's shipped one), with the run's
    cluster facts applied (:func:`run_profile`). A run the program cannot express comes back
    with its ``problem`` and no prediction."""
    try:
        case = run_case(run, profile)
        sim = simulate(case.program, trace=False)
    except DhelixError as exc:
        return Prediction(run, None, None, exc.message.splitlines()[0])
    peak = max(rank.memory for rank in sim.ranks) / 2 ** 30
    assert case.run is not None, "a published run's case holds it"
    return Prediction(case.run, case.measured_s, sim.step_time, predicted_peak_gib=peak)


def summary(predictions) -> dict:
    """Mean and max |error| (fractions) and the count of the predictions that have one."""
    errors = [abs(p.error) for p in predictions if p.error is not None]
    if not errors:
        return {"runs": 0, "mean": math.nan, "max": math.nan}
    return {"runs": len(errors), "mean": sum(errors) / len(errors), "max": max(errors)}


def metrics_case(path: str | Path) -> Case:
    """The :class:`Case` of a ``dhelix run --metrics`` file: the program it ran (``file``,
    relative to the working directory as the run named it) and its measured median step
    (``step_s``). Raises RunSetError when the file is not such a file."""
    from dhelix.dsl.fidelity.runs import RunSetError
    from dhelix.dsl.frontend.imports import read_source
    from dhelix.dsl.simulator.launch import priced_program

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise RunSetError(f"cannot read {path} as a run's metrics file: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("file"), str) or not isinstance(data.get("step_s"), (int, float)):
        raise RunSetError(f"{path}: not a run's metrics file (no 'file' and 'step_s')")
    program, _ = priced_program(read_source(data["file"]), data["file"], None)
    assert program.mesh is not None and program.train is not None, "a checked model"
    mesh = " ".join(f"{axis}{size}" for axis, size in zip(program.mesh.order, program.mesh.sizes, strict=True)
                    if size > 1)
    return Case(str(path), f"{data['file']} {mesh} m{program.train.microbatches}", program, float(data["step_s"]))
