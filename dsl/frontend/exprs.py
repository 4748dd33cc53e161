"""Exact integer evaluation of dhelix expressions.

``/`` must divide exactly (``7 / 2`` is an error, not 3); ``//`` floors; ``%`` is the
remainder of that floor division. Division by zero and unknown names are errors located at
the sub-expression at fault, with a "did you mean" for misspelt names.
"""

from __future__ import annotations

from typing import Mapping

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import CheckError
from dhelix.dsl.core.wording import did_you_mean

FUNCTIONS = {"min": min, "max": max}


class UnknownName(CheckError):
    """A name an expression uses that its environment does not bind; ``name`` is the name,
    so callers can add what they know (a setting written later, the names in scope)."""

    def __init__(self, name: str, message: str, span, notes=()):
        super().__init__(message, span, notes)
        self.name = name


def evaluate(expr: s.Expr, env: Mapping[str, int], what: str = "name") -> int:
    """Evaluate ``expr`` with the integer bindings of ``env``.

    ``what`` names the kind of binding in messages ("model or mesh setting", "schedule
    variable"). Raises :class:`CheckError` for unknown names or functions, inexact ``/``,
    division by zero, and wrong argument counts.
    """
    if isinstance(expr, s.Int):
        return expr.value
    if isinstance(expr, s.Name):
        if expr.id in env:
            return env[expr.id]
        known = [f"known here: {_listing(env)}"] if env else []
        raise UnknownName(expr.id, f"unknown {what} '{expr.id}'", expr.span, did_you_mean(expr.id, env) + known)
    if isinstance(expr, s.Neg):
        return -evaluate(expr.operand, env, what)
    if isinstance(expr, s.Call):
        return _call(expr, env, what)
    if isinstance(expr, s.BinOp):
        return _binop(expr, evaluate(expr.left, env, what), evaluate(expr.right, env, what))
    raise TypeError(f"not an expression: {expr!r}")


def _call(expr: s.Call, env: Mapping[str, int], what: str) -> int:
    func = FUNCTIONS.get(expr.func)
    if func is None:
        raise CheckError(f"unknown function '{expr.func}'", expr.span_of("func"),
                         did_you_mean(expr.func, FUNCTIONS) + ["expressions may call min and max"])
    if len(expr.args) < 2:
        raise CheckError(f"{expr.func}() takes at least 2 arguments, got {len(expr.args)}", expr.span)
    return func(evaluate(a, env, what) for a in expr.args)


def _binop(expr: s.BinOp, left: int, right: int) -> int:
    op = expr.op
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    if right == 0:
        raise CheckError(f"division by zero: the right side of '{op}' is 0", expr.span,
                         [f"{format_expr(expr.right)} evaluates to 0"])
    if op == "/":
        if left % right:
            raise CheckError(f"{left} / {right} does not divide exactly", expr.span,
                             [f"'/' must divide exactly; write '//' to round down "
                              f"({left} // {right} = {left // right})"])
        return left // right
    if op == "//":
        return left // right
    if op == "%":
        return left % right
    raise TypeError(f"unknown operator {op!r}")


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "//": 2, "%": 2}


def format_expr(expr: s.Expr, parent: int = 0, right_side: bool = False) -> str:
    """The canonical text of ``expr``, with only the parentheses its structure needs."""
    if isinstance(expr, s.Int):
        return str(expr.value)
    if isinstance(expr, s.Name):
        return expr.id
    if isinstance(expr, s.Neg):
        return "-" + format_expr(expr.operand, 3)
    if isinstance(expr, s.Call):
        return f"{expr.func}({', '.join(format_expr(a) for a in expr.args)})"
    prec = _PRECEDENCE[expr.op]
    text = f"{format_expr(expr.left, prec)} {expr.op} {format_expr(expr.right, prec, True)}"
    # Operators are left-associative: a right operand of equal precedence needs parentheses.
    if prec < parent or (prec == parent and right_side):
        return f"({text})"
    return text


def _listing(env: Mapping[str, int]) -> str:
    names = sorted(env)
    return ", ".join(names[:24]) + (", …" if len(names) > 24 else "")
