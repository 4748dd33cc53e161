"""Checks of a pipeline definition that hold for every rank and every size.

A pipeline is a per-rank program over the builtins ``p``, ``r``, ``m``, ``v`` and ``g``; most of its
mistakes show only when it runs for some rank at some size (lowering finds those). These do
not: a ``let`` that rebinds a builtin or an action, an SI block that is not a forward beside
a backward, and a ``for`` clause naming no fold. They run on every pipeline of a program,
library files included, so `dhelix check` finds them in a schedule nobody uses yet.
"""

from __future__ import annotations

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import CheckError, DhelixError
from dhelix.dsl.core.program import FOLD_KINDS, unknown_fold
from dhelix.dsl.frontend.parser import ACTIONS

ACTION_NAMES = ACTIONS + ("SI",)

#: The names every pipeline program starts with, and what they mean.
BUILTINS = {"p": "pipeline ranks", "r": "this rank", "m": "micro-batches",
            "v": "chunks per rank", "g": "micro-batches launched together per chunk (train { launch }, default p)",
            "gb": "micro-batches launched together per chunk in the backward (train { launch_backward }, default g)"}
_BUILTIN_LIST = ", ".join(list(BUILTINS)[:-1]) + f" and {list(BUILTINS)[-1]}"


def check_pipeline(pipeline: s.PipelineDef) -> list[DhelixError]:
    """Every rank-independent mistake of ``pipeline``, one error each, in source order."""
    errors: list[DhelixError] = []
    if pipeline.fold is not None and pipeline.fold not in FOLD_KINDS:
        errors.append(unknown_fold(pipeline.fold, pipeline.span_of("fold")))
    for stmt in _walk(pipeline.body):
        if isinstance(stmt, s.Let) and stmt.name in ACTION_NAMES:
            errors.append(CheckError(
                f"'{stmt.name}' names an action and cannot be bound", stmt.span_of("name"),
                ["F, B, W and SI are the actions of a pipeline; pick another name"]))
        if isinstance(stmt, s.Let) and stmt.name in BUILTINS:
            errors.append(CheckError(
                f"'{stmt.name}' is a builtin ({BUILTINS[stmt.name]}) and cannot be rebound",
                stmt.span_of("name"), [f"pick another name; the builtins are {_BUILTIN_LIST}"]))
        if isinstance(stmt, s.SIBlock) and (stmt.fwd.kind, stmt.bwd.kind) != ("F", "B"):
            errors.append(CheckError(
                f"an SI block pairs a forward with a backward, not {stmt.fwd.kind} with "
                f"{stmt.bwd.kind}", stmt.span,
                ["write SI(F[c], B[c']): the forward of one strand beside the backward of "
                 "the other"]))
    return errors


def reads_name(pipeline: s.PipelineDef, name: str) -> bool:
    """Whether an expression of ``pipeline`` reads ``name`` (a builtin such as ``g``)."""
    def exprs(stmt):
        if isinstance(stmt, s.Let):
            return [stmt.value]
        if isinstance(stmt, s.Require):
            return [stmt.left, stmt.right]
        if isinstance(stmt, s.Repeat):
            return [stmt.count]
        acts = [stmt.fwd, stmt.bwd] if isinstance(stmt, s.SIBlock) else [stmt]
        return [expr for act in acts for expr in (act.chunk, act.microbatch) if expr is not None]

    def reads(expr) -> bool:
        if isinstance(expr, s.Name):
            return expr.id == name
        if isinstance(expr, s.BinOp):
            return reads(expr.left) or reads(expr.right)
        if isinstance(expr, s.Neg):
            return reads(expr.operand)
        if isinstance(expr, s.Call):
            return any(reads(arg) for arg in expr.args)
        return False
    return any(reads(expr) for stmt in _walk(pipeline.body) for expr in exprs(stmt))


def _walk(body):
    """The statements of ``body`` and, depth first, of the repeats in it."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, s.Repeat):
            yield from _walk(stmt.body)
