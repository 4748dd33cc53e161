"""One rank of a program's world alone in this process: a stand-in world and emulated links.

``dhelix run --as-rank R`` runs rank R of the program's full mesh at its real shard shapes on
the one device this machine has. :func:`join_standin_world` joins a torch.distributed world of
the program's size in which this process is rank R and no peer exists (torch's fake backend:
every process group and DeviceMesh of the real world can be made, nothing is sent).
:class:`EmulatedComm` is then the rank's communicator: every collective and pipeline transfer
is issued on its real lane (the mesh's local or cross lane, as :meth:`~dhelix.dsl.core.mesh.Mesh.lane`
says; on CUDA a stream per lane, on CPU a thread per lane, as gloo's background threads) and
returns a stand-in of the right shape and dtype — a gather of this rank's block repeated, a
reduction of this rank's own values, zeros received — so that shapes, ordering, streams, events
and memory are the real job's, its numbers are not. What a transfer costs is the emulation's
choice (``--emulate-links``, one of :data:`~dhelix.interpreter.training.train.EMULATIONS`):

* ``copy`` moves the bytes the transfer puts on the wire (the cost model's formula,
  :func:`~dhelix.dsl.planner.costmodel.wire_bytes`) through pinned host memory on the lane
  (on a GPU its copy engines and memory traffic stand in for the link's);
* ``sleep`` keeps the lane busy for the profile's predicted time of the transfer
  (:func:`~dhelix.dsl.planner.costmodel.collective_time`): a spinning kernel on CUDA, a sleep
  on CPU;
* ``none`` costs nothing but the stand-in's own writes (on CPU done at once on the calling
  thread: a lane's thread would only add its hand-offs).

Each lane's busy time is measured around every transfer (CUDA events on its stream, the
clock on its thread); its exposed communication at each wait: on CPU the seconds the thread
blocked; on CUDA the seconds the compute stream stalled (an event recorded before and after
the stream's wait for the lane: the compute stream reaches the first once its earlier work is
done, the second once the lane has finished).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time

import torch
import torch.distributed as dist

from dhelix.dsl.core.mesh import ranks_per_node
from dhelix.dsl.planner.costmodel import collective_time, wire_bytes

from .comm import DistComm, Pending

#: The bytes of pinned host memory a ``copy`` lane streams through (larger transfers wrap around).
_COPY_BUFFER = 64 << 20


def join_standin_world(rank: int, world: int) -> None:
    """Make this process rank ``rank`` of a ``world``-rank torch.distributed world without peers
    (torch's fake backend, registered by importing its module)."""
    import torch.testing._internal.distributed.fake_pg as fake  # registers the "fake" backend

    dist.init_process_group("fake", store=fake.FakeStore(), rank=rank, world_size=world)


def standin_world() -> bool:
    """Whether this process runs in a stand-in world (:func:`join_standin_world`)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake"


class _Lanes:
    """A lane per name, each running its transfers in issue order beside the compute: a CUDA
    stream (a transfer waits for the compute stream's work issued before it), or one worker
    thread on CPU. Tracks the exposed seconds per lane (see the module docstring)."""

    def __init__(self, device: torch.device, inline: bool = False):
        self.device = device
        self.cuda = device.type == "cuda"
        #: On CPU, run each transfer's work at once on the calling thread (``none``: a lane's
        #: thread would only add its hand-offs to the step).
        self.inline = inline and not self.cuda
        self._lanes: dict[str, object] = {}
        self.exposed: dict[str, float] = {}
        self._stalls: list[tuple[str, object, object]] = []  # CUDA: (lane, before, after) events
        self.busy: dict[str, float] = {}
        self._spans: list[tuple[str, object, object]] = []  # CUDA: (lane, start, done) of each transfer
        self._lock = threading.Lock()

    def _timed(self, name: str, work) -> None:
        """Run ``work`` on this CPU lane's thread, adding its seconds to the lane's busy time."""
        start = time.perf_counter()
        work()
        with self._lock:  # the lanes' threads and :meth:`take` share the tally
            self.busy[name] = self.busy.get(name, 0.0) + time.perf_counter() - start

    def prepare(self, names) -> None:
        """Make the lanes ``names`` now (their streams or threads), before the first block: a
        transfer then only queues its work (inline: nothing to make). A lane's tallies start
        with its first transfer."""
        if not self.inline:
            for name in names:
                self._made(name)

    def _made(self, name: str):
        if name not in self._lanes:
            self._lanes[name] = (torch.cuda.Stream(self.device) if self.cuda
                                 else concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"lane-{name}"))
        return self._lanes[name]

    def _lane(self, name: str):
        self.exposed.setdefault(name, 0.0)
        return self._made(name)

    def submit(self, name: str, work, tensors=()) -> "_Work":
        """Run ``work()`` (the stand-in's writes and the link's cost) on lane ``name`` after
        what the compute has issued so far; ``tensors``: those the lane reads or writes."""
        if self.inline:  # no lane thread: nothing shares the tally, no future to hand over
            self.run_inline(name, work)
            return _Work(self, name)
        lane = self._lane(name)
        if not self.cuda:
            return _Work(self, name, future=lane.submit(self._timed, name, work))
        lane.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(lane):
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(lane)
            work()
            done.record(lane)
        self._spans.append((name, start, done))
        for tensor in tensors:  # the caching allocator must not reuse them before the lane is done
            tensor.record_stream(lane)
        return _Work(self, name, event=done)

    def run_inline(self, name: str, work) -> None:
        """Run ``work()`` at once on the calling thread as lane ``name``'s (an inline lane's
        transfer: done when this returns), adding its seconds to the lane's busy time."""
        start = time.perf_counter()
        work()
        self.busy[name] = self.busy.get(name, 0.0) + time.perf_counter() - start
        if name not in self.exposed:
            self.exposed[name] = 0.0

    def waited(self, name: str, work: "_Work") -> None:
        """Block the compute (the thread on CPU, the stream on CUDA) until ``work`` is done,
        counting the exposed time on lane ``name``."""
        if work.future is None and work.event is None:  # done at its issue (inline)
            return
        if not self.cuda:
            start = time.perf_counter()
            work.future.result()
            self.exposed[name] += time.perf_counter() - start
            return
        stream = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(work.event)
        after.record(stream)
        self._stalls.append((name, before, after))

    def take(self) -> dict[str, tuple[float, float]]:
        """Per lane, the seconds it was exposed and busy since the last call (CUDA: after a
        synchronisation; CPU: the transfers finished by now)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            for name, before, after in self._stalls:
                self.exposed[name] += before.elapsed_time(after) / 1e3
            for name, start, done in self._spans:
                self.busy[name] = self.busy.get(name, 0.0) + start.elapsed_time(done) / 1e3
            self._stalls, self._spans = [], []
        with self._lock:
            taken = {name: (self.exposed[name], self.busy.get(name, 0.0)) for name in self.exposed}
            self.exposed, self.busy = {name: 0.0 for name in self.exposed}, {}
        return taken

    def close(self) -> None:
        """Finish every lane's work (and stop the CPU threads)."""
        for lane in self._lanes.values():
            if self.cuda:
                lane.synchronize()
            else:
                lane.shutdown(wait=True)


class _Work:
    """An emulated transfer in flight: waited once through :class:`_Lanes` (neither a
    future nor an event: done when issued, on the calling thread)."""

    def __init__(self, lanes: _Lanes, lane: str, *, future=None, event=None):
        self.lanes, self.lane, self.future, self.event = lanes, lane, future, event
        self._waited = False

    def wait(self) -> None:
        if not self._waited:
            self._waited = True
            self.lanes.waited(self.lane, self)

    def is_completed(self) -> bool:
        if self.future is not None:
            return self.future.done()
        return self.event is None or self.event.query()


class EmulatedComm(DistComm):
    """The communicator of one rank in a stand-in world (:func:`join_standin_world`): the real
    world's groups, every transfer a stand-in on its lane whose cost ``emulate`` (one of
    :data:`EMULATIONS`) decides, priced by ``profile`` for ``sleep``. Records every collective
    issued as ``(kind, axis, shape)`` in :attr:`issued`. ``emulate``: copy, sleep or none
    (:data:`~dhelix.interpreter.training.train.EMULATIONS`)."""

    def __init__(self, mesh, device, profile, emulate: str = "copy", timeout_s: float | None = None):
        super().__init__(mesh, device, timeout_s)
        self.profile, self.emulate = profile, emulate
        self.lanes = _Lanes(self.device, inline=emulate == "none")
        self.issued: list[tuple[str, str, tuple[int, ...]]] = []
        self._host = self._source = None  # ``copy``: the pinned host buffer, the device one copied
        self._lock = threading.Lock()
        self._lane_of: dict[str, tuple[str, int]] = {}
        self._inline_issuers: dict[tuple[str, str, bool], object] = {}
        # Every group's lane found, and made, ahead of the first block.
        self.lanes.prepare(sorted({self.lane_and_nodes(axis)[0] for axis in self._groups}))

    # -- what a transfer costs --------------------------------------------------------------

    def lane_and_nodes(self, axis: str) -> tuple[str, int]:
        """The lane of ``axis``'s group holding this rank and its ranks per node (found once per axis)."""
        found = self._lane_of.get(axis)
        if found is None:
            ranks = self.group_ranks(axis)
            per_node = self.mesh.gpus_per_node
            found = self._lane_of[axis] = (("cross" if len({r // per_node for r in ranks}) > 1 else "local"),
                                           ranks_per_node(ranks, per_node))
        return found

    def _cost(self, kind: str, full_bytes: float, axis: str, group: int):
        """The link's cost of one transfer, to run on its lane (None: none)."""
        lane, per_node = self.lane_and_nodes(axis)
        if self.emulate == "sleep":
            seconds = collective_time(kind, full_bytes, group, lane, self.profile, per_node)
            return lambda: self._sleep(seconds)
        if self.emulate == "copy":
            size = int(wire_bytes(kind, full_bytes, group))
            return lambda: self._copy(size)
        return None

    def _sleep(self, seconds: float) -> None:
        if self.device.type == "cuda":
            torch.cuda._sleep(max(1, int(seconds * _cycles_per_second(self.device))))
        else:
            time.sleep(seconds)

    def _copy(self, size: int) -> None:
        if size <= 0:
            return
        with self._lock:  # the lanes' threads (CPU) share the buffers
            if self._host is None or self._host.numel() < min(size, _COPY_BUFFER):
                # On CUDA once, whole: a buffer replaced could be reused while a lane still copies it.
                length = _COPY_BUFFER if self.device.type == "cuda" else min(max(size, 1 << 20), _COPY_BUFFER)
                self._host = torch.empty(length, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
                self._source = torch.zeros(length, dtype=torch.uint8, device=self.device)
            host, source = self._host, self._source
        for start in range(0, size, host.numel()):
            n = min(host.numel(), size - start)
            host[:n].copy_(source[:n], non_blocking=True)

    def _emulated(self, kind: str, axis: str, x: torch.Tensor, out: torch.Tensor, fill, async_op: bool):
        """Issue the stand-in of collective ``kind`` over ``axis``: ``fill()`` writes ``out``
        from ``x`` on the lane, then the link's cost runs there."""
        self.issued.append((kind, axis, tuple(x.shape)))
        found = self._lane_of.get(axis)
        lane = (found or self.lane_and_nodes(axis))[0]
        if self.emulate == "none":  # the stand-in's writes alone
            if self.lanes.inline:  # written at once: nothing to wait for
                self.lanes.run_inline(lane, fill)
                return Pending(None, out) if async_op else out
            pending = Pending(self.lanes.submit(lane, fill, (x, out)), out)
            return pending if async_op else pending.wait()
        full = max(x.numel(), out.numel()) * x.element_size()  # S: the gathered / unscattered tensor
        cost = self._cost(kind, full, axis, self.size(axis))

        def work() -> None:
            fill()
            if cost is not None:
                cost()

        pending = Pending(self.lanes.submit(lane, work, (x, out)), out)
        return pending if async_op else pending.wait()

    @property
    def completes_at_issue(self) -> bool:
        """Whether every collective is written when its issue returns (``none`` on CPU: inline lanes)."""
        return self.lanes.inline

    def issuer(self, kind: str, axis: str, async_op: bool, bare: bool = False):
        """:meth:`~.comm.Communicator.issuer`; on inline lanes a gather's or a reduction's
        stand-in written straight away (the record, the writes and the lane's busy time of
        :meth:`_emulated`, without its closure and hand-offs)."""
        if not self.lanes.inline or self.size(axis) == 1:
            return super().issuer(kind, axis, async_op, bare)
        size, mine, lane = self.size(axis), self.index(axis), self.lane_and_nodes(axis)[0]
        issued, lanes, clock, wrap = self.issued, self.lanes, time.perf_counter, async_op and not bare
        # (Each body ends as :meth:`_Lanes.run_inline` does: the writes' seconds on the lane.)
        if kind == "all_gather":
            def all_gather(x):
                x = x.contiguous()
                shape = tuple(x.shape)
                out = torch.empty((shape[0] * size,) + shape[1:], dtype=x.dtype, device=x.device)
                issued.append((kind, axis, shape))
                start = clock()
                out.view((size,) + shape).copy_(x.unsqueeze(0).expand((size,) + shape))
                busy = lanes.busy
                busy[lane] = busy.get(lane, 0.0) + clock() - start
                if lane not in lanes.exposed:
                    lanes.exposed[lane] = 0.0
                return Pending(None, out) if wrap else out
            return all_gather
        if kind == "reduce_scatter":
            def reduce_scatter(x):
                x = x.contiguous()
                shape = tuple(x.shape)
                if shape[0] % size:
                    raise ValueError(f"reduce_scatter of {shape[0]} rows over {axis} = {size} does not divide")
                rows = shape[0] // size
                out = torch.empty((rows,) + shape[1:], dtype=x.dtype, device=x.device)
                issued.append((kind, axis, shape))
                start = clock()
                out.copy_(x[mine * rows:(mine + 1) * rows])
                busy = lanes.busy
                busy[lane] = busy.get(lane, 0.0) + clock() - start
                if lane not in lanes.exposed:
                    lanes.exposed[lane] = 0.0
                return Pending(None, out) if wrap else out
            return reduce_scatter

        def all_reduce(x):  # this rank's own values: nothing to write
            issued.append((kind, axis, tuple(x.shape)))
            start = clock()
            busy = lanes.busy
            busy[lane] = busy.get(lane, 0.0) + clock() - start
            if lane not in lanes.exposed:
                lanes.exposed[lane] = 0.0
            return Pending(None, x) if wrap else x
        return all_reduce

    # -- the collectives: stand-ins of the right shape --------------------------------------

    def all_gather(self, x, axis, async_op=False):
        issue = self._inline_issue("all_gather", axis, async_op)
        return issue(x) if issue is not None else super().all_gather(x, axis, async_op)

    def reduce_scatter(self, x, axis, async_op=False):
        issue = self._inline_issue("reduce_scatter", axis, async_op)
        return issue(x) if issue is not None else super().reduce_scatter(x, axis, async_op)

    def all_reduce(self, x, axis, op="sum", async_op=False):
        issue = self._inline_issue("all_reduce", axis, async_op)  # (a stand-in's reduction reads no op)
        return issue(x) if issue is not None else super().all_reduce(x, axis, op, async_op)

    def _inline_issue(self, kind: str, axis: str, async_op: bool):
        """On inline lanes, the collective as :meth:`issuer` writes it (the same record,
        writes and tally as the methods, without their layers; a group of one: the identity),
        bound once per kind, axis and mode; None: the methods run it."""
        key = (kind, axis, async_op)
        found = self._inline_issuers.get(key)
        if found is None:
            found = self._inline_issuers[key] = self.issuer(kind, axis, async_op) if self.lanes.inline else False
        return found or None

    def _all_gather(self, x, axis, async_op):
        size = self.size(axis)
        out = torch.empty((x.shape[0] * size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        return self._emulated("all_gather", axis, x, out,
                              lambda: out.view((size,) + tuple(x.shape)).copy_(x.unsqueeze(0).expand((size,) + tuple(x.shape))),
                              async_op)

    def _reduce_scatter(self, x, axis, async_op):
        size = self.size(axis)
        if x.shape[0] % size:
            raise ValueError(f"reduce_scatter of {x.shape[0]} rows over {axis} = {size} does not divide")
        rows = x.shape[0] // size
        mine = self.index(axis)
        out = torch.empty((rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        return self._emulated("reduce_scatter", axis, x, out, lambda: out.copy_(x[mine * rows:(mine + 1) * rows]),
                              async_op)

    def _all_reduce(self, x, axis, op, async_op):
        return self._emulated("all_reduce", axis, x, x, lambda: None, async_op)

    def _reduce(self, x, axis, root, async_op):
        mine = self.index(axis) == root
        pending = self._emulated("reduce", axis, x, x, (lambda: None) if mine else x.zero_, True)
        return pending if async_op else pending.wait()

    def _broadcast(self, x, axis, root, async_op):
        return self._emulated("broadcast", axis, x, x, lambda: None, async_op)

    def _all_to_all(self, x, axis, in_splits, out_splits, async_op):
        rows = sum(out_splits) if out_splits is not None else x.shape[0]
        out = torch.empty((rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)

        def fill() -> None:  # this rank's rows, repeated or cut to the rows received
            if x.shape[0] == 0:
                out.zero_()
                return
            flat = x.reshape(x.shape[0], -1)
            reps = -(-rows // x.shape[0])
            out.view(rows, -1).copy_(flat.repeat(reps, 1)[:rows])

        return self._emulated("all_to_all", axis, x, out, fill, async_op)

    def _send(self, x, dst, async_op):
        [work] = self._p2p([("send", x, dst, 0)], "peer")
        pending = Pending(work, x)
        return pending if async_op else pending.wait()

    def _recv(self, shape, dtype, src, async_op):
        out = torch.empty(shape, dtype=dtype, device=self.device)
        [work] = self._p2p([("recv", out, src, 0)], "peer")
        pending = Pending(work, out)
        return pending if async_op else pending.wait()

    def post_p2p(self, transfers) -> list:
        """Post pipeline transfers ``(send|recv, tensor, peer, tag)``: a send costs its bytes
        on the lane to its peer, a receive fills its buffer with zeros (its peer's activations
        or gradients do not exist here)."""
        return self._p2p(transfers, "pp")

    def _p2p(self, transfers, axis: str) -> list:
        """Point-to-point ``transfers`` (recorded as over ``axis``: pp for the pipeline's, peer
        for a layer's, as ring attention's), each on the lane to its peer."""
        works = []
        for kind, tensor, peer, _ in transfers:
            self.issued.append((kind, axis, tuple(tensor.shape)))
            lane = "local" if peer // self.mesh.gpus_per_node == self.rank // self.mesh.gpus_per_node else "cross"
            work = tensor.zero_
            if kind == "send":
                work = lambda: None  # noqa: E731
                if self.emulate == "sleep":
                    seconds = collective_time("p2p", tensor.numel() * tensor.element_size(), 2, lane, self.profile)
                    work = lambda s=seconds: self._sleep(s)  # noqa: E731
                elif self.emulate == "copy":
                    nbytes = tensor.numel() * tensor.element_size()
                    work = lambda n=nbytes: self._copy(n)  # noqa: E731
            works.append(self.lanes.submit(lane, work, (tensor,)))
        return works


@functools.cache
def _cycles_per_second(device: torch.device) -> float:
    """The GPU clock as ``torch.cuda._sleep`` counts it, measured once per device."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(10_000_000)
    stop.record()
    stop.synchronize()
    return 10_000_000 / (start.elapsed_time(stop) / 1e3)
