"""Each op of a layer compiled once into a call: the hot path of a :class:`~.layer_exec.LayerRun`.

:meth:`LayerRun.forward_op <.layer_exec.LayerRun.forward_op>` and
:meth:`~.layer_exec.LayerRun.backward_op` find, on every call, the op's step by name, its
role's handler, its context, its weight and its gradient flow, and go through the
communicator's layers for a collective. A :class:`LayerCalls` does that once per op and
issue mode: each op becomes a function ``call(run)`` of straight-line Python, generated from
its step (:attr:`LayerCalls.source` is its text; a traceback shows its lines): its names as
constants, its kernel's body written in (:mod:`.kernel_inline`; a kernel of a shape that does
not inline is called), its shared context and, for a collective, the communicator's bound
issue (:func:`~dhelix.interpreter.ops.collective_kernels.bound`) as the module's globals, the
values its run releases after it and its gradients' checks written out one by one (no loop
over a table, no branch on the op's kind at run time; a value the op alone reads goes
without a count). The SI blocks and the
chains run alone call these (:class:`~.si.Flat`'s ``call``).

A call does exactly what the run's method does for its op, in the same order — the same
kernels on the same tensors, the same gradients added in place, the same values released
— on a run whose recomputation policy keeps everything and that releases its values
(:attr:`LayerRun.fast <.layer_exec.LayerRun.fast>`); on any other run it calls the method.
Ops the calls do not cover go to the method too (their call is None): ring attention's
backward steps, ZeRO-3's gathers, scatters and gathered or staged weights, a backward op
whose forward output feeds nothing, a dgrad of an op reading one value twice.

``bare``: the memory probe is off, so an asynchronous collective complete at its issue may
leave its result itself, not a Pending (a Pending is what the probe counts as a transfer
in flight; without the probe nothing tells them apart).
"""

from __future__ import annotations

import functools
import hashlib
import linecache
import re
from types import CodeType
from typing import Callable, Mapping

from dhelix.dsl.core.oplib import BWD, DGRAD, WGRAD, is_wgrad

from dhelix.interpreter.ops.collective_kernels import bound
from dhelix.interpreter.ops.comm import Communicator, Pending
from dhelix.interpreter.ops.handlers import COMM, FORWARD
from dhelix.interpreter.ops.kernels import KernelCtx
from .kernel_inline import inline
from .layer_exec import LayerPlan, Step

#: A compiled op: ``call(run)`` runs the op on a LayerRun.
Call = Callable[[object], None]

#: What an op's body (:attr:`LayerCalls.bodies`) names its run by; :func:`_on` names it.
RUN = "@run"

class LayerCalls:
    """The calls of every op of ``plan`` over ``comm``, by (forward?, op name, async?);
    None where the op has none (its run's method runs it)."""

    def __init__(self, plan: LayerPlan, comm: Communicator, bare: bool = False):
        contexts = plan.contexts(comm)
        #: The backward's weight-gradient ops by name (what an SI block's filler may hold).
        self.wgrads = frozenset(op.name for op in plan.bwd.ops if is_wgrad(op))
        #: The generated module: its text (:attr:`source`) and its globals (what pairs of
        #: these ops compiled together call, :mod:`.pair_calls`).
        self.module = _Module()
        #: Each compiled op's body (:data:`RUN` for its run), by the key of :attr:`calls`.
        self.bodies: dict[tuple[bool, str, bool], list[str]] = {}
        #: Each compiled op's global name (its function), by the key of :attr:`calls`.
        self.names: dict[tuple[bool, str, bool], str] = {}
        for name, step in plan.steps.items():
            forward = step.forward is None
            for async_op in (False, True):
                # A routed op's context holds its run's routing: made once per run instead.
                ctx = contexts[name][async_op] if not step.routed else _RoutedContext(plan, step, comm, async_op)
                made = (_forward_call(self.module, plan, step, ctx, async_op, bare) if forward
                        else _backward_call(self.module, plan, step, ctx, async_op, bare))
                if made is not None:
                    key = (forward, name, async_op)
                    self.bodies[key] = made[2]
                    self.names[key] = self.module.add(made[0], [
                        "if not run.fast:", f"    return {made[1]}(run)", *on_run(made[2], "run")])
        functions = self.module.load()
        self.calls: dict[tuple[bool, str, bool], Call | None] = {
            key: functions[self.names[key]] if key in self.names else None
            for key in ((step.forward is None, name, async_op) for name, step in plan.steps.items()
                        for async_op in (False, True))}

    @property
    def source(self) -> str:
        """The generated module's text: one function per compiled op (then each compiled
        segment pair's)."""
        return self.module.text()

    def of(self, forward: bool, name: str, async_op: bool) -> Call | None:
        """The call of op ``name`` (a forward op or a backward one) issued with ``async_op``."""
        return self.calls.get((forward, name, async_op))


