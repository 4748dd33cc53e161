"""Execute one layer's forward DAG and derived backward DAG op by op.

A :class:`LayerRun` is the live state of one layer for one micro-batch: activations keyed
by op name, what each forward kernel saved for its backward, and the gradients flowing
back. The executor drives it one :class:`~dhelix.dsl.core.program.Op` at a time
(:meth:`LayerRun.forward_op`, :meth:`LayerRun.backward_op`) in any order the DAG allows —
that is what strand interleaving and wgrad moving need; :meth:`LayerRun.forward` and
:meth:`LayerRun.backward` run a whole DAG in its listed order.

Backward semantics are those autodiff recorded in each backward op's
:class:`~dhelix.dsl.core.program.GradFlow` (``Op.grad``); nothing is re-derived here. A
backward op reads the gradient of its forward op's output from ``grad.upstream`` and
produces the gradients of the forward values in ``grad.produces``, as a map *forward value
→ gradient* (``add`` fans out, ``unpermute`` gives both the routed tokens and the router
scores theirs). A value read by several forward ops receives several contributions; the op
whose ``grad.accumulates`` names it adds the others' to its own. An op with a
``grad.weight`` (a ``.wgrad``, a norm's ``.bwd``) adds that op's weight gradient into
:attr:`LayerRun.grads`, keyed by op name, across micro-batches.

Collectives may run asynchronously: the value stored is a :class:`~.comm.Pending` that the
first reader waits for. Tensors are released as soon as their last reader has run.

An op's role (:func:`~dhelix.interpreter.ops.handlers.handler`) picks the method that runs it
(``_FORWARD_BY_ROLE``, ``_BACKWARD_BY_ROLE``: a kernel, a collective, a ring attention step,
ZeRO-3's weight gathers and gradient reduce-scatters); what a layer keeps between its forward
and its backward is its recomputation policy (:mod:`.recompute`), chosen when the run is
made. Neither :meth:`LayerRun.forward_op` nor :meth:`LayerRun.backward_op` asks which mode
the run is in.

One module because it is one thing, a layer's run: :class:`LayerPlan` (what every run of a
DAG pair shares) and :class:`LayerRun` (the run itself, its op steps, gradient accumulation
and releases). The model's ends are :mod:`.model_ends`; one step without pipelining,
:mod:`.sequential`.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Collection, Mapping

import attrs
import torch

from dhelix.dsl.core.mesh import INTER, INTRA
from dhelix.dsl.core.oplib import BWD, DGRAD, REGROUP, WGRAD
from dhelix.dsl.core.program import COLUMNS, LayerDag, Op
from dhelix.dsl.passes.fsdp import (BACKWARD_GATHER, COLUMN_PIECES, FIRST_STAGE, GATHER as FSDP_GATHER, MATES, PART,
                                    PIECES, unit_of)

from dhelix.interpreter.ops.blocks import part_blocks, without_group
from dhelix.interpreter.ops.comm import Communicator, Pending, resolve
from dhelix.interpreter.ops.fsdp import block_of, from_column_pieces, gather_weight, scatter_grad
from dhelix.interpreter.ops.handlers import COMM, FORWARD, GATHER_W, ROUTED, SCATTER_DW, handler
from dhelix.interpreter.ops.kernels import KernelCtx
from dhelix.interpreter.ops.moe import ROLE, a2a_roles
from dhelix.interpreter.ops.ring_attention import KERNEL as RING_KERNEL, RING, STEP, check_ring, ring_step
from .recompute import KeepAll, keeping


@attrs.frozen(kw_only=True)
class LayerPlan:
    """The static bookkeeping of a (forward, backward) DAG pair, shared by all runs.

    ``fwd_readers``/``bwd_readers``/``saved_users`` count the consumers of each forward
    value, backward value and forward op's saved tensors. ``steps[name]`` is an op's
    :class:`Step` and ``fwd_ops`` the forward ops by name, both resolved once here rather
    than on every call of every run.
    """

    fwd: LayerDag
    bwd: LayerDag
    micro_batch: int
    fwd_readers: Mapping[str, int]
    bwd_readers: Mapping[str, int]
    saved_users: Mapping[str, int]
    steps: Mapping[str, "Step"] = attrs.field(factory=dict)
    fwd_ops: Mapping[str, Op] = attrs.field(factory=dict)
    #: ZeRO-3: the op whose output is the gathered weight each weighted op reads (forward
    #: and backward ops by name), and the units sharded so (:attr:`Op.weight_unit`: weights,
    #: or their column blocks under a chunk along outputs).
    gathered_by: Mapping[str, str] = attrs.field(factory=dict)
    sharded: frozenset = frozenset()
    #: The kernel contexts of the steps that need nothing of a run's own (no MoE routing),
    #: made once per communicator (:meth:`contexts`): op name → (synchronous, asynchronous).
    shared_contexts: dict = attrs.field(factory=dict, eq=False)
    #: Each forward op's weight unit and :attr:`Op.staged` by name (properties that
    #: rebuild the op's parameter dict on every read), resolved once.
    units: Mapping[str, tuple[str, object]] = attrs.field(factory=dict)
    #: ZeRO-3 under selective recomputation: the backward ops that wait for the re-gather of
    #: a weight not their own, the weights the rebuild computes with (:mod:`dhelix.dsl.passes.fsdp`):
    #: the rebuild runs before the first of them, not before the first backward op.
    rebuild_readers: frozenset = frozenset()

    @classmethod
    def build(cls, fwd: LayerDag, bwd: LayerDag, micro_batch: int) -> "LayerPlan":
        """The plan of ``fwd`` and its derived ``bwd`` for micro-batches of ``micro_batch``
        sequences. Raises NotImplementedError for a ring attention it cannot run and
        ValueError for a backward op without a GradFlow (not derived by autodiff)."""
        check_ring(fwd.ops)
        fwd_ops = {op.name: op for op in fwd.ops}
        for op in bwd.ops:
            if op.grad is None or op.forward not in fwd_ops:
                raise ValueError(f"backward op {op.name} has no gradient flow for a forward op of "
                                 f"{fwd.name}: the backward DAG was not derived from this forward")
        roles = a2a_roles(fwd, bwd)  # MoE dispatch / combine direction of each ep all_to_all
        gathers = {op.name: unit_of(op.params) for op in fwd.ops + bwd.ops if op.op == FSDP_GATHER}
        # An op computes with the gather of its own weight unit; it may wait for others too
        # (selective recomputation's readers wait for the weights the rebuild computes with).
        own = {op.name: op.weight_unit for op in fwd.ops if op.weight}
        own |= {op.name: own[op.forward] for op in bwd.ops if op.forward in own}
        gathered_by = {op.name: name for op in fwd.ops + bwd.ops for name in op.waits
                       if gathers.get(name) is not None and gathers[name] == own.get(op.name)}
        rebuild_readers = frozenset(op.name for op in bwd.ops for name in op.waits
                                    if gathers.get(name) is not None and gathers[name] != own.get(op.name))
        steps = {op.name: Step.of(op, roles.get(op.name), None, gathered_by.get(op.name)) for op in fwd.ops}
        steps |= {op.name: Step.of(op, roles.get(op.name), fwd_ops[op.forward], gathered_by.get(op.name))
                  for op in bwd.ops}
        return cls(fwd=fwd, bwd=bwd, micro_batch=micro_batch,
                   fwd_readers=Counter(name for op in fwd.ops for name in dict.fromkeys(op.deps)),
                   bwd_readers=Counter(name for op in bwd.ops for name in dict.fromkeys(op.deps)),
                   saved_users=Counter(op.forward for op in bwd.ops),
                   steps=steps, fwd_ops=fwd_ops, gathered_by=gathered_by,
                   sharded=frozenset(unit_of(op.params) for op in fwd.ops if op.op == FSDP_GATHER),
                   units={op.name: (op.weight_unit, op.staged) for op in fwd.ops}, rebuild_readers=rebuild_readers)

    def contexts(self, comm: Communicator) -> dict[str, tuple[KernelCtx, KernelCtx]]:
        """The shared kernel contexts of the steps that need none of their own (every step
        but those of :data:`~dhelix.interpreter.ops.handlers.ROUTED` kinds), for ``comm``:
        op name → (synchronous, asynchronous), made once (a kernel reads its context, never
        sets it)."""
        found = self.shared_contexts.get(id(comm))
        if found is None or found[0] is not comm:
            made = {name: tuple(KernelCtx(comm, step.op.axis, self.micro_batch, step.params, {}, async_op=flag)
                                for flag in (False, True))
                    for name, step in self.steps.items() if not step.routed}
            found = self.shared_contexts[id(comm)] = (comm, made)
        return found[1]


@attrs.frozen(eq=False)
class Step:
    """What running an op needs besides tensors, resolved once per program so that running
    it looks nothing up by name: its role and kernel (:func:`handler`), its parameters
    (shared read-only by every KernelCtx), the distinct ops it runs after (its inputs and
    what it waits for: when the last reader has run, a value is released), the op itself,
    the LayerRun method that runs it (``run``: by role, for a forward or a backward op;
    None: it has no such role there), a backward op's forward op, the weight it computes
    with (its name, and the ZeRO-3 gather whose output it is instead) and whether its
    kernel reads a run's own MoE routing (``routed``: no shared context)."""

    role: str
    kernel: object
    params: Mapping[str, object]
    inputs: tuple[str, ...]
    op: Op | None = None
    run: Callable | None = None
    forward: Op | None = None
    weight_name: str | None = None
    gathered: str | None = None
    routed: bool = False

    @classmethod
    def of(cls, op: Op, ep_role: str | None = None, forward: Op | None = None,
           gathered: str | None = None) -> "Step":
        """The step of ``op``; ``ep_role`` is an ep all_to_all's direction (:mod:`.moe`);
        ``forward`` a backward op's forward op (None: ``op`` is a forward op); ``gathered``
        the ZeRO-3 gather whose output is its weight."""
        role, kernel = handler(op.op)
        params = dict(op.params) | ({ROLE: ep_role} if ep_role else {})
        position = ring_step(op)
        if position is not None:  # forward ring steps run as forward kernels, backward as RING
            role = FORWARD if op.op == "attention" else RING
            kernel, params[STEP] = RING_KERNEL, position
        run = (_FORWARD_BY_ROLE if forward is None else _BACKWARD_BY_ROLE).get(role)
        return cls(role, kernel, params, tuple(dict.fromkeys(op.deps)), op, run, forward,
                   (op if forward is None else forward).weight_name, gathered, op.op in ROUTED)


