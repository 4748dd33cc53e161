"""Check the distributed interpreter against the single-process reference model.

Inside an initialised world, :func:`check_steps` runs training steps with the executor and
the optimizer and, before each update, compares on global rank 0 the loss and the gradient
of every parameter — assembled from all ranks' shards and averaged over dp — with
:func:`~.reference.reference_step`-style autograd on the same (possibly already updated)
full weights and the same batch. Weights are gathered before each step, so every step of a
multi-step run is checked, the optimizer's updates included.

The global batch of a step has ``dp · microbatches`` micro-batches; DP replica d runs
micro-batches ``[d·m, (d+1)·m)`` (:func:`replica_batch`).
"""

from __future__ import annotations

import ctypes
import math
import pickle
from typing import Mapping

import attrs
import torch
import torch.distributed as dist

from dhelix.dsl.core.dtypes import MAIN_GRAD_DTYPE
from dhelix.dsl.core.program import Program

from dhelix.interpreter.ops.comm import AXES, Communicator, collective_device
from dhelix.interpreter.ops.standin import standin_world
from .reference import Batch, ReferenceModel, make_batch
from dhelix.interpreter.ops.weights import EMBEDDING, LM_HEAD, WeightPlan


@attrs.frozen
class StepCheck:
    """One checked step: the distributed and reference losses, the largest absolute
    gradient difference over every parameter and which parameter it was."""

    step: int
    loss: float
    reference_loss: float
    grad_diff: float
    worst: str
    params: int
    update_diff: float = 0.0
    #: |global gradient norm − the reference's| (clip_grad_norm_ on the full gradients).
    norm_diff: float = 0.0
    #: The largest reference gradient element (the magnitude its differences are held to).
    grad_scale: float = 0.0
    #: What each difference may be (:func:`tolerances`); None: the step is not judged.
    allowed: "Tolerances | None" = None

    @property
    def loss_diff(self) -> float:
        """Absolute difference of the losses."""
        return abs(self.loss - self.reference_loss)

    def excess(self) -> tuple[float, str, float, float]:
        """(difference / allowed, quantity, difference, allowed) of the quantity that comes
        nearest its tolerance (past it when the ratio is above 1); (0, "", 0, 0) unjudged."""
        if self.allowed is None:
            return 0.0, "", 0.0, 0.0
        found = [(self.loss_diff, "loss", self.allowed.loss), (self.grad_diff, "gradient", self.allowed.grad),
                 (self.update_diff, "update", self.allowed.update), (self.norm_diff, "grad norm", self.allowed.norm)]
        diff, quantity, allowed = max(found, key=lambda item: item[0] / item[2])
        return diff / allowed, quantity, diff, allowed

    def __str__(self) -> str:
        # ``step`` is 0-based; printed from 1, as the run's summary and log count steps.
        return (f"step {self.step + 1}: loss {self.loss:.6f} (reference {self.reference_loss:.6f}, "
                f"diff {self.loss_diff:.2e}); max grad diff {self.grad_diff:.2e} over "
                f"{self.params} parameters (worst {self.worst}); max update diff "
                f"{self.update_diff:.2e}; grad norm diff {self.norm_diff:.2e}")


#: The largest absolute difference that a quantity of magnitude 0 may show, by the model's
#: dtype: fp32 must agree to rounding; the reference computes in fp32, so a bf16 or fp16
#: run differs from it by its own rounding (8 or 11 mantissa bits).
FLOORS = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 5e-2}
#: Machine epsilon of each dtype the interpreter runs.
EPSILON = {"fp32": 2.0 ** -23, "fp16": 2.0 ** -10, "bf16": 2.0 ** -7}


@attrs.frozen(kw_only=True)
class Tolerances:
    """The largest difference from the reference that each quantity of one step may show."""

    loss: float
    grad: float
    update: float
    norm: float