class _Module:
    """The source of the calls being generated and the objects their globals name."""

    def __init__(self):
        self.functions: list[str] = []
        self.globals: dict[str, object] = {"Pending": Pending}
        self.names: set[str] = set()
        #: The globals inlined kernels share, by the id of their value (:meth:`shared`).
        self._shared: dict[int, str] = {}
        #: The functions compiled so far, and the namespace they run in.
        self.loaded, self.namespace = 0, {}

    def bind(self, hint: str, value: object) -> str:
        """A global of the module holding ``value``, named after ``hint``."""
        name = self._fresh(hint)
        self.globals[name] = value
        return name

    def shared(self, value: object, hint: str) -> str:
        """The global holding ``value`` that every inlined kernel reads it by (bound on the
        first ask, named after ``hint``)."""
        name = self._shared.get(id(value))
        if name is None:
            # (a trailing underscore: no local of the generated code, an inlined kernel's
            # ``k_`` ones included, ends in one)
            name = self._shared[id(value)] = self.bind(f"{hint}_", value)
        return name

    def add(self, hint: str, body: list[str], params: str = "run") -> str:
        """Add a function of ``params`` (``call(run)``) running ``body``; its name."""
        name = self._fresh(hint)
        self.functions.append("\n".join([f"def {name}({params}):", *("    " + line for line in body)]))
        return name

    def _fresh(self, hint: str) -> str:
        base = re.sub(r"\W", "_", hint)
        name, n = base, 1
        while name in self.names or name in self.globals:
            n += 1
            name = f"{base}_{n}"
        self.names.add(name)
        return name

    def text(self) -> str:
        return "\n\n\n".join(self.functions) + "\n"

    def load(self) -> dict[str, object]:
        """The functions added since the last load compiled and run in the module's
        namespace, once: the namespace (every function by name). Their lines are kept in
        :mod:`linecache` under their own file name, so a traceback through one shows them."""
        text = "\n\n\n".join(self.functions[self.loaded:]) + "\n"
        self.loaded = len(self.functions)
        code = _compiled(text)
        linecache.cache[code.co_filename] = (len(text), None, text.splitlines(True), code.co_filename)
        self.namespace.update((name, value) for name, value in self.globals.items() if name not in self.namespace)
        exec(code, self.namespace)  # noqa: S102 (our own generated source)
        return self.namespace


@functools.lru_cache(maxsize=256)
def _compiled(text: str) -> CodeType:
    # Generated text compiled once per process (every executor of a program makes the same),
    # under a file name of its own (its lines' digest).
    return compile(text, f"<dhelix layer calls {hashlib.sha1(text.encode()).hexdigest()[:12]}>", "exec")


def _releases(step: Step, keep: str, readers: Mapping[str, int]) -> tuple[tuple[str, bool, bool], ...]:
    # Each distinct input or wait of the op, whether it goes when its last reader has run
    # (the layer's result stays: the chain hands it on) and whether this op is its one reader.
    return tuple((name, name != keep, readers.get(name) == 1) for name in step.inputs)


