"""`dhelix generate CK | FILE [--checkpoint CK | --init HF_DIR] [--prompt TEXT] [--max-new N]
[--temperature T --top-p P] [--tokenizer tokenizer.json]`: text from a model, on one process;
`dhelix generate FILE --pipeline zb [--memory N] [--times F,B,W[,C]] [-o OUT.dhx]`: a pipeline.

With ``--pipeline zb`` it writes a schedule instead: the zero-bubble scheduler
(:mod:`dhelix.dsl.planner.zero_bubble`) for FILE's pipeline ranks and micro-batches, from the
F, B and W times of one pipeline stage that FILE's profile gives (or ``--times``, with the
transfer C) and at most ``--memory`` micro-batches' activations per rank (default p, 1F1B's;
the inputs only a W reads count from its B to it),
as a `.dhx` library file with one pipeline, ``zb_auto`` for fold none.

CK is a `dhelix run --save` folder (its program is kept in the save); FILE a program, with the
weights of ``--checkpoint``, of a Hugging Face folder (``--init``) or seeded ones. Text is
byte-level unless ``--tokenizer`` names a ``tokenizer.json``. Greedy by default; with
``--temperature`` > 0, nucleus sampling (``--top-p``, seeded by ``--seed``). The generation
itself is :func:`dhelix.api.generate`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dhelix.dsl.core.errors import DhelixWarning, UsageError


def register(subparsers) -> None:
    """Add the ``generate`` command to the CLI's sub-command parsers."""
    gen = subparsers.add_parser(
        "generate", help="generate text from a checkpoint or a program on one process",
        description="Print the prompt and its continuation by the model of a `dhelix run --save` folder "
                    "or a program (greedy unless --temperature).")
    gen.add_argument("target", metavar="CK|FILE", help="a checkpoint folder (dhelix run --save) or a program")
    gen.add_argument("--checkpoint", metavar="CK", help="with a program: the weights of this checkpoint folder")
    gen.add_argument("--init", metavar="HF_DIR", help="with a program: the weights of a Hugging Face folder")
    gen.add_argument("--prompt", default="The ", help="the text to continue (default 'The ')")
    gen.add_argument("--max-new", type=int, default=100, metavar="N", help="tokens to generate (default 100)")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T",
                     help="sampling temperature (default 0: the most likely token each time)")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P",
                     help="with --temperature: sample among the most likely tokens whose probability reaches P")
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampling (and of seeded weights)")
    gen.add_argument("--tokenizer", metavar="TOKENIZER.json", help="a Hugging Face fast tokenizer (default: bytes)")
    gen.add_argument("--pipeline", choices=("zb",),
                     help="write a pipeline instead of text: zb, the zero-bubble scheduler's for FILE's sizes")
    gen.add_argument("--memory", type=int, metavar="N",
                     help="with --pipeline: micro-batches of activations a rank may hold (default: pipeline ranks)")
    gen.add_argument("--times", metavar="F,B,W[,C]",
                     help="with --pipeline: a stage's forward, input-gradient and weight-gradient times and the "
                          "transfer (default: from FILE's profile)")
    gen.add_argument("-o", "--output", metavar="OUT.dhx", help="with --pipeline: write it here (default: print it)")
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    """`dhelix generate …`; prints the text and returns the exit code."""
    if args.pipeline:
        from dhelix.cli.generate_pipeline import write_pipeline
        return write_pipeline(args)
    if args.memory is not None or args.times or args.output:
        raise UsageError("--memory, --times and -o go with --pipeline")
    if args.max_new < 1:
        raise UsageError("--max-new must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UsageError("--temperature must be 0 or more and --top-p in (0, 1]")
    from dhelix import api
    from dhelix.interpreter.training.checkpoint import latest
    from dhelix.interpreter.training.tokenizer import codec

    target = Path(args.target)
    checkpoint = args.checkpoint
    if target.is_dir():
        if args.checkpoint or args.init:
            raise UsageError(f"{args.target} is a checkpoint: --checkpoint and --init go with a program file")
        _, meta = latest(args.target)
        if "program" not in meta:
            raise UsageError(f"the checkpoint '{args.target}' does not keep its program (saved by an older dhelix): "
                             f"give it, `dhelix generate FILE --checkpoint {args.target}`")
        program = api.load_program(meta["program"]["path"], meta["program"]["text"])
        checkpoint = args.target
    else:
        if args.checkpoint and args.init:
            raise UsageError("--checkpoint and --init both give the weights; give one")
        program = api.load_program(args.target)
    assert program.model is not None  # load_program: a model file
    text = codec(args.tokenizer, program.model.get("vocab"))
    prompt = text.encode(args.prompt)
    if not prompt:
        raise UsageError("--prompt is empty: give at least one character to continue")
    model = api.reference_model(program, seed=args.seed, hf=args.init, checkpoint=checkpoint)
    window = getattr(model.plan.source, "sliding_window", None)
    if window is not None and len(prompt) + args.max_new > window:
        print(DhelixWarning(f"sliding_window = {window} in '{Path(args.init) / 'config.json'}': the prompt and "
                            f"--max-new reach {len(prompt) + args.max_new} tokens, and this attention is full over "
                            f"all of them, so tokens past {window} are not the model's own",
                            notes=[f"give a prompt and --max-new of {window} tokens or less"]).render(),
              file=sys.stderr)
    ids = api.generate(model, prompt, args.max_new, temperature=args.temperature, top_p=args.top_p,
                       seed=args.seed, stop=text.end_of_text)
    sys.stdout.write(text.decode(ids) + "\n")
    return 0
