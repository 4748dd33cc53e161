"""A kernel function's body written into generated code in place of a call to it.

A layer op's compiled call (:mod:`.layer_calls`) calls its kernel (``forward``, ``dgrad``,
``wgrad``, ``wgrad_into`` of a :class:`~dhelix.interpreter.ops.kernels.Kernel`): a Python
frame per op, its inputs packed into a list and its results into tuples, a device test
through a helper. :func:`inline` writes the kernel's own statements there instead, read
from its source: the same torch calls on the same tensors in the same order, so the
results are the same bit for bit and an error is the same exception (its traceback shows
the generated line).

How: the function's parameters become the caller's arguments (a plain name is used as it
is; any other expression is bound to a local first; a list of names unpacked at the top,
``(x,) = inputs``, names them directly); its locals are renamed ``k_<name>`` (no clash with
the generated code's names) and set to None at the end, so its temporaries go when the
kernel's frame would have ended; the globals it reads are bound once in the generated
module; an early ``return`` under a top-level ``if`` becomes that ``if``'s branch and the
rest its ``else``; the value returned is assigned to the caller's target. A helper whose
whole body returns an expression without a call (``on_gpu(x)``: ``x.is_cuda``) is written
as that expression. A function of any other shape (a lambda, a closure, a nested function,
a ``return`` inside a loop, ``with`` or ``try``, defaults, ``*args``) is not inlined: the
caller calls it.
"""

from __future__ import annotations

import ast
import builtins
import copy
import functools
import inspect
import textwrap
import types
from typing import Callable, Sequence

#: The prefix of an inlined kernel's locals.
LOCAL = "k_"


def inline(fn: Callable, args: Sequence[str | list[str]], target: str | None,
           bind: Callable[[object, str], str]) -> list[str] | None:
    """The lines running ``fn(*args)`` inline, its result assigned to ``target`` (Python
    assignment target text; None: discarded), or None when ``fn`` cannot be inlined.
    ``args`` are expressions (text), or a list of names for a parameter the function
    unpacks into that many names. ``bind(value, hint)`` makes ``value`` a global of the
    generated module and returns its name (called once per global the body reads)."""
    parsed = _parsed(fn)
    if parsed is None or len(args) != len(parsed.params):
        return None
    body = copy.deepcopy(parsed.body)
    renames: dict[str, str] = {name: LOCAL + name for name in parsed.locals}
    head: list[str] = []
    for param, arg in zip(parsed.params, args, strict=True):
        if isinstance(arg, list):
            if not _unpacked(body, param, arg, parsed, renames):
                renames[param] = LOCAL + param
                head.append(f"{LOCAL}{param} = [{', '.join(arg)}]")
        elif arg.isidentifier() and param not in parsed.assigned:
            renames[param] = arg
        else:
            renames[param] = LOCAL + param
            head.append(f"{LOCAL}{param} = {arg}")
    resolver = _Resolver(fn.__globals__, renames, {}, bind)
    try:
        body = [resolver.visit(stmt) for stmt in body]
    except NameError:  # a name the function reads that is nowhere now: its call will say so
        return None
    result = ast.parse(f"{target} = None").body[0].targets[0] if target is not None else None  # type: ignore[attr-defined]
    body = _returns_assigned(body, result)
    if body is None:
        return None
    module = ast.Module(body=body, type_ignores=[])
    ast.fix_missing_locations(module)
    lines = head + ast.unparse(module).splitlines()
    cleared = sorted(name for param, name in renames.items() if name.startswith(LOCAL)
                     if param in parsed.outer or param in parsed.params)
    if cleared:
        lines.append(" = ".join(cleared) + " = None")
    return lines


class _Parsed:
    """A function's statements (docstring dropped), parameters, the names local to it and
    those its own scope assigns."""

    def __init__(self, body: list[ast.stmt], params: list[str], local: set[str], outer: set[str],
                 assigned: set[str]):
        self.body, self.params, self.locals, self.outer, self.assigned = body, params, local, outer, assigned


@functools.lru_cache(maxsize=None)
def _parsed(fn: Callable) -> _Parsed | None:
    # The function's tree, when it has a shape that inlines (see the module's docstring).
    if not isinstance(fn, types.FunctionType) or fn.__closure__ or fn.__defaults__ or fn.__kwdefaults__:
        return None
    code = fn.__code__
    if code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS | inspect.CO_GENERATOR) or code.co_kwonlyargcount:
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef) or tree.body[0].name != fn.__name__:
        return None
    node = tree.body[0]
    if node.decorator_list:
        return None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    for sub in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.Global,
                            ast.Nonlocal, ast.Yield, ast.YieldFrom, ast.Await, ast.NamedExpr)):
            return None
    params = [arg.arg for arg in node.args.args]
    local = set(code.co_varnames) | set(code.co_cellvars)
    nested = {name for const in code.co_consts if isinstance(const, types.CodeType) for name in const.co_varnames}
    if nested & set(fn.__globals__):  # a comprehension's name that is also a global read elsewhere
        return None
    assigned = {sub.id for stmt in body for sub in _own_scope(stmt)
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del))}
    return _Parsed(body, params, (local | nested) - set(params), local - set(params), assigned)


def _own_scope(node: ast.AST):
    # The nodes of ``node`` outside comprehensions (their names are their own).
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            yield from _own_scope(child)