def _release_lines(left: str, fetch: str, store: str, releases) -> list[str]:
    # The run's count of each released value's readers, one down; the value goes at zero. A
    # value this op alone reads goes now, uncounted (no other op reads its count; a run
    # whose counts start anew, a recomputing one, runs the methods); ``fetch`` first when a
    # count is kept.
    lines, counted = [], False
    for value, goes, alone in releases:
        if alone:
            if goes:
                lines.append(f"{store}.pop({value!r}, None)")
            continue
        counted = True
        lines += [f"count = {left}[{value!r}] - 1", f"{left}[{value!r}] = count"]
        if goes:
            lines += ["if not count:", f"    {store}.pop({value!r}, None)"]
    return [fetch, *lines] if counted else lines


def _act_lines(target: str, value: str) -> list[str]:
    # :meth:`LayerRun._act`, inline (its policy notes no arrival).
    return [f"{target} = acts[{value!r}]",
            f"if isinstance({target}, Pending):",
            f"    {target} = acts[{value!r}] = {target}.wait()",
            f"    {RUN}.version += 1"]


def on_run(body: list[str], run: str) -> list[str]:
    """An op's ``body`` (:attr:`LayerCalls.bodies`) on the run named ``run`` (a Python name)."""
    return [line.replace(RUN, run) for line in body]


class _RoutedContext:
    """The kernel context of a routed op (:data:`~dhelix.interpreter.ops.handlers.ROUTED`)
    on a run: made on the run's first call of it, with the run's routing, then kept by the
    run (a context's fields are never set; the routing is the run's one dict)."""

    __slots__ = ("key", "args")

    def __init__(self, plan: LayerPlan, step: Step, comm: Communicator, async_op: bool):
        self.key = (step.op.name, async_op)
        self.args = (comm, step.op.axis, plan.micro_batch, step.params)

    def of(self, run) -> KernelCtx:
        found = run.own_contexts.get(self.key)
        if found is None:
            found = run.own_contexts[self.key] = KernelCtx(*self.args, run.routing, async_op=self.key[1])
        return found


def _forward_call(module: _Module, plan: LayerPlan, step: Step, ctx, async_op: bool,
                  bare: bool) -> tuple[str, str, list[str]] | None:
    # The forward op's name hint, its method's global and its body; None: the method runs it.
    op = step.op
    if step.gathered is not None or step.run is None or step.role not in (FORWARD, COMM):
        return None
    name, inputs = op.name, op.inputs
    if step.role == COMM and len(inputs) != 1:
        return None
    hint = f"F_{name}{'_async' if async_op else ''}"
    method = module.bind(f"{hint}_method", _Method(op, async_op, forward=True))
    body = [f"acts = {RUN}.acts"]
    if step.role == COMM:
        body += _act_lines("x", inputs[0])
        if isinstance(ctx, _RoutedContext):
            body.append(f"acts[{name!r}] = {module.bind(f'{hint}_kernel', step.kernel)}(x, {_context(module, hint, ctx)})")
        else:
            issue = module.bind(f"{hint}_issue", bound(op.op, step.kernel, ctx, bare))
            body.append(f"acts[{name!r}] = {issue}(x)")
    else:
        args = []
        for index, value in enumerate(inputs):
            body += _act_lines(f"x{index}", value)
            args.append(f"x{index}")
        body += _kernel_lines(module, f"{hint}_kernel", step.kernel.forward, "out, saved",
                              [args, f"{RUN}.weights.get({step.weight_name!r})", _context(module, hint, ctx)])
        body.append(f"acts[{name!r}] = out")
        if plan.saved_users.get(name):
            body.append(f"{RUN}.saved[{name!r}] = saved")
    body += [*_release_lines("fwd_left", f"fwd_left = {RUN}._fwd_left", "acts",
                             _releases(step, plan.fwd.output, plan.fwd_readers)),
             f"{RUN}.version += 1"]
    return hint, method, body


