"""Every option of a run and every setting of the train block, declared once.

An :class:`Option` says its name, type, default, range or choices, help, and where it can be
written: on `run`'s command line, in the program's ``train { }`` block, or both (then the command
line wins over the block, and the block over the default). Everything else is made from
:data:`OPTIONS`:

- the command line (``dhelix/cli/options.py``): one argument per option with a flag, its help,
  metavar and range check (the CLI spells ``{name}`` in a help as that option's flag,
  ``{-word}`` as ``--word`` — library text names no option — and ``{default}`` as the default);
- :class:`RunSettings`, the base of the ranks' ``RunOptions``: one field per run option, with
  its default;
- the train block's checks (``dsl/frontend/config.py``): which keys it knows, which of them are
  numbers, names, strings or ``auto``, their lowest value, and their limits
  (``dsl/frontend/limits.py``), so the "settings here" list of an unknown setting follows too;
- the tests hold docs/language.md's train-block table to the train keys here.

A new option is one entry here and the code that reads it (docs/architecture.md, *Where a
change goes*).
"""

from __future__ import annotations

from typing import Any

import attrs

from dhelix.dsl.core.dtypes import MAIN_GRAD_DTYPE

#: The kinds of value an option takes.
KINDS = (int, float, str, bool)
#: The longest collective timeout: a week, far past any collective, and a finite one (torch's
#: stores take milliseconds as a 64-bit integer; infinity is a launcher traceback).
MAX_TIMEOUT_S = 7 * 24 * 3600
#: The most steps a run (and every count of steps) may have.
MAX_STEPS = 1_000_000


@attrs.frozen(kw_only=True)
class Option:
    """One option of a run or setting of the train block.

    ``name``: the field of ``RunOptions`` (and the command line's destination); its flag is the
    name with hyphens, or ``flag`` where given (``flag = ""``: not on the command line).
    ``train``: the train block's key that sets it too (None: the command line's only).
    ``field``: whether the ranks read it as a ``RunOptions`` field (False: the command or the
    compiler turns it into something else, e.g. the data's spec). ``lowest`` / ``highest``
    bound a number (inclusive; ``positive``: above 0, for a real number), ``choices`` a name.
    ``auto``: the train block may write ``auto`` for it; ``path``: a string the train block writes
    quoted. A bool is a switch: given, it sets the opposite of its default."""

    name: str
    kind: type
    #: Its value where nothing sets it (Any: an int, float, str, bool or None, as ``kind`` says).
    default: Any = None
    help: str = ""
    train: str | None = None
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    field: bool = True
    lowest: int | float | None = None
    highest: int | float | None = None
    positive: bool = False
    choices: tuple = ()
    auto: bool = False
    path: bool = False
    many: bool = False
    #: What a number counts (``seconds``), for its range's words.
    unit: str = ""
    #: Where ``--help`` shows it: "run" (the command's own), "training" (the loop's) or "launch"
    #: (`run`'s and `profile`'s, beside the number of ranks and the backend).
    group: str = "run"

    @property
    def on_command_line(self) -> bool:
        return self.flag != ""

    @property
    def spelled(self) -> str:
        """Its flag without the leading dashes (``weight-decay``)."""
        return self.flag or self.name.replace("_", "-")


def _steps(name: str, help: str, *, lowest: int = 1, metavar: str = "N", **more) -> Option:
    """An option counting steps: an integer from ``lowest`` to :data:`MAX_STEPS`."""
    return Option(name=name, kind=int, help=help, lowest=lowest, highest=MAX_STEPS, metavar=metavar, **more)