def _unpacked(body: list[ast.stmt], param: str, names: list[str], parsed: _Parsed, renames: dict) -> bool:
    # ``(a, b) = param`` as the body's first statement, ``param`` read nowhere else and the
    # names never assigned again: the names renamed to ``names`` and the statement dropped.
    if not body:
        return False
    first = body[0]
    if not (isinstance(first, ast.Assign) and len(first.targets) == 1
            and isinstance(first.targets[0], (ast.Tuple, ast.List))
            and isinstance(first.value, ast.Name) and first.value.id == param):
        return False
    targets = first.targets[0].elts
    if len(targets) != len(names) or not all(isinstance(t, ast.Name) for t in targets):
        return False
    uses = sum(isinstance(n, ast.Name) and n.id == param for stmt in body for n in ast.walk(stmt))
    stores = [n.id for stmt in body[1:] for n in _own_scope(stmt)
              if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))]
    if uses != 1 or any(t.id in stores for t in targets):  # type: ignore[attr-defined]
        return False
    for target, name in zip(targets, names, strict=True):
        renames[target.id] = name  # type: ignore[attr-defined]
    del body[0]
    return True


class _Resolver(ast.NodeTransformer):
    """Renames locals and parameters, binds the globals read and writes a call of a helper
    that returns one call-free expression as that expression."""

    def __init__(self, scope: dict, renames: dict[str, str], seen: dict[str, str], bind):
        self.scope, self.renames, self.seen, self.bind = scope, renames, seen, bind

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.renames:
            return ast.copy_location(ast.Name(self.renames[node.id], node.ctx), node)
        if node.id in self.scope:
            bound = self.seen.get(node.id)
            if bound is None:
                bound = self.seen[node.id] = self.bind(self.scope[node.id], node.id)
            return ast.copy_location(ast.Name(bound, node.ctx), node)
        if not hasattr(builtins, node.id):
            raise NameError(node.id)
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        helper = _resolved(node.func, self.scope)
        expression = _expression_of(helper) if helper is not None else None
        if (expression is not None and not node.keywords and len(node.args) == len(expression[0])
                and not any(isinstance(a, ast.Starred) for a in node.args)):
            params, value = expression
            args = [self.visit(arg) for arg in node.args]
            uses = {p: sum(isinstance(n, ast.Name) and n.id == p for n in ast.walk(value)) for p in params}
            if all(uses[p] <= 1 or isinstance(a, (ast.Name, ast.Constant)) for p, a in zip(params, args, strict=True)):
                # The helper's globals bound first (its parameters kept), then its arguments put in.
                own = _Resolver(helper.__globals__, {p: p for p in params}, {}, self.bind).visit(copy.deepcopy(value))
                return _Substitute(dict(zip(params, args, strict=True))).visit(own)
        return self.generic_visit(node)


class _Substitute(ast.NodeTransformer):
    def __init__(self, values: dict[str, ast.expr]):
        self.values = values

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return copy.deepcopy(self.values[node.id]) if node.id in self.values else node


def _resolved(func: ast.expr, scope: dict):
    # The object a call's function names at compile time: a global, or an attribute of one.
    if isinstance(func, ast.Name):
        return scope.get(func.id)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in scope:
        owner = scope[func.value.id]
        return getattr(owner, func.attr, None) if isinstance(owner, types.ModuleType) else None
    return None


@functools.lru_cache(maxsize=None)
def _expression_of(fn) -> tuple[list[str], ast.expr] | None:
    # A plain function whose body (docstring aside) is ``return <expression without a call>``:
    # its parameters and that expression.
    parsed = _parsed(fn) if isinstance(fn, types.FunctionType) else None
    if parsed is None or len(parsed.body) != 1 or not isinstance(parsed.body[0], ast.Return):
        return None
    value = parsed.body[0].value
    if value is None or parsed.locals or any(isinstance(n, ast.Call) for n in ast.walk(value)):
        return None
    return parsed.params, value


def _returns_assigned(body: list[ast.stmt], target: ast.expr | None) -> list[ast.stmt] | None:
    """``body`` with its returns made assignments to ``target``: a ``return`` ends the list;
    an ``if`` whose branch returns gets the statements after it as its ``else``. None when a
    ``return`` sits anywhere else."""
    out: list[ast.stmt] = []
    for at, stmt in enumerate(body):
        if isinstance(stmt, ast.Return):
            if target is not None:
                out.append(ast.Assign(targets=[copy.deepcopy(target)],
                                      value=stmt.value or ast.Constant(None), lineno=0))
            elif stmt.value is not None and not _is_none(stmt.value):
                out.append(ast.Expr(stmt.value))
            return out or [ast.Pass()]
        if isinstance(stmt, ast.If) and _returns(stmt.body) and not stmt.orelse:
            then = _returns_assigned(stmt.body, target)
            rest = _returns_assigned(body[at + 1:], target)
            if then is None or rest is None:
                return None
            out.append(ast.If(test=stmt.test, body=then, orelse=rest or []))
            return out
        if any(isinstance(n, ast.Return) for n in ast.walk(stmt)):
            return None
        out.append(stmt)
    if target is not None:  # fell off the end: the function returns None
        out.append(ast.Assign(targets=[copy.deepcopy(target)], value=ast.Constant(None), lineno=0))
    return out


def _returns(body: list[ast.stmt]) -> bool:
    # Whether a branch ends in a return (possibly under an if of its own that does).
    last = body[-1] if body else None
    return isinstance(last, ast.Return) or (isinstance(last, ast.If) and _returns(last.body)
                                             and bool(last.orelse) and _returns(last.orelse))


def _is_none(value: ast.expr) -> bool:
    return isinstance(value, ast.Constant) and value.value is None
