"""`dhelix new --hf config.json [--gpus N] [--tp T] [--pp P] [--seq S] -o model.dhx`: a
program from a Hugging Face model's configuration.

The configuration is read by :mod:`dhelix.dsl.frontend.hfconfig` (what the layer library cannot
compute is an error located at the field); the program it becomes is checked by every pass of
``dhelix check`` and written in the formatter's canonical form. The output is never one of the
inputs, and an existing file is replaced only with ``--force``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from dhelix.cli.paths import output_path, write_output
from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.frontend.fmt import format_source
from dhelix.dsl.frontend.hfconfig import Layout, choose_tp, program_text, read_hf_config
from dhelix.dsl.frontend.imports import read_source
from dhelix.dsl.passes.pipeline import check_text


def register(subparsers) -> None:
    """Add the ``new`` command to the CLI's sub-command parsers."""
    new = subparsers.add_parser(
        "new", help="write a program for a Hugging Face Llama/Mistral configuration",
        description="Write a program (layer llama_rope) for the model of a Hugging Face config.json, "
                    "checked and formatted.")
    new.add_argument("--hf", metavar="CONFIG.json", required=True, help="the model's config.json")
    new.add_argument("-o", "--output", metavar="OUT.dhx", required=True, help="the program to write")
    new.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs to train on (default 1)")
    new.add_argument("--gpus-per-node", type=int, default=8, metavar="G", help="GPUs per node (default 8)")
    new.add_argument("--tp", type=int, metavar="T",
                     help="tensor-parallel size (default: the largest inside a node that splits the model)")
    new.add_argument("--pp", type=int, default=1, metavar="P", help="pipeline-parallel size (default 1)")
    new.add_argument("--seq", type=int, metavar="S",
                     help="sequence length (default: max_position_embeddings, at most 4096)")
    new.add_argument("--micro-batch", type=int, default=1, metavar="B", help="sequences per micro-batch (default 1)")
    new.add_argument("--microbatches", type=int, metavar="M", help="micro-batches per step (default 4 · pp)")
    new.add_argument("--profile", default="h100", help="hardware profile to price it with (default h100)")
    new.add_argument("--name", help="the model's name (default: the configuration's folder)")
    new.add_argument("--force", action="store_true", help="replace OUT.dhx if it exists")
    new.set_defaults(func=cmd_new)


def cmd_new(args) -> int:
    """`dhelix new --hf CONFIG -o OUT`; returns the exit code."""
    layout = _layout(args)
    output = output_path(args.output, "-o", inputs=(args.hf,))
    if output.exists() and not args.force:
        raise UsageError(f"-o {args.output}: the file exists; give another name or --force to replace it")
    if not output.suffix == ".dhx":
        raise UsageError(f"-o {args.output}: a program's name ends in .dhx")
    model = read_hf_config(read_source(args.hf), args.hf, args.seq)
    tp = choose_tp(model, layout)
    if layout.gpus % (tp * layout.pp):
        raise UsageError(f"--gpus {layout.gpus} is not a multiple of tp {tp} × pp {layout.pp}")
    layers = model.get("layers")
    if model.get("tie_embeddings") and layout.pp > 1 and layers % (2 * layout.pp):
        fits = [p for p in range(1, layers // 2 + 1) if layers % (2 * p) == 0]
        raise UsageError(f"--pp {layout.pp}: the configuration ties its embeddings (tie_word_embeddings), and a tied "
                         "LM head runs on the embedding's pipeline rank, which with pp > 1 needs fold u: its "
                         f"{layers} layers do not split into 2 · pp = {2 * layout.pp} stages; give --pp 1"
                         f"{''.join(f' or --pp {p}' for p in fits if p > 1)}")
    name = args.name or _model_name(Path(args.hf))
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise UsageError(f"--name {name}: a model's name is a letter or _ then letters, digits or _")
    text = format_source(program_text(model, name, layout, Path(args.hf).name), str(output))
    program = check_text(text, str(output))  # every pass of `dhelix check`; nothing is written on an error
    write_output(output, text)
    assert program.mesh is not None  # a model file
    mesh = " × ".join(f"{axis} {program.mesh.size(axis)}" for axis in ("tp", "pp", "dp"))
    print(f"{output}: model {name} ({model.model_type}, {model.get('layers')} layers, hidden {model.get('hidden')}) "
          f"on {layout.gpus} GPU{'s' * (layout.gpus != 1)}: {mesh}", file=sys.stderr)
    return 0


def _layout(args) -> Layout:
    for flag, value in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node), ("--tp", args.tp),
                        ("--pp", args.pp), ("--seq", args.seq), ("--micro-batch", args.micro_batch),
                        ("--microbatches", args.microbatches)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        raise UsageError(f"--gpus {args.gpus} is not a whole number of nodes of {args.gpus_per_node}")
    return Layout(args.gpus, args.gpus_per_node, args.tp, args.pp, args.micro_batch, args.microbatches, args.profile)


def _model_name(config: Path) -> str:
    """The configuration's folder name as a model name (``Llama-3.2-1B`` → ``llama_3_2_1b``)."""
    name = re.sub(r"[^A-Za-z0-9_]+", "_", config.resolve().parent.name).strip("_").lower()
    return name if re.fullmatch(r"[A-Za-z_]\w*", name or "") else f"model_{name}" if name else "model"