#: The key of a backward re-gather's weight among the backward values.
GATHERED = "weight"


class GradStore(dict):
    """A layer's or the model ends' weight gradients by key (a layer's op name, or a
    parameter name), as the backward makes and adds them. Those in :attr:`main` are main
    gradients (:meth:`~dhelix.interpreter.training.optim.DistributedAdamW.main_grads`): views
    of the optimizer's fp32 buffers, added into in place and never replaced."""

    def __init__(self, values=(), main: frozenset = frozenset()):
        super().__init__(values)
        self.main = main

    @classmethod
    def seeded(cls, main_grads: dict, keys, prefix: str = "") -> "GradStore":
        """The store of ``keys`` whose parameter (``prefix + key``) has a main gradient in
        ``main_grads``, seeded with them."""
        held = {key: main_grads[prefix + key] for key in keys if prefix + key in main_grads}
        return cls(held, frozenset(held))


def add_grad(store: dict, key: str, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``store[key]``: in place into a main gradient; else the first
    gradient is kept as it is and a later one summed into a new tensor."""
    if key in getattr(store, "main", ()):
        store[key].add_(grad)
    else:
        store[key] = store[key] + grad if key in store else grad


class LayerRun:
    """One layer's forward and backward for one micro-batch.

    ``releases``: whether a value goes once its last reader has run (:meth:`_release`; a
    subclass that keeps every tensor sets it False and overrides that method).

    ``weights`` are this rank's shards keyed by op name; ``grads`` (shared across the runs
    of the same layer so micro-batches accumulate) receives the weight gradients. The
    communicator does the collectives of the DAG's comm ops.
    """

    releases = True

    def __init__(self, plan: LayerPlan, weights: Mapping[str, torch.Tensor], comm: Communicator,
                 grads: dict[str, torch.Tensor] | None = None, recompute: bool = False,
                 defer: Callable[[Pending], None] | None = None, selective: Collection[str] = ()):
        self.plan, self.weights, self.comm = plan, weights, comm
        self._contexts = plan.contexts(comm)
        #: Whether the communicator names collectives by op (tracing), read once per run.
        self._names_ops = comm.names_ops
        #: Takes a ZeRO-3 gradient reduce-scatter left in flight (nothing in the layer reads
        #: it; the caller waits for it before the optimizer); without one, waited for at once.
        self.defer = defer if defer is not None else _wait_now
        #: ZeRO-3: this micro-batch's full gradient of each sharded weight, until its
        #: reduce-scatter adds this rank's piece into :attr:`grads`.
        self.full_grads: dict[str, torch.Tensor] = {}
        #: What the layer keeps between its forward and its backward (:mod:`.recompute`):
        #: everything, only its input (``recompute``: full recomputation) or all but the
        #: outputs of the ``selective`` ops (selective recomputation).
        self.keeping = keeping(recompute, selective)
        #: Whether the policy keeps everything (its hooks do nothing: not called).
        self._keeps_all = type(self.keeping) is KeepAll
        #: Whether the compiled calls (:mod:`.layer_calls`) may run this run's ops: a plain
        #: run (no subclass's methods) that keeps everything (else its methods run them).
        self.fast = self._keeps_all and type(self) is LayerRun
        self._forward_done = 0
        self.grads = grads if grads is not None else {}
        self.routing: dict = {}  # MoE routing shared by permute and grouped_gemm
        #: The kernel contexts of its routed ops, made once per run (:mod:`.layer_calls`).
        self.own_contexts: dict = {}
        self.acts: dict[str, object] = {}
        self.saved: dict[str, object] = {}
        self.bgrads: dict[str, dict[str, object]] = {}
        self._fwd_left = _counts(plan.fwd_readers)
        self._bwd_left = _counts(plan.bwd_readers)
        self._saved_left = _counts(plan.saved_users)
        #: Bumped whenever the live tensors may have changed (see :meth:`storages`).
        self.version = 0
        self._memo: tuple[int, dict[int, int]] = (-1, {})

    # -- forward -------------------------------------------------------------------------

    def start(self, x: torch.Tensor) -> None:
        """Set the layer input ``x`` (this rank's ``[tokens, hidden]`` rows)."""
        self.acts[self.plan.fwd.input] = x
        self.keeping.started(self, x)
        self.version += 1

    def forward_op(self, op: Op, async_op: bool = False) -> None:
        """Run forward op ``op``; a collective with ``async_op`` is left in flight."""
        step = self.plan.steps[op.name]
        if step.run is None or step.forward is not None:
            raise ValueError(f"{op.name} ({op.op}) is not a forward op")
        acts = self.acts
        args = []  # a loop: a comprehension's own frame cost more than its one or two inputs
        for name in op.inputs:
            value = acts[name]
            args.append(self._act(name) if isinstance(value, Pending) else value)
        step.run(self, op, step, args, async_op)
        if self.releases:  # :meth:`_release`, inline
            left, keep = self._fwd_left, self.plan.fwd.output
            for name in step.inputs:
                left[name] -= 1
                if left[name] == 0 and name != keep:
                    acts.pop(name, None)
        else:
            self._release(step.inputs, self._fwd_left, acts, keep=self.plan.fwd.output)
        self.version += 1
        self._forward_done += 1
        if self._forward_done == len(self.plan.fwd.ops):
            self.keeping.forward_ended(self)

    def _forward_comm(self, op: Op, step: "Step", args: list, async_op: bool) -> None:
        # A collective of the forward (left in flight with ``async_op``).
        ctx = self._contexts[op.name][async_op] if not step.routed else self._ctx(op, step, async_op)
        if not self._names_ops:
            self.acts[op.name] = step.kernel(args[0], ctx)
            return
        with self.comm.op_named(op.name):
            self.acts[op.name] = step.kernel(args[0], ctx)

    def _forward_gather(self, op: Op, step: "Step", args: list, async_op: bool) -> None:
        # ZeRO-3: the all-gather of a weight (the second stage of a grouped one reads the first's).
        self.acts[op.name] = self._gather(op, async_op, args[0] if args else None)

    def _forward_kernel(self, op: Op, step: "Step", args: list, async_op: bool) -> None:
        # A compute kernel (a ring attention's forward steps included); its saved tensors
        # are kept while a backward op reads them.
        weight = self.weights.get(step.weight_name) if step.gathered is None else self._weight(op, step)
        ctx = self._contexts[op.name][async_op] if not step.routed else self._ctx(op, step, async_op)
        out, saved = step.kernel.forward(args, weight, ctx)
        self.acts[op.name] = out
        if self._saved_left.get(op.name):
            self.saved[op.name] = saved
        if not self._keeps_all:
            self.keeping.forwarded(self, op, out, args)

    def remake(self, op: Op, args: list) -> torch.Tensor:
        """The output of forward kernel ``op`` computed again from ``args`` (selective
        recomputation; nothing saved, nothing left in flight)."""
        step = self.plan.steps[op.name]
        weight = self._weight(op, step) if step.gathered is None else self._regathered(op)
        out, _ = step.kernel.forward(args, weight, self._ctx(op, step, False))
        return out

    def _regathered(self, op: Op) -> torch.Tensor:
        # Under ZeRO-3 the forward's gathered weight is gone by the backward: a rebuilt op
        # computes with the backward's re-gather of it, which its readers waited for.
        gathered = self.bgrads[op.weight_unit + BACKWARD_GATHER]
        gathered[GATHERED] = weight = resolve(gathered[GATHERED])
        return weight

    def restart_forward(self) -> None:
        """Count every forward value's and saved tensor's readers afresh (a replay's forward)."""
        self._fwd_left = Counter(self.plan.fwd_readers)
        self._saved_left = Counter(self.plan.saved_users)

    def output(self) -> torch.Tensor:
        """The layer output (waits for it if a collective produces it)."""
        return self._act(self.plan.fwd.output)

    def hand_on_output(self) -> None:
        """Let go of the layer output once the chain has handed it on (to the next stage's
        mailbox or the LM head): no backward op of this layer reads it (a kernel that saves
        its own output keeps it in :attr:`saved`), and a chain's last layer kept it alive,
        uncounted by the memory model, while its micro-batch was in flight."""
        if self.acts.pop(self.plan.fwd.output, None) is not None:
            self.version += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the whole forward DAG on ``x`` in its listed order; returns the output."""
        self.start(x)
        for op in self.plan.fwd.ops:
            self.forward_op(op)
        return self.output()

    # -- backward ------------------------------------------------------------------------

    def start_backward(self, grad_out: torch.Tensor) -> None:
        """Set the gradient of the layer output."""
        self.bgrads[self.plan.bwd.input] = {self.plan.fwd.output: grad_out}
        self.version += 1

    def backward_op(self, op: Op, async_op: bool = False) -> None:
        """Run backward op ``op`` (a dgrad, a wgrad, an op's whole backward or a collective)."""
        if not self._keeps_all:
            self.keeping.before_backward(self, op)
        step = self.plan.steps[op.name]
        handler, forward = step.run, step.forward
        if handler is None or forward is None:
            raise ValueError(f"{op.name} ({op.op}) is not a backward op")
        if step.role in _FSDP_ROLES:
            handler(self, op, step, async_op)
            return
        flow = op.grad
        assert flow is not None, "LayerPlan.build checked that every backward op has its GradFlow"
        if flow.upstream is None:
            grad = self._upstream(None, forward)
        else:  # :meth:`_upstream`, inline
            grad = self.bgrads[flow.upstream][forward.name]
            if isinstance(grad, Pending):
                grad = grad.wait()
        out = handler(self, op, step, forward, grad, async_op)
        if flow.weight is not None:
            self._add_weight_grad(flow.weight, step.kernel, grad)
        for value, producers in flow.accumulates:
            out[value] = self._accumulated(out[value], value, producers)
        if out:  # a wgrad's result lives in grads, not in the flow of gradients
            self.bgrads[op.name] = out
        if self.releases:  # :meth:`_release`, inline
            left, keep, bgrads = self._bwd_left, self.plan.bwd.output, self.bgrads
            for name in step.inputs:
                left[name] -= 1
                if left[name] == 0 and name != keep:
                    bgrads.pop(name, None)
        else:
            self._release(step.inputs, self._bwd_left, self.bgrads, keep=self.plan.bwd.output)
        self._saved_left[forward.name] -= 1
        if self._saved_left[forward.name] == 0:
            self.saved.pop(forward.name, None)
        self.version += 1

    def _backward_comm(self, op: Op, step: "Step", forward: Op, grad, async_op: bool) -> dict:
        # A collective of the backward: the gradient of the one value it produces.
        (value,) = op.grad.produces
        ctx = self._contexts[op.name][async_op] if not step.routed else self._ctx(op, step, async_op)
        if not self._names_ops:
            return {value: step.kernel(grad, ctx)}
        with self.comm.op_named(op.name):
            return {value: step.kernel(grad, ctx)}

    def _backward_dgrad(self, op: Op, step: "Step", forward: Op, grad, async_op: bool) -> dict:
        # A data gradient (or an op's whole backward): the gradients of its forward inputs.
        weight = self.weights.get(step.weight_name) if step.gathered is None else self._weight(op, step)
        grads = step.kernel.dgrad(grad, self.saved[forward.name], weight)
        return _by_value(forward.inputs, grads, op.grad.produces)

    def _backward_ring(self, op: Op, step: "Step", forward: Op, grad, async_op: bool) -> dict:
        # A ring attention's backward step: carrying steps pass the ring's state on; the last gives d(qkv).
        value = step.kernel.backward(grad, self.saved[forward.name], self._ctx(op, step, async_op))
        return {op.grad.produces[0] if op.grad.produces else forward.name: value}

    def _backward_wgrad(self, op: Op, step: "Step", forward: Op, grad, async_op: bool) -> dict:
        # A weight gradient: it adds into :attr:`grads` (``op.grad.weight``), nothing flows on.
        return {}

    @property
    def backward_started(self) -> bool:
        """Whether the backward's own preparation is done: a full recomputation's replay (its
        forward collectives) or a selective one's rebuild runs with the first backward op."""
        return self.keeping.prepared

    def input_grad(self) -> torch.Tensor:
        """The gradient of the layer input (after the whole backward DAG has run)."""
        return resolve(self.bgrads[self.plan.bwd.output][self.plan.fwd.input])

    def backward(self, grad_out: torch.Tensor) -> torch.Tensor:
        """Run the whole backward DAG in its listed order; returns the input gradient."""
        self.start_backward(grad_out)
        for op in self.plan.bwd.ops:
            self.backward_op(op)
        return self.input_grad()

    # -- ZeRO-3 ----------------------------------------------------------------------------

    def _gather(self, op: Op, async_op: bool, source: torch.Tensor | None = None):
        # ``source``: the first stage's output, for the second of a ``group weights`` gather.
        params = dict(op.params)
        if source is None:  # this rank's piece of the weight, or of its columns' block
            source = block_of(self.weights[params["weight"]], params.get(COLUMNS))
        elif params.get(PART) == MATES:  # three ways: the node's pieces but this rank's own go across
            base = op.axis.rpartition(".")[0]
            source = without_group(source, self.comm.size(f"{base}.{INTRA}"), self.comm.index(f"{base}.{INTRA}"))
        with self.comm.op_named(op.name):
            return gather_weight(source, self.comm,
                                 params["shape"], async_op, op.axis, bool(params.get(FIRST_STAGE) or params.get(PART)),
                                 bool(params.get(REGROUP)), params[PIECES] if params.get(COLUMN_PIECES) else 0)

    def _weight(self, op: Op, step: "Step") -> torch.Tensor | None:
        """The weight ``op`` computes with: its ZeRO-3 gather's output (an activation in the
        forward, a backward value in the backward), else this rank's kept weight (its
        forward op's :attr:`Op.weight_name`)."""
        source = step.gathered
        if source is None:
            return self.weights.get(step.weight_name)
        forward = self.plan.fwd_ops.get(op.name) or self.plan.fwd_ops[op.forward]
        if op.name in self.plan.fwd_ops:
            weight = self._act(source)
        else:
            gathered = self.bgrads[source]
            gathered[GATHERED] = weight = resolve(gathered[GATHERED])
        return weight if forward.staged is None else self._staged_weight(forward, weight)

    def _staged_columns(self, forward: Op) -> torch.Tensor:
        """The columns of its whole weight that a gemm chunked at its gather's stages
        computes on (:attr:`Op.staged`): part 0 those of the column blocks the first stage
        brings this rank, the later parts the blocks each later stage brings (two parts, or
        three under ``by stages3``), each in block order; the ``merge`` named like the gemm
        says over which axis and into how many blocks."""
        part, first, columns = forward.staged
        merge = self.plan.fwd_ops[forward.weight_name]
        params = dict(merge.params)
        blocks = params["blocks"]
        width = columns // blocks
        chosen = part_blocks(self.comm, params["axis"], first, blocks, len(merge.inputs))[part]
        return torch.cat([torch.arange(b * width, (b + 1) * width) for b in chosen])

    def _staged_weight(self, forward: Op, weight: torch.Tensor) -> torch.Tensor:
        # A stage's pieces (flat: in the forward) side by side, or the part's columns of the
        # whole weight (re-gathered for the backward). Three ways, the cross-node stages'
        # pieces hold this rank's node's too (its own place's, its mates'): left out.
        whole = (*forward.weight[:-1], forward.staged[2])
        if weight.dim() == 1:
            merge = self.plan.fwd_ops[forward.weight_name]
            params = dict(merge.params)
            if len(merge.inputs) == 3 and forward.staged[0] > 0:
                inter = f"{params['axis']}.{INTER}"
                weight = without_group(weight, self.comm.size(inter), self.comm.index(inter))
            return from_column_pieces(weight, whole, params["blocks"])
        return weight.index_select(-1, self._staged_columns(forward).to(weight.device))

    def _fsdp_backward(self, op: Op, step: "Step", async_op: bool) -> None:
        """A backward re-gather (its weight stays among the backward values until its last
        reader) or a gradient reduce-scatter (its piece adds into :attr:`grads`)."""
        params = dict(op.params)
        name, unit = params["weight"], unit_of(params)
        # The second stage of a ``group weights`` collective reads the first's output.
        source = resolve(self.bgrads[op.inputs[0]][GATHERED]) if op.inputs else None
        if step.role == GATHER_W:
            self.bgrads[op.name] = {GATHERED: self._gather(op, async_op, source)}
        else:
            with self.comm.op_named(op.name):
                sent = scatter_grad(self._full_grad(unit) if source is None else source, self.comm, async_op,
                                    op.axis, source is None, bool(params.get(REGROUP)), params.get(PIECES),
                                    bool(params.get(COLUMN_PIECES)))
            if params.get(FIRST_STAGE):  # the second stage reduce-scatters it on
                self.bgrads[op.name] = {GATHERED: sent}
            elif isinstance(sent, Pending):
                self.defer(sent.then(lambda mine: self._add_piece(name, mine, params.get(COLUMNS))))
            else:
                self._add_piece(name, sent, params.get(COLUMNS))
        self._release(step.inputs, self._bwd_left, self.bgrads, keep=self.plan.bwd.output)
        self.version += 1

    def _full_grad(self, unit: str) -> torch.Tensor:
        # This micro-batch's full gradient of ``unit`` (a weight, or a column block of one),
        # handed to its reduce-scatter.
        return self.full_grads.pop(unit)

    def _add_piece(self, name: str, mine: torch.Tensor, columns: tuple[int, int] | None = None) -> torch.Tensor:
        # ``mine``: this rank's piece of weight ``name``'s gradient, or of its column block
        # ``columns`` (whose place in the piece :func:`block_of` gives).
        if columns is not None:
            if name not in self.grads:
                self.grads[name] = mine.new_zeros(mine.numel() * columns[1])
            block_of(self.grads[name], columns).add_(mine)
        elif name in self.grads:
            self.grads[name] += mine
        else:
            self.grads[name] = mine
        return mine

    # -- helpers -------------------------------------------------------------------------

    def _ctx(self, op: Op, step: "Step", async_op: bool) -> KernelCtx:
        if not step.routed:
            return self._contexts[op.name][async_op]
        return KernelCtx(self.comm, op.axis, self.plan.micro_batch, step.params, self.routing,
                         async_op=async_op)

    def _act(self, name: str) -> torch.Tensor:
        value = self.acts[name]
        if isinstance(value, Pending):
            pending, value = value, value.wait()
            self.acts[name] = value
            self.keeping.arrived(pending, value)
            self.version += 1
        return value

    def storages(self) -> dict[int, int]:
        """The storages (data pointer → bytes) of the activations, saved tensors and
        gradients this run holds. The memory probe asks after every layer for every run in
        flight; most have not changed since, so the walk is redone only after a change."""
        if self._memo[0] != self.version:
            seen: dict[int, int] = {}
            count_storages((self.acts, self.saved, self.bgrads, self.keeping.held()), seen)
            self._memo = (self.version, seen)
        return self._memo[1]

    def _upstream(self, source: str | None, forward: Op) -> torch.Tensor:
        # The gradient of ``forward``'s output as ``source`` holds it (a carrying ring step
        # keeps the ring's state under the attention's name, so the next step finds it the same way).
        if source is None:  # the forward output feeds nothing differentiable
            like = next(iter(self.weights.values()), torch.zeros(()))
            return torch.zeros(forward.shape, dtype=like.dtype, device=like.device)
        return resolve(self.bgrads[source][forward.name])

    def _accumulated(self, own, value: str, producers: tuple[str, ...]):
        # Taken now: a collective's sum is made when it lands, after this op released them.
        parts = [self.bgrads[producer][value] for producer in producers]

        def total(tensor):
            for part in parts:
                tensor = tensor + resolve(part)
            return tensor

        return own.then(total) if isinstance(own, Pending) else total(own)

    def _add_weight_grad(self, op_name: str, kernel, grad: torch.Tensor) -> None:
        # Later micro-batches (and the other chunks of a partitioned op, which share its
        # weight) add into the gradient in place (a GEMM's wgrad as one addmm) instead of
        # materialising their own and adding it.
        saved, (name, staged) = self.saved[op_name], self.plan.units[op_name]
        # A ZeRO-3 weight's full gradient is this micro-batch's only, until its reduce-scatter
        # (a chunk along outputs computes its own columns' block: its unit's gradient).
        grads = self.full_grads if name in self.plan.sharded else self.grads
        if staged is not None:  # its columns of the whole weight's gradient
            forward = self.plan.fwd_ops[op_name]
            part = kernel.wgrad(grad, saved)
            if name not in grads:
                grads[name] = part.new_zeros((*part.shape[:-1], staged[2]))
            grads[name].index_add_(-1, self._staged_columns(forward).to(part.device), part.to(grads[name].dtype))
        elif name not in grads:
            grads[name] = kernel.wgrad(grad, saved)
        elif kernel.wgrad_into is not None and grads[name].dtype == grad.dtype:
            kernel.wgrad_into(grads[name], grad, saved)
        else:
            grads[name] += kernel.wgrad(grad, saved)

    def _release(self, names, left: dict, store: dict, keep: str) -> None:
        for name in names:
            left[name] -= 1
            if left[name] == 0 and name != keep:
                store.pop(name, None)


#: What runs a forward op of each role (:func:`~dhelix.interpreter.ops.handlers.handler`; ring steps run as kernels).
_FORWARD_BY_ROLE = {COMM: LayerRun._forward_comm, GATHER_W: LayerRun._forward_gather,
                    FORWARD: LayerRun._forward_kernel}
#: What runs a backward op of each role; ZeRO-3's re-gathers and reduce-scatters
#: (:data:`_FSDP_ROLES`) handle the gradients' flow themselves.
_BACKWARD_BY_ROLE = {COMM: LayerRun._backward_comm, DGRAD: LayerRun._backward_dgrad, BWD: LayerRun._backward_dgrad,
                     RING: LayerRun._backward_ring, WGRAD: LayerRun._backward_wgrad,
                     GATHER_W: LayerRun._fsdp_backward, SCATTER_DW: LayerRun._fsdp_backward}
_FSDP_ROLES = (GATHER_W, SCATTER_DW)


def _counts(readers: Mapping[str, int]) -> dict[str, int]:
    """A run's own count of ``readers`` (every value an op releases is counted there), a
    plain dict: a run is made per layer and micro-batch, and a Counter's constructor runs
    Python code."""
    return dict(readers)


def _wait_now(pending: Pending) -> None:
    """Wait for ``pending`` at once (a LayerRun's ZeRO-3 reduce-scatter with nowhere to defer it)."""
    pending.wait()


def count_storages(values, seen: dict[int, int]) -> None:
    """Add to ``seen`` the storages of the tensors in ``values`` (nested tuples, lists and
    dicts; anything else, a Pending included, holds nothing countable yet). A walk with a
    stack of containers, each one's items handled in place and the common types tested by
    identity first: it runs after every layer."""
    tensor = torch.Tensor
    stack = [values]
    while stack:
        container = stack.pop()
        for value in container.values() if isinstance(container, dict) else container:
            kind = type(value)
            if kind is tensor:
                storage = value.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            elif kind is tuple or kind is dict or kind is list:
                stack.append(value)
            elif value is None or kind is int or kind is bool or kind is str:  # a kernel's meta
                continue
            elif isinstance(value, tensor):
                storage = value.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            elif isinstance(value, (tuple, list, dict)):
                stack.append(value)


def _by_value(inputs: tuple[str, ...], grads, produces: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The gradients a kernel's ``dgrad`` returned (one per forward input, in ``inputs``
    order) by forward value, for the values in ``produces``; an input read twice gets the sum."""
    out: dict[str, torch.Tensor] = {}
    for name, grad in zip(inputs, grads, strict=True):
        if name not in produces:
            continue
        if grad is None:
            raise ValueError(f"the kernel gave no gradient for {name}, which autodiff says it produces")
        out[name] = out[name] + grad if name in out else grad
    return out
