"""MoE with expert parallelism (ep > 1) against the single-process reference (fp32, max abs
diff <= 1e-5): the EP dispatch/combine of :mod:`dhelix.interpreter.ops.moe` with real variable
splits, the backward all_to_alls as their transposes, and the optimizer summing expert
gradients over the replicas of each expert shard (edp) but dense ones over dp.

Two gloo worlds: 2 ranks (dp = ep = 2) for one layer, 4 ranks for executor steps.
"""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.interpreter.ops.comm import AXES, EDP, Communicator, DistComm, expert_dp_groups  # noqa: E402
from dhelix.interpreter.execute.executor import Executor  # noqa: E402
from dhelix.interpreter.verify.harness import check_steps  # noqa: E402
from dhelix.interpreter.execute.layer_exec import LayerPlan, LayerRun  # noqa: E402
from dhelix.interpreter.ops.moe import COMBINE, DISPATCH, a2a_roles  # noqa: E402
from dhelix.interpreter.training.optim import DistributedAdamW, for_executor  # noqa: E402
from dhelix.interpreter.verify.reference import reference_layer  # noqa: E402
from dhelix.dsl.planner.si_plan import op_by_op_plan  # noqa: E402
from dhelix.interpreter.ops.weights import WeightPlan, param_name  # noqa: E402

from distributed import TOL, assert_steps_match, gloo_results, join, run_ranks  # noqa: E402

SEED, DATA_SEED, MICRO_BATCH = 13, 4, 2


def program(mesh: str, pipeline: str = "one_f_one_b", fold: str = "none", layers: int = 2,
            microbatches: int = 2, nodes: int = 1, per_node: int = 2, zero: int = 0, recompute: str = "none"):
    """A tiny MoE model (4 experts, top-2) on ``mesh``."""
    return check_text(f"""
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m {{ layers = {layers}  hidden = 32  ffn = 64  heads = 4  kv_heads = 2  seq = 8  vocab = 64
  experts = 4  top_k = 2  dtype = fp32  layer = moe }}
cluster {{ nodes = {nodes}  gpus_per_node = {per_node}  profile = "a40" }}
mesh {{ {mesh} }}
train {{ micro_batch = {MICRO_BATCH}  microbatches = {microbatches}  zero = {zero}  recompute = {recompute} }}
fold {fold}
pipeline {pipeline}
""", "t.dhx")


# -- one process -------------------------------------------------------------------------

def test_dispatch_and_combine_roles_and_their_transposes():
    prog = program("dp = 2  ep = 2")
    roles = a2a_roles(prog.forward, prog.backward)
    assert roles == {"dsp": DISPATCH, "cmb": COMBINE, "cmb.bwd": DISPATCH, "dsp.bwd": COMBINE}


def test_expert_dp_groups_pair_the_replicas_of_one_shard():
    mesh = program("dp = 4  ep = 2", per_node=4).mesh
    assert mesh.groups("ep") == [(0, 1), (2, 3)]
    assert expert_dp_groups(mesh) == [(0, 2), (1, 3)]
    comm = Communicator()
    comm.mesh, comm.rank = mesh, 3
    assert (comm.size(EDP), comm.index(EDP), comm.index("ep"), comm.group_ranks(EDP)) == (2, 1, 1, (1, 3))


def test_the_optimizer_refuses_to_guess_the_expert_parameters():
    prog = program("dp = 2  ep = 2")
    comm = Communicator()
    comm.mesh = prog.mesh
    with pytest.raises(ValueError, match="sharded over ep"):
        DistributedAdamW({"w": torch.zeros(3)}, comm)


# -- two ranks: one layer at dp = ep = 2 ----------------------------------------------------

