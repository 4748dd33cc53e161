"""dhelix's stdlib pipelines against torch.distributed.pipelining's own ``pipeline_order``,
action for action (the compute order of every rank), over a grid of (ranks, micro-batches).

torch builds each schedule's ``pipeline_order`` in its constructor; here the constructor runs
on stand-in stages (no process group: the schedules read only a stage's rank, group size,
stage count and module), exactly as ``get_schedule_class(name)(stages, m)`` would for a real
run. Its actions are written in dhelix's notation (``F3.1``: micro-batch 3 on this rank's
chunk 1; torch's ``I`` is our ``B``, its ``OVERLAP_F_B`` our SI block) and compared with the
lowered stdlib pipeline, transfers left out. Where dhelix differs on purpose, the difference
has a name below and is applied to torch's side before the comparison; nothing else is.
The whole module skips when torch or its pipelining module is absent.
"""

from __future__ import annotations

import types

import pytest

from dhelix.dsl.core.errors import ScheduleError
from dhelix.dsl.core.schedule import Interleaved, Transfer
from dhelix.dsl.frontend.stdlib import stdlib_pipelines
from dhelix.dsl.passes.fold import placement_for
from dhelix.dsl.passes.lower import lower_pipeline
from dhelix.dsl.passes.validate import validate_lowered

torch = pytest.importorskip("torch")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

#: torch's schedule name (get_schedule_class) → (dhelix pipeline, fold, chunks per rank).
SCHEDULES = {
    "GPipe": ("gpipe", "none", 1),
    "1F1B": ("one_f_one_b", "none", 1),
    "Interleaved1F1B": ("interleaved_1f1b", "loop", 2),
    "LoopedBFS": ("looped_bfs", "loop", 2),
    "InterleavedZeroBubble": ("interleaved_zb", "loop", 2),
    "ZBVZeroBubble": ("zbv", "u", 2),
    "DualPipeV": ("dualpipe_v", "u", 2),
}

GRID = [(p, m) for p in (1, 2, 3, 4, 6, 8) for m in range(1, 4 * p + 3)]


def torch_rounds(ranks: int, microbatches: int) -> int:
    """The micro-batches torch's interleaved schedules launch per chunk in a row
    (``microbatches_per_round``): dhelix's ``g`` (train { launch })."""
    return microbatches // max(1, microbatches // ranks)


def refused_on_purpose(name: str, ranks: int, microbatches: int) -> str | None:
    """The named difference under which dhelix refuses sizes torch runs, if any."""
    if name == "Interleaved1F1B" and torch_rounds(ranks, microbatches) < ranks:
        return INTERLEAVED_GROUP_AT_LEAST_P
    return None


# --- the differences dhelix makes on purpose -------------------------------------------------

#: INTERLEAVED_GROUP_AT_LEAST_P: dhelix's interleaved_1f1b keeps Megatron-LM's rule that a
#: chunk's group of micro-batches (g) is at least p; torch runs m < p with a group of m.
INTERLEAVED_GROUP_AT_LEAST_P = "interleaved_1f1b needs g >= p (Megatron); torch also runs g = m < p"

#: SPLIT_FULL_BACKWARD: DualPipeV mixes full and split backwards; a dhelix schedule splits
#: every backward or none, so where torch's DualPipeV runs a full backward (its ``B``),
#: dualpipe_v runs B and then W at once (the same work, the same order of everything else).
SPLIT_FULL_BACKWARD = "dualpipe_v runs torch's full backward B as B then W"

#: ONE_F_ONE_B_LAST_RANK: torch 2.13's Schedule1F1B numbers the last rank's forwards 1..m in
#: its pipeline_order (it starts its counter at the last warm-up forward, and the last rank
#: has none); the schedule it runs (_step_microbatches) takes 0..m-1, as one_f_one_b does.
ONE_F_ONE_B_LAST_RANK = "torch's 1F1B pipeline_order numbers the last rank's forwards from 1"


class _Stage(types.SimpleNamespace):
    """What a torch schedule's constructor reads of a pipeline stage."""


def torch_pipeline_order(name: str, ranks: int, microbatches: int, chunks: int) -> dict:
    """torch's ``pipeline_order`` of schedule ``name`` for ``ranks`` ranks of ``chunks``
    stages each: {rank: [_Action | None, ...]}."""
    cls = schedules.get_schedule_class(name)

    def stage(index: int) -> _Stage:
        return _Stage(num_stages=ranks * chunks, group_size=ranks, group_rank=0, stage_index=index,
                      submod=torch.nn.Identity(), is_first=index == 0, is_last=index == ranks * chunks - 1)

    if issubclass(cls, schedules.PipelineScheduleSingle):
        schedule = cls(stage(0), microbatches)
    else:
        schedule = cls([stage(c * ranks) for c in range(chunks)], microbatches)
    return schedule.pipeline_order


