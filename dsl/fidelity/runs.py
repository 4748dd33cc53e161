"""Measured training runs: what a prediction is held to.

A set of measured runs is a YAML file (``benchmarks/published_runs.yaml`` holds the published
ones) with two sections::

    sources:                     # who measured, and the facts of their cluster
      narayanan2021:
        cite: "Narayanan et al., SC'21, arXiv 2104.04473"      # required
        flops_convention: hardware   # hardware (recomputation counted) | model (MFU's count) | none
        cross_gbps_per_gpu: 25       # cross-node bandwidth per GPU, GB/s (NICs per node / GPUs)
        gpus_per_node: 8
        flash_attention: false       # the default of its runs
        grad_overlap: false          # DP gradient reduction overlapped with the backward
        grad_reduce_dtype: fp16      # the dtype DP reduces the gradients in (default: fp32)
        interleaving: fewest         # a run's unstated vp: fewest chunks (default), or tuned
        loss: upcast                 # how its loss holds the logits: vocab_parallel (default), upcast, fused
    runs:
      - id: narayanan2021-1.7b       # unique
        source: narayanan2021        # required: a key of ``sources``
        where: "Table 1, row 1.7B"   # required: the table, figure or section
        quote: "…"                   # required: the source's words with the figure
        gpu: a100-80gb
        gpus: 32
        model: {family: gpt, layers: 24, hidden: 2304, heads: 24, seq: 2048, vocab: 51200}
        dtype: fp16
        tp: 1  pp: 1  dp: 32  cp: 1  ep: 1  vp: 1
        micro_batch: 1               # null: not stated (1 is assumed, and said)
        global_batch: 512            # sequences
        recompute: full              # full | selective | none
        zero: 0
        measured: {tflops_per_gpu: 137}   # or mfu, iteration_s, tokens_per_s_per_gpu, tokens_per_s

A CSV with one row per run (the same keys, the model's as ``model.layers`` and so on, the
measured figure as ``measured.iteration_s``) and a source column naming a ``sources`` entry of
a YAML file given beside it is read the same way (:func:`load_runs`). Every mistake is a
:class:`RunSetError` naming the file, the line and the run.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import attrs
import yaml

from dhelix.dsl.core.errors import DhelixError, ErrorCollector
from dhelix.dsl.core.mesh import MESH_AXES
from dhelix.dsl.core.options import option
from dhelix.dsl.core.span import Source, Span
from dhelix.dsl.core.textfile import FileProblem, read_text_file
from dhelix.dsl.frontend.kernel_terms import LOSS_IMPLS

FIGURES = ("iteration_s", "tflops_per_gpu", "mfu", "tokens_per_s_per_gpu", "tokens_per_s")
FAMILIES = ("gpt", "llama", "moe")
RECOMPUTE = ("full", "selective", "none", "unknown")
#: Figures a source prints beside the one compared (kept in the file, not read).
INFORMATIVE = ("pct_of_peak",)
CONVENTIONS = ("hardware", "model", "none")  # none: the source prints no FLOP figure
RUN_KEYS = ("id", "source", "where", "quote", "gpu", "gpus", "model", "dtype", "tp", "pp", "dp", "cp", "ep",
            "vp", "micro_batch", "global_batch", "recompute", "zero", "flash_attention", "grad_overlap",
            "measured", "memory_gib", "assumed", "schedule", "notes", "sequence_parallel", "doubt", "cp_kind",
            "system")
RUN_REQUIRED = ("id", "source", "where", "quote", "gpu", "gpus", "model", "tp", "pp", "global_batch", "measured")
MODEL_KEYS = ("family", "layers", "hidden", "heads", "kv_heads", "ffn", "seq", "vocab", "experts", "top_k",
              "moe_every", "name", "head_dim",
              # what the stdlib's layers do not model, kept as the source says it
              "activation", "norm", "pos", "sliding_window", "swa_pattern", "capacity_factor")
#: The model's settings that are sizes (whole numbers ≥ 1).
MODEL_NUMBERS = ("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "vocab", "experts", "top_k", "head_dim")
SOURCE_KEYS = ("cite", "system", "url_hint", "read_via", "flops_convention", "cross_gbps_per_gpu", "hbm_gbps",
               "gpus_per_node", "flash_attention", "grad_overlap", "grad_reduce_dtype", "notes", "quote", "cluster",
               "interleaving", "loss",
               # the source's own words behind a fact (kept in the file, not read)
               "flops_quote", "hardware_quote", "loss_quote", "moe_quote")
#: How a run whose source does not say its chunks per rank (``vp: null``) is interleaved:
#: ``fewest`` (:func:`_stated_interleaving`) or ``tuned`` — the source says it tunes its
#: schedule, and the prediction takes the count dhelix prices fastest (:func:`interleavings`).
INTERLEAVINGS = ("fewest", "tuned")


class RunSetError(DhelixError):
    """A set of measured runs that cannot be read or misses what a prediction needs."""


@attrs.frozen
class RunSource:
    """Who measured a set of runs, and the facts of their cluster and software."""

    key: str
    cite: str
    flops_convention: str = "model"
    cross_gbps_per_gpu: float | None = None
    hbm_gbps: float | None = None  # the GPU's memory bandwidth where it differs from the profile's
    gpus_per_node: int = 8
    flash_attention: bool = True
    grad_overlap: bool = True
    interleaving: str = "fewest"  # INTERLEAVINGS
    #: The dtype its data parallelism reduced the gradients in (``train { grad_reduce_dtype }``);
    #: None: not stated, the program's default.
    grad_reduce_dtype: str | None = None
    #: How its loss holds the logits (a profile's ``kernels.loss``); None: the profile's.
    loss: str | None = None


@attrs.frozen
class MeasuredRun:
    """One measured training run (module docstring), its figure read as stated."""

    id: str
    source: RunSource
    where: str
    gpu: str
    gpus: int
    model: dict = attrs.field(hash=False)
    dtype: str
    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    vp: int  # chunks per rank (a source's unstated count: see _stated_interleaving)
    micro_batch: int | None
    global_batch: int
    recompute: str
    zero: int
    flash_attention: bool
    grad_overlap: bool
    measured: dict = attrs.field(hash=False)  # figure -> value
    memory_gib: float | None = None
    cp_kind: str = "ring"  # ring (dhelix's context parallelism) | all_gather (Llama 3's)
    #: The software that ran it where it is not its source's own (a baseline measured by the
    #: source: Narayanan et al.'s DeepSpeed ZeRO-3 rows); "" for the source's system.
    system: str = ""
    #: Whether the source states ``vp`` (False: ``vp`` is the stand-in of :func:`_stated_interleaving`).
    vp_stated: bool = True
    span: Span | None = attrs.field(default=None, eq=False, kw_only=True)

    @property
    def family(self) -> str:
        return self.model["family"]

    def layout(self) -> str:
        """The run's parallel layout in the usual short form: ``TP8 PP4 DP32 (v2) mb1 gb1536``."""
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"DP{self.dp}"]
        parts += [f"{axis.upper()}{size}" for axis, size in (("cp", self.cp), ("ep", self.ep)) if size > 1]
        if self.vp > 1:
            parts.append(f"v{self.vp}")
        if self.zero:
            parts.append(f"Z{self.zero}")
        parts.append(f"rc:{self.recompute}")
        return " ".join(parts)

    @property
    def sequences_per_replica(self) -> int:
        return self.global_batch // self.dp


