"""Communicators: the collectives a layer and the pipeline need, over mesh axes.

A communicator knows this rank's place in the mesh and offers, per axis (``tp``, ``cp``,
``dp``, ``pp``, ``ep``):

* ``all_gather`` and ``reduce_scatter`` along dim 0, the token dimension (Megatron's
  sequence parallelism): rank i of the group holds rows ``[i*n, (i+1)*n)`` of the gathered
  tensor;
* ``all_reduce`` (sum or max), ``all_to_all`` with optional split sizes;
* point-to-point ``send``/``recv`` between global ranks.

Every collective takes ``async_op``: False returns the result tensor, True returns a
:class:`Pending` whose ``wait()`` returns it — so an executor can issue a collective,
compute something else and collect the result when a consumer needs it. A group of size 1
is the identity on every implementation, so a single process runs any DAG with
:class:`SingleRankComm`. Which rank blocks a group-partitioned collective's stages move is
:mod:`.blocks`.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from dhelix.dsl.core.mesh import DIMENSIONS, Mesh

#: Every mesh axis, in the order a measured profile lists them (the dimensions, then ep).
AXES = DIMENSIONS + ("ep",)
#: The expert-data-parallel axis: the dp / ep replicas of one expert shard (same ep index,
#: one per EP block), over which sharded expert weights' gradients are summed.
EDP = "edp"


def expert_dp_groups(mesh: Mesh) -> list[tuple[int, ...]]:
    """The groups of the :data:`EDP` axis: each dp group split by ep index, i.e. the dp
    coordinates ``e, e + ep, e + 2·ep, …`` (EP groups are blocks of consecutive ones)."""
    return sorted(group[e::mesh.ep] for group in mesh.groups("dp") for e in range(mesh.ep))


def collective_device() -> torch.device:
    """Where the default process group takes its tensors: this rank's current GPU under
    NCCL (which has no CPU collectives), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Newer torch renamed the tensor collectives; keep working on the older names too.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


#: An empty context, entered as often as wanted (what :meth:`Communicator.op_named` gives
#: where nothing reads the name).
UNNAMED = contextlib.nullcontext()