def torch_orders(name: str, ranks: int, microbatches: int) -> list[list[str]]:
    """Per rank, torch's compute actions in dhelix's notation, the named differences applied."""
    _, fold, chunks = SCHEDULES[name]
    order = torch_pipeline_order(name, ranks, microbatches, chunks)
    if fold == "u":  # V: stage r is this rank's chunk 0, stage 2p - 1 - r its chunk 1
        def chunk_of(rank, stage):
            return 0 if stage == rank else 1
    else:  # loop: stage c·p + r is rank r's chunk c
        def chunk_of(rank, stage):
            return stage // ranks
    split = any(a is not None and a.computation_type.value == "W" for row in order.values() for a in row)
    def token(rank, action, kind):
        return f"{kind}{action.microbatch_index}.{chunk_of(rank, action.stage_index)}"

    out = []
    for rank in range(ranks):
        row = []
        for action in order[rank]:
            kind = None if action is None else action.computation_type.value
            if kind is None or kind == "REDUCE_GRAD":
                continue
            if kind == "OVERLAP_F_B":
                fwd, bwd = action.sub_actions
                row.append(f"SI({token(rank, fwd, 'F')},{token(rank, bwd, 'B')})")
                action = bwd
            else:
                row.append(token(rank, action, {"I": "B"}.get(kind, kind)))
            if split and action.computation_type.value == "B":  # SPLIT_FULL_BACKWARD
                row.append(token(rank, action, "W"))
        out.append(row)
    if name == "1F1B" and microbatches and out[-1] and out[-1][0] == "F1.0":  # ONE_F_ONE_B_LAST_RANK
        out[-1] = [f"F{int(t[1:-2]) - 1}.0" if t.startswith("F") else t for t in out[-1]]
    return out


def dhelix_orders(name: str, ranks: int, microbatches: int) -> list[list[str]]:
    """Per rank, the compute actions of the lowered (and validated) dhelix pipeline, with
    torch's group of micro-batches per chunk as ``g``."""
    pipeline, fold, chunks = SCHEDULES[name]
    placement = placement_for(fold, chunks if fold == "loop" else None, 12 * ranks, ranks)
    launch = torch_rounds(ranks, microbatches) if fold == "loop" else None
    lowered = lower_pipeline(stdlib_pipelines()[pipeline], ranks=ranks, microbatches=microbatches,
                             placement=placement, launch=launch)
    validate_lowered(lowered)
    return [[str(a) for a in row if not isinstance(a, Transfer)] for row in lowered.actions]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_compute_order_equals_torchs_pipeline_order(name):
    compared = 0
    for ranks, microbatches in GRID:
        try:
            theirs = torch_orders(name, ranks, microbatches)
        except ValueError:  # torch's own limits (DualPipeV: m >= 2p; interleaved: rounds dividing m)
            continue
        reason = refused_on_purpose(name, ranks, microbatches)
        if reason is not None:
            with pytest.raises(ScheduleError):
                dhelix_orders(name, ranks, microbatches)
            continue
        assert dhelix_orders(name, ranks, microbatches) == theirs, (name, ranks, microbatches)
        compared += 1
    assert compared >= 25, compared


def test_si_blocks_are_torchs_overlapped_pairs():
    # DualPipeV's OVERLAP_F_B actions are SI blocks, one for one, with the same pair inside.
    ranks, microbatches = 4, 10
    ours = dhelix_orders("DualPipeV", ranks, microbatches)
    theirs = torch_orders("DualPipeV", ranks, microbatches)
    for rank in range(ranks):
        blocks = [t for t in ours[rank] if t.startswith("SI(")]
        assert blocks and blocks == [t for t in theirs[rank] if t.startswith("SI(")]
    lowered = lower_pipeline(stdlib_pipelines()["dualpipe_v"], ranks=ranks, microbatches=microbatches,
                             placement=placement_for("u", None, 12 * ranks, ranks))
    assert sum(isinstance(a, Interleaved) for row in lowered.actions for a in row) == \
        sum(t.startswith("SI(") for row in theirs for t in row)


def test_the_named_differences_are_real():
    """The named differences are torch's, in its raw pipeline_order: the full backwards
    DualPipeV keeps, the last rank's forward numbering of 1F1B (corrected only where torch
    writes it), and the m < p groups that dhelix's interleaved 1F1B refuses."""
    raw = torch_pipeline_order("DualPipeV", 2, 4, 2)
    assert any(a is not None and a.computation_type.value == "B" for a in raw[0]), SPLIT_FULL_BACKWARD
    raw = torch_pipeline_order("1F1B", 3, 4, 1)  # corrected only while torch numbers them so
    forwards = [a.microbatch_index for a in raw[2] if a is not None and a.computation_type.value == "F"]
    assert forwards in ([1, 2, 3, 4], [0, 1, 2, 3]), ONE_F_ONE_B_LAST_RANK
    assert torch_orders("Interleaved1F1B", 4, 2)  # torch runs m = 2 < p = 4 with a group of 2
    assert refused_on_purpose("Interleaved1F1B", 4, 2) == INTERLEAVED_GROUP_AT_LEAST_P