class _LineLoader(yaml.SafeLoader):
    """PyYAML's safe loader that keeps each mapping's first line (``__line__``)."""

    def construct_mapping(self, node, deep=False):
        mapping = super().construct_mapping(node, deep=deep)
        mapping["__line__"] = node.start_mark.line + 1
        return mapping


def load_runs(path: str | Path, sources_from: str | Path | None = None) -> tuple[MeasuredRun, ...]:
    """The runs of the YAML (or, ending in ``.csv``, CSV) file ``path``; a CSV's sources come
    from the YAML file ``sources_from`` (its ``sources`` section). Raises RunSetError with
    every mistake found (file and line of each)."""
    text, source = _read(path)
    if str(path).endswith(".csv"):
        if sources_from is None:
            raise RunSetError(f"{path}: a CSV of runs needs a YAML file of their sources (its 'sources' section)")
        sources_text, sources_source = _read(sources_from)
        data = _yaml(sources_text, sources_source)
        runs: object = _csv_rows(text)
    else:
        data = _yaml(text, source)
        runs = data.get("runs")
        sources_source = source
    errors = ErrorCollector()
    sources = _sources(data.get("sources"), sources_source, errors)
    if not isinstance(runs, list) or not runs:
        errors.add(RunSetError(f"{path}: no runs (a 'runs' list of mappings)"))
        errors.raise_if_any()
    assert isinstance(runs, list), "refused above"
    out, seen = [], set()
    for index, row in enumerate(runs):
        run = _run(row, index, sources, source, errors)
        if run is None:
            continue
        if run.id in seen:
            errors.add(RunSetError(f"run id '{run.id}' appears twice", run.span))
            continue
        seen.add(run.id)
        out.append(run)
    errors.raise_if_any()
    return tuple(out)


def _read(path) -> tuple[str, Source]:
    try:
        text = read_text_file(Path(path))
    except FileProblem as exc:
        raise RunSetError(f"cannot read {path}: {exc.reason}") from None
    except OSError as exc:
        raise RunSetError(f"cannot read {path}: {exc.strerror or exc}") from None
    return text, Source(str(path), text)


