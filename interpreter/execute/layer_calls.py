"""Each op of a layer compiled once into a call: the hot path of a :class:`~.layer_exec.LayerRun`.

:meth:`LayerRun.forward_op <.layer_exec.LayerRun.forward_op>` and
:meth:`~.layer_exec.LayerRun.backward_op` find, on every call, the op's step by name, its
role's handler, its context, its weight and its gradient flow, and go through the
communicator's layers for a collective. A :class:`LayerCalls` does that once per op and
issue mode: each op becomes a closure ``call(run)`` holding its kernel function, its shared
context, its input and weight names, which values its run releases after it and, for a
collective, the communicator's bound issue (:func:`~dhelix.interpreter.ops.collective_kernels.bound`).
The SI blocks and the chains run alone call these (:class:`~.si.Flat`'s ``call``).

A call does exactly what the run's method does for its op, in the same order — the same
kernels on the same tensors, the same gradients added in place, the same values released
— on a run whose recomputation policy keeps everything and that releases its values
(:attr:`LayerRun.fast <.layer_exec.LayerRun.fast>`); on any other run it calls the method.
Ops the calls do not cover go to the method too (their call is None): MoE routing's ops
(a run's own routing), ring attention's backward steps, ZeRO-3's gathers, scatters and
gathered or staged weights, a backward op whose forward output feeds nothing.

``bare``: the memory probe is off, so an asynchronous collective complete at its issue may
leave its result itself, not a Pending (a Pending is what the probe counts as a transfer
in flight; without the probe nothing tells them apart).
"""

from __future__ import annotations

from typing import Callable

from dhelix.dsl.core.oplib import BWD, DGRAD, WGRAD, is_wgrad

from dhelix.interpreter.ops.collective_kernels import bound
from dhelix.interpreter.ops.comm import Communicator, Pending
from dhelix.interpreter.ops.handlers import COMM, FORWARD
from dhelix.interpreter.ops.kernels import KernelCtx
from .layer_exec import LayerPlan, Step

#: A compiled op: ``call(run)`` runs the op on a LayerRun.
Call = Callable[[object], None]


class LayerCalls:
    """The calls of every op of ``plan`` over ``comm``, by (forward?, op name, async?);
    None where the op has none (its run's method runs it)."""

    def __init__(self, plan: LayerPlan, comm: Communicator, bare: bool = False):
        contexts = plan.contexts(comm)
        #: The backward's weight-gradient ops by name (what an SI block's filler may hold).
        self.wgrads = frozenset(op.name for op in plan.bwd.ops if is_wgrad(op))
        self.calls: dict[tuple[bool, str, bool], Call | None] = {}
        for name, step in plan.steps.items():
            forward = step.forward is None
            for async_op in (False, True):
                # A routed op's context holds its run's routing: made once per run instead.
                ctx = contexts[name][async_op] if not step.routed else _RoutedContext(plan, step, comm, async_op)
                made = (_forward_call(plan, step, ctx, async_op, bare) if forward
                        else _backward_call(plan, step, ctx, async_op, bare))
                self.calls[(forward, name, async_op)] = made

    def of(self, forward: bool, name: str, async_op: bool) -> Call | None:
        """The call of op ``name`` (a forward op or a backward one) issued with ``async_op``."""
        return self.calls.get((forward, name, async_op))


def _releases(step: Step, keep: str) -> tuple[tuple[str, bool], ...]:
    # Each distinct input or wait of the op, and whether it goes when its last reader has run
    # (the layer's result stays: the chain hands it on).
    return tuple((name, name != keep) for name in step.inputs)


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