def allowed_difference(dtype: str, magnitude: float, terms: int, floor: str | None = None) -> float:
    """How far a quantity of ``magnitude`` computed in ``dtype`` by a reduction of ``terms``
    terms may lie from the same reduction summed in another order: the dtype's floor plus
    eps·√terms·magnitude (rounding errors of a sum add as a random walk). ``floor``: the
    dtype whose floor applies, when the reduction runs in another dtype than the model's."""
    return FLOORS[floor or dtype] + EPSILON[dtype] * math.sqrt(max(terms, 1)) * abs(magnitude)


def tolerances(dtype: str, *, loss: float, tokens: int, vocab: int, grad_scale: float, weight_scale: float,
               norm: float, elements: int) -> Tolerances:
    """The tolerances of one step of a ``dtype`` model: the loss (a cross entropy over
    ``vocab`` logits, averaged over ``tokens``), every gradient element (a sum over the
    ``tokens``, at most ``grad_scale``), the updated weights (at most ``weight_scale``) and
    the global gradient norm (over ``elements`` fp32 main gradients, of value ``norm``)."""
    return Tolerances(loss=allowed_difference(dtype, loss, tokens * vocab),
                      grad=allowed_difference(dtype, grad_scale, tokens),
                      update=allowed_difference(dtype, weight_scale, 1),
                      norm=allowed_difference(MAIN_GRAD_DTYPE, norm, elements, floor=dtype))


def worst_excess(checks) -> tuple[float, str, float, float, int]:
    """The :meth:`StepCheck.excess` of the step of ``checks`` nearest its tolerance, and that
    step (1-based); (0, "", 0, 0, 0) for none."""
    found = [(*check.excess(), check.step + 1) for check in checks]
    return max(found, default=(0.0, "", 0.0, 0.0, 0))


def replica_batch(batch: Batch, replica: int, microbatches: int) -> Batch:
    """DP replica ``replica``'s micro-batches of a global ``batch``."""
    part = slice(replica * microbatches, (replica + 1) * microbatches)
    return Batch(batch.inputs[part].contiguous(), batch.targets[part].contiguous())


def global_batch(program: Program, seed: int) -> Batch:
    """The seeded global batch of one step: ``dp · microbatches`` micro-batches."""
    return make_batch(program, seed, program.train.microbatches * program.mesh.size("dp"))


def gather_to_first(obj) -> list | None:
    """Every rank's picklable ``obj``, in rank order, on global rank 0 (None elsewhere).
    Collective over the world; ``torch.distributed.gather_object`` without NumPy (which
    the CPU build of torch may lack), on the device the backend needs."""
    gathered = gather_to_all(obj)
    return gathered if dist.get_rank() == 0 or standin_world() else None


def gather_to_all(obj) -> list:
    """Every rank's picklable ``obj``, in rank order, on every rank (collective over the
    world), on the device the backend needs; in a stand-in world (one rank, no peers) its own."""
    if standin_world():
        return [obj]
    device = collective_device()
    data = pickle.dumps(obj)
    world = dist.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(s) for s in sizes)
    buffer = torch.zeros(longest, dtype=torch.uint8)
    buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    # all_gather rather than gather: every backend has it.
    gathered = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, buffer.to(device))
    blobs = [t.cpu() for t in gathered]
    return [pickle.loads(ctypes.string_at(t.data_ptr(), int(n))) for t, n in zip(blobs, sizes, strict=True)]