class Pending:
    """An issued asynchronous operation; :meth:`wait` blocks once and returns its result.

    ``finish`` post-processes the raw result after the wait (a slice, a sum with other
    gradient contributions); it runs once.
    """

    def __init__(self, work, result: torch.Tensor, finish: Callable | None = None):
        self._work, self._result, self._finish = work, result, finish
        self._done = False

    @classmethod
    def ready(cls, result: torch.Tensor) -> "Pending":
        """A Pending that is already complete (what a size-1 group returns)."""
        return cls(None, result)

    def then(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Pending":
        """A Pending whose result is ``fn`` of this one's, applied after the wait."""
        return Pending(self, None, lambda _: fn(self.wait()))

    def done(self) -> bool:
        """Whether :meth:`wait` would return without blocking on the operation."""
        if self._done or self._work is None:
            return True
        if isinstance(self._work, Pending):
            return self._work.done()
        completed = getattr(self._work, "is_completed", None)
        return completed() if completed is not None else True  # unknown: the wait will tell

    def wait(self) -> torch.Tensor:
        """Wait for the operation (idempotent) and return its result."""
        if not self._done:
            if self._work is not None:
                self._work.wait()
            if self._finish is not None:
                self._result = self._finish(self._result)
            self._done = True
        return self._result


def resolve(value):
    """``value`` itself, or its result if it is a :class:`Pending`."""
    return value.wait() if isinstance(value, Pending) else value


class Communicator:
    """The interface; subclasses implement the ``_``-prefixed primitives.

    ``rank`` is the global rank and ``mesh`` the program's mesh (None for the single-rank
    communicator, where every axis has size 1). ``names_ops``: whether :meth:`op_named`
    does anything (callers skip it otherwise).
    """

    rank: int = 0
    mesh: Mesh | None = None
    names_ops: bool = False

    def op_named(self, name: str):
        """Within the block, the collectives issued are the program's op ``name`` (``rs1``):
        a recording communicator names its events so; the others ignore it (one reusable
        empty context: every collective of a layer enters it)."""
        return UNNAMED

    def _found(self) -> tuple[dict[str, int], dict[str, int]]:
        # Sizes and indices by axis, found once each (every collective asks), for the mesh
        # and rank as they are now (a test may set them after construction).
        cached = self.__dict__.get("_found_for")
        if cached is None or cached[0] is not self.mesh or cached[1] != self.rank:
            cached = self.__dict__["_found_for"] = (self.mesh, self.rank, {}, {})
        return cached[2], cached[3]

    def size(self, axis: str) -> int:
        """Number of ranks in this rank's group of ``axis``."""
        cached = self.__dict__.get("_found_for")  # the common case without a call
        if cached is not None and cached[0] is self.mesh and cached[1] == self.rank:
            found = cached[2].get(axis)
            if found is not None:
                return found
        sizes = self._found()[0]
        found = sizes.get(axis)
        if found is None:
            if self.mesh is None:
                found = 1
            else:
                found = self.mesh.size("dp") // self.mesh.ep if axis == EDP else self.mesh.size(axis)
            sizes[axis] = found
        return found

    def index(self, axis: str) -> int:
        """This rank's position inside its group of ``axis`` (0 … size-1)."""
        indices = self._found()[1]
        found = indices.get(axis)
        if found is None:
            if self.mesh is None:
                found = 0
            elif axis == "ep":  # EP groups are blocks of consecutive DP coordinates (see dsl.core.mesh)
                found = self.mesh.coords(self.rank).get("dp", 0) % self.mesh.ep
            elif axis == EDP:
                found = self.mesh.coords(self.rank).get("dp", 0) // self.mesh.ep
            else:
                found = self.mesh.position(self.rank, axis)
            indices[axis] = found
        return found

    def peer(self, axis: str, offset: int) -> int:
        """The global rank ``offset`` steps along ``axis`` from this one, cyclically."""
        if self.mesh is None:
            return self.rank
        group = self.group_ranks(axis)
        return group[(self.index(axis) + offset) % len(group)]

    def group_ranks(self, axis: str) -> tuple[int, ...]:
        """The global ranks of this rank's group of ``axis``, in axis order."""
        if self.mesh is None:
            return (self.rank,)
        groups = expert_dp_groups(self.mesh) if axis == EDP else self.mesh.groups(axis)
        return next(g for g in groups if self.rank in g)

    #: Whether every collective is complete when its issue returns (a stand-in's inline
    #: lanes): a caller need not ask a Pending whether it has landed.
    completes_at_issue: bool = False

    def issuer(self, kind: str, axis: str, async_op: bool, bare: bool = False) -> Callable[[torch.Tensor], Any]:
        """Collective ``kind`` (``all_gather``, ``reduce_scatter`` or ``all_reduce``, a sum)
        over ``axis`` bound once, for a hot path that issues it on every micro-batch: a
        function of the input alone, as the method with these arguments, its group's size
        looked up here and not on every call. ``bare``: an asynchronous one complete at its
        issue may give its result itself instead of a Pending (its caller takes either, as
        :func:`resolve` does)."""
        if self.size(axis) == 1:
            return _same if bare or not async_op else Pending.ready
        if kind == "all_reduce":
            primitive = self._all_reduce
            return lambda x: primitive(x, axis, "sum", async_op)
        primitive = {"all_gather": self._all_gather, "reduce_scatter": self._reduce_scatter}[kind]
        return lambda x: primitive(x.contiguous(), axis, async_op)

    # -- collectives: identity on a size-1 group, else the subclass primitive --------------

    def all_gather(self, x: torch.Tensor, axis: str, async_op: bool = False):
        """Concatenate every group member's ``x`` along dim 0, in axis order."""
        if self.size(axis) == 1:
            return _done(x, async_op)
        return self._all_gather(x.contiguous(), axis, async_op)

    def reduce_scatter(self, x: torch.Tensor, axis: str, async_op: bool = False):
        """Sum ``x`` over the group and keep this rank's block of dim 0."""
        if self.size(axis) == 1:
            return _done(x, async_op)
        return self._reduce_scatter(x.contiguous(), axis, async_op)

    def all_reduce(self, x: torch.Tensor, axis: str, op: str = "sum", async_op: bool = False):
        """Reduce ``x`` (``sum`` or ``max``) over the group, in place; returns ``x``."""
        if self.size(axis) == 1:
            return _done(x, async_op)
        return self._all_reduce(x, axis, op, async_op)

    def reduce(self, x: torch.Tensor, axis: str, root: int, async_op: bool = False):
        """Sum ``x`` over the group onto group member ``root``: the sum there, zeros on the
        other members (a reduce of distinct roots; as a broadcast's transpose each rank gets
        only its own gradient). ``x`` is overwritten."""
        if self.size(axis) == 1:
            return _done(x, async_op)
        return self._reduce(x.contiguous(), axis, root, async_op)

    def broadcast(self, x: torch.Tensor, axis: str, root: int, async_op: bool = False):
        """Group member ``root``'s ``x`` on every member; ``x`` is overwritten."""
        if self.size(axis) == 1:
            return _done(x, async_op)
        return self._broadcast(x.contiguous(), axis, root, async_op)

    def all_to_all(self, x: torch.Tensor, axis: str, in_splits=None, out_splits=None,
                   async_op: bool = False):
        """Send row block i of ``x`` to group member i; ``in_splits``/``out_splits`` give
        the block sizes (equal blocks when None). Returns the received rows in member order."""
        if self.size(axis) == 1:
            return _done(x, async_op)
        return self._all_to_all(x.contiguous(), axis, in_splits, out_splits, async_op)

    def send(self, x: torch.Tensor, dst: int, async_op: bool = False):
        """Send ``x`` to global rank ``dst``; async returns a Pending resolving to ``x``."""
        if dst == self.rank:
            raise ValueError(f"rank {self.rank} cannot send to itself")
        return self._send(x.contiguous(), dst, async_op)

    def recv(self, shape, dtype: torch.dtype, src: int, async_op: bool = False):
        """Receive a tensor of ``shape`` and ``dtype`` from global rank ``src``."""
        if src == self.rank:
            raise ValueError(f"rank {self.rank} cannot receive from itself")
        return self._recv(tuple(shape), dtype, src, async_op)

    def post_p2p(self, transfers) -> list:
        """Post pipeline transfers ``(kind, tensor, peer, tag)`` — kind ``send`` or ``recv``,
        peer a global rank, tag matching messages where the backend uses tags — as one batch;
        returns one work per transfer (its ``wait()`` blocks until done; None: done already)."""
        raise TypeError(f"{type(self).__name__} has no peers to send to")

    def _all_gather(self, *args: Any, **kwargs: Any) -> Any:
        # Only a group of more than one rank gets here, and only DistComm has those (each
        # of its methods with its own arguments: any, here).
        raise TypeError(f"{type(self).__name__} has no process groups to communicate over")

    _reduce_scatter = _all_reduce = _all_to_all = _send = _recv = _reduce = _broadcast = _all_gather


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _done(x: torch.Tensor, async_op: bool):
    return Pending.ready(x) if async_op else x


def reduce_in(dtype: torch.dtype | None, comm: Communicator, flat: torch.Tensor, axis: str, scatter: bool,
              async_op: bool = False):
    """Sum ``flat`` (fp32 gradients) over ``axis`` with the wire in ``dtype``: an all-reduce,
    in place as :meth:`Communicator.all_reduce`, or with ``scatter`` a reduce-scatter (this
    rank's block, a new tensor). ``dtype`` None or ``flat``'s own: as the plain collective.
    Otherwise ``flat`` is cast to ``dtype`` (``train { grad_reduce_dtype }``), reduced, and
    the result cast back into ``flat``'s dtype (written into ``flat`` for the all-reduce), so
    a caller sees the plain collective's types and aliasing; a Pending of it with ``async_op``."""
    collective = comm.reduce_scatter if scatter else comm.all_reduce
    if dtype is None or dtype == flat.dtype or comm.size(axis) == 1:
        return collective(flat, axis, async_op=async_op)
    sent = collective(flat.to(dtype), axis, async_op=async_op)

    def back(landed: torch.Tensor) -> torch.Tensor:
        return landed.to(flat.dtype) if scatter else flat.copy_(landed)

    return sent.then(back) if isinstance(sent, Pending) else back(sent)


class SingleRankComm(Communicator):
    """One process holding the whole mesh position: every group has size 1."""

    def __init__(self) -> None:
        self.rank, self.mesh = 0, None


class DistComm(Communicator):
    """Collectives over torch.distributed process groups, one group per mesh-axis group.

    Must be constructed on every rank of an initialised default process group, in the
    same order (``new_group`` is collective). ``device`` is where received tensors go.
    """

    def __init__(self, mesh: Mesh, device: torch.device | str = "cpu", timeout_s: float | None = None):
        self.mesh, self.rank = mesh, dist.get_rank()
        self.device = torch.device(device)
        if dist.get_world_size() != mesh.world:
            raise ValueError(f"the mesh has {mesh.world} ranks but torch.distributed has "
                             f"{dist.get_world_size()}")
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        #: The mesh's dimensions (tp, cp, dp, pp larger than 1) as a torch DeviceMesh with
        #: named dims, for DTensor and distributed checkpointing; None on one rank.
        self.device_mesh = _device_mesh(mesh, self.device.type, timeout)
        self._groups: dict[str, dist.ProcessGroup] = {}
        if self.device_mesh is not None:
            self._groups = {axis: self.device_mesh.get_group(axis) for axis in self.device_mesh.mesh_dim_names}
        # ep groups (blocks of dp coordinates), the expert-dp groups and the sub-axes of group
        # partitions (tp.intra, tp.inter) are not dimensions of the mesh: groups of their own.
        for axis in ("ep",) + ((EDP,) if mesh.ep > 1 else ()) + mesh.sub_axes():
            for ranks in expert_dp_groups(mesh) if axis == EDP else mesh.groups(axis):
                if len(ranks) == 1:
                    continue
                # Every rank creates every group (a collective call), and keeps its own.
                group = dist.new_group(list(ranks), timeout=timeout)
                if self.rank in ranks:
                    self._groups[axis] = group
        if mesh.ep == 1 and "dp" in self._groups:  # without EP the expert replicas are the dp group
            self._groups[EDP] = self._groups["dp"]
        #: gloo's reduce_scatter_tensor sends an all_reduce's bytes: reduce-scatter by
        #: exchange there (:meth:`_reduce_scatter_by_exchange`); NCCL's is native.
        self._exchange_reduce_scatter = dist.get_backend() == "gloo"

    def _all_gather(self, x, axis, async_op):
        out = torch.empty((x.shape[0] * self.size(axis),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        work = _all_gather_single(out, x, group=self._groups[axis], async_op=async_op)
        return Pending(work, out) if async_op else out

    def _reduce_scatter(self, x, axis, async_op):
        size = self.size(axis)
        if x.shape[0] % size:
            raise ValueError(f"reduce_scatter of {x.shape[0]} rows over {axis} = {size} does not divide")
        if self._exchange_reduce_scatter:
            return self._reduce_scatter_by_exchange(x, axis, size, async_op)
        out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        work = _reduce_scatter_single(out, x, group=self._groups[axis], async_op=async_op)
        return Pending(work, out) if async_op else out

    def _reduce_scatter_by_exchange(self, x, axis, size, async_op):
        """A reduce_scatter as an all_to_all (block j of every rank's input goes to rank j)
        and a sum of the ``size`` blocks received, in rank order (the same order on every
        rank). Each rank sends (size - 1)/size of its input, as a ring reduce_scatter does;
        torch's gloo ``reduce_scatter_tensor`` moves an all_reduce's 2(size - 1)/size: on two
        ranks over a 200 Mbit/s link it took as long as an all_reduce of its input (43 ms
        for 1 MiB in, an all_gather to 1 MiB 26 ms); over loopback, 16 MiB in, 25.6 ms
        against this 9.2 ms."""
        received = torch.empty_like(x)
        work = dist.all_to_all_single(received, x, group=self._groups[axis], async_op=async_op)

        def summed(blocks: torch.Tensor) -> torch.Tensor:
            return blocks.view((size, x.shape[0] // size) + tuple(x.shape[1:])).sum(0)

        return Pending(work, received, summed) if async_op else summed(received)

    def _all_reduce(self, x, axis, op, async_op):
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        work = dist.all_reduce(x, op=reduce_op, group=self._groups[axis], async_op=async_op)
        return Pending(work, x) if async_op else x

    def _reduce(self, x, axis, root, async_op):
        mine = self.index(axis) == root
        work = dist.reduce(x, dst=self.group_ranks(axis)[root], group=self._groups[axis], async_op=async_op)

        def kept(result: torch.Tensor) -> torch.Tensor:  # the other members' buffers hold partial sums
            return result if mine else result.zero_()
        return Pending(work, x, kept) if async_op else kept(x)

    def _broadcast(self, x, axis, root, async_op):
        work = dist.broadcast(x, src=self.group_ranks(axis)[root], group=self._groups[axis], async_op=async_op)
        return Pending(work, x) if async_op else x

    def _all_to_all(self, x, axis, in_splits, out_splits, async_op):
        rows = sum(out_splits) if out_splits is not None else x.shape[0]
        out = torch.empty((rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        work = dist.all_to_all_single(out, x, output_split_sizes=_list(out_splits),
                                      input_split_sizes=_list(in_splits), group=self._groups[axis],
                                      async_op=async_op)
        return Pending(work, out) if async_op else out

    def _send(self, x, dst, async_op):
        if async_op:
            return Pending(dist.isend(x, dst), x)
        dist.send(x, dst)
        return x

    def _recv(self, shape, dtype, src, async_op):
        out = torch.empty(shape, dtype=dtype, device=self.device)
        if async_op:
            return Pending(dist.irecv(out, src), out)
        dist.recv(out, src)
        return out

    def post_p2p(self, transfers) -> list:
        ops = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, tag=tag)
               for kind, tensor, peer, tag in transfers]
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # one work per op on every backend we run
            works = [works[0]] * len(ops) if works else [None] * len(ops)
        return works


def _device_mesh(mesh: Mesh, device_type: str, timeout: timedelta | None):
    """A DeviceMesh of ``mesh``'s dimensions larger than 1, outermost first (DeviceMesh's
    last dim is the innermost, dhelix lists axes innermost first: the same rank layout),
    every dim with its own process groups and ``timeout``; None when no dim is larger than 1."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = [(axis, size) for axis, size in zip(mesh.order, mesh.sizes, strict=True)
            if axis in DIMENSIONS and size > 1][::-1]
    if not dims:
        return None
    backend = dist.get_backend()
    options = None
    if backend == "gloo" and timeout is not None:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
    elif backend == "nccl" and timeout is not None:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
    # A backend per dim also keeps a dim spanning the world off the default group.
    return init_device_mesh(device_type, tuple(size for _, size in dims),
                            mesh_dim_names=tuple(axis for axis, _ in dims),
                            backend_override={axis: (backend, options) for axis, _ in dims})


def _list(splits):
    return None if splits is None else [int(s) for s in splits]
