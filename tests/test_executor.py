"""The action executor against the single-process reference (fp32, max abs diff <= 1e-5 for
the loss and every gradient): one process for pp = 1, then one world of 4 gloo ranks that
runs every distributed configuration in turn (spawning a world costs more than the checks).
"""

from __future__ import annotations

import math
import re

import pytest

torch = pytest.importorskip("torch")


from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.dsl.simulator.events import block_orders  # noqa: E402
from dhelix.interpreter.ops.comm import DistComm, SingleRankComm  # noqa: E402
from dhelix.interpreter.execute.executor import ExecutionError, Executor  # noqa: E402
from dhelix.interpreter.verify.harness import broadcast_from_first, check_steps, compare, reference_with  # noqa: E402
from dhelix.dsl.passes.validate import check_fifo  # noqa: E402
from dhelix.interpreter.training.optim import AdamWConfig, DistributedAdamW, for_executor  # noqa: E402
from dhelix.interpreter.verify.reference import Batch, make_batch  # noqa: E402
from dhelix.dsl.planner.si_plan import check_plan, fixed_plan, op_by_op_plan, sequential_plan  # noqa: E402
from dhelix.dsl.simulator.events import planned_pairs  # noqa: E402
from dhelix.interpreter.ops.weights import WeightPlan  # noqa: E402

from distributed import TOL, assert_steps_match, gloo_results  # noqa: E402

SEED, DATA_SEED = 7, 3


def program(mesh: str, pipeline: str, fold: str = "none", microbatches: int = 4, layers: int = 4, train: str = ""):
    """A tiny Llama on ``mesh`` in "nodes" of 2 ranks (1 rank for a 1-rank mesh)."""
    world = math.prod(int(size) for size in re.findall(r"\d+", mesh))
    nodes, per_node = (2, 2) if world == 4 else (1, 1)  # the a40 profile prices the planner's pairs
    return check_text(f"""
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m {{ layers = {layers}  hidden = 32  ffn = 64  heads = 4  kv_heads = 2  seq = 8  vocab = 64
  dtype = fp32  layer = llama }}
cluster {{ nodes = {nodes}  gpus_per_node = {per_node}  profile = "a40" }}
mesh {{ {mesh} }}
train {{ micro_batch = 2  microbatches = {microbatches}  {train} }}
fold {fold}
pipeline {pipeline}
""", "t.dhx")


# -- one process -------------------------------------------------------------------------

@pytest.mark.parametrize("pipeline", ["gpipe", "one_f_one_b", "zb_h1"])
def test_single_rank_step_matches_reference(pipeline):
    prog = program("tp = 1", pipeline, layers=2, microbatches=3)
    batch = make_batch(prog, DATA_SEED)
    executor = Executor(prog, SingleRankComm(), seed=SEED)
    loss = executor.step(batch)
    check = compare(0, loss.item(), executor.grads(), reference_with(prog, _full(prog), batch, SEED))
    assert check.loss_diff <= TOL and check.grad_diff <= TOL, str(check)
    assert executor.recorder.peak_bytes > 0


@pytest.mark.parametrize("pipeline", ["one_f_one_b", "zb_h1"])
def test_selective_recomputation_drops_norm_and_activation_outputs_and_stays_exact(pipeline):
    # Without sequence parallelism both norms' outputs are saved (for the GEMMs' wgrads), and
    # so is the SwiGLU's: all three are dropped, and rebuilt when each layer's backward starts
    # (before W too, under zb_h1's split backward).
    plain = program("tp = 1", pipeline, layers=2, microbatches=3)
    prog = program("tp = 1", pipeline, layers=2, microbatches=3, train="recompute = selective")
    batch = make_batch(prog, DATA_SEED)
    peaks = {}
    for name, p in (("plain", plain), ("selective", prog)):
        executor = Executor(p, SingleRankComm(), seed=SEED)
        loss = executor.step(batch)
        check = compare(0, loss.item(), executor.grads(), reference_with(p, _full(p), batch, SEED))
        assert check.loss_diff <= TOL and check.grad_diff <= TOL, str(check)
        peaks[name] = executor.recorder.peak_bytes
    assert Executor(prog, SingleRankComm(), seed=SEED).selective == ("ln1", "ln2", "act")
    assert peaks["selective"] < peaks["plain"]


def _full(prog):
    plan = WeightPlan(prog, SEED)
    return {name: plan.full(name) for name in plan.names()}