def _yaml(text: str, source: Source) -> dict:
    try:
        data = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        span = _span(source, mark.line + 1) if mark else None
        raise RunSetError(f"not valid YAML: {getattr(exc, 'problem', exc)}", span) from None
    if not isinstance(data, dict):
        raise RunSetError(f"{source.path}: expected a mapping with 'sources' and 'runs'")
    return data


def _csv_rows(text: str) -> list[dict]:
    rows = []
    for number, row in enumerate(csv.DictReader(io.StringIO(text)), start=2):
        nested: dict = {"__line__": number}
        for key, value in row.items():
            if key is None or value in (None, ""):
                continue
            value = _scalar(value)
            head, _, tail = key.partition(".")
            if tail:
                nested.setdefault(head, {})[tail] = value
            else:
                nested[head] = value
        rows.append(nested)
    return rows


def _scalar(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return {"true": True, "false": False, "null": None}.get(value.lower(), value)


def _span(source: Source, line: int | None) -> Span | None:
    return Span(source, line, 1, line, 1) if line else None


def _sources(data, source: Source, errors: ErrorCollector) -> dict[str, RunSource]:
    if not isinstance(data, dict):
        errors.add(RunSetError(f"{source.path}: no 'sources' mapping (who measured each run)"))
        return {}
    out = {}
    for key, entry in data.items():
        if key == "__line__":
            continue
        span = _span(source, entry.get("__line__") if isinstance(entry, dict) else None)
        if not isinstance(entry, dict) or not entry.get("cite"):
            errors.add(RunSetError(f"source '{key}' has no 'cite'", span,
                                   ["say who published it and where: authors, title, venue or address"]))
            continue
        unknown = [name for name in entry if name not in SOURCE_KEYS and name != "__line__"]
        if unknown:
            errors.add(RunSetError(f"source '{key}': unknown key(s) {', '.join(map(str, unknown))}", span,
                                   [f"a source's keys: {', '.join(SOURCE_KEYS)}"]))
            continue
        convention = entry.get("flops_convention", "model")
        if convention not in CONVENTIONS:
            errors.add(RunSetError(f"source '{key}': flops_convention must be one of {', '.join(CONVENTIONS)}", span))
            continue
        if entry.get("interleaving", "fewest") not in INTERLEAVINGS:
            errors.add(RunSetError(f"source '{key}': interleaving must be one of {', '.join(INTERLEAVINGS)}", span))
            continue
        reduce_dtype = entry.get("grad_reduce_dtype")
        if reduce_dtype is not None and reduce_dtype not in option("grad_reduce_dtype").choices:
            errors.add(RunSetError(f"source '{key}': grad_reduce_dtype must be one of "
                                   f"{', '.join(option('grad_reduce_dtype').choices)}", span))
            continue
        loss = entry.get("loss")
        if loss is not None and loss not in LOSS_IMPLS:
            errors.add(RunSetError(f"source '{key}': loss must be one of {', '.join(LOSS_IMPLS)}", span))
            continue
        if not _whole(entry.get("gpus_per_node", 8), 1):
            errors.add(RunSetError(f"source '{key}': gpus_per_node must be a whole number ≥ 1", span))
            continue
        out[key] = RunSource(key, str(entry["cite"]), convention, _positive(entry.get("cross_gbps_per_gpu")),
                             _positive(entry.get("hbm_gbps")), int(entry.get("gpus_per_node", 8)), bool(entry.get("flash_attention", True)),
                             bool(entry.get("grad_overlap", True)), str(entry.get("interleaving", "fewest")),
                             reduce_dtype, loss)
    return out


def _whole(value, low: int) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _positive(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def _stated_interleaving(row: dict, model: dict) -> int:
    """The chunks per rank of an interleaved schedule whose source does not say how many
    (``vp: null``): the fewest, at least 2, that divide a stage's layers (1 without a
    pipeline, or when none does)."""
    pp, layers = row.get("pp") or 1, model.get("layers")
    if pp <= 1 or not isinstance(layers, int):
        return 1
    per_stage = -(-layers // pp)  # an uneven split is simulated padded (predict.padded_layers)
    return next((v for v in range(2, per_stage + 1) if per_stage % v == 0), 1)


def interleavings(run: "MeasuredRun") -> tuple[int, ...]:
    """The chunks per rank a prediction of ``run`` tries: its own count, unless its source
    does not state it and tunes its schedule (``interleaving: tuned``), then every count from
    2 that divides a stage's (padded) layers."""
    if run.vp_stated or run.source.interleaving != "tuned" or run.pp <= 1:
        return (run.vp,)
    per_stage = -(-run.model["layers"] // run.pp)
    return tuple(v for v in range(2, per_stage + 1) if per_stage % v == 0) or (run.vp,)


def _run(row, index: int, sources: dict, source: Source, errors: ErrorCollector) -> MeasuredRun | None:
    if not isinstance(row, dict):
        errors.add(RunSetError(f"{source.path}: run {index + 1} is not a mapping"))
        return None
    span = _span(source, row.get("__line__"))
    name = row.get("id", f"#{index + 1}")
    problems = [f"no '{key}'" for key in RUN_REQUIRED if row.get(key) in (None, "")]
    problems += [f"unknown key '{key}'" for key in row if key not in RUN_KEYS and key != "__line__"]
    if row.get("source") not in (None, "") and row["source"] not in sources:
        problems.append(f"source '{row['source']}' is not in the 'sources' section")
    given = row.get("model")
    model = given if isinstance(given, dict) else {}
    if given is not None and not model:
        problems.append("'model' must be a mapping")
    problems += [f"model: unknown key '{key}'" for key in model if key not in MODEL_KEYS and key != "__line__"]
    problems += [f"model: no '{key}'" for key in ("family", "layers", "hidden", "heads", "seq", "vocab")
                 if model and key not in model]
    if model.get("family") not in (None, *FAMILIES):
        problems.append(f"model: family must be one of {', '.join(FAMILIES)}")
    if model.get("family") == "moe" and not (model.get("experts") and model.get("top_k")):
        problems.append("model: a moe model needs experts and top_k")
    given = row.get("measured")
    measured = given if isinstance(given, dict) else {}
    figures = {k: v for k, v in measured.items() if k not in ("__line__", *INFORMATIVE)}
    if row.get("measured") is not None and not any(k in FIGURES for k in figures):
        problems.append(f"measured: none of {', '.join(FIGURES)}")
    problems += [f"measured: unknown figure '{k}'" for k in figures if k not in FIGURES]
    problems += [f"measured.{k} must be a positive number" for k, v in figures.items()
                 if k in FIGURES and not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v))]
    recompute = row.get("recompute") or "none"
    if recompute not in RECOMPUTE:
        problems.append(f"recompute must be one of {', '.join(RECOMPUTE)} (got '{recompute}')")
    sizes = {axis: row.get(axis, 1) for axis in MESH_AXES if axis != "dp"}  # dp may follow from gpus
    sizes["vp"] = row.get("vp", 1) if row.get("vp", 1) is not None else _stated_interleaving(row, model)
    sizes["dp"] = row.get("dp")
    gpus = row.get("gpus")
    problems += [f"{key} must be a whole number ≥ {low}" for key, low in (("gpus", 1), ("global_batch", 1))
                 if row.get(key) is not None and not _whole(row[key], low)]
    problems += [f"{key} must be a whole number ≥ {low} or null" for key, low in (("micro_batch", 1), ("zero", 0))
                 if row.get(key) is not None and not _whole(row[key], low)]
    problems += [f"model: {key} must be a whole number ≥ 1" for key in MODEL_NUMBERS
                 if model.get(key) is not None and not _whole(model[key], 1)]
    if isinstance(gpus, int) and sizes["dp"] is None and all(isinstance(v, int) for k, v in sizes.items() if k != "dp"):
        sizes["dp"] = gpus // (sizes["tp"] * sizes["pp"] * sizes["cp"]) if sizes["tp"] * sizes["pp"] * sizes["cp"] else None
    if not all(isinstance(v, int) and v >= 1 for v in sizes.values()):
        problems.append("tp, pp, dp, cp, ep and vp must be whole numbers ≥ 1")
    elif isinstance(gpus, int) and sizes["tp"] * sizes["pp"] * sizes["cp"] * sizes["dp"] != gpus:
        problems.append(f"tp × pp × cp × dp = {sizes['tp'] * sizes['pp'] * sizes['cp'] * sizes['dp']}, not gpus = {gpus}")
    if problems:
        errors.add(RunSetError(f"run '{name}': " + "; ".join(problems), span))
        return None
    origin = sources[row["source"]]
    assert gpus is not None, "a required key"
    return MeasuredRun(
        id=str(row["id"]), source=origin, where=str(row["where"]), gpu=str(row["gpu"]), gpus=int(gpus),
        model={k: v for k, v in model.items() if k != "__line__"}, dtype=str(row.get("dtype") or "bf16"),
        micro_batch=row.get("micro_batch"), global_batch=int(row["global_batch"]), recompute=recompute,
        zero=int(row.get("zero") or 0),
        flash_attention=bool(row.get("flash_attention", origin.flash_attention)),
        grad_overlap=bool(row.get("grad_overlap", origin.grad_overlap)),
        measured={k: float(v) for k, v in figures.items()}, memory_gib=_positive(row.get("memory_gib")),
        cp_kind=str(row.get("cp_kind") or "ring"), system=str(row.get("system") or ""),
        vp_stated=row.get("vp", 1) is not None, span=span, **sizes)
