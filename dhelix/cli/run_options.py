"""What `dhelix run` and `dhelix run --as-rank` share: the interpreter's RunOptions from the
command line and the train block (:func:`run_options`), what is read
and checked of them before any rank starts (the data, the checkpoint to resume, the Hugging
Face weights: :func:`preflight_data`, :func:`refuse_data`, :func:`resume_differences`), the
warnings printed once per node (:func:`warn`) and the run's trace file (:func:`write_trace`).
torch is imported only inside the functions."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dhelix.cli.options import run_values
from dhelix.cli.paths import refuse_inputs, write_output
from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.render.trace import trace_json


def reporter() -> bool:
    """Whether this process prints what every process meets before the ranks join (errors,
    warnings): outside torchrun, or as a node's local rank 0 under it."""
    rank = os.environ.get("RANK")
    return rank is None or "WORLD_SIZE" not in os.environ or os.environ.get("LOCAL_RANK", rank) == "0"


def warn(warnings) -> None:
    """Print ``warnings`` (DhelixWarning, or lines) on standard error, once per node."""
    if reporter():
        for warning in warnings:
            print(warning if isinstance(warning, str) else warning.render(), file=sys.stderr)


def refuse_data(outputs: dict, data) -> None:
    """UsageError when an output would overwrite the training data: a file output that is a
    data file, or a checkpoint folder that holds data files."""
    from dhelix.interpreter.training.data import data_files

    files = data_files(data)
    for flag, path in outputs.items():
        if flag != "--save":
            refuse_inputs(path, flag, files)
            continue
        folder = os.path.realpath(path)
        inside = [f for f in files if os.path.realpath(f).startswith(folder + os.sep) or os.path.realpath(f) == folder]
        if inside:
            raise UsageError(f"--save {path}: the folder holds the training data ('{inside[0]}'); the checkpoints "
                             "would be mixed with it; give another folder")


def preflight_data(options, verified: list | None = None) -> None:
    """Read the data and the checkpoint to resume before any rank starts, so that their
    errors come once, located, and not from every rank; the save resumed from is checked
    against its manifest unless ``verified`` (what checking it already said) is given."""
    from dhelix.interpreter.training import checkpoint, data
    from dhelix.interpreter.ops.weights import WeightPlan

    program = options.compiled.program
    if options.init is not None:  # every tensor's presence and shape
        WeightPlan(program, options.seed, options.compiled.reference, hf=options.init)
    sequences = program.train.micro_batch * program.train.microbatches * program.mesh.size("dp")
    corpus = None
    if options.data is not None:
        corpus = data.load_corpus(options.data, program.model.get("vocab"), program.model.get("seq"),
                                  options.eval_data)
        warn(filter(None, [data.short_data(options.data, corpus, sequences)]))
    if options.resume is not None:
        warn(checkpoint.verify(checkpoint.resolve(options.resume)) if verified is None else verified)
        _, meta = checkpoint.latest(options.resume)
        plan = WeightPlan(program, options.seed, options.compiled.reference)
        checkpoint.check_fits(options.resume, meta, plan, sequences)
        if meta["step"] >= options.steps:
            raise UsageError(f"--resume {options.resume}: the checkpoint is at step {meta['step']}, and this run "
                             f"has {options.steps} steps in all; give --steps above {meta['step']}")
        saved = (meta.get("data") or {}).get("fingerprint") or {}
        warn(resume_differences(meta, options, data.fingerprint(corpus, sampled="hashed" not in saved)))


