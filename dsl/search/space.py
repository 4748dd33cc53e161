"""What `dhelix tune` may change in a program, and every combination of it.

A :class:`Choice` is one assignment of the searched settings: the mesh (tp, cp, pp, dp and,
for expert layers, ep), the micro-batch size and count at the program's global batch, the
ZeRO stage (with hybrid sharding's shard group under ZeRO-3), the recomputation, Centauri's
partition (the file's own block, or the one :mod:`~dhelix.dsl.search.partitions` generates for
the layout, its counts, substitutions and priority left to the planner), when ZeRO-1's
all-gather runs (``param_gather``: after the optimizer or under the next forward), where the optimizer's
states live (``offload``: on the device, or a share of them in host memory where the profile
gives the host link: :mod:`~dhelix.dsl.search.offload`), the fold,
the pipeline and, for a pipeline that writes SI blocks, whether they co-execute their strands
(``si`` on, or off: each runs its forward, then its backward — ``train { si = off }``, the
"without SI" of `dhelix simulate --compare`). Its :attr:`~Choice.layout` is everything but the
schedule (fold, pipeline and SI): what fixes the layer DAGs, the model states and the work per
micro-batch.

:class:`Space` holds the domain of each setting, built from the checked program
(:func:`space_of`): the global batch, the model and the cluster stay as written; a setting
named in ``keep`` stays as written too (`dhelix tune --keep`), and so does ``si`` when the
train block writes it (a file that says SI on or off pins it). The domains are generous —
every divisor, but tensor parallelism beyond two nodes and context parallelism beyond 16,
which no published recipe uses (keep a written value to search around it) — and the checker
decides what is valid (a choice the passes refuse is reported with their reason).
"""

from __future__ import annotations

import math

import itertools
from typing import Iterator

import attrs

from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.core.mesh import MESH_AXES
from dhelix.dsl.core.program import FOLD_COPIES, FOLD_KINDS, Program
from dhelix.dsl.core.wording import did_you_mean
from dhelix.dsl.frontend.config import OFFLOAD, PARAM_GATHER, RECOMPUTE, SI_SETTINGS, ZERO_STAGES
from dhelix.dsl.search.generated import GENERATED
from dhelix.dsl.search.partitions import writes_si
from dhelix.dsl.search.placement import PLACED_AXES, placement_text, placements

#: What ``--keep`` can name: a mesh axis, ``mesh`` (all of them and their order), ``order``
#: (the mesh axes' order: where they sit), a train setting, the fold, the pipeline, SI (on or
#: off) or ``stages`` (the first and last stages' layers).
KEEPABLE = MESH_AXES + ("mesh", "order", "micro_batch", "zero", "recompute", "shard", "partition", "param_gather", "fold",
                        "pipeline", "si", "stages", "offload")
#: The partitions a layout may take: the file's partition block (none when it has none), or
#: the one generated for the layout (:func:`~dhelix.dsl.search.partitions.generated_partition`).
PARTITIONS = ("written", "auto")
#: Micro-batch sizes tried (those that divide the per-replica batch).
MICRO_BATCHES = (1, 2, 4, 8)
#: The largest context-parallel size tried: the ring attention DAG grows with cp, and
#: published recipes stop at 16 (Llama 3's 405B pre-training at 128K context).
MAX_CP = 16
#: Tensor parallelism tried up to this many nodes' GPUs: inside a node, and across two (the
#: cross-node TP that SI hides; beyond, the all-gathers of every layer cross a node per
#: rank pair and no published recipe goes).
MAX_TP_NODES = 2
#: The most chunks per rank tried for ``fold loop(v)`` (Megatron's virtual pipeline stages:
#: published recipes go to 8 for dense models, e.g. Llama 3.1 405B on Megatron-Bridge, PP 8 VP 8).
MAX_LOOP_CHUNKS = 8


def fold_chunks(fold: str) -> int:
    """The chunks per rank of the fold written ``fold`` (``none``, ``u``, ``loop(3)``)."""
    kind, _, arg = fold.partition("(")
    count = FOLD_KINDS.get(kind)
    return count if count is not None else int(arg.rstrip(")"))


