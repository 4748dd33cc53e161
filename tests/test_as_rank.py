"""`dhelix run --as-rank R`: one rank of a program's whole mesh alone in this process.

The recorded-actions check: a rank run alone issues exactly what the lowered schedule says for
its pipeline rank — every action of its row, in order, each step — and, where the real world
fits this machine, the same collectives (kind, mesh axis, shape, in issue order) and pipeline
transfers as that rank of a real gloo run of the same program.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from commands import dhelix_here

from dhelix.dsl.core.schedule import Transfer
from dhelix.dsl.frontend.imports import read_source
from dhelix.dsl.simulator.runplan import build_run_plan

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny_llama_cpu.dhx"


def _program(mesh: str, *, layer: str = "llama", layers: int = 8, nodes: int = 8, gpus: int = 8,
             extra: str = "", heads: int = 8, schedule: str = "fold u\npipeline w_helix") -> str:
    return f"""import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model big_tiny {{
  layers = {layers}  hidden = 64  ffn = 128  heads = {heads}  kv_heads = {heads}  seq = 32  vocab = 256
  dtype = fp32  layer = {layer}
{extra}}}
cluster {{ nodes = {nodes}  gpus_per_node = {gpus}  profile = "a40" }}
mesh {{ {mesh} }}
train {{ micro_batch = 1  microbatches = 8  seed = 3 }}
{schedule}
strands {{ overlap tp  comm_with_comm on  movable wgrad }}
"""


#: Large-mesh versions of the tiny example: every axis the issue names, worlds up to 128.
LARGE = {
    "tp8_pp4_dp2": _program("tp = 8  pp = 4  dp = 2"),
    "tp8_cp2_pp4_dp2": _program("tp = 8  cp = 2  pp = 4  dp = 2", nodes=16, layer="llama_rope",
                                extra="  rope_theta = 10000  norm_inv_eps = 100000\n"),
    "tp2_pp2_dp8_ep4": _program("tp = 2  pp = 2  dp = 8  ep = 4", layer="moe", layers=4, nodes=4,
                                extra="  experts = 8  top_k = 2\n", schedule="fold none\npipeline one_f_one_b"),
}


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread for the ranks run in this process: with the machine's other jobs on
    both cores, torch's spinning OpenMP threads made a 3 s run take 25 s."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _as_rank(path, rank: int, *args, steps: int = 2):
    """Run ``path``'s rank alone in this process (the API the command uses) and return the run
    options and its result (the rank's record: what it issued)."""
    from dhelix.interpreter.launch import join
    from dhelix.interpreter.training import train

    compiled = build_run_plan(read_source(str(path)), str(path))
    options = train.RunOptions(path=str(path), compiled=compiled, steps=steps, as_rank=rank, emulate="none",
                               seed=compiled.program.train.seed or 0)
    return compiled.program, join.run_as_rank(options, train.train)


def _actions_seen(monkeypatch) -> list:
    """Patch the executor's action hook to record ``(step, index)`` of every action run."""
    from dhelix.interpreter.training import train

    seen: list = []
    real = train._action_hook

    def hook(comm, program, heartbeat):
        inner = real(comm, program, heartbeat)

        def record(step, index):
            seen.append((step, index))
            if inner is not None:
                inner(step, index)
        return record

    monkeypatch.setattr(train, "_action_hook", hook)
    return seen


def _expected_transfers(program, rank: int) -> Counter:
    """The pipeline transfers (send/recv) the lowered schedule gives ``rank``'s row per step."""
    row = program.lowered.actions[program.mesh.position(rank, "pp")]
    return Counter(action.kind.lower() for action in row if isinstance(action, Transfer))


@pytest.mark.parametrize("name", sorted(LARGE))
def test_large_mesh_first_and_last_rank_issue_their_rows(name, tmp_path, monkeypatch):
    path = tmp_path / f"{name}.dhx"
    path.write_text(LARGE[name])
    world = build_run_plan(path.read_text(), str(path)).program.mesh.world
    for rank in (0, world - 1):
        seen = _actions_seen(monkeypatch)
        program, result = _as_rank(path, rank)
        [record] = result.ranks
        assert record.rank == rank and len(record.step) == 2
        row = program.lowered.actions[program.mesh.position(rank, "pp")]
        assert seen == [(step, index) for step in range(2) for index in range(len(row))]
        issued = Counter(kind for kind, axis, _ in record.issued if axis == "pp" and kind in ("send", "recv"))
        assert issued == Counter({kind: 2 * n for kind, n in _expected_transfers(program, rank).items()})
        axes = {axis for _, axis, _ in record.issued}
        assert "tp" in axes  # the layer's collectives ran over the real tp group
        monkeypatch.undo()


def _comm_events(trace: Path, rank: int) -> Counter:
    """The communication events (name, lane) of ``rank`` in a run's Chrome trace: every
    collective the rank issued and every pipeline receive it waited for."""
    events = json.loads(trace.read_text())["traceEvents"]
    return Counter((e["name"], e["cat"]) for e in events
                   if e.get("ph") == "X" and e.get("pid") == rank and e.get("cat") not in ("compute", None))


def test_same_communication_as_the_real_rank(tmp_path):
    """Rank 3 of the tiny example alone issues the collectives and receives that rank 3 of a
    real 4-rank gloo run issues (as both runs' traces record them: op and lane); the command
    prints its figures beside the simulator's."""
    real, alone, metrics = tmp_path / "real.json", tmp_path / "alone.json", tmp_path / "m.json"
    done = _cli(TINY, "--steps", 2, "--trace", real)
    assert done.returncode == 0, done.stderr
    done = _cli(TINY, "--steps", 2, "--trace", alone, "--as-rank", 3, "--emulate-links", "sleep",
                "--metrics", metrics)
    assert done.returncode == 0, done.stderr
    expected, got = _comm_events(real, 3), _comm_events(alone, 3)
    assert expected and got == expected, (got - expected, expected - got)
    assert "rank 3 of 4 alone" in done.stdout and "step (this rank alone)" in done.stdout
    assert "not the reference's" in done.stdout
    figures = json.loads(metrics.read_text())
    assert figures["rank"] == 3 and figures["stage"] == 1 and figures["emulate"] == "sleep"
    assert figures["step_s"] > 0 and figures["predicted"]["alone_s"] > 0
    assert set(figures["lanes_exposed_s"]) <= {"local", "cross"}


def _cli(*args, command="run", timeout=300):
    """``dhelix run ARGS`` (or ``command``) in this process (:func:`commands.dhelix_here`: the
    real run's ranks forked from the session's forkserver, a rank alone run here)."""
    return dhelix_here(command, *map(str, args), timeout=timeout)


def test_cli_as_rank_large_mesh(tmp_path):
    path = tmp_path / "big.dhx"
    path.write_text(LARGE["tp8_pp4_dp2"])
    done = _cli(path, "--as-rank", 0, "--steps", 2)
    assert done.returncode == 0, done.stderr
    assert "rank 0 of 64 alone" in done.stdout


@pytest.mark.parametrize("args, words", [
    (("--as-rank", 4), "ranks 0 to 3"),
    (("--as-rank", 0, "--check"), "--check needs the other ranks"),
    (("--emulate-links", "sleep"), "--emulate-links goes with --as-rank"),
])
def test_cli_as_rank_usage_errors(args, words):
    done = _cli(TINY, *args, timeout=120)
    assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr


def test_stand_in_collectives_shapes_and_lanes():
    """The stand-ins have the real results' shapes and dtypes; ``sleep`` keeps the transfer's lane
    (cross, for dp across nodes) busy for at least the profile's time of the transfer, and the
    other lane not at all."""
    import torch
    import torch.distributed as dist

    from dhelix.dsl.core.mesh import Mesh
    from dhelix.dsl.frontend.profiles import load_profile
    from dhelix.dsl.planner.costmodel import collective_time
    from dhelix.interpreter.ops.standin import EmulatedComm, join_standin_world, standin_world

    program = build_run_plan(LARGE["tp8_pp4_dp2"], "big.dhx").program
    mesh: Mesh = program.mesh
    join_standin_world(5, mesh.world)
    try:
        assert standin_world() and dist.get_world_size() == 64
        comm = EmulatedComm(mesh, "cpu", load_profile("a40"), "sleep")
        x = torch.arange(24.0).reshape(4, 6)
        gathered = comm.all_gather(x, "tp")
        assert gathered.shape == (32, 6) and torch.equal(gathered[:4], x)
        scattered = comm.reduce_scatter(torch.ones(16, 6), "tp")
        assert scattered.shape == (2, 6)
        moved = comm.all_to_all(x, "tp", in_splits=[1, 1, 0, 0, 1, 1, 0, 0], out_splits=[2] * 8)
        assert moved.shape == (16, 6) and moved.dtype == x.dtype
        big = torch.zeros(1 << 20)  # 4 MiB over tp (local lane) and over dp (across nodes)
        seconds = collective_time("all_reduce", big.numel() * 4, 2, "cross", comm.profile, 1)
        comm.lanes.take()
        comm.all_reduce(big, "dp", async_op=True).wait()
        lanes = comm.lanes.take()
        exposed, busy = lanes["cross"]
        # A sleep lasts at least its time (what a loaded machine adds only lengthens it).
        assert busy >= seconds and exposed >= 0 and lanes["local"] == (0.0, 0.0)
        comm.lanes.close()
    finally:
        dist.destroy_process_group()


def test_inline_stand_ins_give_what_the_lanes_threads_give():
    """On inline lanes (``none``) the collectives' methods go straight to the bound stand-ins
    (:meth:`~dhelix.interpreter.ops.standin.EmulatedComm.issuer`): the same tensors, the same
    record of what was issued, a Pending where asked for one, the same error, as a lane thread."""
    import pytest
    import torch
    import torch.distributed as dist

    from dhelix.dsl.frontend.profiles import load_profile
    from dhelix.interpreter.ops.comm import Pending
    from dhelix.interpreter.ops.standin import EmulatedComm, join_standin_world

    program = build_run_plan(LARGE["tp8_pp4_dp2"], "big.dhx").program
    join_standin_world(5, program.mesh.world)
    try:
        got = []
        for emulate in ("none", "copy"):
            comm = EmulatedComm(program.mesh, "cpu", load_profile("a40"), emulate)
            x = torch.arange(48.0).reshape(8, 6)
            pending = comm.reduce_scatter(x, "tp", async_op=True)
            assert isinstance(pending, Pending)
            outs = [comm.all_gather(x[:2], "tp"), pending.wait(), comm.all_reduce(x.clone(), "dp", "max"),
                    comm.all_gather(x, "pp")]
            with pytest.raises(ValueError, match="reduce_scatter of 3 rows over tp = 8 does not divide"):
                comm.reduce_scatter(x[:3], "tp")
            got.append((outs, list(comm.issued)))
            comm.lanes.close()
        (inline, issued), (threaded, issued_threaded) = got
        assert all(torch.equal(a, b) for a, b in zip(inline, threaded, strict=True)) and issued == issued_threaded
    finally:
        dist.destroy_process_group()


def test_cli_profile_as_rank_then_run_with_it(tmp_path):
    profile = tmp_path / "alone.yaml"
    done = _cli(TINY, "--as-rank", 3, "--repeats", 1, "-o", profile, command="profile")
    assert done.returncode == 0, done.stderr
    assert "rank 3 of 4 alone" in done.stdout and "links are the emulation's" in done.stdout
    done = _cli(TINY, "--as-rank", 3, "--steps", 2, "--profile", profile, "--json")
    assert done.returncode == 0, done.stderr
    assert "measured on this machine" in json.loads(done.stdout)["predicted"]["note"]


def test_stand_in_weights_are_drawn_per_shard():
    """A rank alone draws each shard at its shape from the full tensor's distribution, without
    the full tensor; the real run's shards stay slices of the seeded full tensor."""
    from dhelix.interpreter.ops.weights import WeightPlan

    program = build_run_plan(LARGE["tp8_pp4_dp2"], "big.dhx").program
    real, alone = WeightPlan(program, 3), WeightPlan(program, 3, stand_in=True)
    index = {"tp": 5}
    for name in real.names(layers=[0]):
        a, b = real.shard(name, index), alone.shard(name, index)
        assert a.shape == b.shape and a.dtype == b.dtype
        if a.numel() > 256:
            assert abs(float(a.std()) - float(b.std())) < 0.25 * float(a.std()) + 0.02
    assert not all(bool((real.shard(n, index) == alone.shard(n, index)).all()) for n in real.names(layers=[0]))


def test_zero1_gathers_bf16_weights_not_fp32_masters():
    """ZeRO-1's all-gather of the updated weights sends them in the parameters' dtype (bf16: the
    bytes the simulator prices, as Megatron-LM's distributed optimizer sends), not the fp32
    masters; this rank's own part of every weight is its master rounded to bf16."""
    import functools

    import torch
    import torch.distributed as dist

    from dhelix.dsl.frontend.profiles import load_profile
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.ops.standin import EmulatedComm, join_standin_world
    from dhelix.interpreter.training.optim import for_executor
    from dhelix.interpreter.verify.reference import make_batch

    text = _program("dp = 2", layers=2, nodes=1, gpus=2, schedule="fold none\npipeline one_f_one_b")
    program = build_run_plan(text.replace("dtype = fp32", "dtype = bf16").replace("seed = 3 }", "seed = 3  zero = 1 }"),
                             "z.dhx").program
    join_standin_world(0, program.mesh.world)
    try:
        comm = EmulatedComm(program.mesh, "cpu", load_profile("a40"), "none")
        executor = Executor(program, comm, seed=3, optimizer=functools.partial(for_executor, zero1=True),
                            stand_in_weights=True)
        optimizer = executor.optimizer
        executor.step(make_batch(program, 1))
        sent = []
        gather = comm.all_gather
        comm.all_gather = lambda x, axis, async_op=False: (sent.append((x.dtype, axis)), gather(x, axis, async_op))[1]
        optimizer.step(executor.grads(), 1e-3)
        assert sent and all(dtype == torch.bfloat16 and axis == "dp" for dtype, axis in sent)
        for bucket in optimizer.buckets:
            if bucket.sliced and bucket.master is not None:
                flat = bucket.flat({n: executor.params[n] for n in bucket.names})
                mine = flat[bucket.offset:bucket.offset + bucket.width][:max(0, bucket.total - bucket.offset)]
                assert torch.equal(mine, bucket.master[:mine.numel()].to(torch.bfloat16).float())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tags", [True, False])
def test_receives_are_posted_ahead_of_their_recv_where_messages_carry_tags(tags):
    """A pipeline message crosses only once its receive is posted: with tags (gloo) each rank
    posts its receives RECV_AHEAD RECVs before their turn, in order; without (NCCL, whose
    transfers to a peer run in the order posted) each at its RECV. Rank 1 of pp 2, alone."""
    import torch.distributed as dist

    from dhelix.dsl.frontend.profiles import load_profile
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.execute.pipeline_comm import RECV_AHEAD
    from dhelix.interpreter.ops.standin import EmulatedComm, join_standin_world
    from dhelix.interpreter.verify.reference import make_batch

    text = _program("pp = 2", layers=2, nodes=1, gpus=2, schedule="fold none\npipeline one_f_one_b")
    program = build_run_plan(text, "p.dhx").program
    join_standin_world(1, program.mesh.world)
    try:
        executor = Executor(program, EmulatedComm(program.mesh, "cpu", load_profile("a40"), "none"), seed=3,
                            stand_in_weights=True, use_tags=tags)
        posted = []
        recv = executor.p2p.recv
        executor.p2p.recv = lambda *args: (posted.append((executor.index_now, args[3])), recv(*args))[1]
        executor.step(make_batch(program, 1))
        receives = [(index, action) for index, (action, kind) in enumerate(zip(executor.actions, executor.kinds))
                    if kind == "RECV"]
        assert [action for _, action in posted] == [action for _, action in receives]  # in order, each once
        # Where each was posted: the RECV_AHEAD-th RECV before its own (the first ones before any action).
        expected = [0] * RECV_AHEAD + [index for index, _ in receives[:-RECV_AHEAD]] if tags else \
            [index for index, _ in receives]
        assert [index for index, _ in posted] == expected
    finally:
        dist.destroy_process_group()