def test_plans_cover_both_dags_in_order():
    prog = program("tp = 1", "gpipe", layers=2)
    fwd, bwd = prog.forward, prog.backward
    for plan in (sequential_plan(fwd, bwd), op_by_op_plan(fwd, bwd)):
        check_plan(plan, fwd, bwd)
    backwards = tuple(reversed(op_by_op_plan(fwd, bwd)))
    with pytest.raises(ValueError, match="before"):
        check_plan(backwards, fwd, bwd)
    with pytest.raises(ValueError, match="missing"):
        check_plan(sequential_plan(fwd, bwd)[:1], fwd, bwd)


def test_a_failing_action_names_rank_action_and_grid():
    prog = program("tp = 1", "one_f_one_b", layers=2, microbatches=2)
    executor = Executor(prog, SingleRankComm(), seed=SEED)
    bad = Batch(torch.zeros((2, 2, 8)), torch.zeros((2, 2, 8), dtype=torch.long))  # float token ids
    with pytest.raises(ExecutionError) as info:
        executor.step(bad)
    text = info.value.render()
    assert "rank 0 (pipeline rank 0) failed in F0.0, step 0" in text
    assert ">F0.0<" in text


# -- one world of 4 gloo ranks ---------------------------------------------------------------

#: name → (mesh, pipeline, fold, SI: on / off / "planned" / "scheduled" / "barrier", ZeRO-1, steps[, layers,
#: micro-batches]); "barrier": op_by_op with the barrier after every segment pair (the CUDA path);
#: ZeRO-1 "forward": its weight gathers left in flight by the optimizer, landing layer by layer
#: under the next step's forward (param_gather = forward)
CASES = {
    "tp2_dp2": ("tp = 2  dp = 2", "one_f_one_b", "none", True, False, 2),
    "tp2_dp2_zero1": ("tp = 2  dp = 2", "one_f_one_b", "none", True, True, 2),
    "pp2_1f1b": ("tp = 2  pp = 2", "one_f_one_b", "none", True, False, 1),
    "pp2_w_helix_si": ("tp = 2  pp = 2", "w_helix", "u", True, False, 2),
    "pp2_w_helix_no_si": ("tp = 2  pp = 2", "w_helix", "u", False, False, 1),
    "pp2_dualpipe_v": ("tp = 2  pp = 2", "dualpipe_v", "u", True, False, 1),
    "pp2_dp2_zb_h1": ("pp = 2  dp = 2", "zb_h1", "none", True, True, 1),
    "pp2_dp2_w_helix_gather_under_forward": ("pp = 2  dp = 2", "w_helix", "u", True, "forward", 3),
    # The gradients reduced after the step (grad_reduce = step) instead of under the backward
    # (the default, every other dp case here), ZeRO-1 and without.
    "tp2_dp2_reduce_after_step": ("tp = 2  dp = 2", "one_f_one_b", "none", True, False, 2),
    # DualPipeV's split backward (W actions, some inside SI blocks' schedules) reducing under it.
    "pp2_dp2_dualpipe_v": ("pp = 2  dp = 2", "dualpipe_v", "u", "planned", True, 2),
    # The CUDA path (the barrier after every segment pair, no held wgrads) reducing under the backward.
    "pp2_dp2_w_helix_pair_barrier": ("pp = 2  dp = 2", "w_helix", "u", "barrier", False, 2),
    "pp2_dp2_w_helix_zero1_reduce_after_step": ("pp = 2  dp = 2", "w_helix", "u", True, True, 2),
    # Four micro-batches launched together per chunk (g = 4 > p), the gathers under them.
    "pp2_dp2_interleaved_launch4": ("pp = 2  dp = 2", "interleaved_1f1b", "loop(2)", True, "forward", 2, 8, 8),
    # GPipe on fold u, each chunk 4 micro-batches in a row (g = 4, not p = 2).
    "pp2_dp2_gpipe_u_launch4": ("pp = 2  dp = 2", "gpipe_u", "u", False, False, 1, 4, 8),
    "pp2_dualpipe_v_planned": ("tp = 2  pp = 2", "dualpipe_v", "u", "planned", False, 1),
    "pp2_w_helix_planned": ("tp = 2  pp = 2", "w_helix", "u", "planned", False, 1),
    "pp2_w_helix_pair_barrier": ("tp = 2  pp = 2", "w_helix", "u", "barrier", False, 1),
    # Two layers per chunk: the next forward layer's lead issued in the layer pair before,
    # the wgrads held across the layer pairs.
    "pp2_w_helix_planned_two_layer_chunks": ("tp = 2  pp = 2", "w_helix", "u", "planned", False, 1, 8, 4),
    "pp2_w_helix_barrier_two_layer_chunks": ("tp = 2  pp = 2", "w_helix", "u", "barrier", False, 1, 8, 4),
    # The block scheduler's order (SI blocks run whole, the strands drifting across layers):
    # two layers per chunk; DualPipeV's split backward with ZeRO-1, reducing under it.
    "pp2_w_helix_scheduled_two_layer_chunks": ("tp = 2  pp = 2", "w_helix", "u", "scheduled", False, 1, 8, 4),
    "pp2_dp2_dualpipe_v_scheduled": ("pp = 2  dp = 2", "dualpipe_v", "u", "scheduled", True, 2),
    "pp2_dp2_w_helix_scheduled": ("pp = 2  dp = 2", "w_helix", "u", "scheduled", True, 2, 8, 4),
    # Tensor and context parallelism under SI: the filler runs wgrads when a rank would wait,
    # in an order that differs by rank; the step's partial-gradient sums must not follow it.
    "tp2_cp2_w_helix_planned": ("tp = 2  cp = 2", "w_helix", "u", "planned", False, 1),
    # Lowered in FIFO order (a gradient no longer overtakes an activation between ranks 0
    # and 1), so it runs without message tags, as on NCCL.
    "pp4_dualpipe_v_untagged": ("pp = 4", "dualpipe_v", "u", "untagged", False, 1, 8, 8),
}


