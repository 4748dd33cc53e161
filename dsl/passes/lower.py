"""Lowering: run a pipeline definition once per rank into explicit action lists.

A pipeline body is a per-rank program over the builtins ``p`` (ranks), ``r`` (this rank),
``m`` (micro-batches), ``v`` (chunks per rank), ``g`` (micro-batches launched together
per chunk: ``train { launch }``, default p) and ``gb`` (the same in the backward: ``train {
launch_backward }``, default g). Semantics, statement by statement:

- ``name = expr`` binds ``name`` for the statements after it; binding it again rebinds it (so
  ``k = k + 1`` inside a repeat counts iterations). The builtins cannot be rebound (a
  rank-independent mistake, found by :mod:`dhelix.dsl.frontend.pipelinecheck`).
- ``repeat N { … }`` runs its body N times; N must be ≥ 0.
- ``require a CMP b`` stops with an error naming the values when it does not hold.
- ``F[c]``, ``B[c]``, ``W[c]`` (chunk 0 unless given) and ``SI(F[c], B[c'])`` emit actions.
  Micro-batch numbers are implicit: the k-th ``F[1]`` a rank runs is micro-batch k of chunk 1,
  counted separately per (action kind, chunk) (under fold bidir from the first micro-batch of
  the chunk's model copy: copy 1 runs micro-batches m/2 .. m-1); ``B[1, k]`` names micro-batch k itself and
  leaves the counter as it is (a schedule that runs micro-batches out of order: LoopedBFS's
  backwards, last first).

Around each computation the lowering inserts the transfers the placement implies: a RECV
right before an action whose input comes from another rank, a SEND right after an action whose
output goes to another rank; hand-offs between chunks of one rank need none. Then every rank's
receives from a peer are put in the order that peer sends (:func:`fifo_order`), so that
untagged point-to-point backends (NCCL) pair every message right.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Callable

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import CheckError, DhelixError, ErrorCollector, ScheduleError
from dhelix.dsl.core.program import FOLD_KINDS
from dhelix.dsl.frontend.exprs import evaluator, format_expr
from dhelix.dsl.frontend.fmt import format_statement
from dhelix.dsl.frontend.pipelinecheck import check_pipeline
from dhelix.dsl.passes.fold import Placement
from dhelix.dsl.core.wording import join_words
from dhelix.dsl.core.schedule import Compute, Interleaved, Lowered, Transfer

_COMPARE = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
            ">": operator.gt, "<": operator.lt}

#: How many statements a rank may execute per action it is allowed, before lowering gives up
#: on a runaway repeat (a repeat whose body emits nothing would otherwise spin silently).
_STATEMENTS_PER_ACTION = 64


def lower_pipeline(pipeline: s.PipelineDef, *, ranks: int, microbatches: int,
                   placement: Placement, launch: int | None = None, launch_backward: int | None = None) -> Lowered:
    """Run ``pipeline`` for every rank of ``placement`` with ``microbatches`` micro-batches
    (``launch``: the builtin ``g``, micro-batches launched together per chunk; default p).

    ``ranks`` must equal ``placement.ranks`` (a caller bug otherwise: ValueError). Returns the
    :class:`Lowered` schedule, unvalidated. Raises :class:`ScheduleError` (one, or an ErrorGroup
    of all of them) for a failed ``require``, a negative repeat count, a chunk outside
    ``0..v-1`` or a runaway program; each names the rank(s) it fails on (unless it fails on
    every rank) and points at the statement. A pipeline that did not go through the checker
    (parsed alone) gets the checker's errors for its rank-independent mistakes
    (:func:`~dhelix.dsl.frontend.pipelinecheck.check_pipeline`) and for a ``for`` clause
    naming another fold.
    """
    if ranks != placement.ranks:
        raise ValueError(f"ranks={ranks} but the placement is for {placement.ranks} ranks")
    errors = ErrorCollector()
    for error in check_pipeline(pipeline):
        errors.add(error)
    errors.raise_if_any()
    check_fold(pipeline, placement.kind)
    rows, failures = [], []
    for rank in range(ranks):
        program = _RankProgram(pipeline.name, rank, microbatches, placement, launch or ranks,
                               launch_backward or launch or ranks)
        try:
            program.run(pipeline.body)
        except _Failure as failure:
            failures.append((rank, failure))
        rows.append(tuple(program.actions))
    _raise_failures(failures, ranks)
    if microbatches % placement.copies:  # (after the ranks ran: a pipeline's own `require` says it first)
        raise ScheduleError(f"pipeline {pipeline.name} runs {placement.copies} model copies (fold {placement.kind}), "
                            f"which share the m = {microbatches} micro-batches equally, but {placement.copies} "
                            f"does not divide {microbatches}", pipeline.span_of("name"),
                            [f"choose a multiple of {placement.copies} micro-batches"])
    return Lowered(pipeline.name, ranks, microbatches, placement.chunks, placement.slots(),
                   fifo_order(rows, placement), span=pipeline.span_of("name"), copies=placement.copies)


def leading_failure(pipeline: s.PipelineDef, *, ranks: int, microbatches: int, placement: Placement,
                    launch: int | None = None, launch_backward: int | None = None) -> DhelixError | None:
    """The error :func:`lower_pipeline` raises (same arguments; ``pipeline`` well formed, as
    checked) when every rank fails in the ``let`` and ``require`` statements that open the
    pipeline's body, before its first repeat or action; None when some rank gets past them
    (the rest of the body may still fail). Every rank runs those statements first and
    emits nothing in them, so when each fails there, the lowering fails just so whatever
    follows: what `dhelix tune` needs to know of the sizes a pipeline's ``require`` refuses,
    without lowering the schedules it accepts."""
    if ranks != placement.ranks:
        raise ValueError(f"ranks={ranks} but the placement is for {placement.ranks} ranks")
    opening = []
    for stmt in pipeline.body:
        if not isinstance(stmt, (s.Let, s.Require)):
            break
        opening.append(stmt)
    check_fold(pipeline, placement.kind)
    failures = []
    for rank in range(ranks):
        program = _RankProgram(pipeline.name, rank, microbatches, placement, launch or ranks,
                               launch_backward or launch or ranks)
        try:
            program.run(opening)
        except _Failure as failure:
            failures.append((rank, failure))
        else:
            return None
    try:
        _raise_failures(failures, ranks)
    except DhelixError as error:  # a ScheduleError, or a group of them when the ranks fail apart
        return error
    raise AssertionError("every rank failed: one error at least")


def fifo_order(rows: list[tuple], placement: Placement) -> tuple[tuple, ...]:
    """``rows`` with every rank's receives from each peer in the order that peer sends them.

    Untagged point-to-point backends (NCCL) match messages between two ranks in posting
    order, so a receive that comes before one sent earlier (DualPipe-V at p >= 3: a gradient
    overtakes an activation) would take the wrong message. A receive sent earlier than the one
    a rank is about to post is hoisted to just before it; this cannot deadlock a schedule that
    did not, because the peer sent it before the receive the rank was waiting for anyway.
    """
    stage = {slot: index for index, slot in enumerate(placement.slots())}

    def message(rank: int, transfer: Transfer) -> tuple:  # _message, its stages looked up once
        index = stage[rank, transfer.chunk]
        if transfer.kind == "RECV":
            index += -1 if transfer.data == "F" else 1
        return transfer.data, transfer.microbatch, index

    sent: dict[tuple[int, int], list] = defaultdict(list)  # (sender, receiver) -> messages in order
    for rank, row in enumerate(rows):
        for action in row:
            if type(action) is Transfer and action.kind == "SEND":
                sent[rank, action.peer].append(message(rank, action))
    ordered = []
    for rank, row in enumerate(rows):
        pending = {message(rank, a): a for a in row if type(a) is Transfer and a.kind == "RECV"}
        if not pending:
            ordered.append(tuple(row))
            continue
        position: dict[int, int] = defaultdict(int)  # peer -> messages received so far
        out: list = []
        for action in row:
            if not (type(action) is Transfer and action.kind == "RECV"):
                out.append(action)
                continue
            key = message(rank, action)
            if key not in pending:  # hoisted already
                continue
            order = sent[action.peer, rank]
            at = position[action.peer]
            if at < len(order) and order[at] == key:  # the next the peer sent: nothing to hoist
                out.append(pending.pop(key))
                position[action.peer] = at + 1
                continue
            while position[action.peer] < len(order) and order[position[action.peer]] != key:
                earlier = pending.pop(order[position[action.peer]], None)
                if earlier is not None:
                    out.append(earlier)
                position[action.peer] += 1
            out.append(pending.pop(key))
            position[action.peer] += 1
        ordered.append(tuple(out))
    return tuple(ordered)


def check_fold(pipeline: s.PipelineDef, fold: str, fold_span=None) -> None:
    """Raise when ``pipeline`` declares (``pipeline X for u``) a fold other than ``fold``
    (a placement's kind, ``loop(2)`` for loop). The clause names a known fold: the checker
    saw to that. ``fold_span`` locates the program's fold statement, named in a note."""
    if pipeline.fold is None or pipeline.fold == fold.split("(")[0]:  # loop(2) is a loop
        return
    where = f" (at {fold_span})" if fold_span is not None else ""
    raise ScheduleError(f"pipeline {pipeline.name} is written for fold {pipeline.fold}, "
                        f"but the program uses fold {fold}{where}", pipeline.span_of("fold"),
                        [f"write `fold {pipeline.fold}{'(2)' if FOLD_KINDS[pipeline.fold] is None else ''}` "
                         f"or pick a pipeline written for fold {fold}"])


class _Failure(Exception):
    """A rank's first error; ``message`` has a ``{where}`` slot for the ranks it fails on."""

    def __init__(self, message: str, span, notes=()):
        super().__init__(message)
        self.message, self.span, self.notes = message, span, tuple(notes)


class _RankProgram:
    """The state of one rank while its program runs: bindings, counters, emitted actions."""

    def __init__(self, name: str, rank: int, microbatches: int, placement: Placement, launch: int,
                 launch_backward: int):
        self.name = name
        self.rank = rank
        self.placement = placement
        self.env = {"p": placement.ranks, "r": rank, "m": microbatches, "v": placement.chunks, "g": launch,
                    "gb": launch_backward}
        self.defs: dict[str, s.Expr] = {}  # the expression each let was last bound to
        self.counters: dict[tuple[str, int], int] = defaultdict(int)
        self.actions: list = []
        #: (RECV or SEND, F or B, chunk) -> the rank on the other end (None: this rank).
        self.peers: dict[tuple, int | None] = {}
        self.computes = 0
        # A correct schedule runs one F, one B and at most one W per micro-batch and chunk.
        self.limit = 3 * placement.chunks * microbatches
        self.budget = _STATEMENTS_PER_ACTION * (self.limit + 1)

    def run(self, body) -> None:
        """Execute ``body``; raises _Failure at the first error."""
        for stmt in body:
            self.spend(stmt)
            kind = type(stmt)  # (the statement kinds are distinct classes: most are actions)
            if kind is s.Act:
                self.emit_one(self.compute(stmt), stmt.span)
            elif kind is s.Let:
                self.env[stmt.name] = self.eval(stmt.value)
                self.defs[stmt.name] = stmt.value
            elif kind is s.Repeat:
                self.repeat(stmt)
            elif kind is s.Require:
                self.require(stmt)
            else:
                self.emit([self.compute(stmt.fwd), self.compute(stmt.bwd)], stmt.span)

    def spend(self, stmt) -> None:
        """Count one executed statement (or repeat iteration) against the budget."""
        self.budget -= 1
        if self.budget < 0:
            raise _Failure(f"pipeline {self.name} runs too long{{where}}", stmt.span,
                           ("a repeat count is far larger than the schedule needs",))

    def eval(self, expr: s.Expr) -> int:
        if isinstance(expr, s.Int):  # the common leaves first, as evaluate reads them
            return expr.value
        if isinstance(expr, s.Name) and expr.id in self.env:
            return self.env[expr.id]
        try:
            return _evaluator(expr)(self.env)
        except CheckError as error:
            raise _Failure(error.message + "{where}", error.span, error.notes) from None

    def repeat(self, stmt: s.Repeat) -> None:
        count = self.eval(stmt.count)
        if count < 0:
            raise _Failure(f"repeat count {format_expr(stmt.count)} is {count}{{where}}"
                           f"{self.values(stmt.count)}", stmt.count.span,
                           ("a repeat runs its body N ≥ 0 times; clamp it with "
                            f"max(0, {format_expr(stmt.count)}) if nothing should run here",))
        for _ in range(count):
            self.spend(stmt)
            self.run(stmt.body)

    def require(self, stmt: s.Require) -> None:
        left, right = self.eval(stmt.left), self.eval(stmt.right)
        if _COMPARE[stmt.op](left, right):
            return
        text = f"{format_expr(stmt.left)} {stmt.op} {format_expr(stmt.right)}"
        raise _Failure(f"pipeline {self.name} needs {text}{{where}}"
                       f"{self.values(stmt.left, stmt.right)}", stmt.span,
                       (f"choose sizes with {text}, or another pipeline",))

    def values(self, *exprs: s.Expr) -> str:
        """' (warm = -1, p = 4, r = 3)': the names of ``exprs`` and, through lets, what they use."""
        names: list[str] = []
        pending = [name for expr in exprs for name in _names(expr)]
        while pending:
            name = pending.pop(0)
            if name not in names:
                names.append(name)
                pending.extend(_names(self.defs[name]) if name in self.defs else ())
        listed = ", ".join(f"{name} = {self.env[name]}" for name in names if name in self.env)
        return f" ({listed})" if listed else ""

    def compute(self, act: s.Act) -> Compute:
        chunk = 0 if act.chunk is None else self.eval(act.chunk)
        chunks = self.placement.chunks
        if not 0 <= chunk < chunks:
            allowed = "the only chunk is 0" if chunks == 1 else f"chunks are 0..{chunks - 1}"
            raise _Failure(f"chunk {chunk} of {format_statement(act)} is out of range{{where}}: "
                           f"v = {chunks}, so {allowed}", act.span,
                           ("fold none gives v = 1 chunk per rank, fold u and fold bidir 2, fold loop(v) v",))
        self.computes += 1
        if self.computes > self.limit:
            raise _Failure(f"pipeline {self.name} runs more than {self.limit} F/B/W actions"
                           f"{{where}} (3·v·m with v = {chunks}, m = {self.env['m']})",
                           act.span, ("each micro-batch runs one F, one B and at most one W "
                                      "per chunk; check the repeat counts",))
        if act.microbatch is not None:  # B[c, k]: this micro-batch; the counters stay
            microbatch = self.eval(act.microbatch)
            if not 0 <= microbatch < self.env["m"]:
                raise _Failure(f"micro-batch {microbatch} of {format_statement(act)} is out of range{{where}}: "
                               f"m = {self.env['m']}, so micro-batches are 0..{self.env['m'] - 1}"
                               f"{self.values(act.microbatch)}", act.microbatch.span,
                               ("B[c, k] runs micro-batch k of chunk c; F, B or W without k runs the "
                                "next one of its (kind, chunk) counter",))
            return Compute(act.kind, microbatch, chunk, span=act.span)
        key = (act.kind, chunk)
        microbatch = self.counters[key] + self.first_microbatch(chunk)
        self.counters[key] += 1
        return Compute(act.kind, microbatch, chunk, span=act.span)

    def first_microbatch(self, chunk: int) -> int:
        """The micro-batch a (kind, chunk) counter starts at: 0, or under fold bidir the first
        of the share of the copy whose stage this chunk holds."""
        placement = self.placement
        if placement.copies == 1:
            return 0
        index = placement.stage_at(self.rank, chunk).index
        share = self.env["m"] // placement.copies
        return placement.copy_of(index) * share

    def emit(self, parts: list[Compute], span) -> None:
        """Append ``parts`` (one action, or the two of an SI block) with their transfers."""
        receives = [t for part in parts for t in self.transfers(part, "RECV", span)]
        sends = [t for part in parts for t in self.transfers(part, "SEND", span)]
        main = parts[0] if len(parts) == 1 else Interleaved(parts[0], parts[1], span=span)
        self.actions.extend(receives + [main] + sends)

    def emit_one(self, part: Compute, span) -> None:
        """:meth:`emit` of one action: its receive, it, its send (as the peers place them)."""
        if part.kind != "W":
            receive = self.transfers(part, "RECV", span)
            if receive:
                self.actions.append(receive[0])
            self.actions.append(part)
            send = self.transfers(part, "SEND", span)
            if send:
                self.actions.append(send[0])
        else:
            self.actions.append(part)

    def transfers(self, part: Compute, kind: str, span) -> list[Transfer]:
        """The RECV before or SEND after ``part`` when its neighbour stage is on another rank."""
        if part.kind == "W":
            return []
        peer = self.peers.get((kind, part.kind, part.chunk), -1)
        if peer == -1:
            stages = self.placement.stages
            here = self.placement.stage_at(self.rank, part.chunk).index
            # Activations flow to the next stage, gradients to the previous one.
            step = 1 if part.kind == "F" else -1
            neighbour = self.placement.neighbour(here, -step if kind == "RECV" else step)
            peer = None if neighbour is None or stages[neighbour].rank == self.rank else stages[neighbour].rank
            self.peers[kind, part.kind, part.chunk] = peer
        if peer is None:
            return []
        return [Transfer(kind, part.kind, part.microbatch, part.chunk, peer, span=span)]


#: The compiled expressions of the pipelines lowered (:func:`~dhelix.dsl.frontend.exprs.evaluator`),
#: by identity, each kept with its expression so that its id stays its own; at most _COMPILED_KEPT.
_COMPILED: dict[int, tuple[s.Expr, Callable]] = {}
_COMPILED_KEPT = 4096


def _evaluator(expr: s.Expr) -> Callable:
    """:func:`~dhelix.dsl.frontend.exprs.evaluator` of ``expr`` (a schedule variable's), once
    per expression object: a search lowers one pipeline for many sizes."""
    found = _COMPILED.get(id(expr))
    if found is None or found[0] is not expr:
        if len(_COMPILED) >= _COMPILED_KEPT:
            _COMPILED.clear()
        found = _COMPILED[id(expr)] = (expr, evaluator(expr, "schedule variable"))
    return found[1]


def _names(expr: s.Expr):
    """The names ``expr`` uses, left to right (an explicit stack: chains can be long)."""
    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, s.Name):
            yield node.id
        elif isinstance(node, s.Neg):
            stack.append(node.operand)
        elif isinstance(node, s.BinOp):
            stack += (node.right, node.left)
        elif isinstance(node, s.Call):
            stack.extend(reversed(node.args))


def _raise_failures(failures: list[tuple[int, _Failure]], ranks: int) -> None:
    """One error per distinct failure, naming the ranks it happens on (none if on all)."""
    groups: dict[tuple, list[int]] = {}
    for rank, failure in failures:
        position = None if failure.span is None else (failure.span.line, failure.span.column)
        groups.setdefault((failure.message, position, failure.notes), []).append(rank)
    errors = ErrorCollector()
    for (message, _, notes), failing in groups.items():
        span = next(f.span for r, f in failures if r == failing[0])
        where = "" if len(failing) == ranks else " on " + _ranks_text(failing)
        errors.add(ScheduleError(message.replace("{where}", where), span, notes))
    errors.raise_if_any()


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + join_words(ranks)
