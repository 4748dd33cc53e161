"""Data-parallel gradient synchronisation and AdamW.

The gradients of a rank's parameters are flattened into one buffer (in sorted name order,
the same on every DP replica since replicas hold the same stages and shards) and averaged
over the ``dp`` axis. The buffers are fp32 and are the gradients themselves: the executor
adds every micro-batch's weight gradient into views of them (:meth:`DistributedAdamW.main_grads`,
Megatron-LM's ``main_grad``), so a rank holds no second copy in the model dtype; ZeRO-2 and
ZeRO-3 pieces, whose gradients are reduced a micro-batch at a time, keep their own:

* plain data parallelism: one all-reduce of the buffer, then every replica runs AdamW on
  all of it;
* ZeRO-1 (Rajbhandari et al., 2020, stage 1): a reduce-scatter leaves each replica the
  average of its 1/dp slice of the buffer; it keeps the AdamW moments of that slice only,
  updates those parameters, and an all-gather gives every replica all parameters again;
* ZeRO-2 (``train { zero = 2 }``, stage 2 as DeepSpeed runs it): the same, but the executor
  hands each layer's gradients over after every micro-batch's backward (``per_microbatch``)
  and drops them; each is reduce-scattered from a buffer of its own, which lands into a
  running sum of the bucket's slices at the next hand-over (in the same order on every
  replica: one full buffer in flight at a time), so what a rank keeps of those gradients is
  its 1/dp slice (:attr:`DistributedAdamW.grad_parts` after :meth:`DistributedAdamW.step`).

Under hybrid sharding the pieces' buckets are summed across the replicas (``dp.replicate``)
by an all-reduce, or, where the program substitutes it (``replicas_sliced``: ``substitute
weights as reduce_scatter + all_gather``), sliced there as ZeRO-1's are.

Before the update the gradients may be clipped to a global norm (``AdamWConfig.clip``, as
``torch.nn.utils.clip_grad_norm_`` on the full model): the norm counts every element of the
full model once, so each rank weighs its squared gradients by one over the number of ranks
that hold the same elements (:func:`norm_weights`: tp-replicated norms are held by every tp
rank, a pipeline stage's weights by its rank only, a ZeRO-1 slice by one replica) and the
weighted sums are added over the world. The learning rate of each update is passed to
:meth:`DistributedAdamW.step` (the training loop reads it from :class:`~.schedule.LRSchedule`,
torch's schedulers). The update itself is torch's AdamW (``torch.optim.adamw.adamw``), its
fused kernel over each bucket's fp32 tensors (benchmarks/optimizer_step.py measures it
against the per-tensor loop it replaced).

Both compute the same numbers; the average over replicas matches the reference model, whose
loss is the mean over all micro-batches of all replicas.

The reduction may run during the backward (``train { grad_reduce = backward }``, the default:
PyTorch DDP's bucketed overlap, Megatron's ``--overlap-grad-reduce``, Centauri's model-level
overlap of the reduce-scatter): the parameters then form one bucket per group of ``groups``
(a layer's weights, a model end's), and the executor hands a layer's gradients to
:meth:`DistributedAdamW.reduce` once the step's last backward of that layer has finished (at
a point of its action list that is the same on every replica, so the buckets are reduced in
the same order everywhere); their all-reduce or reduce-scatter is left in flight and
:meth:`DistributedAdamW.step` waits for it. Those gradients come as this rank's partial sums
over tp and cp (the executor no longer sums them itself, which would block the backward on
a collective): since every reduction here is a sum, the bucket is summed over dp first and
the spans of the partial parameters then over tp and cp, inside this rank's part — replicas
of one dp index hold the same bucket layout. The final norm's and the LM head's bucket is
handed over with the last stage's last layer; under hybrid sharding a layer's pieces, whose
reduce-scatters the executor waits for when the next layer's backward ends, then, for the all-reduce
across the shard groups; the embedding's and everything with ``grad_reduce = step`` are
reduced in :meth:`~DistributedAdamW.step`.

ZeRO-1's all-gather of the updated weights may run under the next step's forward
(``train { param_gather = forward }``, Megatron's ``--overlap-param-gather``, Centauri's
model-level overlap): with the buckets per group of ``groups`` (in the order the next
forward uses them), :meth:`DistributedAdamW.step` leaves each bucket's all-gather in flight, and
:meth:`DistributedAdamW.ready` waits for the buckets holding the parameters a forward is
about to read (the executor calls it before each layer); :meth:`DistributedAdamW.settle`
waits for all, and everything here that reads or writes parameters or states settles first.
The numbers are the same; only when the copies land changes.

With expert parallelism (ep > 1) the grouped-GEMM weights are sharded over ep: ranks of one
dp group with different ep indices hold *different* experts, so those parameters form a
second buffer, summed only over the ``edp`` group (:data:`~.comm.EDP`: the dp / ep replicas
of the same expert shard). Each rank's expert gradient already holds the contributions of
every token its EP group routed to those experts, so that sum covers every DP replica's
tokens once, and dividing it by dp (not dp / ep) gives the same average as the dense
weights. Dense weights (attention, norms, router, the model's ends) stay in the buffer over
``dp``. Each buffer is padded to a multiple of its axis size and, under ZeRO-1, sliced
over that axis.

With ``train { offload = optimizer }`` every bucket's masters and moments live in host
memory (an fp32 master copy for fp32 weights too; with ``offload_percent = P`` those of the
first P % of each part's elements, the rest on the device): its averaged part goes to the
host, AdamW runs there, and the updated weights come back as a device tensor that
:meth:`DistributedAdamW._publish` takes as it takes a device update (:mod:`.offload`); the
numbers are the same.

One module, though over 500 lines, because it is one thing: the data-parallel optimizer step,
from the gradient buckets' reductions to the updated weights (:class:`DistributedAdamW`; its
buckets and the norm's weights are parts of it).
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Collection, Mapping, Sequence

import attrs
import torch
from torch.optim.adamw import adamw

from dhelix.dsl.core.options import option
from dhelix.interpreter.execute.executor import StepHooks
from dhelix.interpreter.ops.comm import EDP, Communicator, Pending, collective_device, reduce_in
from dhelix.interpreter.ops.weights import DTYPES, LM_HEAD
from dhelix.interpreter.training.offload import DeviceTail, HostStaging, host_copy, host_zeros


@attrs.frozen
class AdamWConfig:
    """AdamW hyper-parameters (Loshchilov & Hutter, decoupled weight decay)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    #: The largest global gradient norm (None: no clipping).
    clip: float | None = None
    #: Keep fp32 master weights (Megatron's mixed precision: bf16 parameters are copies of
    #: them); False updates the parameters in their own dtype ("pure" bf16).
    master: bool = True
    #: Post-validation (``train { optimizer_check = post }``): update before the global
    #: norm is known, roll back where it says otherwise (:meth:`DistributedAdamW.step`).
    post: bool = False
    #: The dtype data parallelism reduces the fp32 gradients in (``train { grad_reduce_dtype }``).
    grad_reduce_dtype: str = option("grad_reduce_dtype").default