def synthetic_batch(prog, seed: int) -> Batch:
    """Counting sequences (start + stride·i mod vocab, stride 1 or 3): learnable in a few steps."""
    gen = torch.Generator().manual_seed(seed)
    m, mb, seq, vocab = prog.train.microbatches, prog.train.micro_batch, prog.model.get("seq"), prog.model.get("vocab")
    start = torch.randint(0, vocab, (m, mb, 1), generator=gen)
    stride = 1 + 2 * torch.randint(0, 2, (m, mb, 1), generator=gen)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return Batch(tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous())


def _case(name: str):
    mesh, pipeline, fold, si, zero1, steps, *sizes = CASES[name]
    layers, microbatches = sizes or (4, 4)
    train = ("launch = 4" if "launch4" in name else "") + ("  zero = 1  param_gather = forward" if zero1 == "forward" else "") \
        + ("  grad_reduce = step" if "after_step" in name else "")
    prog = program(mesh, pipeline, fold, microbatches, layers, train)
    comm = DistComm(prog.mesh, timeout_s=60)
    # "planned": the planner's segment pairs (rank 0's, as `dhelix run` does).
    plan_for = fixed_plan(broadcast_from_first(planned_pairs(prog))) if si == "planned" else op_by_op_plan
    # "scheduled": the block scheduler's orders (rank 0's, as `dhelix run` does).
    orders = broadcast_from_first(block_orders(prog)) if si == "scheduled" else None
    landed = []  # per ready() call: the gathers in flight before and after it
    reduced = []  # per grad_ready call: (step, action index, the names taken)

    def observed(executor):  # the optimizer `dhelix run` builds, its hooks recording their calls
        optimizer = for_executor(executor, zero1=bool(zero1), norms=False)
        ready, reduce = optimizer.ready, optimizer.reduce

        def ready_logged(names):
            before = len(optimizer._inflight)
            ready(names)
            landed.append((before, len(optimizer._inflight)))

        def reduce_logged(grads):
            taken = reduce(grads)
            reduced.append((executor.steps_run, executor.index_now, sorted(taken)))
            return taken
        optimizer.ready, optimizer.reduce = ready_logged, reduce_logged
        return optimizer

    executor = Executor(prog, comm, seed=SEED, si=bool(si), plan_for=plan_for, block_orders=orders,
                        pair_barrier=True if si == "barrier" else None, use_tags=si != "untagged",
                        optimizer=observed)
    optimizer = executor.optimizer
    checks = check_steps(executor, optimizer, steps, DATA_SEED)
    return {"checks": checks, "landed": landed, "buckets": len(optimizer.buckets), "reduced": reduced,
            "groups": len(executor.param_groups()), "actions": len(executor.actions),
            "param_groups": [sorted(group) for group in executor.param_groups()], "early": optimizer.early,
            "place": (comm.index("pp"), comm.index("tp"), comm.index("dp"))}


