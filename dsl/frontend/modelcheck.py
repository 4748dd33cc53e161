"""Checks of a model against its mesh and fold, and the names layer expressions may use."""

from __future__ import annotations

import math

from dhelix.dsl.core.errors import CheckError, DhelixError
from dhelix.dsl.core.mesh import MESH_AXES, Mesh
from dhelix.dsl.core.program import Model, Train
from dhelix.dsl.core.wording import join_words

#: Names derived from the settings, available in layer expressions (and reserved).
DERIVED = ("tokens",)
#: Names derived from the settings unless the model sets them (``head_dim``: Qwen3, Gemma and
#: GPT-OSS attend with heads narrower or wider than ``hidden / heads``).
DEFAULTED = ("head_dim",)


def layer_env(model: Model, mesh: Mesh, train: Train) -> dict[str, int]:
    """The integer names a layer's expressions may use: model settings, mesh axis sizes,
    ``micro_batch``/``microbatches``, ``tokens`` (micro_batch * seq / cp, the tokens of one
    context-parallel rank) and ``head_dim`` (the model's, else hidden / heads). Assumes
    check_divisibility passed."""
    env = dict(model.settings)
    env.update({axis: mesh.size(axis) for axis in MESH_AXES})
    env.update(micro_batch=train.micro_batch, microbatches=train.microbatches)
    env["tokens"] = train.micro_batch * model.setting("seq") // mesh.size("cp")
    env["head_dim"] = model.get("head_dim") or model.setting("hidden") // model.setting("heads")
    return env


def check_divisibility(model: Model, model_block, mesh: Mesh, mesh_block) -> list[DhelixError]:
    """Every way the model does not split over the mesh (the fold: :func:`stage_split_error`)."""
    errors: list[DhelixError] = []
    errors += _reserved(model_block)
    get = model.get

    def need(key: str, axis: str, why: str) -> None:
        value, size = get(key), mesh.size(axis)
        if value is None or value % size == 0:
            return
        ok = [n for n in range(1, min(value, 64) + 1) if value % n == 0 and n <= 64]
        errors.append(CheckError(f"{key} = {value} is not divisible by {axis} = {size}",
                                 mesh_block.span(axis) or model_block.span(key),
                                 [why,
                                  _where(model_block, key, value),
                                  f"{axis} sizes that divide {value}: {', '.join(map(str, ok[:12]))}"]))

    if get("head_dim") is None and model.setting("hidden") % model.setting("heads"):
        errors.append(CheckError(f"hidden = {get('hidden')} is not divisible by heads = {get('heads')}",
                                 model_block.span("hidden"), ["head_dim = hidden / heads must be whole, or set "
                                                              "head_dim in the model"]))
    need("heads", "tp", why="each tp rank computes heads/tp attention heads")
    need("kv_heads", "tp", why="each tp rank holds kv_heads/tp key-value heads")
    need("ffn", "tp", why="each tp rank holds ffn/tp of the MLP's hidden features")
    need("vocab", "tp", why="the embedding and LM head are split over tp by vocabulary")
    errors += _check_sequence(model, model_block, mesh, mesh_block)
    errors += _check_experts(model, model_block, mesh, mesh_block)
    return errors


def _where(model_block, key: str, value: int) -> str:
    span = model_block.span(key)
    if span is None:  # kv_heads defaults to heads
        return f"{key} = {value} by default (from heads); set {key} to change it"
    return f"{key} = {value} is set at {span}"


_FORMULAS = {"tokens": "micro_batch * seq / cp", "head_dim": "hidden / heads"}


def _reserved(model_block) -> list[DhelixError]:
    return [CheckError(f"'{name}' is derived from the other settings and cannot be set", model_block.span(name),
                       [f"layers see {name} = {_FORMULAS.get(name, 'a derived value')}; "
                        "give your own setting another name"])
            for name in DERIVED if name in model_block.values]