def norm_weights(plan, comm: Communicator, names, flat=None) -> dict[str, float]:
    """For each of this rank's parameter ``names``, one over the number of ranks in the
    world that hold the same elements (the same shard of the same parameter; under ZeRO-3
    the same dp piece, ``flat`` being the run's :class:`~.fsdp.FlatShards`); collective over
    the world; 0 for a tied LM head (a copy of the embedding, counted there). ``plan`` is
    the run's :class:`~.weights.WeightPlan`."""
    import torch.distributed as dist

    def pieces(name: str) -> int:  # a layer weight is cut in dp (or shard) pieces under ZeRO-3
        return flat.pieces if flat is not None and flat.enabled and name not in plan.model_specs else 1

    def parts(name: str) -> int:
        axis = plan.spec(name).axis
        return comm.size(axis) if axis else 1

    keys = {(name, part, p) for name in plan.names() for part in range(parts(name)) for p in range(pieces(name))}
    index = {key: i for i, key in enumerate(sorted(keys))}
    mine = {name: (name, comm.index(plan.spec(name).axis) if plan.spec(name).axis else 0,
                   flat.index if pieces(name) > 1 else 0) for name in names}
    counts = torch.zeros(len(index), dtype=torch.float64)
    for key in mine.values():
        counts[index[key]] += 1
    if dist.is_available() and dist.is_initialized():
        on_device = counts.to(collective_device())  # NCCL has no CPU collectives
        dist.all_reduce(on_device)
        counts = on_device.cpu()
    copies = {LM_HEAD} if plan.tied else set()
    return {name: 0.0 if name in copies else 1.0 / float(counts[index[key]]) for name, key in mine.items()}