def _training(steps: int = 20) -> list[float]:
    prog = program("tp = 2  pp = 2", "w_helix", "u")
    comm = DistComm(prog.mesh, timeout_s=60)
    executor = Executor(prog, comm, seed=SEED, plan_for=op_by_op_plan)
    optimizer = DistributedAdamW(executor.params, comm, config=AdamWConfig(lr=1e-2))
    losses = []
    for step in range(steps):
        losses.append(executor.step(synthetic_batch(prog, step % 4)).item())
        optimizer.step(executor.grads())
    return losses


def _results(rank: int, world: int) -> dict:
    results = {name: _case(name) for name in CASES}
    results["training"] = _training()
    return results


@pytest.fixture(scope="module")
def world_ranks(tmp_path_factory):
    return gloo_results(_results, 4, tmp_path_factory.mktemp("world"))


@pytest.fixture(scope="module")
def world_results(world_ranks):
    return world_ranks[0]


@pytest.mark.parametrize("name", list(CASES))
def test_distributed_step_matches_reference(world_results, name):
    assert_steps_match(world_results[name]["checks"], CASES[name][5], TOL)


@pytest.mark.parametrize("name", ["tp2_dp2", "tp2_dp2_zero1", "pp2_dp2_w_helix_gather_under_forward",
                                  "pp2_dp2_zb_h1", "pp2_dp2_w_helix_pair_barrier", "pp2_dp2_dualpipe_v",
                                  "pp2_dp2_dualpipe_v_scheduled", "pp2_dp2_w_helix_scheduled"])
@pytest.mark.parametrize("rank", range(4))
def test_gradients_are_reduced_under_the_backward_layer_by_layer(world_ranks, name, rank):
    result = world_ranks[rank][name]
    steps, reduced = CASES[name][5], result["reduced"]
    # One reduction per step of each layer's bucket and of the LM head's with the final
    # norm's; the embedding's is left to the step.
    groups = result["param_groups"]
    expected = [g for g in groups if g != ["embedding"]]
    assert sorted(names for _, _, names in reduced) == sorted(expected * steps)
    # Under the backward: with the U fold, chunk 1's layers are reduced while chunk 0's
    # backwards still run, before the step's last action; without it every layer's last
    # backward is in the last action (B, or W for zb_h1), which issues them layer by layer.
    first_step = [index for step, index, _ in reduced if step == 0]
    assert min(first_step) < result["actions"] - 1 if CASES[name][2] == "u" else \
        set(first_step) == {result["actions"] - 1}
    # The same layers in the same order on the other dp replica of this stage, the order
    # every replica issues its collectives in.
    pp, tp, dp = result["place"]
    (peer,) = [r[name]["reduced"] for r in world_ranks if r[name]["place"] == (pp, tp, 1 - dp)]
    assert [names for _, _, names in reduced] == [names for _, _, names in peer]


def test_grad_reduce_step_reduces_nothing_under_the_backward(world_results):
    for name in ("tp2_dp2_reduce_after_step", "pp2_dp2_w_helix_zero1_reduce_after_step"):
        assert world_results[name]["reduced"] == [] and not world_results[name]["early"]
    assert world_results["tp2_dp2"]["early"]


def test_zero1_gathers_land_layer_by_layer_under_the_next_forward(world_results):
    result = world_results["pp2_dp2_w_helix_gather_under_forward"]
    # Rank 0 (stage 0 and the last stage under the U fold): the embedding, its layers and the
    # head each a bucket, gathered in the order its forwards first read them.
    assert result["buckets"] == result["groups"] >= 4
    landings = [before - after for before, after in result["landed"] if before > after]
    # Steps 2 and 3 began with every bucket in flight; each forward landed only its own.
    assert len(landings) == 2 * result["buckets"] and set(landings) == {1}
    assert max(before for before, _ in result["landed"]) == result["buckets"]


def test_si_on_and_off_give_the_same_result(world_results):
    on, off = world_results["pp2_w_helix_si"]["checks"][0], world_results["pp2_w_helix_no_si"]["checks"][0]
    assert abs(on.loss - off.loss) <= 1e-6
    assert abs(on.grad_diff - off.grad_diff) <= TOL


def test_receives_out_of_send_order_need_tags():
    import attrs

    prog = program("pp = 4", "dualpipe_v", "u", 8, 8)
    assert check_fifo(prog.lowered) == []
    row = list(prog.lowered.actions[1])
    hoisted = next(i for i, a in enumerate(row) if str(a) == "RECV_F6.0<0")  # lowered before RECV_B0.1<0
    row.insert(hoisted + 1, row.pop(hoisted))
    crossed = attrs.evolve(prog.lowered, actions=(prog.lowered.actions[0], tuple(row), *prog.lowered.actions[2:]))
    prog = attrs.evolve(prog, lowered=crossed)
    assert check_fifo(crossed)
    with pytest.raises(ValueError, match="not in the same order on both sides"):
        Executor(prog, SingleRankComm(), use_tags=False)


