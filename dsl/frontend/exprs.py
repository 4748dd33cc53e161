"""Exact integer evaluation of dhelix expressions.

``/`` must divide exactly (``7 / 2`` is an error, not 3); ``//`` floors; ``%`` is the
remainder of that floor division. Division by zero and unknown names are errors located at
the sub-expression at fault, with a "did you mean" for misspelt names.
"""

from __future__ import annotations

from typing import Callable, Mapping

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import CheckError
from dhelix.dsl.core.wording import did_you_mean

FUNCTIONS = {"min": min, "max": max}
#: Every value an expression computes, intermediate ones included, is below this in
#: magnitude, so arithmetic stays fast (sizes have their own, smaller limits).
MAX_MAGNITUDE = 10**30


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
    # A chain `a + b + … + z` nests to the left: walk that spine in a loop, so a long chain
    # needs no recursion; right operands, '-' and calls nest at most parser.MAX_NESTING deep.
    spine = []
    while isinstance(expr, s.BinOp):
        spine.append(expr)
        expr = expr.left
    value = _leaf(expr, env, what)
    for node in reversed(spine):
        value = _bounded(_binop(node, value, evaluate(node.right, env, what)), node)
    return value


#: A compiled expression: its value in an environment, or _Slow where :func:`evaluate` must
#: say what is wrong (an unknown name, a division by zero or inexact, a value too large).
Compiled = Callable[[Mapping[str, int]], int]
#: The deepest expression compiled (deeper ones are evaluated as they are: no recursion limit).
_COMPILED_DEPTH = 32


class _Slow(Exception):
    """A compiled expression met what :func:`evaluate` reports as an error."""


def evaluator(expr: s.Expr, what: str = "name") -> Callable[[Mapping[str, int]], int]:
    """A function of an environment equal to ``evaluate(expr, env, what)`` (the same value,
    the same error), for an expression evaluated many times: a pipeline's statements, run
    once per repeat per rank. Its arithmetic is compiled to closures once; anything the
    closures would get wrong (an unknown name, a division by zero, an inexact ``/``, a value
    out of range) falls back on :func:`evaluate`, which raises the located error."""
    compiled = _compiled(expr, _COMPILED_DEPTH)
    if compiled is None:
        return lambda env: evaluate(expr, env, what)

    def value(env: Mapping[str, int]) -> int:
        try:
            return compiled(env)
        except (_Slow, KeyError):
            return evaluate(expr, env, what)
    return value


def _compiled(expr: s.Expr, depth: int) -> Compiled | None:
    """``expr`` as closures (raising _Slow or KeyError where :func:`evaluate` raises), None
    when deeper than ``depth`` or calling an unknown function (evaluated as written)."""
    if depth <= 0:
        return None
    if isinstance(expr, s.Int):
        constant = expr.value
        return lambda env: constant
    if isinstance(expr, s.Name):
        name = expr.id
        return lambda env: env[name]
    if isinstance(expr, s.Neg):
        operand = _compiled(expr.operand, depth - 1)
        return None if operand is None else (lambda env: -operand(env))
    if isinstance(expr, s.Call):
        func = FUNCTIONS.get(expr.func)
        args = [_compiled(arg, depth - 1) for arg in expr.args]
        if func is None or len(args) < 2 or any(arg is None for arg in args):
            return None
        return lambda env: func([arg(env) for arg in args])  # type: ignore[misc]
    if isinstance(expr, s.BinOp):
        left, right = _compiled(expr.left, depth - 1), _compiled(expr.right, depth - 1)
        if left is None or right is None:
            return None
        return _compiled_binop(expr.op, left, right)
    return None


def _compiled_binop(op: str, left: Compiled, right: Compiled) -> Compiled | None:
    """``left op right`` as :func:`_binop` and :func:`_bounded` compute it, _Slow where they raise."""
    def bounded(value: int) -> int:
        if abs(value) >= MAX_MAGNITUDE:
            raise _Slow
        return value

    if op == "+":
        return lambda env: bounded(left(env) + right(env))
    if op == "-":
        return lambda env: bounded(left(env) - right(env))
    if op == "*":
        return lambda env: bounded(left(env) * right(env))

    def divided(env: Mapping[str, int]) -> int:
        a, b = left(env), right(env)
        if b == 0 or (op == "/" and a % b):
            raise _Slow
        return bounded(a % b if op == "%" else a // b)
    return divided if op in ("/", "//", "%") else None


def _leaf(expr: s.Expr, env: Mapping[str, int], what: str) -> int:
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
    raise TypeError(f"not an expression: {expr!r}")


def _bounded(value: int, expr: s.Expr) -> int:
    if abs(value) >= MAX_MAGNITUDE:
        raise CheckError(f"this expression's value has {len(str(abs(value)))} digits: too large", expr.span,
                         ["values stay below 10**30 in magnitude; every size is far smaller"])
    return value


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
    spine = []
    while isinstance(expr, s.BinOp):  # a long chain in a loop, as in evaluate
        spine.append(expr)
        expr = expr.left
    if isinstance(expr, s.Int):
        text = str(expr.value)
    elif isinstance(expr, s.Name):
        text = expr.id
    elif isinstance(expr, s.Neg):
        text = "-" + format_expr(expr.operand, 3)
    else:
        text = f"{expr.func}({', '.join(format_expr(a) for a in expr.args)})"
    if not spine:
        return text
    parts, opened = [text], 0
    for node in reversed(spine):
        prec = _PRECEDENCE[node.op]
        if _loosest(node.left) < prec:  # a left operand of lower precedence: (a + b) * c
            parts.append(")")
            opened += 1
        parts.append(f" {node.op} {format_expr(node.right, prec, True)}")
    text = "(" * opened + "".join(parts)
    prec = _PRECEDENCE[spine[0].op]
    # Operators are left-associative: a right operand of equal precedence needs parentheses.
    if prec < parent or (prec == parent and right_side):
        return f"({text})"
    return text


def _loosest(expr: s.Expr) -> int:
    """The precedence of ``expr``'s outermost operator (3 for an atom or '-')."""
    return _PRECEDENCE[expr.op] if isinstance(expr, s.BinOp) else 3


def _listing(env: Mapping[str, int]) -> str:
    names = sorted(env)
    return ", ".join(names[:24]) + (", …" if len(names) > 24 else "")