def _check_sequence(model, model_block, mesh, mesh_block) -> list[DhelixError]:
    seq, cp, tp = model.get("seq"), mesh.size("cp"), mesh.size("tp")
    if cp > 1 and seq % (2 * cp):
        return [CheckError(f"seq = {seq} is not divisible by 2 * cp = {2 * cp}", mesh_block.span("cp"),
                           ["causal ring attention balances load by cutting the sequence into 2*cp chunks",
                            f"seq = {seq} is set at {model_block.span('seq')}"])]
    if (seq // cp) % tp:
        return [CheckError(f"seq / cp = {seq // cp} tokens are not divisible by tp = {tp}", mesh_block.span("tp"),
                           ["sequence parallelism splits each rank's tokens over tp",
                            f"seq = {seq} is set at {model_block.span('seq')}"])]
    return []


def _check_experts(model, model_block, mesh, mesh_block) -> list[DhelixError]:
    ep, experts = mesh.size("ep"), model.get("experts")
    if ep > 1 and experts is None:
        return [CheckError(f"ep = {ep} but model {model.name} sets no 'experts'", mesh_block.span("ep"),
                           ["expert parallelism needs a mixture-of-experts model (experts = 16, top_k = 2)"])]
    if experts is not None and experts % ep:
        return [CheckError(f"experts = {experts} is not divisible by ep = {ep}", mesh_block.span("ep"),
                           ["each ep rank holds experts/ep experts",
                            f"experts = {experts} is set at {model_block.span('experts')}"])]
    return []


def stage_widths(layers: int, count: int, ends: tuple[int | None, int | None] = (None, None)
                 ) -> tuple[int, ...] | None:
    """The layers of each of ``count`` pipeline stages in model order: ``ends`` (the first
    stage's, the last's; None: not set) where set, the other stages an equal share of the
    rest; None when they do not split so (a share that is not whole or not positive, ends
    left over, or more ends than stages)."""
    first, last = ends
    given = [k for k in (first, last) if k is not None]
    middle, rest = count - len(given), layers - sum(given)
    if count < 1 or middle < 0 or (middle == 0 and rest != 0) or (middle > 0 and (rest < middle or rest % middle)):
        return None
    share = rest // middle if middle else 0
    widths = [share] * count
    if first is not None:
        widths[0] = first
    if last is not None:
        widths[-1] = last
    return tuple(widths)


def stage_split_error(fold: str, layers: int, ranks: int, chunks: int, span,
                      ends: tuple[int | None, int | None] = (None, None), ends_span=None, *,
                      copies: int = 1) -> CheckError | None:
    """Why ``layers`` layers do not split into ``ranks * chunks / copies`` pipeline stages for
    fold ``fold`` (its text, e.g. ``loop(3)``) — equal ones, or with ``ends`` (the first and the
    last stage's layers, :func:`stage_widths`; the error then at ``ends_span``) —, saying
    which sizes work; None when they do. ``copies`` is the model copies the fold places (2 for
    bidir: each copy runs all the layers over the ranks, one stage per rank, and the ranks must
    pair up, so pp is even; its stages are equal).

    The checker reports it with the program's other errors; the fold pass raises it for
    sizes changed after checking (command-line overrides)."""
    if copies > 1:
        if ends != (None, None):
            return CheckError(f"fold {fold} with first_stage_layers or last_stage_layers", ends_span or span,
                              [f"fold {fold}'s model copies hold equal stages (each copy's first stage sits on "
                               "the rank of the other's last): remove the stage sizes, or use another fold"])
        return _copies_split_error(fold, layers, ranks, copies, span)
    if ends != (None, None) and chunks >= 1 and ranks >= 1 and layers >= 1:
        return _ends_error(fold, layers, ranks * chunks, ends, ends_span or span)
    if chunks < 1:
        return CheckError(f"fold {fold} needs at least 1 chunk per rank", span,
                          ["write loop(2) or more for Megatron's interleaved schedule; "
                           "loop(1) is the same as fold none"])
    if ranks < 1:
        return CheckError(f"a pipeline needs at least 1 rank, got {ranks}", span, ["set mesh pp to 1 or more"])
    if layers < 1:
        return CheckError(f"a model needs at least 1 layer, got {layers}", span)
    count = ranks * chunks
    if layers % count == 0:
        return None
    per_rank = "" if chunks == 1 else f" ({chunks} per rank)"
    on_ranks = f"{ranks} rank{'s' if ranks != 1 else ''}"
    working = _divisors(layers // chunks) if layers % chunks == 0 else []
    multiples = ", ".join(str(count * k) for k in (1, 2, 3))
    works = (f"with {layers} layers, fold {fold} works on {_listing(working)} ranks" if working
             else f"no number of ranks works: fold {fold} needs a multiple of {chunks} layers")
    return CheckError(
        f"{layers} layers do not split into {count} stages{per_rank} for fold {fold} "
        f"on {on_ranks}", span,
        [works, f"on {on_ranks}, fold {fold} needs a multiple of {count} layers "
                f"({multiples}, …)"])


def _copies_split_error(fold: str, layers: int, ranks: int, copies: int, span) -> CheckError | None:
    """:func:`stage_split_error` for a fold placing ``copies`` model copies, each split into
    ``ranks`` stages of which rank r holds stage r of copy 0 and stage p - 1 - r of copy 1."""
    if ranks < 2 or ranks % 2:
        return CheckError(f"fold {fold} needs an even number of pipeline ranks, got pp = {ranks}", span,
                          [f"fold {fold} puts stage r of model copy 0 and stage p - 1 - r of copy 1 on rank r; "
                           "with odd pp the middle rank would hold the same stage of both copies",
                           "set mesh pp to 2, 4, 6, …"])
    if layers < 1:
        return CheckError(f"a model needs at least 1 layer, got {layers}", span)
    if layers % ranks == 0:
        return None
    working = [d for d in _divisors(layers) if d % 2 == 0]
    return CheckError(f"{layers} layers do not split into {ranks} stages for fold {fold} on {ranks} ranks", span,
                      [f"each of fold {fold}'s {copies} model copies runs all layers, one stage per rank: "
                       f"on {ranks} ranks it needs a multiple of {ranks} layers",
                       f"with {layers} layers, fold {fold} works on {_listing(working)} ranks" if working
                       else f"with {layers} layers no even number of ranks works"])


def _ends_error(fold: str, layers: int, count: int, ends: tuple[int | None, int | None], span) -> CheckError | None:
    """The error of :func:`stage_split_error` for stages with set ends, or None."""
    if stage_widths(layers, count, ends) is not None:
        return None
    first, last = ends
    written = " and ".join(f"{key} = {value}" for key, value in (("first_stage_layers", first),
                                                                   ("last_stage_layers", last)) if value is not None)
    given = sum(k is not None for k in ends)
    middle, rest = count - given, layers - sum(k for k in ends if k is not None)
    if middle < 0 or (middle == 0 and rest != 0):
        return CheckError(f"{written}: fold {fold} has {count} stage{'s' * (count != 1)}, and the ends' layers "
                          f"must make the model's {layers}", span,
                          ["a first and a last stage need two stages or more: remove one, or add pipeline ranks"
                           if middle < 0 else "one stage holds every layer: remove it, or add pipeline ranks"
                           if count == 1 else f"with two stages, write layers that add up to {layers}"])
    if rest < middle:
        return CheckError(f"{written} leave{'s' * (given == 1)} {max(rest, 0)} of the model's {layers} layers for the "
                          f"other {middle} stage{'s' * (middle != 1)} of fold {fold}, which need one each", span,
                          ["write fewer layers on the ends, or use fewer pipeline stages"])
    near = [k for k in range(1, layers) if (rest + (first or last or 0) - k) % middle == 0
            and 0 < rest + (first or last or 0) - k][:3] if given == 1 else []
    return CheckError(f"{written} leave{'s' * (given == 1)} {rest} layers for the other {middle} stage"
                      f"{'s' * (middle != 1)} of fold {fold}: not an equal share", span,
                      [f"the stages between the ends split the rest of the {layers} layers evenly"
                       + (f"; e.g. {'first' if first is not None else 'last'}_stage_layers = "
                          f"{join_words([str(k) for k in near], 'or')}" if near else "")])


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, in O(sqrt(n)) steps (``n`` may be large)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _listing(values: list[int]) -> str:
    words = [str(v) for v in values[:8]] + (["…"] if len(values) > 8 else [])
    return join_words(words, "or")


#: The model setting that ties the LM head to the embedding (1: tied; absent: untied).
TIE_SETTING = "tie_embeddings"


def tie_error(model, model_block) -> CheckError | None:
    """An error at ``tie_embeddings`` when it is set to anything but 1; None otherwise. (Where
    the tied ends sit is the fold pass's to check: :func:`~dhelix.dsl.passes.fold.tie_placement_error`.)"""
    value = model.get(TIE_SETTING)
    if value is None or value == 1:
        return None
    return CheckError(f"{TIE_SETTING} = {value}: write {TIE_SETTING} = 1 for an LM head tied to the embedding",
                      model_block.span(TIE_SETTING), ["leave it out for an LM head of its own"])