def broadcast_from_first(obj):
    """Global rank 0's picklable ``obj`` on every rank (collective over the world); in a
    stand-in world (one rank, no peers) ``obj`` itself."""
    if standin_world():
        return obj
    device = collective_device()
    data = pickle.dumps(obj) if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.long, device=device)
    dist.broadcast(size, 0)
    buffer = torch.zeros(int(size), dtype=torch.uint8)
    if data:
        buffer[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buffer = buffer.to(device)
    dist.broadcast(buffer, 0)
    buffer = buffer.cpu()
    return pickle.loads(ctypes.string_at(buffer.data_ptr(), int(size)))


def gather_full(plan: WeightPlan, comm: Communicator, tensors: Mapping[str, torch.Tensor], flat=None, *,
                owned: bool = False):
    """On global rank 0, the full value of every parameter (or gradient) from all ranks'
    shards, keyed by parameter name; None on the other ranks. Collective over the world.
    ``flat`` (the run's :class:`~.fsdp.FlatShards`) says which tensors are ZeRO-3 dp pieces:
    they are gathered over dp first. With ``owned``, every rank gets the full values of its
    own share of the parameters instead (:func:`owned_names`)."""
    if flat is not None:
        tensors = flat.gather(comm, tensors)
    index = {axis: comm.index(axis) for axis in AXES}
    mine = (index, {name: t.detach().cpu() for name, t in tensors.items()})
    if owned:
        return _join(plan, gather_to_all(mine), owned_names(plan, dist.get_rank(), dist.get_world_size()))
    pieces = gather_to_first(mine)
    return None if pieces is None else _join(plan, pieces, plan.names())


def owned_names(plan: WeightPlan, rank: int, world: int) -> list[str]:
    """The parameters that ``rank`` of ``world`` holds in full for a save: the largest first,
    each to the rank with the fewest elements so far (the same answer on every rank)."""
    load, mine = [0] * world, []
    sizes = {name: _numel(plan.spec(name).full) for name in plan.names()}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += sizes[name]
        if owner == rank:
            mine.append(name)
    return mine


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _join(plan: WeightPlan, pieces: list, names) -> dict:
    """The full value of each of ``names`` from every rank's (index, shards) ``pieces``."""
    full = {}
    for name in names:
        spec = plan.spec(name)
        # The first DP replica, or with ep > 1 the first EP block (dp < ep: one rank per
        # expert shard; its dp coordinate is its ep index, so neither may tell shards apart).
        holders = [(idx, values[name]) for idx, values in pieces if name in values and idx["dp"] == idx["ep"]]
        holders.sort(key=lambda item: item[0].get(spec.axis or "tp", 0))
        if not holders:
            raise ValueError(f"no rank holds parameter {name}")
        if spec.axis is None:
            full[name] = holders[0][1]
        else:
            same = [a for a in AXES if a != spec.axis and not (spec.axis == "ep" and a == "dp")]
            split = [t for idx, t in holders if all(idx[a] == holders[0][0][a] for a in same)]
            full[name] = plan.join(name, split)
    return full


def reference_with(program: Program, params: Mapping[str, torch.Tensor], batch: Batch, seed: int,
                   plan: WeightPlan | None = None):
    """The reference loss and gradients of ``batch`` with the full ``params`` (``plan``: the
    run's WeightPlan, whose reference DAGs the model runs; built when None)."""
    model = ReferenceModel(program, seed, plan=plan)
    with torch.no_grad():
        for name, value in params.items():
            model.params[name].copy_(value)
    loss = model(batch)
    loss.backward()
    return loss.detach(), model.grads()


def compare(step: int, loss: float, grads: Mapping[str, torch.Tensor], reference) -> StepCheck:
    """A StepCheck of ``loss`` and ``grads`` against ``reference`` = (loss, grads)."""
    ref_loss, ref_grads = reference
    if set(grads) != set(ref_grads):
        raise ValueError(f"gradients of {sorted(set(ref_grads) ^ set(grads))} are missing on one side")
    diffs = {name: (grads[name] - ref_grads[name]).abs().max().item() for name in ref_grads}
    worst = max(diffs, key=diffs.get)
    scale = max(ref_grads[name].abs().max().item() for name in ref_grads)
    return StepCheck(step, float(loss), float(ref_loss), diffs[worst], worst, len(diffs), grad_scale=scale)


def check_steps(executor, optimizer, steps: int, data=0, lrs=None) -> list[StepCheck]:
    """Run ``steps`` steps of ``executor`` (an :class:`~.executor.Executor`) with
    ``optimizer`` (a :class:`~.optim.DistributedAdamW` over its params), checking each
    against the reference before the update, and the update (clipping included) against
    ``torch.optim.AdamW`` and ``torch.nn.utils.clip_grad_norm_`` applied to the same
    averaged gradients. ``data`` is a seed of random batches or a function step → global
    batch; ``lrs`` the learning rate of each step (default: the optimizer's). Returns the
    checks on global rank 0 and an empty list elsewhere. Collective: every rank of the world
    must call it."""
    program, comm, plan, flat = executor.program, executor.comm, executor.weights, executor.flat
    batch_of = data if callable(data) else (lambda step: global_batch(program, data + step))
    checks, shadow = [], _ShadowAdamW(optimizer.config, plan.tied) if comm.rank == 0 else None
    # A step's update is checked once its weights are read: after the next step has run its
    # forward (the executor never writes its weights, but with ZeRO-1's gathers under the
    # forward they land there), after the last step once every gather has.
    unchecked = None  # (step, loss, reference's params, averaged grads, lr, batch, the run's norm)

    def check(updated) -> None:
        step, loss, params, grads, lr, batch, last_norm = unchecked
        if comm.rank == 0:
            found = compare(step, loss, grads, reference_with(program, params, batch, plan.seed, plan))
            update_diff, norm, weight_scale = shadow.diff(params, grads, updated, lr)
            norm_diff = abs(norm - last_norm) if last_norm is not None else 0.0
            allowed = tolerances(program.model.dtype, loss=found.reference_loss, tokens=batch.targets.numel(),
                                 vocab=program.model.get("vocab"), grad_scale=found.grad_scale,
                                 weight_scale=weight_scale, norm=norm,
                                 elements=sum(grad.numel() for grad in grads.values()))
            checks.append(attrs.evolve(found, update_diff=update_diff, norm_diff=norm_diff, allowed=allowed))

    params = gather_full(plan, comm, executor.params, flat)
    for step in range(steps):
        batch = batch_of(step)
        lr = lrs[step] if lrs is not None else optimizer.config.lr
        loss = executor.step(replica_batch(batch, comm.index("dp"), program.train.microbatches))
        if unchecked is not None:
            params = gather_full(plan, comm, executor.params, flat)  # the weights it ran with
            check(params)
        grads = gather_full(plan, comm, optimizer.averaged_grads(executor.grads()), flat)
        optimizer.step(executor.grads(), lr)
        unchecked = (step, loss.item(), params, grads, lr, batch, optimizer.last_norm)
    optimizer.settle()
    if unchecked is not None:
        check(gather_full(plan, comm, executor.params, flat))
    return checks


class _ShadowAdamW:
    """torch.optim.AdamW on full parameters, fed the distributed run's gathered weights and
    averaged gradients, to check the distributed update."""

    def __init__(self, config, tied: bool = False):
        # A tied LM head is a copy of the embedding: the norm counts it once, as torch's
        # clip_grad_norm_ on the one tied parameter does.
        self.config, self.params, self.optimizer, self.tied = config, None, None, tied

    def diff(self, params, grads, updated, lr: float) -> tuple[float, float, float]:
        """Largest difference between ``updated`` and AdamW with learning rate ``lr`` applied
        to ``params`` with ``grads`` (clipped as the config says), the gradients' norm and
        the largest updated weight.
        The shadow works in fp32 whatever the run's dtype (a bf16 run updates fp32 masters:
        its update differs from this one by the rounding of its weights to bf16)."""
        if self.params is None:
            self.params = {name: value.float().clone().requires_grad_(True) for name, value in params.items()}
            cfg = self.config
            self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=cfg.lr, betas=cfg.betas,
                                               eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=False)
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(params[name])
                param.grad = grads[name].float().clone()
        clip = self.config.clip if self.config.clip is not None else float("inf")
        counted = [p for name, p in self.params.items() if not (self.tied and name == LM_HEAD)]
        norm = float(torch.nn.utils.clip_grad_norm_(counted, clip, foreach=False))
        if self.tied and LM_HEAD in self.params:  # scaled as the embedding was
            self.params[LM_HEAD].grad.copy_(self.params[EMBEDDING].grad.t())
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        diff = max((self.params[name] - updated[name].float()).abs().max().item() for name in updated)
        return diff, norm, max(self.params[name].detach().abs().max().item() for name in updated)