class _Bucket:
    """Parameters synchronised over one axis: their names (sorted, the same on every
    replica), the flat buffer layout padded to a multiple of the axis size, and the AdamW
    moments of this rank's part (all of it, or its 1/size slice under ZeRO-1).

    The buffers a step writes (the gradients, the flat parameters of a ZeRO-1 or master
    update) are allocated once and reused: a step that allocates several model-sized
    buffers pays for fresh pages every time, which on a CPU rank cost more than the update
    itself."""

    def __init__(self, names, params: Mapping[str, torch.Tensor], comm: Communicator, axis: str,
                 zero1: bool, device, summed: bool = False, partial: Mapping[str, tuple[str, ...]] = {},
                 offload: int = 0):
        self.names, self.axis, self.device = sorted(names), axis, device
        self.name_set = frozenset(self.names)
        #: ZeRO-3 pieces: their gradients arrive summed over ``axis`` (each replica holds its
        #: own piece, so nothing is reduced or sliced here).
        self.summed = summed
        zero1 = zero1 and not summed
        #: Whether this rank keeps only its 1/size slice of the buffer (ZeRO-1).
        self.sliced = zero1
        self.shapes = [params[n].shape for n in self.names]
        #: The parameters' dtype (fp32 where they differ): what a ZeRO-1 gather sends.
        dtypes = {params[n].dtype for n in self.names}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self.starts = list(itertools.accumulate((s.numel() for s in self.shapes), initial=0))[:-1]
        self.total = sum(params[n].numel() for n in self.names)
        size = comm.size(axis)
        self.padded = math.ceil(max(self.total, 1) / size) * size
        width = self.padded // size if zero1 else self.padded
        self.offset = comm.index(axis) * width if zero1 else 0
        self.width = width
        #: Offloaded (:mod:`.offload`, ``offload`` the percent of the part's elements): the
        #: host buffers the first :attr:`host_width` elements' gradients land in and their
        #: updated weights leave from; the moments and masters of those elements then live on
        #: the host (:attr:`exp_avg`, :attr:`exp_avg_sq`, :attr:`master`), the others' on the
        #: device (:attr:`tail`).
        self.host_width = width * offload // 100
        self.staging = HostStaging(self.host_width, self.dtype, device) if offload else None
        self.tail = DeviceTail(width - self.host_width, device) if offload and self.host_width < width else None
        if offload:
            self.exp_avg, self.exp_avg_sq = (host_zeros(self.host_width, torch.float32, device) for _ in range(2))
        else:
            self.exp_avg = torch.zeros(width, dtype=torch.float32, device=device)
            self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self._grads: torch.Tensor | None = None
        #: The flat fp32 parameters an update without masters reads when it cannot update
        #: the parameters in place (ZeRO-1 slices, parameters not in fp32); made when needed.
        self.flat_params: torch.Tensor | None = None
        #: This rank's part of the fp32 master weights (None: the parameters are the masters).
        self.master: torch.Tensor | None = None
        #: Per axis a gradient is a partial sum over (tp, cp), the (start, end) of those
        #: parameters' elements inside this rank's part.
        self.partial_spans: dict[str, list[tuple[int, int]]] = {}
        for name, lo, hi in self.part_spans():
            for part_axis in partial.get(name, ()):
                if comm.size(part_axis) > 1:
                    self.partial_spans.setdefault(part_axis, []).append((lo, hi))

    @property
    def grads(self) -> torch.Tensor:
        """The flat fp32 gradients (the padding stays zero), made on first use: ZeRO-2's
        buckets, whose gradients are reduced a micro-batch at a time from buffers of their
        own, never make it."""
        if self._grads is None:
            self._grads = self.zeros()
        return self._grads

    def zeros(self) -> torch.Tensor:
        """A new padded flat fp32 buffer of zeros on the bucket's device."""
        return torch.zeros(self.padded, dtype=torch.float32, device=self.device)

    @property
    def offloaded(self) -> bool:
        """Whether the part's masters and moments live in host memory (:mod:`.offload`)."""
        return self.staging is not None

    def keep_master(self, params: Mapping[str, torch.Tensor]) -> None:
        """Start the fp32 masters of this rank's part from ``params`` (on the host when offloaded)."""
        part = self.flat(params)[self.offset:self.offset + self.width]
        if not self.offloaded:
            self.master = part.clone()
            return
        self.master = host_copy(part[:self.host_width], self.device)
        if self.tail is not None:
            self.tail.master.copy_(part[self.host_width:])

    def state(self, name: str) -> torch.Tensor:
        """This rank's whole part of ``exp_avg``, ``exp_avg_sq`` or ``master`` on the device:
        the bucket's tensor itself, or offloaded, its host and device pieces joined (a copy)."""
        head = getattr(self, name)
        if not self.offloaded:
            return head
        head = head.to(self.device)
        return torch.cat([head, getattr(self.tail, name)]) if self.tail is not None else head

    def set_state(self, name: str, part: torch.Tensor) -> None:
        """Write ``part`` (this rank's whole part of ``exp_avg``, ``exp_avg_sq`` or ``master``)
        into the bucket's tensor, or offloaded, into its host and device pieces."""
        getattr(self, name).copy_(part[:self.host_width] if self.offloaded else part)
        if self.tail is not None:
            getattr(self.tail, name).copy_(part[self.host_width:])

    def fill(self, out: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Copy ``tensors`` of :attr:`names` into the padded fp32 buffer ``out``; returns it
        (a tensor that is already its place in ``out``, a main gradient, stays)."""
        for name, start, shape in zip(self.names, self.starts, self.shapes, strict=True):
            place = out[start:start + shape.numel()].view(shape)
            value = tensors[name]
            if value.data_ptr() != place.data_ptr() or value.dtype != place.dtype:
                place.copy_(value)
        return out

    def flat(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``tensors`` of :attr:`names` as a new padded fp32 buffer."""
        return self.fill(self.zeros(), tensors)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` shaped like the parameters, by name."""
        return {name: flat[start:start + shape.numel()].view(shape)
                for name, start, shape in zip(self.names, self.starts, self.shapes, strict=True)}

    def part_spans(self) -> list[tuple[str, int, int]]:
        """(name, start, end) of each parameter's elements inside this rank's part, relative
        to the part's first element (a parameter may straddle a ZeRO-1 slice boundary)."""
        spans = []
        for name, start, shape in zip(self.names, self.starts, self.shapes, strict=True):
            lo, hi = max(start, self.offset), min(start + shape.numel(), self.offset + self.width)
            if lo < hi:
                spans.append((name, lo - self.offset, hi - self.offset))
        return spans


class DistributedAdamW:
    """AdamW over this rank's ``params`` (name → tensor, updated in place) with the
    gradients averaged over dp by ``comm``; ``zero1`` shards the optimizer state.
    ``pieces`` names ZeRO-3 pieces (:mod:`.fsdp`): their gradients come summed over dp
    (reduce-scattered in the layers) and their states are this rank's alone; under hybrid
    sharding they come summed over the shard group and are all-reduced over
    ``replicated_over`` (``dp.replicate``) here, their states replicated there.

    ``expert`` names the parameters sharded over ep (the grouped GEMMs'; see
    :meth:`~.weights.WeightPlan.ep_sharded`): with ep > 1 they are synchronised over the
    ``edp`` group instead of ``dp`` (module docstring) and must be given — None is refused
    then, so that no caller silently sums the gradients of different experts."""

    def __init__(self, params: Mapping[str, torch.Tensor], comm: Communicator, *, zero1: bool = False,
                 config: AdamWConfig = AdamWConfig(), expert: Collection[str] | None = None,
                 weights: Mapping[str, float] | None = None, pieces: Collection[str] = (),
                 groups: Sequence[Collection[str]] | None = None, gather_forward: bool = False,
                 reduce_backward: bool = False, partial: Mapping[str, tuple[str, ...]] = {},
                 replicated_over: str | None = None, per_microbatch: bool = False, replicas_sliced: bool = False,
                 offload: int = 0):
        self.params, self.comm, self.zero1, self.config = dict(params), comm, zero1, config
        #: The percent of each bucket part whose masters and moments live in host memory
        #: (:mod:`.offload`; 0: none).
        self.offload = offload
        #: The wire dtype of the gradients' reductions over dp (fp32: as accumulated).
        self.reduce_dtype = DTYPES[config.grad_reduce_dtype]
        #: ZeRO-1 gathers left in flight by :meth:`step` (module docstring): (bucket, its
        #: updated part, the pending all-gather), in issue order.
        self.deferred = zero1 and gather_forward and groups is not None and comm.size("dp") > 1
        self._inflight: list[tuple[_Bucket, torch.Tensor, Pending]] = []
        #: Whether :meth:`reduce` takes a layer's gradients during the backward; the
        #: reductions it left in flight and the averaged parts waited for, by bucket index.
        self.early = reduce_backward and groups is not None and comm.size("dp") > 1
        self._reducing: dict[int, list[Pending]] = {}
        #: ZeRO-2: :meth:`reduce` takes a layer's gradients after every micro-batch's backward
        #: (each reduce-scattered on its own, the slices summed), not once per step.
        self.per_microbatch = per_microbatch
        self._landed: dict[int, torch.Tensor] = {}
        #: Whether the executor adds its gradients into :meth:`main_grads`: a bucket's buffer
        #: is then its gradients, averaged in place once a step (kept in ``_landed``).
        self._main = False
        #: ZeRO-2: per bucket, the sum of the slices landed so far this step (each full
        #: buffer freed once its slice is added, at the next :meth:`reduce`), and the averaged parts
        #: of the last step (the gradient state ZeRO-2 keeps: 1/dp of each bucket).
        self._summed: dict[int, torch.Tensor] = {}
        self.grad_parts: list[torch.Tensor] = []
        #: The global gradient norm of the last step (None without ``weights``: see
        #: :func:`norm_weights`; clipping needs them).
        self.last_norm: float | None = None
        if config.clip is not None and weights is None:
            raise ValueError("clipping needs the norm weights of the parameters (weights=norm_weights(…))")
        self.dp = comm.size("dp")
        if comm.size("ep") > 1 and expert is None:
            raise ValueError("with ep > 1 the optimizer must be told which parameters are sharded over "
                             "ep (expert=…): their gradients are summed over edp, not dp")
        # With one expert shard the experts are plain dp replicas: one buffer suffices.
        expert = set(expert or ()) & set(self.params) if comm.size("ep") > 1 else set()
        like = next(iter(self.params.values()), torch.zeros(()))
        pieces = set(pieces) & set(self.params)
        dense = set(self.params) - expert - pieces
        per_group = [set(group) for group in groups or ()] if self.deferred or self.early else []
        rest, rest_expert = dense - set().union(*per_group), expert - set().union(*per_group)

        def bucket(names, axis: str, summed: bool = False) -> _Bucket:
            # Hybrid sharding's pieces are sliced across the replicas only where the program
            # substitutes their all-reduce (replicas_sliced); ZeRO-1's buckets everywhere else.
            sliced = zero1 and not summed and (axis != replicated_over or replicas_sliced)
            return _Bucket(names, self.params, comm, axis, sliced,
                           like.device, summed=summed, partial=partial, offload=offload)

        self.buckets = [bucket(group & dense, "dp") for group in per_group if group & dense]
        if rest or not self.buckets:
            self.buckets.append(bucket(rest, "dp"))
        self.buckets += [bucket(group & expert, EDP) for group in per_group if group & expert]
        if rest_expert:
            self.buckets.append(bucket(rest_expert, EDP))
        if pieces and replicated_over:  # hybrid sharding: summed over the shard group only
            self.buckets += [bucket(group & pieces, replicated_over) for group in per_group if group & pieces]
            if pieces - set().union(*per_group):
                self.buckets.append(bucket(pieces - set().union(*per_group), replicated_over))
        elif pieces:
            self.buckets.append(bucket(pieces, "dp", summed=True))
        if config.master or offload:  # fp32 parameters are their own masters on the device: no copy of them
            for bucket in self.buckets:
                if offload or any(self.params[name].dtype != torch.float32 for name in bucket.names):
                    bucket.keep_master(self.params)
        #: Per bucket, (weight, start, end) of each parameter inside this rank's part, the
        #: weight being one over the ranks that hold those elements (None: no norm).
        self.norm_weights = None
        if weights is not None:
            # Under ZeRO-1 each replica of the bucket's axis holds its own slice.
            self.norm_weights = [[(weights[name] * (comm.size(bucket.axis) if bucket.sliced else 1), lo, hi)
                                  for name, lo, hi in bucket.part_spans()] for bucket in self.buckets]
        self.steps = 0
        #: Post-validation: (step, "clipped" or "skipped") of every update this rank rolled
        #: back (1-based optimizer steps), and the copies a rollback restores, by bucket.
        self.rollbacks: list[tuple[int, str]] = []
        self._copies: dict[int, list[torch.Tensor]] = {}

    def reduce(self, grads: Mapping[str, torch.Tensor]) -> set[str]:
        """Start reducing, in flight, the buckets all of whose parameters are in ``grads`` (a
        layer's final gradients of the step, partial sums over tp and cp as its backward left
        them; the executor calls this at the same point of its action list on every
        replica). Returns the names taken: their gradients are this optimizer's to sum over
        tp and cp (:meth:`step` does it); nothing without ``reduce_backward``."""
        taken: set[str] = set()
        if not self.early:
            return taken
        if self.per_microbatch:
            # ZeRO-2: the reductions issued before (a layer's backward ago) land into their
            # slices now, so one full flat buffer at a time is in flight, not one per layer.
            for index in [index for index, pending in self._reducing.items() if pending]:
                self._fold(index)
        for index, bucket in enumerate(self.buckets):
            # ZeRO-3 pieces come summed over dp by their layers' reduce-scatters (the executor
            # hands hybrid sharding's over once those have landed, for the all-reduce across).
            if bucket.summed or not bucket.names or not bucket.name_set <= grads.keys() \
                    or (index in self._reducing and not self.per_microbatch):
                continue
            if index not in self._reducing:
                self._landed.pop(index, None)  # a previous step's, had it not been used
            # ZeRO-2 leaves one layer's reduction in flight while the next fills: a buffer each.
            flat = bucket.fill(bucket.zeros() if self.per_microbatch else bucket.grads, grads)
            self._reducing.setdefault(index, []).append(
                reduce_in(self.reduce_dtype, self.comm, flat, bucket.axis, bucket.sliced, async_op=True))
            taken |= bucket.name_set
        return taken

    def _averaged(self, index: int, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        # Bucket ``index``'s averaged part: the reduction :meth:`reduce` left in flight (then
        # kept until :meth:`step` has used it), or one run now from ``grads``.
        if index in self._landed:
            return self._landed[index]
        bucket = self.buckets[index]
        if index not in self._reducing:
            flat = self._average(bucket, grads)
            if self._main:  # its buffer holds the gradients: averaged in place, once a step
                self._landed[index] = flat
            return flat
        self._fold(index)
        self._reducing.pop(index)
        flat = self._summed.pop(index)
        for axis, spans in bucket.partial_spans.items():  # sums commute: dp first, then these
            joined = torch.cat([flat[lo:hi] for lo, hi in spans])
            self.comm.all_reduce(joined, axis)
            at = 0
            for lo, hi in spans:
                flat[lo:hi].copy_(joined[at:at + hi - lo])
                at += hi - lo
        self._landed[index] = flat.div_(self.dp)
        return flat

    def _fold(self, index: int) -> None:
        # Wait for bucket ``index``'s reductions in flight and add their results to its sum
        # (ZeRO-2: the micro-batches' slices, in the same order on every rank), which drops
        # the full buffers they were reduced from.
        for pending in self._reducing[index]:
            landed = pending.wait()
            summed = self._summed.get(index)
            self._summed[index] = landed if summed is None else summed.add_(landed)
        self._reducing[index] = []

    def _average(self, bucket: _Bucket, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        # A sum over the bucket's axis divided by dp, for edp too (module docstring). The
        # result is this rank's part: the bucket's gradient buffer, or a new ZeRO-1 slice.
        flat = bucket.fill(bucket.grads, grads)
        if bucket.sliced or not bucket.summed:
            flat = reduce_in(self.reduce_dtype, self.comm, flat, bucket.axis, bucket.sliced)
        return flat.div_(self.dp)

    def averaged_grads(self, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every parameter's gradient averaged over dp (ZeRO-1 gathers the slices: for checks);
        copies, which the next step does not overwrite."""
        self.settle()
        out = {}
        for index, bucket in enumerate(self.buckets):
            flat = self._averaged(index, grads)
            if bucket.sliced:
                flat = self.comm.all_gather(flat, bucket.axis)
            out.update({name: value.clone() for name, value in bucket.unflatten(flat).items()})
        return out

    def global_norm(self, averaged: list[torch.Tensor]) -> float:
        """The norm of the full model's averaged gradient from this rank's ``averaged``
        bucket parts (collective over the world): the weighted sum of the squared fp32 norm
        of each parameter's part, as ``clip_grad_norm_`` takes a norm per tensor."""
        import torch.distributed as dist

        total = self._norm_squares(averaged)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
        return math.sqrt(float(total))

    def _norm_squares(self, averaged: list[torch.Tensor]) -> torch.Tensor:
        # This rank's share of the squared global norm: one fp32 norm per parameter part,
        # weighed and summed in fp64 on the device (no host round trip per parameter on CUDA).
        assert self.norm_weights is not None, "norm weights"
        norms, weights = [], []
        for spans, grad in zip(self.norm_weights, averaged, strict=True):
            for weight, lo, hi in spans:
                norms.append(torch.linalg.vector_norm(grad[lo:hi]))
                weights.append(weight)
        device = averaged[0].device
        total = torch.zeros((), dtype=torch.float64, device=device)
        if norms:
            squares = torch.stack(norms).double() ** 2
            total = (torch.tensor(weights, dtype=torch.float64, device=device) * squares).sum()
        return total

    def _coefficient(self, norm: float) -> float:
        # torch.nn.utils.clip_grad_norm_'s coefficient, so the reference agrees (1.0: unclipped).
        return 1.0 if self.config.clip is None else min(1.0, self.config.clip / (norm + 1e-6))

    def step(self, grads: Mapping[str, torch.Tensor], lr: float | None = None,
             accept: Callable[[float | None], bool] | None = None) -> bool:
        """Average ``grads`` (dense over dp, experts over edp), clip them to the global norm
        ``config.clip`` and apply one AdamW update with learning rate ``lr`` (default
        ``config.lr``) to :attr:`params`; the norm before clipping is :attr:`last_norm`.
        ``accept(norm)`` False (the same on every rank: the norm is global) leaves the
        parameters and the moments as they were. Returns whether the update was applied.

        With ``config.post`` (post-validation, Qi et al., ICLR'24 §4) the update does not wait
        for the norm's all-reduce: it runs unclipped while the norm is reduced, where this
        rank's own share of the norm (a lower bound of it) neither clips nor is non-finite,
        and is rolled back — the moments, masters and parameters it wrote restored from
        copies taken before it — then redone clipped, or left undone, where the global norm
        says so (:attr:`rollbacks`); a rank whose share already clips or is not finite waits
        as the synchronous step does, and so does a world of one rank (nothing to hide).
        Nothing reaches another rank (ZeRO-1's weight gathers)
        before the norm has been checked, so the numbers are the synchronous step's, bit for
        bit."""
        self.settle()
        self.steps += 1
        lr = self.config.lr if lr is None else lr
        early = set(self._reducing) | set(self._landed)
        averaged = [self._averaged(index, grads) for index in range(len(self.buckets))]
        self._landed = {}
        if self.per_microbatch:  # kept until the next step's: ZeRO-2's sharded gradients
            self.grad_parts = [averaged[index] for index in sorted(early) if self.buckets[index].sliced]
        if self.config.post and self.norm_weights is not None and _world_size() > 1:
            return self._post_validated(averaged, lr, accept)
        if self.norm_weights is not None:
            self.last_norm = self.global_norm(averaged)
        if accept is not None and not accept(self.last_norm):
            self.steps -= 1
            return False
        if self.norm_weights is not None and self.config.clip is not None:
            scale = self._coefficient(self.last_norm)  # type: ignore[arg-type]
            for grad in averaged:
                grad.mul_(scale)
        self._update(averaged, lr, publish=True)
        return True

    def _post_validated(self, averaged: list[torch.Tensor], lr: float,
                        accept: Callable[[float | None], bool] | None) -> bool:
        # The step of config.post (see step): the norm's all-reduce in flight under the update.
        total = self._norm_squares(averaged)
        reduced = total.clone()
        pending = _all_reduce(reduced)
        share = float(total)  # read while the reduction runs
        hopeful = math.isfinite(share) and self._coefficient(math.sqrt(share)) == 1.0
        parts = None
        if hopeful:
            self._keep_copies()
            parts = self._update(averaged, lr, publish=False)
        if pending is not None:
            pending.wait()
        self.last_norm = norm = math.sqrt(float(reduced))
        if accept is not None and not accept(norm):
            if parts is not None:
                self._restore_copies()
                self.rollbacks.append((self.steps, "skipped"))
            self.steps -= 1
            return False
        scale = self._coefficient(norm)
        if parts is not None and scale != 1.0:
            self._restore_copies()
            self.rollbacks.append((self.steps, "clipped"))
            parts = None
        if parts is None:
            if scale != 1.0:  # (× 1.0 is exact: the synchronous step's numbers either way)
                for grad in averaged:
                    grad.mul_(scale)
            self._update(averaged, lr, publish=True)
            return True
        for bucket, mine in parts:  # the update stands: now the other ranks may have it
            self._publish(bucket, mine)
        return True

    def _update(self, averaged: list[torch.Tensor], lr: float, publish: bool) -> list[tuple[_Bucket, torch.Tensor]]:
        # One AdamW update of every bucket's part from its averaged (clipped) gradients, each
        # published to the parameters as soon as it is updated (``publish``: a ZeRO-1 gather
        # left in flight runs under the next buckets' updates), else returned as (bucket,
        # updated part) to publish later (fp32 parameters without masters, not sliced, are
        # updated where they are: nothing to publish).
        parts = []
        for bucket, grad in zip(self.buckets, averaged, strict=True):
            if bucket.offloaded:
                mine = self._update_on_host(bucket, grad, lr)
                if publish:
                    self._publish(bucket, mine)
                else:
                    parts.append((bucket, mine))
                continue
            if self._in_place(bucket):
                views = bucket.unflatten
                self._adamw([self.params[n] for n in bucket.names], list(views(grad).values()),
                            list(views(bucket.exp_avg).values()), list(views(bucket.exp_avg_sq).values()), lr)
                continue
            if bucket.master is not None:
                mine = bucket.master
            else:
                if bucket.flat_params is None:
                    bucket.flat_params = bucket.zeros()
                mine = bucket.fill(bucket.flat_params, self.params)[bucket.offset:bucket.offset + grad.numel()]
            self._adamw([mine], [grad], [bucket.exp_avg], [bucket.exp_avg_sq], lr)
            if publish:
                self._publish(bucket, mine)
            else:
                parts.append((bucket, mine))
        return parts

    def _update_on_host(self, bucket: _Bucket, grad: torch.Tensor, lr: float) -> torch.Tensor:
        # An offloaded bucket's update (:mod:`.offload`): its averaged part's host elements to
        # the host, the device's elements (offload_percent < 100) updated on the device
        # meanwhile, AdamW on the host's masters and moments, the updated weights back as a
        # new device tensor in the parameters' dtype (the two pieces joined), for _publish.
        staging, tail, host = bucket.staging, bucket.tail, bucket.host_width
        assert staging is not None and bucket.master is not None, "an offloaded bucket"
        if not self.config.master:  # no masters kept: the step starts from the weights, as on the device
            bucket.set_state("master", bucket.flat(self.params)[bucket.offset:bucket.offset + bucket.width])
        staging.take(grad[:host])
        if tail is not None:
            self._adamw([tail.master], [grad[host:]], [tail.exp_avg], [tail.exp_avg_sq], lr)
        if host:
            self._adamw([bucket.master], [staging.landed()], [bucket.exp_avg], [bucket.exp_avg_sq], lr)
        mine = staging.give(bucket.master)
        return mine if tail is None else torch.cat([mine, tail.master.to(bucket.dtype)])

    def _in_place(self, bucket: _Bucket) -> bool:
        # fp32 parameters are their own masters: updated where they are.
        return bucket.master is None and not bucket.sliced and all(
            self.params[n].dtype == torch.float32 for n in bucket.names)

    def _kept(self, bucket: _Bucket) -> list[torch.Tensor]:
        # What an update writes that outlives it: the moments, and the masters or the
        # parameters updated in place (a part made from the parameters is made again).
        return [bucket.exp_avg, bucket.exp_avg_sq] + ([bucket.master] if bucket.master is not None else []) \
            + (bucket.tail.tensors() if bucket.tail is not None else [])

    def _keep_copies(self) -> None:
        # Post-validation's copies of what the update writes, taken before it (one set per
        # bucket, made once and reused: scratch_tensors counts them).
        for index, bucket in enumerate(self.buckets):
            kept = self._kept(bucket)
            copies = self._copies.get(index)
            if copies is None:
                copies = self._copies[index] = [t.clone() for t in kept]
                if self._in_place(bucket):
                    copies.append(bucket.flat(self.params))
                continue
            for copy, tensor in zip(copies, kept):
                copy.copy_(tensor)
            if self._in_place(bucket):
                bucket.fill(copies[-1], self.params)

    def _restore_copies(self) -> None:
        # The rollback: every bucket as _keep_copies found it.
        for index, bucket in enumerate(self.buckets):
            copies = self._copies[index]
            for copy, tensor in zip(copies, self._kept(bucket)):
                tensor.copy_(copy)
            if self._in_place(bucket):
                for name, value in bucket.unflatten(copies[-1]).items():
                    self.params[name].copy_(value)

    def _publish(self, bucket: _Bucket, mine: torch.Tensor) -> None:
        # Every replica's parameters from the updated part. A ZeRO-1 gather sends them in
        # their own dtype, as Megatron-LM's distributed optimizer does (bf16 weights: half the
        # bytes of the fp32 masters, and what the simulator prices); rounding before the
        # gather gives the same weights as rounding after it.
        if bucket.sliced:
            mine = mine.to(bucket.dtype)
        if bucket.sliced and self.deferred:
            mine = mine.contiguous()  # nothing writes it before the next step settles
            self._inflight.append((bucket, mine, self.comm.all_gather(mine, bucket.axis, async_op=True)))
            return
        flat = self.comm.all_gather(mine.contiguous(), bucket.axis) if bucket.sliced else mine
        self._land(bucket, flat)

    def _land(self, bucket: _Bucket, flat: torch.Tensor) -> None:
        for name, value in bucket.unflatten(flat).items():
            self.params[name].copy_(value)

    def ready(self, names: Collection[str]) -> None:
        """Wait for the in-flight weight gathers of the buckets holding any of ``names`` and
        copy them into the parameters (nothing to do unless ``param_gather = forward``)."""
        if not self._inflight:
            return
        wanted, left = frozenset(names), []
        for bucket, mine, pending in self._inflight:
            if bucket.name_set & wanted:
                self._land(bucket, pending.wait())
            else:
                left.append((bucket, mine, pending))
        self._inflight = left

    def hooks(self) -> StepHooks:
        """The executor's hooks into this optimizer: :meth:`ready` before a forward reads
        parameters when ZeRO-1's gathers run under it (:attr:`deferred`), :meth:`reduce`
        with each layer's final gradients when they are reduced under the backward
        (:attr:`early`), :meth:`main_grads` at the start of a step whose gradients it takes."""
        return StepHooks(param_ready=self.ready if self.deferred else None,
                         grad_ready=self.reduce if self.early else None, main_grads=self.main_grads)

    def main_grads(self) -> dict[str, torch.Tensor]:
        """Zeroed fp32 gradients of the parameters, by name, each a view of its place in its
        bucket's flat buffer (Megatron-LM's ``main_grad``): the backward adds every
        micro-batch's weight gradient into them, so no gradient is held twice (in the model
        dtype and again flat in fp32) and the sum over micro-batches is kept in fp32 whatever
        the model dtype. Not for ZeRO-3 pieces (their layers reduce-scatter each
        micro-batch's gradient, :mod:`.fsdp`) nor ZeRO-2 (it drops each micro-batch's
        gradients once handed over): those keep their own."""
        if self.per_microbatch:
            return {}
        self._main = True
        out: dict[str, torch.Tensor] = {}
        for index, bucket in enumerate(self.buckets):
            if bucket.summed or not bucket.names:
                continue
            self._landed.pop(index, None)
            bucket.grads.zero_()
            out.update(bucket.unflatten(bucket.grads))
        return out

    def settle(self) -> None:
        """Wait for every in-flight weight gather (before the parameters are read elsewhere)."""
        for bucket, _, pending in self._inflight:
            self._land(bucket, pending.wait())
        self._inflight = []

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors the optimizer keeps between steps: this rank's AdamW moments and fp32
        masters (what the simulator's model states count as the optimizer's; a flat
        gradient buffer is the gradients where the executor adds into :meth:`main_grads`,
        else scratch, see :meth:`scratch_tensors`)."""
        return [t for b in self.buckets for t in ((b.exp_avg, b.exp_avg_sq, b.master) if not b.offloaded else
                                                  b.tail.tensors() if b.tail is not None else ()) if t is not None]

    def host_tensors(self) -> list[torch.Tensor]:
        """Offloaded (:mod:`.offload`): what the optimizer keeps in host memory — the moments
        and fp32 masters of this rank's parts and the staging buffers of their copies (what
        the simulator's ``ModelStates.host`` counts); [] otherwise."""
        return [t for b in self.buckets if b.staging is not None
                for t in [b.exp_avg, b.exp_avg_sq, b.master, *b.staging.tensors()] if t is not None]

    def scratch_tensors(self) -> list[torch.Tensor]:
        """The optimizer's work buffers: the padded flat fp32 gradients of the buckets whose
        gradients the executor keeps apart (ZeRO-2, ZeRO-3 pieces: not :meth:`main_grads`)
        and the flat fp32 parameters (made when needed)."""
        main = self._main and not self.per_microbatch
        return [t for b in self.buckets for t in (None if main and not b.summed and b.names else b._grads,
                                                  b.flat_params) if t is not None] + \
            [t for copies in self._copies.values() for t in copies]

    def moments(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """This rank's AdamW moments (exp_avg, exp_avg_sq) of each of its parameters, shaped
        like them (ZeRO-1 gathers the slices over the bucket's axis: collective)."""
        self.settle()
        out: dict = {}
        for bucket in self.buckets:
            # (offloaded: on the device, as the collectives here and the checkpoint's take them)
            pair = [m if not bucket.sliced else self.comm.all_gather(m.contiguous(), bucket.axis)
                    for m in (bucket.state("exp_avg"), bucket.state("exp_avg_sq"))]
            first, second = (bucket.unflatten(m) for m in pair)
            out.update({name: (first[name].clone(), second[name].clone()) for name in bucket.names})
        return out

    def masters(self) -> dict[str, torch.Tensor]:
        """The fp32 value of each of this rank's parameters: its master weight, or the
        parameter itself without masters (ZeRO-1 gathers the slices: collective)."""
        self.settle()
        out = {}
        for bucket in self.buckets:
            if bucket.master is None:
                out.update({name: self.params[name].float() for name in bucket.names})
                continue
            master = bucket.state("master")  # (offloaded: from the host)
            flat = self.comm.all_gather(master.contiguous(), bucket.axis) if bucket.sliced else master
            out.update({name: value.clone() for name, value in bucket.unflatten(flat).items()})
        return out

    def load_state(self, masters: Mapping[str, torch.Tensor],
                   moments: Mapping[str, tuple[torch.Tensor, torch.Tensor]], steps: int) -> None:
        """Set every parameter and its master from fp32 ``masters``, the moments and the step
        count (each tensor shaped like this rank's shard, as :meth:`masters` and
        :meth:`moments` return them on any layout)."""
        self.settle()
        for bucket in self.buckets:
            for name in bucket.names:
                self.params[name].copy_(masters[name])
            if bucket.master is not None:
                bucket.keep_master(masters)
            for slot, moment in enumerate(("exp_avg", "exp_avg_sq")):
                flat = bucket.flat({name: moments[name][slot] for name in bucket.names})
                bucket.set_state(moment, flat[bucket.offset:bucket.offset + bucket.width])
        self.steps = steps

    def _adamw(self, params, grads, exp_avgs, exp_avg_sqs, lr: float) -> None:
        """One AdamW update of ``params`` in place (the parameters or this rank's flat fp32
        part, with their gradients and moments: views of the bucket's buffers) by torch's own
        AdamW, the function ``torch.optim.AdamW`` runs: its fused kernel (every tensor here is
        fp32 on one device), else its multi-tensor (foreach) one where no fused kernel exists
        for the device."""
        cfg = self.config
        device = params[0].device
        # torch counts this step itself: its step tensors start from the steps before it.
        steps = list(torch.full((len(params),), float(self.steps - 1), device=device).unbind(0))
        kernel = {"fused": True} if device.type in _FUSED_DEVICES else {"foreach": True}
        adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, beta1=cfg.betas[0],
              beta2=cfg.betas[1], lr=lr, weight_decay=cfg.weight_decay, eps=cfg.eps, maximize=False, **kernel)


def _world_size() -> int:
    """Ranks in the world (1 outside one): post-validation has nothing to hide on one."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_reduce(total: torch.Tensor):
    """Sum ``total`` over the world in place, in flight: its work handle (``wait()``), or
    None without a world to sum over."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.all_reduce(total, async_op=True)


#: Devices torch has a fused AdamW kernel for.
_FUSED_DEVICES = ("cpu", "cuda")


def for_executor(executor, *, zero1: bool = False, config: AdamWConfig = AdamWConfig(),
                 norms: bool = True) -> DistributedAdamW:
    """The optimizer of ``executor``'s parameters (an :class:`~.executor.Executor`), its
    buckets and hooks as the program's train block says: the gradients reduced during the
    backward (``grad_reduce = backward``: :meth:`DistributedAdamW.reduce` becomes the
    executor's ``grad_ready``), ZeRO-1's gathers under the next forward (``param_gather =
    forward`` with ``zero1``: :meth:`DistributedAdamW.ready` its ``param_ready``), the states
    in host memory with ``offload = optimizer`` (:mod:`.offload`). The
    executor takes those hooks when it builds the optimizer itself: pass
    ``functools.partial(for_executor, …)`` as its ``optimizer`` argument. ``norms``
    computes the norm weights (collective over the world; clipping needs them)."""
    train = executor.program.train
    gather = zero1 and train.param_gather == "forward"
    reduce = train.grad_reduce == "backward"
    per_microbatch = train.zero == 2 and zero1
    comm = executor.comm
    optimizer = DistributedAdamW(
        executor.params, comm, zero1=zero1, config=config, expert=executor.weights.ep_sharded(executor.params),
        weights=norm_weights(executor.weights, comm, executor.params, executor.flat) if norms else None,
        pieces=executor.flat.shapes, replicated_over=executor.flat.replicated_over,
        groups=executor.param_groups() if gather or reduce else None, gather_forward=gather,
        reduce_backward=reduce, partial=executor.partial_sums(), per_microbatch=per_microbatch,
        replicas_sliced=executor.facts.replicas_sliced, offload=train.offload_share)
    return optimizer