#: Every option and train setting, the train block's in the order its "settings here" list and
#: docs/language.md name them.
OPTIONS: tuple[Option, ...] = (
    # --- the train block's (and run's where they have a flag) -----------------------------------
    Option(name="micro_batch", kind=int, flag="", train="micro_batch", lowest=1, highest=65_536, field=False),
    Option(name="microbatches", kind=int, flag="", train="microbatches", lowest=1, highest=65_536, field=False),
    Option(name="seed", kind=int, default=0, train="seed", lowest=0, highest=2**63 - 1,
           help="seed of the weights and the data (default: the train block's seed, else {default})"),
    _steps("steps", "training steps (default: the train block's steps, else {default})", train="steps", default=10,
           metavar="K"),
    Option(name="data", kind=str, train="data", path=True, many=True, field=False, metavar="[WEIGHT:]PATH",
           group="training",
           help="train on a text file or a folder of them (byte-level tokens), or on token files "
                "(raw .uint16/.uint32 ids, or a 1-D integer .npy array); overrides the train block's "
                "data. Several sources make a blend, drawn by weight: 0.7:web/ 0.3:code.npy (without "
                "weights, by size)"),
    _steps("eval_every", "evaluate on the held-out data every N steps (default: the train block's eval_every)",
           train="eval_every", group="training"),
    _steps("warmup", "linear learning-rate warm-up steps (default: the train block's warmup, else {default})",
           train="warmup", lowest=0, default=0, group="training"),
    Option(name="zero", kind=int, flag="", train="zero", default=0, choices=(0, 1, 2, 3), field=False),
    Option(name="shard", kind=int, flag="", train="shard", lowest=1, field=False),
    Option(name="launch", kind=int, flag="", train="launch", lowest=1, auto=True, field=False),
    Option(name="launch_backward", kind=int, flag="", train="launch_backward", lowest=1, auto=True, field=False),
    Option(name="param_gather", kind=str, flag="", train="param_gather", default="step", choices=("step", "forward"),
           field=False),
    Option(name="grad_reduce", kind=str, flag="", train="grad_reduce", default="backward",
           choices=("backward", "step"), field=False),
    Option(name="recompute", kind=str, flag="", train="recompute", default="none",
           choices=("none", "selective", "full"), field=False),
    Option(name="recompute_layers", kind=int, flag="", train="recompute_layers", lowest=1, highest=10_000,
           field=False),
    Option(name="offload", kind=str, flag="", train="offload", default="none", choices=("none", "optimizer"),
           field=False),
    Option(name="offload_percent", kind=int, flag="", train="offload_percent", lowest=1, highest=100, field=False),
    Option(name="first_stage_layers", kind=int, flag="", train="first_stage_layers", lowest=1, highest=10_000,
           field=False),
    Option(name="last_stage_layers", kind=int, flag="", train="last_stage_layers", lowest=1, highest=10_000,
           field=False),
    Option(name="si", kind=str, flag="", train="si", default="on", choices=("on", "off"), field=False),
    Option(name="optimizer_check", kind=str, train="optimizer_check", default="sync", choices=("sync", "post"),
           group="training",
           help="when the step's global checks (the gradient norm that {clip} clips to, the non-finite check "
                "of {skip_nonfinite}) hold the optimizer back: sync (default) waits for the norm's all-reduce "
                "before updating; post updates at once, unclipped, while the norm is reduced, and rolls the "
                "update back (then redoes it clipped, or skips it) where the norm says so: the zero-bubble "
                "paper's post-validation, the same numbers"),
    Option(name="grad_reduce_dtype", kind=str, flag="", train="grad_reduce_dtype", default=MAIN_GRAD_DTYPE,
           choices=("fp32", "bf16", "fp16"), group="training",
           help="the dtype data parallelism reduces the gradients in: fp32 (default: the main gradients as "
                "accumulated, as Megatron-LM does for bf16 models) or a 16-bit one (each bucket cast before its "
                "all-reduce or reduce-scatter and back after: half the bytes on the wire; Megatron-LM's "
                "bf16 gradient reduction setting, FSDP's reduce_dtype, and Megatron-LM's fp16 default)"),
    # --- run's own ------------------------------------------------------------------------------
    Option(name="trace", kind=str, metavar="OUT.json", help="write a Chrome trace of what ran"),
    Option(name="lr", kind=float, default=1e-3, positive=True, help="AdamW learning rate (default {default})"),
    Option(name="zero1", kind=bool, default=False,
           help="shard the optimizer state over dp (ZeRO-1), as `train { zero = 1 }` does"),
    Option(name="check", kind=bool, default=False,
           help="compare every step's loss and gradients with the single-process reference"),
    Option(name="nproc", kind=int, lowest=1, metavar="N", field=False, group="launch",
           help="local ranks to spawn (must equal the mesh size)"),
    Option(name="backend", kind=str, choices=("gloo", "nccl"), field=False, group="launch",
           help="collective backend (default: nccl when every local rank can have a GPU of its own, else "
                "gloo; nccl needs one GPU per local rank)"),
    Option(name="timeout", kind=float, default=60.0, positive=True, highest=MAX_TIMEOUT_S, unit="seconds", metavar="S",
           group="launch",
           help="collective timeout in seconds: a dead or hung peer ends the run after this (default {default})"),
    Option(name="metrics", kind=str, metavar="OUT.json", field=False,
           help="write the summary's figures as JSON: step time and exposed communication (medians without the "
                "first step), the simulator's prediction of both, and every rank's per-step times, in seconds"),
    Option(name="json", kind=bool, default=False, field=False,
           help="print the summary's figures as JSON (what {metrics} writes) instead of the table"),
    Option(name="force", kind=bool, default=False, field=False,
           help="start even when the simulator predicts more memory than this machine has"),
    Option(name="topology", kind=str, default="declared", choices=("declared", "measured"),
           help="under torchrun: check the nodes the ranks run on against the cluster block "
                "(declared, the default: a mismatch is an error), or let them decide which groups "
                "are node-local (measured; the summary says so)"),
    # --- the training loop's --------------------------------------------------------------------
    Option(name="eval_data", kind=str, metavar="PATH", field=False, group="training",
           help="evaluate on this held-out data (text or token files, as {data}) instead of the last "
                "10 % of the training data, which is then all trained on"),
    Option(name="tokenizer", kind=str, metavar="TOKENIZER.json", field=False, group="training",
           help="tokenize text data with this Hugging Face fast tokenizer (documents separated by its "
                "end-of-text token) instead of byte-level"),
    Option(name="save", kind=str, metavar="DIR", group="training",
           help="save a checkpoint to DIR at the end (and every {save_every})"),
    _steps("save_every", "also save every N steps", group="training"),
    _steps("keep", "keep the K newest saves in {save} DIR, removing older ones (default {default})", default=2,
           metavar="K", group="training"),
    Option(name="resume", kind=str, metavar="DIR|auto", group="training",
           help="continue the run saved in DIR (a {save} folder, or one save of it: DIR/step-000010), on "
                "this program's layout ({steps} counts all steps); auto: from the newest intact save in "
                "{save} DIR if there is one, else from the start (for restarts, torchrun's "
                "{-max-restarts} included)"),
    Option(name="init", kind=str, metavar="HF_DIR", group="training",
           help="start from the weights of a Hugging Face Llama checkpoint folder (model.safetensors or "
                "its shards; each rank reads only its slices) instead of seeded ones"),
    Option(name="export_weights", kind=str, metavar="OUT.pt", group="training",
           help="write the trained full weights as one torch.save state_dict of the reference model"),
    Option(name="log", kind=str, flag="step-log", aliases=("log",), metavar="OUT.jsonl", group="training",
           help="write one JSON line per step (loss, lr, grad norm, step time, tokens/s, exposed "
                "communication, peak memory) and per evaluation; an existing log is continued by "
                "{resume} and refused otherwise ({-log} is the same option outside torchrun, whose "
                "own options claim it)"),
    Option(name="lr_decay", kind=str, default="cosine", choices=("cosine", "constant"), group="training",
           help="after the warm-up: cosine decay to 0.1 · lr at the last step (default), or constant"),
    Option(name="weight_decay", kind=float, default=0.0, lowest=0.0, metavar="W", group="training",
           help="AdamW weight decay (default {default})"),
    Option(name="clip", kind=float, positive=True, metavar="NORM", group="training",
           help="clip gradients to this global norm"),
    Option(name="skip_nonfinite", kind=bool, default=False, group="training",
           help="skip a step whose loss or gradient norm is NaN or infinite (its update is not "
                "applied; the log marks it) instead of stopping the run there"),
    Option(name="master", kind=bool, default=True, flag="no-fp32-master", group="training",
           help="with dtype bf16 or fp16, update the parameters in that dtype (\"pure\" bf16) "
                "instead of keeping fp32 master weights"),
)