#: Each inlined call's lines, by (kernel, args, target), with the globals its body read: the
#: inlining (a parse, a deep copy and an unparse of the kernel) runs once per process, not once
#: per layer of every executor built (46 ms an executor of the tiny example without it).
_INLINED: dict[tuple, tuple[list[str] | None, list[tuple[object, str, str]]]] = {}


def _inlined(module: _Module, fn, args: list, target: str | None) -> list[str] | None:
    """:func:`.kernel_inline.inline` of ``fn(*args)`` into ``module``, from :data:`_INLINED`
    when done before: the globals it read bound in this module again, renamed where this
    module names them otherwise."""
    key = (fn, tuple(tuple(arg) if isinstance(arg, list) else arg for arg in args), target)
    found = _INLINED.get(key)
    if found is None:
        read: list[tuple[object, str, str]] = []

        def shared(value: object, hint: str) -> str:
            name = module.shared(value, hint)
            read.append((value, hint, name))
            return name

        found = _INLINED[key] = (inline(fn, args, target, shared), read)
        return found[0]
    lines, read = found
    renamed = {name: module.shared(value, hint) for value, hint, name in read}
    renamed = {old: new for old, new in renamed.items() if old != new}
    if lines is None or not renamed:
        return lines
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, renamed)) + r")\b")
    return [pattern.sub(lambda m: renamed[m.group(1)], line) for line in lines]


def _kernel_lines(module: _Module, hint: str, fn, target: str | None, args: list) -> list[str]:
    # ``target = fn(*args)`` (None: the result dropped): the kernel's body inlined
    # (:func:`.kernel_inline.inline`), or a call of it where it does not inline. An arg is
    # an expression, or a list of names (passed as a list).
    lines = _inlined(module, fn, args, target)
    if lines is not None:
        return [f"# {fn.__module__.rpartition('.')[2]}.{fn.__name__}, inlined", *lines]
    texts = [f"[{', '.join(arg)}]" if isinstance(arg, list) else arg for arg in args]
    call = f"{module.bind(hint, fn)}({', '.join(texts)})"
    return [call if target is None else f"{target} = {call}"]


def _indented(lines: list[str]) -> list[str]:
    return ["    " + line for line in lines]


def _context(module: _Module, hint: str, ctx) -> str:
    # The expression of an op's kernel context: a routed op's is its run's (made on the run's
    # first call of it), any other's the op's one, a global.
    name = module.bind(f"{hint}_ctx", ctx)
    return f"{name}.of({RUN})" if isinstance(ctx, _RoutedContext) else name