def layer_case(plan: WeightPlan, skewed: bool):
    """The full layer weights, the two ranks' inputs and output gradients. ``skewed`` makes
    the router send almost every token to experts 0 and 1 (both on ep rank 0): very uneven
    splits, rank 1 receiving few or no rows."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    tokens, hidden = MICRO_BATCH * plan.program.model.get("seq"), plan.program.model.get("hidden")
    weights = {op: plan.full(param_name(0, op)) for op in plan.layer_specs}
    x = torch.randn(2 * tokens, hidden, generator=gen)
    if skewed:
        direction = torch.randn(hidden, generator=gen)
        x = x + 4 * direction  # every token leans the same way…
        weights["rt"] = weights["rt"].clone()
        weights["rt"][:, 0] += 3 * direction / direction.norm()  # …which experts 0, 1 favour
        weights["rt"][:, 1] += 2 * direction / direction.norm()
    return weights, x, 0.1 * torch.randn(2 * tokens, hidden, generator=gen)


def _layer_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    join(rank, world, port)
    try:
        prog = program("dp = 2  ep = 2")
        comm, plan = DistComm(prog.mesh), WeightPlan(prog, SEED)
        index = {axis: comm.index(axis) for axis in AXES}
        layer_plan = LayerPlan.build(prog.forward, prog.backward, MICRO_BATCH)
        results = {}
        for skewed in (False, True):
            full, x, dout = layer_case(plan, skewed)
            # This rank's expert shard of the (possibly skewed) full weights, its own tokens.
            weights = {op: plan.spec(param_name(0, op)).take(w, index["ep"], 2) for op, w in full.items()}
            for async_comm in (False, True):
                run = LayerRun(layer_plan, weights, comm)
                run.start(x.chunk(2)[rank])
                for op in layer_plan.fwd.ops:
                    run.forward_op(op, async_op=async_comm and op.kind == "comm")
                out = run.output()
                layout = run.routing["ep"]
                run.start_backward(dout.chunk(2)[rank])
                for op in layer_plan.bwd.ops:
                    run.backward_op(op, async_op=async_comm and op.kind == "comm")
                results[skewed, async_comm] = dict(out=out, dx=run.input_grad(), grads=run.grads,
                                                   send=layout.send, recv=layout.recv)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def layer_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("moe_layer")
    run_ranks(_layer_worker, 2, str(out_dir))
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(2)]


def assert_close(got, want, what):
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"{what}: max abs diff {diff:.3g}"


@pytest.mark.parametrize("async_comm", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("skewed", [False, True], ids=["seeded", "skewed"])
def test_ep2_layer_matches_reference(layer_results, skewed, async_comm):
    ranks = [r[skewed, async_comm] for r in layer_results]
    plan = WeightPlan(program("dp = 2  ep = 2"), SEED)
    full, x, dout = layer_case(plan, skewed)
    # Rank r's rows are micro-batch r: the reference runs both as one of twice the size.
    weights = {op: w.clone().requires_grad_(True) for op, w in full.items()}
    x.requires_grad_(True)
    want = reference_layer(plan.full_forward, weights, x, 2 * MICRO_BATCH)
    want.backward(dout)
    assert_close(torch.cat([r["out"] for r in ranks]), want.detach(), "output")
    assert_close(torch.cat([r["dx"] for r in ranks]), x.grad, "input gradient")
    for op in plan.layer_specs:
        name, pieces = param_name(0, op), [r["grads"][op] for r in ranks]
        # Experts: each rank's shard already has both ranks' tokens; dense: a dp sum.
        got = plan.join(name, pieces) if plan.spec(name).axis == "ep" else sum(pieces)
        assert_close(got, weights[op].grad, f"gradient of {op}")
    # What the ranks sent each other is a transpose, and the splits really vary.
    assert [ranks[0]["send"][1], ranks[1]["send"][0]] == [ranks[1]["recv"][0], ranks[0]["recv"][1]]
    splits = ranks[0]["send"] + ranks[1]["send"]
    if skewed:
        assert sum(ranks[1]["recv"]) < sum(ranks[0]["recv"]) // 4, splits
    assert len(set(splits)) > 1, splits


# -- four ranks: executor steps with the optimizer ---------------------------------------------

#: name → (mesh, pipeline, fold, si, zero level, steps, recompute)
CASES = {
    # Two EP groups on two pipeline stages, strand-interleaved (the ep all_to_alls of two
    # micro-batches interleave); edp groups of one rank.
    "dp2_ep2_pp2_w_helix": ("dp = 2  ep = 2  pp = 2", "w_helix", "u", True, 0, 2, "none"),
    # Two EP blocks: the expert gradients are summed over edp groups of two ranks.
    "dp4_ep2": ("dp = 4  ep = 2", "one_f_one_b", "none", False, 0, 2, "none"),
    "dp4_ep2_zero1": ("dp = 4  ep = 2", "one_f_one_b", "none", False, 1, 2, "none"),
    # ZeRO-2: each micro-batch's layer gradients reduce-scattered, the expert ones over edp.
    "dp4_ep2_zero2": ("dp = 4  ep = 2", "one_f_one_b", "none", False, 2, 2, "none"),
    # Full recomputation: the forward's replay routes again and reuses the first run's layout.
    "dp4_ep2_recompute_full": ("dp = 4  ep = 2", "one_f_one_b", "none", False, 0, 2, "full"),
}


def _case(name: str):
    mesh, pipeline, fold, si, zero, steps, recompute = CASES[name]
    layers, microbatches = (4, 4) if "pp" in mesh else (2, 2)
    prog = program(mesh, pipeline, fold, layers, microbatches, nodes=2, per_node=2, zero=zero,
                   recompute=recompute)
    comm = DistComm(prog.mesh, timeout_s=60)
    # As `dhelix run` builds it: dense and expert buckets per layer, reduced under the backward.
    executor = Executor(prog, comm, seed=SEED, si=si, plan_for=op_by_op_plan,
                        optimizer=functools.partial(for_executor, zero1=zero > 0, norms=False))
    optimizer = executor.optimizer
    return check_steps(executor, optimizer, steps, DATA_SEED)


def _results(rank: int, world: int) -> dict:
    return {name: _case(name) for name in CASES}


@pytest.fixture(scope="module")
def world_results(tmp_path_factory):
    return gloo_results(_results, 4, tmp_path_factory.mktemp("moe_world"))[0]


@pytest.mark.parametrize("name", list(CASES))
def test_ep_steps_match_reference_and_adamw(world_results, name):
    assert_steps_match(world_results[name], CASES[name][5], TOL)
