"""A lowered schedule for other tools (the writer behind `dhelix export`).

:func:`torch_csv` gives the CSV that torch.distributed.pipelining's
``_PipelineScheduleRuntime._load_csv`` reads (torch 2.13): one row per pipeline rank, one cell
per action in torch's action notation (``_Action.from_str``):

- ``{s}F{mb}`` forward of global stage ``s`` (model order: ``Lowered.stages[s]`` is its
  (rank, chunk) slot), micro-batch ``mb``;
- ``{s}B{mb}`` a whole backward; when the dhelix schedule splits its backward, its ``B`` (input
  gradient) is torch's ``{s}I{mb}`` and its ``W`` is ``{s}W{mb}``;
- ``({s}F{mb};{s'}B{mb'})OVERLAP_F_B`` an SI block, forward first;
- ``{s}SEND_F{mb}`` / ``{s}RECV_F{mb}`` / ``{s}SEND_B{mb}`` / ``{s}RECV_B{mb}`` transfers, ``s``
  being the sending stage for a SEND and the receiving stage for a RECV (torch's convention),
  and ``{s}REDUCE_GRAD`` after the last backward of stage ``s`` (where torch's own lowering puts
  it; it scales the gradients by 1/m).

Two forms:

- ``compute_only`` (default): compute actions only, the form ``_load_csv(path)`` reads by
  default. torch then adds the transfers itself (``_add_send_recv``) in an order that matches
  every receive with its send, plus REDUCE_GRAD, exactly as for its built-in schedules.
- ``compute_comms``: also dhelix's own SEND/RECV order and REDUCE_GRAD; load it with
  ``_load_csv(path, format="compute_comms")``. torch's P2P operations carry no tag, so between
  two ranks receives pair with sends in posting order; the export refuses (ScheduleError) a
  schedule whose receives from a rank are not in the order that rank sends them.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict

from dhelix.dsl.core.errors import ScheduleError
from dhelix.dsl.core.schedule import Compute, Interleaved, Lowered, Transfer, computes, format_grid

TORCH_FORMATS = ("compute_only", "compute_comms")


def torch_csv(lowered: Lowered, form: str = "compute_only") -> str:
    """The CSV text of ``lowered`` in torch's ``form`` (see the module docstring).

    Raises ScheduleError for ``compute_comms`` when receives and sends between two ranks are
    in different orders, and for a schedule of two model copies (fold bidir), which torch's
    stages (one chain, each stage on one rank) cannot say.
    """
    if lowered.copies > 1:
        raise ScheduleError(f"pipeline {lowered.name} runs {lowered.copies} model copies (fold bidir): torch's "
                            "pipeline stages form one chain with each stage on one rank, so its CSV cannot say "
                            "two copies of each stage", lowered.span,
                            ["a one-copy schedule exports: dualpipe_v on fold u is DualPipe's V"])
    rows = torch_actions(lowered, with_comms=form == "compute_comms")
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for row in rows:
        writer.writerow(row)
    return buffer.getvalue()


def torch_actions(lowered: Lowered, *, with_comms: bool) -> tuple[tuple[str, ...], ...]:
    """Per rank, the actions of ``lowered`` in torch's notation (transfers only ``with_comms``)."""
    if with_comms:
        check_p2p_order(lowered)
    counts: dict[int, int] = defaultdict(int)  # backward-like actions seen per stage
    rows = []
    for rank, row in enumerate(lowered.actions):
        out = []
        for action in row:
            if isinstance(action, Transfer):
                if with_comms:
                    out.append(_transfer(lowered, rank, action))
                continue
            out.append(_compute_action(lowered, rank, action))
            if with_comms:
                out += _reduce_grads(lowered, rank, action, counts)
        rows.append(tuple(out))
    return tuple(rows)


def _stage(lowered: Lowered, rank: int, chunk: int) -> int:
    stage = lowered.stage_of(rank, chunk)
    assert stage is not None, "a validated schedule runs on its placement"
    return stage


def _compute(lowered: Lowered, rank: int, part: Compute) -> str:
    kind = "I" if part.kind == "B" and lowered.split else part.kind
    return f"{_stage(lowered, rank, part.chunk)}{kind}{part.microbatch}"


def _compute_action(lowered: Lowered, rank: int, action) -> str:
    if isinstance(action, Interleaved):
        return f"({_compute(lowered, rank, action.fwd)};{_compute(lowered, rank, action.bwd)})OVERLAP_F_B"
    return _compute(lowered, rank, action)


def _transfer(lowered: Lowered, rank: int, action: Transfer) -> str:
    return f"{_stage(lowered, rank, action.chunk)}{action.kind}_{action.data}{action.microbatch}"


def _reduce_grads(lowered: Lowered, rank: int, action, counts: dict[int, int]) -> list[str]:
    """REDUCE_GRAD for each stage whose last backward ``action`` runs (torch's rule: the m-th
    W, or the m-th B when the backward is not split)."""
    last = "W" if lowered.split else "B"
    done = []
    for part in computes(action):
        if part.kind == last:
            stage = _stage(lowered, rank, part.chunk)
            counts[stage] += 1
            if counts[stage] == lowered.microbatches:
                done.append(f"{stage}REDUCE_GRAD")
    return done


def check_p2p_order(lowered: Lowered) -> None:
    """Raise ScheduleError unless, for every pair of ranks, the receiving rank posts its
    receives in the order the sending rank sends (torch pairs untagged P2P messages in order)."""
    sends: defaultdict[tuple, list] = defaultdict(list)
    receives: defaultdict[tuple, list] = defaultdict(list)
    places = {}
    for rank, row in enumerate(lowered.actions):
        for step, action in enumerate(row):
            if isinstance(action, Transfer):
                pair = (rank, action.peer) if action.kind == "SEND" else (action.peer, rank)
                (sends if action.kind == "SEND" else receives)[pair].append((action.data, action.microbatch))
                places[(rank, action.kind, action.data, action.microbatch, action.peer)] = step
    words = {"F": "the activation", "B": "the gradient"}
    for pair in sorted(sends):
        sent, received = sends[pair], receives.get(pair, [])
        if sent == received:
            continue
        index = next((i for i, (a, b) in enumerate(zip(sent, received)) if a != b),
                     min(len(sent), len(received)))
        if index >= len(received):
            continue  # an unmatched send is validate's business, not an ordering problem
        (early, early_mb), (first, first_mb) = received[index], sent[index]
        step = places[(pair[1], "RECV", early, early_mb, pair[0])]
        raise ScheduleError(
            f"rank {pair[1]} receives {words[early]} of micro-batch {early_mb} from rank "
            f"{pair[0]} before {words[first]} of micro-batch {first_mb}, which rank {pair[0]} "
            "sends first; torch's P2P operations carry no tag, so the compute_comms form would "
            "pair them wrongly", lowered.span,
            ["export the compute_only form (the default) instead: torch then orders the "
             "transfers itself"],
            grid=format_grid(lowered, {pair[1]: step}))