def stage_ends_tried(layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    """(first, last) stage layers tried for ``layers`` on ``pp`` ranks of fold none, 0 for an
    equal share: equal stages; both ends lighter, ``e`` each and ``w > e`` on each of the
    p − 2 others, at the least such ``w``; and the last stage alone so (``w`` on the p − 1
    others). Megatron's recipes lighten the ends for the embedding's and the LM head's work."""
    tried = [(0, 0)]
    for ends in (2, 1) if pp >= 3 else (1,) if pp == 2 else ():
        for width in range(max(1, layers // pp), layers + 1):
            rest = layers - (pp - ends) * width
            if rest < ends:
                break
            if rest % ends == 0 and rest // ends < width:
                tried.append((rest // ends if ends == 2 else 0, rest // ends))
                break
    return tuple(tried)


def loop_chunks(layers: int, pipeline_sizes) -> tuple[int, ...]:
    """The chunk counts v (2 to :data:`MAX_LOOP_CHUNKS`) tried for ``fold loop(v)``: those
    that split ``layers`` evenly over some p of ``pipeline_sizes`` (p·v stages of equal
    layers, as the fold needs); a v no p divides would only be refused."""
    return tuple(v for v in range(2, MAX_LOOP_CHUNKS + 1) if any(layers % (p * v) == 0 for p in pipeline_sizes))


@attrs.frozen(order=True)
class Layout:
    """Everything a choice sets but the schedule: mesh sizes, micro-batch size and count,
    ZeRO stage, hybrid sharding's shard group (0: none), recomputation, the partition
    (:data:`PARTITIONS`) and when ZeRO-1's all-gather runs (``step`` or ``forward``)."""

    tp: int
    cp: int
    pp: int
    dp: int
    ep: int
    micro_batch: int
    microbatches: int
    zero: int
    shard: int
    recompute: str
    partition: str = "written"
    param_gather: str = "step"
    #: The order of the mesh axes larger than 1 (but ep, which lives inside dp), innermost
    #: first (:mod:`~dhelix.dsl.search.placement`); () for the file's order.
    order: tuple[str, ...] = ()
    #: With ``recompute = full``: the leading layers of each model chunk that recompute
    #: (``train { recompute_layers }``); 0: every layer.
    recompute_layers: int = 0
    #: The layers of the first and the last pipeline stage (``train { first_stage_layers
    #: last_stage_layers }``); 0: an equal share.
    stage_ends: tuple[int, int] = (0, 0)
    #: Where the optimizer's states live (``train { offload }``): ``none`` (the device) or
    #: ``optimizer`` (host memory).
    offload: str = "none"
    #: Offloaded: the percent of the optimizer's states on the host (``train { offload_percent }``);
    #: 0 where the pricer chooses it (:mod:`~dhelix.dsl.search.offload`: a priced choice
    #: carries the share it chose), and for ``offload = none``.
    offload_percent: int = 0

    def mesh(self) -> dict[str, int]:
        """The mesh sizes by axis."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def axes(self) -> tuple[str, ...]:
        """The axes larger than 1 in their order (innermost first), then ep."""
        sizes = self.mesh()
        placed = self.order or tuple(a for a in PLACED_AXES if sizes[a] > 1)
        return placed + (("ep",) if self.ep > 1 else ())

    def describe(self, gpus_per_node: int | None = None) -> str:
        """``tp8 pp2 dp4  b1 m16  zero1  recompute none`` (the axes larger than 1 innermost
        first; with ``gpus_per_node``, ``|`` where a node ends: ``tp8 | pp2 dp4``; ``recompute
        full 2/chunk`` where only each chunk's first 2 layers recompute), then ``gather
        forward``, ``offload 40%`` (the share in host memory; ``offload`` while not chosen)
        and ``partition auto`` where they are set."""
        sizes = self.mesh()
        placed = self.axes()[:len(self.axes()) - (self.ep > 1)]
        axes = placement_text(placed, sizes, gpus_per_node) if gpus_per_node else " ".join(
            f"{a}{sizes[a]}" for a in placed)
        axes = " ".join(part for part in (axes, f"ep{self.ep}" if self.ep > 1 else "") if part) or "1 rank"
        zero = f"zero{self.zero}" + (f" shard{self.shard}" if self.shard else "")
        zero += " gather forward" if self.param_gather == "forward" else ""
        partition = "  partition auto" if self.partition == "auto" else ""
        recompute = self.recompute + (f" {self.recompute_layers}/chunk" if self.recompute_layers else "")
        first, last = self.stage_ends
        ends = f"  stages {first or '='}..{last or '='}" if self.stage_ends != (0, 0) else ""
        offload = "" if self.offload == "none" else f"  offload {self.offload_percent}%" if self.offload_percent \
            else "  offload"
        return f"{axes}  b{self.micro_batch} m{self.microbatches}  {zero}{offload}  recompute {recompute}{partition}{ends}"


@attrs.frozen(order=True)
class Choice:
    """One point of the space: a layout and a schedule (fold text, pipeline name and
    whether its SI blocks co-execute: ``si`` on or off; on for a pipeline without any)."""

    layout: Layout
    fold: str
    pipeline: str
    si: str = "on"

    def describe(self) -> str:
        """The layout's description, then ``fold u  w_helix`` (and ``SI off`` where it is)."""
        return f"{self.layout.describe()}  {self.schedule()}"

    def schedule(self) -> str:
        """``fold u  w_helix``, then ``SI off`` when the SI blocks do not co-execute."""
        return f"fold {self.fold}  {self.pipeline}" + ("  SI off" if self.si == "off" else "")

    def settings(self) -> dict[str, object]:
        """Every setting by name (``tp``, …, ``fold``, ``pipeline``, ``si``): what tables compare."""
        return {**attrs.asdict(self.layout), "fold": self.fold, "pipeline": self.pipeline, "si": self.si}


@attrs.frozen
class Space:
    """The domain of each searched setting; ``sequences`` is the global batch (sequences per
    step), ``world`` the GPUs, ``schedules`` the (fold, pipeline, si) to try."""

    world: int
    sequences: int
    tp: tuple[int, ...]
    cp: tuple[int, ...]
    pp: tuple[int, ...]
    ep: tuple[int, ...]
    micro_batch: tuple[int, ...]
    zero: tuple[int, ...]
    shard: tuple[int, ...]
    recompute: tuple[str, ...]
    schedules: tuple[tuple[str, str, str], ...]
    kept: dict = attrs.field(factory=dict, eq=False)
    partition: tuple[str, ...] = ("written",)
    param_gather: tuple[str, ...] = ("step",)
    #: The file's order of the mesh axes, and the GPUs of a node and of each declared level:
    #: where the placements of a layout's axes differ (:func:`~dhelix.dsl.search.placement.placements`;
    #: none: the file's order only).
    written_order: tuple[str, ...] = ()
    boundaries: tuple[int, ...] = ()
    #: The model's layers, which the partial recomputations tried follow (0: none tried).
    layers: int = 0
    #: Whether uneven stages are tried (:func:`stage_ends_tried`; `dhelix tune --stages`).
    stages: bool = False
    #: Where the optimizer's states may live: on the device, and in host memory where the
    #: profile gives the host link (``train { offload = optimizer }``).
    offload: tuple[str, ...] = ("none",)
    #: The share an offloading layout keeps on the host: the written one when offload is kept
    #: (100 where the file writes none), else 0 (the pricer chooses it).
    offload_percent: int = 0

    def layouts(self) -> Iterator[Layout]:
        """Every layout of the space whose sizes multiply to the world and divide the batch."""
        for tp, cp, pp in itertools.product(self.tp, self.cp, self.pp):
            if self.world % (tp * cp * pp):
                continue
            dp = self.world // (tp * cp * pp)
            if "dp" in self.kept and dp != self.kept["dp"]:
                continue
            for ep, b in itertools.product(self.ep, self.micro_batch):
                if dp % ep or self.sequences % (dp * b):
                    continue
                for zero, recompute in itertools.product(self.zero, self.recompute):
                    if zero and dp == 1 and not (zero == 3 and cp > 1) and "zero" not in self.kept:
                        continue  # nothing to shard over (ZeRO-3 shards over dp x cp): the same as zero = 0
                    for shard, partition, gather, order, again, ends, offload in itertools.product(
                            self._shards(zero, dp, cp), self.partition, self._gathers(zero),
                            placements({"tp": tp, "cp": cp, "pp": pp, "dp": dp}, self.written_order,
                                       () if "order" in self.kept else self.boundaries),
                            self._recomputed(recompute, pp), self._stage_ends(pp), self.offload):
                        yield Layout(tp, cp, pp, dp, ep, b, self.sequences // (dp * b), zero, shard, recompute,
                                     partition, gather, order, again, ends, offload,
                                     self.offload_percent if offload != "none" else 0)

    def _shards(self, zero: int, dp: int, cp: int) -> tuple[int, ...]:
        if zero != 3 or cp > 1:  # (hybrid sharding with cp > 1 is refused)
            return (0,)
        return tuple(k for k in self.shard if k == 0 or (1 < k < dp and dp % k == 0))

    def _recomputed(self, recompute: str, pp: int) -> tuple[int, ...]:
        """The ``recompute_layers`` tried with ``recompute`` on ``pp`` pipeline ranks: the
        written one when ``recompute`` is kept; else 0 (every layer) and, with full
        recomputation, a quarter, a half and three quarters of the smallest model chunk that a
        schedule of the space gives on ``pp`` ranks (those from 1 to its size less one: a
        larger one recomputes every layer of that chunk, the same program as 0 there)."""
        if "recompute" in self.kept:
            return (int(self.kept["recompute_layers"]),)
        if recompute != "full" or not self.layers:
            return (0,)
        chunks = [pp * fold_chunks(fold) for fold, _, _ in self.schedules]
        smallest = min((self.layers // n for n in chunks if self.layers % n == 0), default=0)
        return (0,) + tuple(sorted({n for n in (round(smallest * k / 4) for k in (1, 2, 3)) if 0 < n < smallest}))

    def _stage_ends(self, pp: int) -> tuple[tuple[int, int], ...]:
        """The first and last stages' layers tried on ``pp`` pipeline ranks: as written when
        ``stages`` is kept, else :func:`stage_ends_tried` where :attr:`stages` asks (equal
        stages otherwise)."""
        if "stages" in self.kept:
            return (self.kept["stages"],)
        return stage_ends_tried(self.layers, pp) if self.stages and self.layers else ((0, 0),)

    def _gathers(self, zero: int) -> tuple[str, ...]:
        # Only ZeRO-1 and ZeRO-2 have an all-gather of the updated weights to place.
        return self.param_gather if zero in (1, 2) else (PARAM_GATHER[0],)

    def choices(self) -> Iterator[Choice]:
        """Every choice: each layout with each schedule."""
        for layout in self.layouts():
            for schedule in self.schedules:
                yield Choice(layout, *schedule)


def divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n`` in increasing order (found up to its square root)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def space_of(program: Program, world: int | None = None, keep: tuple[str, ...] = (),
             partitions: bool = False, generated: bool = False, stages: bool = False) -> Space:
    """The search space of a checked ``program`` (a model, mesh and train block) on ``world``
    GPUs (None: its cluster's); ``keep`` names settings that stay as written (KEEPABLE);
    ``partitions`` adds the generated partition against the file's own (`dhelix tune
    --partitions`: each such candidate's chunk counts are settled by simulating its step
    several times, so the search takes longer); ``generated`` adds the zero-bubble
    scheduler's pipelines, written for each layout (:data:`~dhelix.dsl.search.generated.GENERATED`,
    fold none); ``stages`` adds uneven pipeline stages (:func:`stage_ends_tried`; `dhelix tune
    --stages`: each pipeline size's layouts three times over). Where the profile has a host
    section, the optimizer's states are searched on the device and in host memory (each
    layout twice; the share offloaded chosen when priced: :mod:`~dhelix.dsl.search.offload`)
    unless ``keep`` names ``offload``. Raises UsageError for an unknown name in ``keep`` or a world the nodes cannot
    hold."""
    for name in keep:
        if name not in KEEPABLE:
            notes = did_you_mean(name, KEEPABLE)
            raise UsageError(f"unknown setting '{name}' to keep" + (f" ({notes[0]})" if notes else "")
                             + f"; settings: {', '.join(KEEPABLE)}")
    mesh, train, model = program.mesh, program.train, program.model
    assert mesh is not None and train is not None and model is not None and program.cluster is not None, \
        "a checked model"
    world = world or mesh.world
    kept = _kept(program, keep)
    sequences = mesh.size("dp") * train.micro_batch * train.microbatches

    def domain(name: str, values):
        return (kept[name],) if name in kept else tuple(values)

    experts = model.get("experts")
    layers = model.setting("layers")
    pp = domain("pp", (d for d in divisors(world) if d <= layers))
    return Space(
        world=world, sequences=sequences,
        tp=domain("tp", (d for d in divisors(world) if d <= MAX_TP_NODES * program.cluster.gpus_per_node)),
        cp=domain("cp", (d for d in divisors(world) if d <= MAX_CP)),
        pp=pp,
        ep=domain("ep", (d for d in divisors(world) if experts and experts % d == 0) if experts else (1,)),
        micro_batch=domain("micro_batch", (b for b in MICRO_BATCHES if sequences % b == 0)),
        zero=domain("zero", ZERO_STAGES), shard=domain("shard", (0,) + divisors(world)[1:]),
        recompute=domain("recompute", RECOMPUTE),
        schedules=_schedules(program, kept, loop_chunks(layers, pp), generated), kept=kept,
        partition=domain("partition", PARTITIONS if partitions else PARTITIONS[:1]),
        param_gather=domain("param_gather", PARAM_GATHER),
        written_order=tuple(axis for axis in mesh.order if axis in PLACED_AXES),
        boundaries=tuple(sorted({program.cluster.gpus_per_node} | {gpus for _, gpus in mesh.levels
                                                                    if gpus < world})),
        layers=layers, stages=stages,
        offload=domain("offload", OFFLOAD if program.profile is not None and program.profile.host is not None
                       else (train.offload,)),
        offload_percent=kept.get("offload_percent", 0))


def _kept(program: Program, keep: tuple[str, ...]) -> dict:
    """The written value of each kept setting (``mesh`` stands for every mesh axis)."""
    mesh, train = program.mesh, program.train
    assert mesh is not None and train is not None and program.fold is not None and program.pipeline is not None, \
        "a checked model"
    names = set(keep) | (set(MESH_AXES) | {"order"} if "mesh" in keep else set())
    names |= {"recompute_layers"} if "recompute" in names else set()  # kept with recompute
    names |= {"offload_percent"} if "offload" in names else set()  # kept with offload
    # The written end stages' layers split the written fold's stages, not every fold's.
    names |= {"fold"} if "stages" in names else set()
    written: dict[str, object] = {axis: mesh.size(axis) for axis in MESH_AXES}
    written.update(order=tuple(axis for axis in mesh.order if axis in PLACED_AXES), micro_batch=train.micro_batch,
                   zero=train.zero, recompute=train.recompute, recompute_layers=train.recompute_layers or 0,
                   stages=(train.first_stage_layers or 0, train.last_stage_layers or 0),
                   shard=train.shard or 0, fold=program.fold.text, pipeline=program.pipeline.name,
                   partition="written", param_gather=train.param_gather, si=train.si or SI_SETTINGS[0],
                   offload=train.offload, offload_percent=train.offload_share)
    if train.si is not None:  # written: the file pins it
        names.add("si")
    return {name: written[name] for name in sorted(names - {"mesh"})}


def _schedules(program: Program, kept: dict, chunks: tuple[int, ...],
               generated: bool = False) -> tuple[tuple[str, str, str], ...]:
    """(fold, pipeline, si) for every pipeline the program can name, each with the fold it
    is written for (every fold for one written for any; loop with each of ``chunks``), and
    SI on and off for one that writes SI blocks (SI as kept when it is; a pipeline without
    any takes the kept value, else on: it changes nothing there); with ``generated``, the
    generated pipelines the program does not define itself, on fold none."""
    out = []
    if generated:
        defined = {pipeline.name for pipeline in program.pipelines}
        out += [("none", name, kept.get("si", SI_SETTINGS[0])) for name in GENERATED if name not in defined]
    for pipeline in sorted(program.pipelines, key=lambda p: p.name):
        # (a pipeline written for any fold runs one model copy: fold bidir's two need their own)
        kinds = (pipeline.fold,) if pipeline.fold else tuple(k for k in FOLD_KINDS if k not in FOLD_COPIES)
        si = SI_SETTINGS if writes_si(pipeline) and "si" not in kept else (kept.get("si", SI_SETTINGS[0]),)
        for kind in kinds:
            folds = [kind] if FOLD_KINDS[kind] is not None else [f"{kind}({v})" for v in chunks]
            if FOLD_KINDS[kind] is None and kept.get("fold", "").startswith(f"{kind}(") and kept["fold"] not in folds:
                folds.append(kept["fold"])  # a kept loop(v) the tried counts do not hold
            out += [(fold, pipeline.name, on) for fold in folds for on in si]
    return tuple((fold, name, on) for fold, name, on in out
                 if kept.get("fold", fold) == fold and kept.get("pipeline", name) == name)