def option(name: str) -> Option:
    """The option called ``name`` (KeyError for none)."""
    for found in OPTIONS:
        if found.name == name:
            return found
    raise KeyError(name)


def train_options() -> tuple[Option, ...]:
    """The train block's settings, in the order its messages and docs list them."""
    return tuple(o for o in OPTIONS if o.train)


def train_keys() -> tuple[str, ...]:
    """The keys a train block may write."""
    return tuple(o.train for o in train_options() if o.train)


def run_fields() -> tuple[Option, ...]:
    """The options the ranks read as ``RunOptions`` fields."""
    return tuple(o for o in OPTIONS if o.field)


def run_settings_class(options: tuple[Option, ...] | None = None) -> type:
    """A frozen attrs class with one keyword field per run option of ``options`` (default:
    :func:`run_fields`), at its default: the base of the ranks' ``RunOptions``."""
    def kind(o: Option) -> Any:
        return o.kind if o.default is not None else o.kind | None

    fields = {o.name: attrs.field(default=o.default, type=kind(o)) for o in (options if options is not None else run_fields())}
    cls = attrs.make_class("RunSettings", fields, frozen=True, kw_only=True)
    cls.__module__ = __name__
    cls.__doc__ = "The run options' fields, made from :data:`OPTIONS` (one per run option, at its default)."
    return cls


#: The run options as fields (``RunOptions`` adds what the command computes: the compiled run,
#: the backend, the data's specs).
RunSettings: Any = run_settings_class()


def range_words(o: Option) -> str | None:
    """What ``o``'s values must be, in words (``between 1 and 1000000``, ``a finite number,
    positive``), or None for an option without a range."""
    if o.kind is int and (o.lowest is not None or o.highest is not None) and not o.choices:
        return f"between {o.lowest} and {o.highest}" if o.highest is not None else f"at least {o.lowest}"
    if o.kind is float:
        bound = "positive" if o.positive else f"at least {o.lowest:g}" if o.lowest is not None else "any"
        unit = f" of {o.unit}" if o.unit else ""
        return f"a finite number{unit}, {bound}" + (f", at most {o.highest:g}" if o.highest is not None else "")
    return None


def in_range(o: Option, value) -> bool:
    """Whether ``value`` (not None) is within ``o``'s range (NaN and infinities are not)."""
    if o.kind is float:
        if value != value or value in (float("inf"), float("-inf")):
            return False
        if o.positive and value <= 0:
            return False
    if o.lowest is not None and value < o.lowest:
        return False
    return o.highest is None or value <= o.highest
