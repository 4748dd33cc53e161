"""The upper limits on every setting, and on the size of a lowered schedule.

Each limit is far above any real training configuration and low enough that every command
finishes in seconds and bounded memory (``benchmarks/scaling.py`` measures how time and
memory grow). docs/language.md lists them; a value past one is a located error naming it.
"""

from __future__ import annotations

from dhelix.dsl.core.errors import CheckError
from dhelix.dsl.core.options import train_options

#: The most each setting may be, by block. Settings not named (integers a layer uses, such as
#: `head_dim2 = 128`) get :data:`OTHER_LIMIT`.
LIMITS: dict[str, dict[str, int | float]] = {
    "model": {"layers": 10_000, "hidden": 2**20, "ffn": 2**22, "heads": 4096, "kv_heads": 4096,
              "seq": 2**24, "vocab": 2**24, "experts": 4096, "top_k": 4096},
    "cluster": {"nodes": 16_384, "gpus_per_node": 1024},
    "mesh": {"tp": 65_536, "cp": 65_536, "ep": 65_536, "dp": 65_536, "pp": 1024},
    # the train block's, as dhelix.dsl.core.options declares them
    "train": {o.train: o.highest for o in train_options() if o.train and o.highest is not None},
}
OTHER_LIMIT = 2**40
#: The most chunks per rank of `fold loop(V)`.
MAX_CHUNKS = 1024
#: The most (rank, micro-batch, chunk) forward passes a lowered schedule may hold: lowering,
#: validation, export and simulation all take time in proportion to it.
MAX_SCHEDULE_PASSES = 2**17
#: The most layer passes one step may hold (micro-batches × layers: each micro-batch goes
#: through every layer forward and backward): the simulator's time and memory (its trace
#: keeps per-layer memory samples) are in proportion to it.
MAX_LAYER_PASSES = 2**20


def limit_of(block: str, key: str) -> int | float:
    """The largest value setting ``key`` of ``block`` may take."""
    return LIMITS.get(block, {}).get(key, OTHER_LIMIT)


def range_error(block: str, key: str, value: int, span, lowest: int | float = 1) -> CheckError | None:
    """The error for ``key = value`` in ``block`` outside [lowest, its limit], or None."""
    if value < lowest:
        bound = "positive" if lowest == 1 else f"at least {lowest}"
        return CheckError(f"'{key}' must be {bound}, got {value}", span)
    limit = limit_of(block, key)
    if value > limit:
        return CheckError(f"'{key}' must be at most {limit:,}, got {_digits(value)}", span,
                          [f"dhelix limits {block} settings to sizes it can plan and simulate quickly "
                           "(docs/language.md, Limits)"])
    return None


def schedule_size_error(ranks: int, microbatches: int, chunks: int, layers: int, span) -> CheckError | None:
    """The error for a schedule of ``ranks × microbatches × chunks`` forward passes past
    :data:`MAX_SCHEDULE_PASSES`, or of ``microbatches × layers`` layer passes past
    :data:`MAX_LAYER_PASSES`; None when it is within both."""
    if microbatches * layers > MAX_LAYER_PASSES:
        return CheckError(f"one step would run {microbatches * layers:,} layer passes (microbatches "
                          f"{microbatches} x layers {layers}); the limit is {MAX_LAYER_PASSES:,}", span,
                          ["use fewer micro-batches or layers (docs/language.md, Limits)"])
    passes = ranks * microbatches * chunks
    if passes <= MAX_SCHEDULE_PASSES:
        return None
    return CheckError(f"the schedule would hold {passes:,} forward passes (pp {ranks} x microbatches "
                      f"{microbatches} x {chunks} chunk{'s' * (chunks != 1)}); the limit is "
                      f"{MAX_SCHEDULE_PASSES:,}", span,
                      ["use fewer micro-batches or pipeline ranks (docs/language.md, Limits)"])


def _digits(value: int) -> str:
    text = f"{value:,}"
    return text if len(text) <= 32 else f"a number of {len(str(value))} digits"