def test_twenty_steps_reduce_the_loss(world_results):
    losses = world_results["training"]
    assert len(losses) == 20
    assert losses[-1] < 0.8 * losses[0], losses



def test_the_model_ends_leave_their_reductions_in_flight_and_finish_on_the_wait():
    # The embedding's forward reduction, the head backward's reduction and the embedding
    # backward's gather may stay in flight (an SI block issues them asynchronously): the
    # results on the wait equal the synchronous ones, and nothing is added before it.
    from dhelix.interpreter.ops.comm import Pending
    from dhelix.interpreter.execute.model_ends import EmbedRun, HeadRun

    gen = torch.Generator().manual_seed(0)
    comm = SingleRankComm()
    embedding, norm, head = (torch.randn(shape, generator=gen) for shape in ((32, 16), (16,), (16, 32)))
    ids, targets = torch.randint(32, (8,), generator=gen), torch.randint(32, (8,), generator=gen)
    results = {}
    for async_op in (False, True):
        grads: dict = {}
        embed = EmbedRun(embedding, comm, 0, True, grads)
        x = embed.forward(ids, async_op=async_op)
        assert isinstance(x, Pending) == async_op
        x = x.wait() if async_op else x
        run = HeadRun(norm, head, comm, 0, True, grads)
        loss = run.forward(x * 1.5, targets)
        grad = run.backward(0.5, async_op=async_op)
        if async_op:
            assert isinstance(grad, Pending) and "final_norm" not in grads  # the norm runs on the wait
            grad = grad.wait()
        done = embed.backward(grad * 1.5, async_op=async_op)
        if async_op:
            assert isinstance(done, Pending) and "embedding" not in grads
            done.wait()
        results[async_op] = (loss, grad, dict(grads))
    (loss, grad, grads), (aloss, agrad, agrads) = results[False], results[True]
    assert torch.equal(loss, aloss) and torch.equal(grad, agrad) and grads.keys() == agrads.keys()
    assert all(torch.equal(grads[name], agrads[name]) for name in grads)


def _mesh_groups(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dhelix.dsl.core.mesh import Mesh

    mesh = Mesh(("tp", "cp", "dp", "pp"), (2, 1, 1, 2), gpus_per_node=2)
    comm = DistComm(mesh, timeout_s=30)
    device_mesh = comm.device_mesh
    return {"names": device_mesh.mesh_dim_names, "shape": tuple(device_mesh.mesh.shape),
            "groups": {axis: tuple(dist.get_process_group_ranks(comm._groups[axis])) for axis in ("tp", "pp")},
            "sub": {axis: tuple(dist.get_process_group_ranks(comm._groups[axis])) for axis in comm._groups
                    if "." in axis}}


def test_the_process_groups_come_from_a_device_mesh_with_the_mesh_s_layout(tmp_path):
    from dhelix.dsl.core.mesh import Mesh

    mesh = Mesh(("tp", "cp", "dp", "pp"), (2, 1, 1, 2), gpus_per_node=2)
    for rank, got in enumerate(gloo_results(_mesh_groups, 4, tmp_path)):
        # DeviceMesh lists the outermost dim first; size-1 dims are left out.
        assert got["names"] == ("pp", "tp") and got["shape"] == (2, 2)
        for axis in ("tp", "pp"):
            assert got["groups"][axis] == next(g for g in mesh.groups(axis) if rank in g)
        assert got["sub"] == {}  # tp lies inside a node: no group partition sub-axes


def test_the_executor_is_built_whole_in_its_constructor():
    """Every attribute the Executor's methods assign is first set in ``__init__`` (a step
    resets its state; it adds none)."""
    import ast
    import inspect

    from dhelix.interpreter.execute import executor as module

    tree = ast.parse(inspect.getsource(module))
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Executor")
    assigned: dict[str, set[str]] = {}
    for method in (node for node in cls.body if isinstance(node, ast.FunctionDef)):
        for node in ast.walk(method):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in (t for tg in targets for t in ast.walk(tg)):
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    assigned.setdefault(target.attr, set()).add(method.name)
    outside = sorted(name for name, methods in assigned.items() if "__init__" not in methods)
    assert outside == [], f"first set outside __init__: {outside}"