def _backward_call(module: _Module, plan: LayerPlan, step: Step, ctx, async_op: bool,
                   bare: bool) -> tuple[str, str, list[str]] | None:
    # The backward op's name hint, its method's global and its body; None: the method runs it.
    op, forward = step.op, step.forward
    flow = op.grad
    if (step.gathered is not None or step.run is None or flow is None or flow.upstream is None
            or step.role not in (COMM, DGRAD, BWD, WGRAD)):
        return None
    weighted = None
    if flow.weight is not None:
        unit, staged = plan.units[flow.weight]
        if staged is not None or unit in plan.sharded:
            return None
        weighted = (flow.weight, unit)
    role = step.role
    if role in (DGRAD, BWD) and len(set(forward.inputs)) != len(forward.inputs):
        return None  # an input read twice gets the sum of its gradients: the method's
    name, source = op.name, forward.name
    hint = f"B_{name}{'_async' if async_op else ''}"
    method = module.bind(f"{hint}_method", _Method(op, async_op, forward=False))
    body = [f"bgrads = {RUN}.bgrads", f"grad = bgrads[{flow.upstream!r}][{source!r}]",
            "if isinstance(grad, Pending):", "    grad = grad.wait()"]
    produced: list[str] = []
    if role == COMM:
        (value,) = flow.produces
        if isinstance(ctx, _RoutedContext):
            kernel = module.bind(f"{hint}_kernel", step.kernel)
            body.append(f"out = {{{value!r}: {kernel}(grad, {_context(module, hint, ctx)})}}")
        else:
            issue = module.bind(f"{hint}_issue", bound(op.op, step.kernel, ctx, bare))
            body.append(f"out = {{{value!r}: {issue}(grad)}}")
        produced.append(value)
    elif role in (DGRAD, BWD):
        body += _kernel_lines(module, f"{hint}_dgrad", step.kernel.dgrad, "grads",
                              ["grad", f"{RUN}.saved[{source!r}]", f"{RUN}.weights.get({step.weight_name!r})"])
        for index, value in enumerate(forward.inputs):
            if value in flow.produces:
                body += [f"part{index} = grads[{index}]", f"if part{index} is None:",
                         f"    raise ValueError({_no_gradient(value)!r})"]
                produced.append(value)
        picked = [f"{value!r}: part{forward.inputs.index(value)}" for value in produced]
        body.append(f"out = {{{', '.join(picked)}}}")
    elif flow.accumulates:  # a weight gradient: it adds into the run's grads, nothing flows on
        body.append("out = {}")
    if weighted is not None:
        kept, unit = weighted
        wgrad = step.kernel.wgrad
        body += [f"weight_grads = {RUN}.grads", f"saved = {RUN}.saved[{kept!r}]",
                 f"into = weight_grads.get({unit!r})", "if into is None:",
                 *_indented(_kernel_lines(module, f"{hint}_wgrad", wgrad, f"weight_grads[{unit!r}]", ["grad", "saved"]))]
        if step.kernel.wgrad_into is not None:
            body += ["elif into.dtype == grad.dtype:",
                     *_indented(_kernel_lines(module, f"{hint}_wgrad_into", step.kernel.wgrad_into, None,
                                              ["into", "grad", "saved"]))]
        body += ["else:", *_indented(_kernel_lines(module, f"{hint}_wgrad", wgrad, "part", ["grad", "saved"])),
                 f"    weight_grads[{unit!r}] += part", "    part = None"]  # (the temporary goes now)
    for value, producers in flow.accumulates:
        # :meth:`LayerRun._accumulated`, inline where the own part has landed: the other
        # producers' parts added in their order, each waited for when still in flight.
        body += [f"own = out[{value!r}]", "if isinstance(own, Pending):",
                 f"    out[{value!r}] = {RUN}._accumulated(own, {value!r}, {producers!r})", "else:"]
        for producer in producers:
            body += [f"    part = bgrads[{producer!r}][{value!r}]",
                     "    own = own + (part.wait() if isinstance(part, Pending) else part)"]
        body.append(f"    out[{value!r}] = own")
    if produced:
        body.append(f"bgrads[{name!r}] = out")
    body += [*_release_lines("bwd_left", f"bwd_left = {RUN}._bwd_left", "bgrads",
                             _releases(step, plan.bwd.output, plan.bwd_readers)),
             *_release_lines("users", f"users = {RUN}._saved_left", f"{RUN}.saved",
                             ((source, True, plan.saved_users.get(source) == 1),)),
             f"{RUN}.version += 1"]
    return hint, method, body


def _no_gradient(value: str) -> str:
    return f"the kernel gave no gradient for {value}, which autodiff says it produces"


class _Method:
    """The run's own method for an op (a run the calls do not cover)."""

    __slots__ = ("op", "async_op", "forward")

    def __init__(self, op, async_op: bool, forward: bool):
        self.op, self.async_op, self.forward = op, async_op, forward

    def __call__(self, run) -> None:
        (run.forward_op if self.forward else run.backward_op)(self.op, self.async_op)
