"""`dhelix export FILE --torch-csv OUT [--torch-format FORM] [overrides]`: write the lowered
schedule for torch.distributed.pipelining; `dhelix export FILE --checkpoint CK --hf OUT_DIR
[--tokenizer TOKENIZER.json]`: write a checkpoint's weights as a Hugging Face Llama or Qwen2
folder (:func:`dhelix.api.export_hf`).

The CSV and its two forms are :mod:`dhelix.dsl.render.torch_csv`'s; this module reads the
command line, checks the output path (:mod:`dhelix.cli.paths`), writes the file and says on
standard error what it wrote. The overrides (``--ranks``, ``--microbatches``, ``--layers``,
``--pipeline``, ``--fold``) re-lower the file's schedule at other sizes, as for ``render``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dhelix.cli.paths import output_path, program_inputs, refuse_inputs, write_output
from dhelix.dsl.core.errors import UsageError
from dhelix.cli.overrides import add_override_arguments, overrides_from_args
from dhelix.dsl.passes.overrides import load_file
from dhelix.dsl.render.torch_csv import TORCH_FORMATS, torch_csv


def register(subparsers) -> None:
    """Add the ``export`` command to the CLI's sub-command parsers."""
    export = subparsers.add_parser(
        "export", help="write the lowered schedule for torch.distributed.pipelining",
        description="Write FILE's lowered pipeline schedule as the CSV that torch.distributed."
                    "pipelining's _PipelineScheduleRuntime._load_csv reads (SI blocks as "
                    "OVERLAP_F_B).")
    export.add_argument("file", metavar="FILE")
    export.add_argument("--torch-csv", metavar="OUT", help="write the torch schedule CSV to OUT")
    export.add_argument("--torch-format", default="compute_only", metavar="FORM",
                        help="compute_only (default; torch adds SEND/RECV itself) or compute_comms "
                             "(dhelix's own SEND/RECV; load with format=\"compute_comms\")")
    export.add_argument("--checkpoint", metavar="CK", help="with --hf: the `dhelix run --save` folder to export")
    export.add_argument("--hf", metavar="OUT_DIR",
                        help="write CK's weights as a Hugging Face folder (LlamaForCausalLM, or Qwen2ForCausalLM for "
                             "layer qwen2_rope: config.json, generation_config.json and model.safetensors, sharded "
                             "above --max-shard-size, with its index); OUT_DIR must be new or empty")
    export.add_argument("--tokenizer", metavar="TOKENIZER.json",
                        help="with --hf: copy this tokenizer into OUT_DIR, with the tokenizer files beside it "
                             "(tokenizer_config.json, special_tokens_map.json, tokenizer.model)")
    export.add_argument("--max-shard-size", type=float, default=5000, metavar="MB",
                        help="with --hf: the largest safetensors file in MB before sharding (default 5000)")
    add_override_arguments(export)
    export.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    """`dhelix export FILE --torch-csv OUT [--torch-format FORM] [overrides]`; returns the
    exit code."""
    if args.torch_format not in TORCH_FORMATS:
        raise UsageError(f"--torch-format: unknown form '{args.torch_format}'; "
                         f"forms: {', '.join(TORCH_FORMATS)}")
    if args.hf or args.checkpoint or args.tokenizer:
        return _export_hf(args)
    if not args.torch_csv:
        raise UsageError("nothing to export: give --torch-csv OUT.csv, or --checkpoint CK --hf OUT_DIR")
    output = output_path(args.torch_csv, "--torch-csv", inputs=(args.file,))
    program = load_file(args.file, overrides_from_args(args))
    refuse_inputs(output, "--torch-csv", program_inputs(program))
    lowered = program.lowered
    assert lowered is not None  # load_file: a validated model
    write_output(output, torch_csv(lowered, args.torch_format))
    print(f"{output}: {lowered.name}, p = {lowered.ranks}, m = {lowered.microbatches}, "
          f"{len(lowered.stages)} stages, {args.torch_format}", file=sys.stderr)
    return 0


def _export_hf(args) -> int:
    """`dhelix export FILE --checkpoint CK --hf OUT_DIR`; returns the exit code."""
    if not (args.hf and args.checkpoint):
        raise UsageError("--hf OUT_DIR and --checkpoint CK go together: the weights of CK are written to OUT_DIR")
    if args.torch_csv:
        raise UsageError("--torch-csv and --hf write different things; give one of them")
    if args.max_shard_size <= 0:
        raise UsageError("--max-shard-size must be positive")
    if args.tokenizer and not Path(args.tokenizer).is_file():
        raise UsageError(f"--tokenizer {args.tokenizer}: no such file; give a tokenizer.json")
    out = Path(args.hf)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--hf {args.hf}: that exists and is not an empty folder; give a new folder")
    if not out.parent.resolve().is_dir():
        raise UsageError(f"--hf {args.hf}: the folder '{out.parent}' does not exist")
    for name in (args.file, args.checkpoint):
        if Path(name).resolve() == out.resolve() or out.resolve() in Path(name).resolve().parents:
            raise UsageError(f"--hf {args.hf}: that holds an input ('{name}'); give a new folder")
    from dhelix import api

    program = api.load_program(args.file)
    written = api.export_hf(program, args.checkpoint, str(out), int(args.max_shard_size * 10**6),
                            tokenizer=args.tokenizer)
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    print(f"{out}: {len(written)} files ({architecture}; load with from_pretrained)", file=sys.stderr)
    return 0