def _forward_call(plan: LayerPlan, step: Step, ctx, async_op: bool, bare: bool) -> Call | None:
    op = step.op
    if step.gathered is not None or step.run is None or step.role not in (FORWARD, COMM):
        return None
    name, inputs, releases = op.name, op.inputs, _releases(step, plan.fwd.output)
    method = _Method(op, async_op, forward=True)
    routed = ctx if isinstance(ctx, _RoutedContext) else None
    if step.role == COMM:
        if len(inputs) != 1:
            return None
        (source,) = inputs
        kernel = step.kernel
        issue = bound(op.op, kernel, ctx, bare) if routed is None else None

        def collective(run) -> None:
            if not run.fast:
                return method(run)
            acts = run.acts
            x = acts[source]
            if isinstance(x, Pending):  # :meth:`LayerRun._act`, inline (its policy notes no arrival)
                x = acts[source] = x.wait()
                run.version += 1
            acts[name] = issue(x) if routed is None else kernel(x, routed.of(run))
            left = run._fwd_left
            for value, goes in releases:
                count = left[value] - 1
                left[value] = count
                if not count and goes:
                    acts.pop(value, None)
            run.version += 1
        return collective

    kernel, weight, saves = step.kernel.forward, step.weight_name, bool(plan.saved_users.get(name))
    if routed is None and len(releases) == 1 and inputs == (releases[0][0],):  # most ops: one input, no other dependency
        (source,), ((_, goes),) = inputs, releases

        def compute_one(run) -> None:
            if not run.fast:
                return method(run)
            acts = run.acts
            x = acts[source]
            if isinstance(x, Pending):  # :meth:`LayerRun._act`, inline (its policy notes no arrival)
                x = acts[source] = x.wait()
                run.version += 1
            out, saved = kernel([x], run.weights.get(weight), ctx)
            acts[name] = out
            if saves:
                run.saved[name] = saved
            left = run._fwd_left
            count = left[source] - 1
            left[source] = count
            if not count and goes:
                del acts[source]
            run.version += 1
        return compute_one

    def compute(run) -> None:
        if not run.fast:
            return method(run)
        acts = run.acts
        args = []
        for value in inputs:
            x = acts[value]
            if isinstance(x, Pending):  # :meth:`LayerRun._act`, inline
                x = acts[value] = x.wait()
                run.version += 1
            args.append(x)
        out, saved = kernel(args, run.weights.get(weight), ctx if routed is None else routed.of(run))
        acts[name] = out
        if saves:
            run.saved[name] = saved
        left = run._fwd_left
        for value, goes in releases:
            count = left[value] - 1
            left[value] = count
            if not count and goes:
                acts.pop(value, None)
        run.version += 1
    return compute


def _backward_call(plan: LayerPlan, step: Step, ctx, async_op: bool, bare: bool) -> Call | None:
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
        weighted = (flow.weight, unit, step.kernel.wgrad, step.kernel.wgrad_into)
    name, upstream, source = op.name, flow.upstream, forward.name
    accumulates, releases = flow.accumulates, _releases(step, plan.bwd.output)
    method = _Method(op, async_op, forward=False)
    role, issue, dgrad, picks, produced = step.role, None, None, (), None
    routed = ctx if isinstance(ctx, _RoutedContext) else None
    collective = role == COMM
    if collective:
        (produced,) = flow.produces
        kernel = step.kernel
        issue = bound(op.op, kernel, ctx, bare) if routed is None else None
    elif role in (DGRAD, BWD):
        if len(set(forward.inputs)) != len(forward.inputs):
            return None  # an input read twice gets the sum of its gradients: the method's
        dgrad = step.kernel.dgrad
        picks = tuple((index, value) for index, value in enumerate(forward.inputs) if value in flow.produces)
    weight = step.weight_name

    def call(run) -> None:
        if not run.fast:
            return method(run)
        bgrads = run.bgrads
        grad = bgrads[upstream][source]
        if isinstance(grad, Pending):
            grad = grad.wait()
        if collective:
            out = {produced: issue(grad) if routed is None else kernel(grad, routed.of(run))}
        elif dgrad is not None:
            grads = dgrad(grad, run.saved[source], run.weights.get(weight))
            out = {}
            for index, value in picks:
                part = grads[index]
                if part is None:
                    raise ValueError(f"the kernel gave no gradient for {value}, which autodiff says it produces")
                out[value] = part
        else:  # a weight gradient: it adds into the run's grads, nothing flows on
            out = {}
        if weighted is not None:
            kept, unit, wgrad, wgrad_into = weighted
            grads, saved = run.grads, run.saved[kept]
            into = grads.get(unit)
            if into is None:
                grads[unit] = wgrad(grad, saved)
            elif wgrad_into is not None and into.dtype == grad.dtype:
                wgrad_into(into, grad, saved)
            else:
                grads[unit] += wgrad(grad, saved)
        for value, producers in accumulates:
            out[value] = run._accumulated(out[value], value, producers)
        if out:
            bgrads[name] = out
        left = run._bwd_left
        for value, goes in releases:
            count = left[value] - 1
            left[value] = count
            if not count and goes:
                bgrads.pop(value, None)
        users = run._saved_left
        count = users[source] - 1
        users[source] = count
        if not count:
            run.saved.pop(source, None)
        run.version += 1
    return call


class _Method:
    """The run's own method for an op (a run the calls do not cover)."""

    __slots__ = ("op", "async_op", "forward")

    def __init__(self, op, async_op: bool, forward: bool):
        self.op, self.async_op, self.forward = op, async_op, forward

    def __call__(self, run) -> None:
        (run.forward_op if self.forward else run.backward_op)(self.op, self.async_op)