def resume_differences(meta: dict, options, fingerprint: dict | None = None) -> list:
    """Warnings (DhelixWarning) for what a resumed run changes from the saved one: the seed
    (the data order), the training data (``fingerprint``, this run's
    :func:`~dhelix.interpreter.training.data.fingerprint`, against the saved one) and each
    setting of the learning-rate schedule the checkpoint stored."""
    from dhelix.dsl.core.errors import DhelixWarning
    from dhelix.interpreter.training.data import FINGERPRINT_SAMPLES

    found = []
    saved = (meta.get("data") or {}).get("fingerprint")
    same = fingerprint is not None and saved is not None and all(
        saved.get(key) == fingerprint.get(key) for key in ("windows", "sha256"))
    if saved is not None and not same:
        now = "seeded random tokens" if fingerprint is None else f"{fingerprint['windows']} windows"
        hashed = saved.get("hashed", f"{FINGERPRINT_SAMPLES} sampled windows")
        compared = ("the window count and a SHA-256 of every training token" if hashed == "all" else
                    f"the window count and a SHA-256 of {hashed} (the saved run's dhelix fingerprinted no more)")
        found.append(DhelixWarning(
            f"--resume {options.resume}: the training data differs from the saved run's ({saved['windows']} "
            f"windows, fingerprint {saved['sha256']}; now {now}"
            + ("" if fingerprint is None else f", fingerprint {fingerprint['sha256']}") + ")",
            notes=[f"compared: {compared}",
                   "the steps continue by number over other data; give the saved run's --data to continue it"]))
    if meta.get("seed") is not None and meta["seed"] != options.seed:
        found.append(DhelixWarning(f"--resume {options.resume}: the run was saved with seed {meta['seed']}, this one "
                                   f"has {options.seed}; the data order changes from here",
                                   notes=[f"give --seed {meta['seed']} to continue the same run"]))
    found += _blend_differences(meta, options)
    saved, now = meta.get("schedule") or {}, options.schedule()
    changed = [f"{key} {saved[key]} → {now[key]}" for key in now if key in saved and saved[key] != now[key]]
    if changed:
        found.append(DhelixWarning(f"--resume {options.resume}: the learning-rate schedule differs from the saved "
                                   f"run's ({'; '.join(changed)})",
                                   notes=["the resumed steps follow this run's options; give the saved ones to "
                                          "continue the same trajectory"]))
    return found


def _blend_differences(meta: dict, options) -> list:
    """A warning (DhelixWarning) when the resumed run's data blend is not the saved one's."""
    from dhelix.dsl.core.errors import DhelixWarning
    from dhelix.interpreter.training.data import Blend

    saved = (meta.get("data") or {}).get("blend")
    now = options.data.describe() if isinstance(options.data, Blend) else None
    if saved is None or now is None or saved == now:
        return []
    return [DhelixWarning(f"--resume {options.resume}: the data blend differs from the saved run's (sources "
                          f"{' '.join(saved['sources'])}, weights {saved['weights'] or 'by size'}); its order is "
                          "drawn again from the first step with this run's sources and weights",
                          notes=["give the saved blend to continue where each source stood"])]


def run_options(args, compiled, backend: str):
    """The interpreter's RunOptions from the command line, the program's train block and
    the run ``compiled`` once (a :class:`~dhelix.dsl.simulator.runplan.RunPlan`): every
    declared run option by :func:`~dhelix.cli.options.value_of`, then what the command computes
    (the data's specs, absolute paths, ZeRO-1 from the train block's ``zero``)."""
    from dhelix.interpreter.training import data, train

    program = compiled.program
    values = run_values(args, program.train)
    values.update(
        zero1=values["zero1"] or program.train.zero >= 1,
        init=str(Path(args.init).resolve()) if args.init else None,
        data=data.data_spec(program, args.file, args.data, "--data", args.tokenizer),
        eval_data=data.DataSpec(str(Path(args.eval_data).resolve()), flag="--eval-data",
                                tokenizer=str(Path(args.tokenizer).resolve()) if args.tokenizer else None)
        if args.eval_data else None)
    return train.RunOptions(**values, path=args.file, compiled=compiled, backend=backend)


def write_trace(path: Path, program, options, result) -> None:
    """Write the Chrome trace of a run's ``result`` (every rank's events, measured) to
    ``path``; UsageError if it cannot be written."""
    metadata = {"source": options.path, "program": program.model.name, "schedule": program.pipeline.name,
                "backend": options.backend, "si": options.si, "si_plan": options.plan, "zero1": options.zero1,
                "steps": options.steps, "measured": "dhelix run: a process per rank, a thread per lane"}
    write_output(path, trace_json(result.events, metadata=metadata))
