"""``train { zero = 2 }``: ZeRO-2, the baseline Centauri compares with — the optimizer states
and the gradients sharded over dp, each micro-batch's layer gradients reduce-scattered after
its backward (no full gradient kept across micro-batches), the weights replicated and
all-gathered after the update as under ZeRO-1. Simulated (one reduce-scatter per layer and
micro-batch) and run exactly on 4 gloo ranks."""

from __future__ import annotations

import pytest

from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.simulator.events import simulate

TEXT = """
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m {{ layers = 4  hidden = 32  ffn = 64  heads = 4  kv_heads = 4  seq = 8  vocab = 64  dtype = fp32
  layer = llama }}
cluster {{ nodes = 2  gpus_per_node = 2  profile = "a40" }}
mesh {{ pp = 2  dp = 2 }}
train {{ micro_batch = 2  microbatches = 4  zero = {zero} }}
fold {fold}
pipeline {pipeline}
"""


def program(zero: int, pipeline: str = "one_f_one_b", fold: str = "none"):
    return check_text(TEXT.format(zero=zero, pipeline=pipeline, fold=fold), "t.dhx")


def _layer_reductions(sim, rank: int) -> list:
    return [e for e in sim.events if e.rank == rank and e.name.startswith("reduce_scatter") and "layer" in e.name]


def test_zero2_reduce_scatters_each_micro_batch_s_layer_gradients_where_zero1_does_it_once():
    one, two = simulate(program(1)), simulate(program(2))
    layers_per_rank, m = 2, 4
    assert len(_layer_reductions(one, 0)) == layers_per_rank
    assert len(_layer_reductions(two, 0)) == layers_per_rank * m
    assert all(e.args["bytes"] == _layer_reductions(one, 0)[0].args["bytes"] for e in _layer_reductions(two, 0))
    # Four times the gradient traffic over the two-node link: the step is longer.
    assert two.step_time > one.step_time


def test_the_simulation_names_zero2_not_zero1():
    from dhelix.dsl.simulator.report import describe

    assert describe(simulate(program(2))).endswith("ZeRO-2 (optimizer states and gradients sharded)")
    assert describe(simulate(program(1))).endswith("ZeRO-1 optimizer")


def test_gradients_are_reduced_in_fp32_and_weights_gathered_in_the_model_dtype():
    # The interpreter reduces the fp32 main gradients (as Megatron-LM does for bf16) and
    # gathers ZeRO-1's updated weights in their own dtype: the simulator sends what it sends.
    from dhelix.dsl.simulator.costs import step_costs
    from dhelix.dsl.simulator.events import schedule_plan

    for zero in (1, 2):
        prog = check_text(TEXT.format(zero=zero, pipeline="one_f_one_b", fold="none").replace("fp32", "bf16"), "t.dhx")
        sim = simulate(prog)
        params = step_costs(prog, schedule_plan(prog)).params
        reductions = _layer_reductions(sim, 0)
        assert reductions and all(e.args["bytes"] == params.layer_dense * 4 for e in reductions)
        # Rank 0 holds the first stage: the embedding and two layers, gathered after the update.
        gathers = [e for e in sim.events if e.rank == 0 and e.name == "all_gather weights"]
        assert sum(e.args["bytes"] for e in gathers) == (params.embedding + 2 * params.layer_dense) * 2


def test_the_search_s_floor_counts_the_gradient_reductions_one_after_another():
    # A rank's reductions run one after another before its optimizer: the untimed floor a
    # search prunes with is at least their sum (here far above the compute), never above the step.
    from dhelix.dsl.simulator.costs import step_costs
    from dhelix.dsl.simulator.events import untimed

    for zero in (1, 2):
        prog = check_text(TEXT.format(zero=zero, pipeline="one_f_one_b", fold="none").replace("fp32", "bf16"), "t.dhx")
        sim = simulate(prog)
        floor = untimed(prog, step_costs(prog, None)).floor
        reductions = max(sum(e.duration for e in sim.events if e.rank == rank and e.args.get("kind") == "DP"
                             and not e.name.startswith("all_gather")) for rank in range(2))
        assert reductions > 10 * max(rank.busy for rank in sim.ranks)
        assert reductions < floor <= sim.step_time * (1 + 1e-9)



def test_a_layout_s_bound_counts_the_average_rank_s_layer_reductions():
    # The search's layout bound (before any schedule is lowered) takes the average rank's
    # layer reductions too: here far above the compute, so the bound is too, never above
    # the step of any schedule of the layout.
    from dhelix.dsl.passes import pipeline as passes
    from dhelix.dsl.planner.paircost import PairCost
    from dhelix.dsl.search.bound import layout_bound

    for zero in (0, 1, 2):
        steps = []
        for pipeline, fold in (("one_f_one_b", "none"), ("zb_h1", "none"), ("w_helix", "u")):
            prog = check_text(TEXT.format(zero=zero, pipeline=pipeline, fold=fold).replace("fp32", "bf16"), "t.dhx")
            steps.append(simulate(prog))
        dags = passes.rerun(prog, after="check", stop="autodiff")
        bound = layout_bound(dags, PairCost.for_program(dags)).seconds
        compute = max(rank.busy for sim in steps for rank in sim.ranks)
        assert 5 * compute < bound <= min(sim.step_time for sim in steps) * (1 + 1e-9), zero


def _runs(rank: int, world: int) -> dict:
    from dhelix.interpreter.ops.comm import DistComm
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.verify.harness import check_steps
    from dhelix.interpreter.training.optim import for_executor

    results = {}
    for name, (pipeline, fold) in {"1f1b": ("one_f_one_b", "none"), "zb_h1": ("zb_h1", "none"),
                                   "w_helix_si": ("w_helix", "u")}.items():
        prog = program(2, pipeline, fold)
        calls = []

        def observed(executor, calls=calls):
            optimizer = for_executor(executor, zero1=True)
            reduce = optimizer.reduce
            optimizer.reduce = lambda grads: (calls.append(sorted(grads)), reduce(grads))[1]
            return optimizer

        executor = Executor(prog, DistComm(prog.mesh, timeout_s=60), seed=7, optimizer=observed)
        optimizer = executor.optimizer
        results[name] = (check_steps(executor, optimizer, 2, 3), len(calls))
        if name == "1f1b":
            results["states"] = {2: _held(executor, optimizer)}
    prog = program(1)
    executor = Executor(prog, DistComm(prog.mesh, timeout_s=60), seed=7,
                        optimizer=lambda executor: for_executor(executor, zero1=True))
    check_steps(executor, executor.optimizer, 2, 3)
    results["states"][1] = _held(executor, executor.optimizer)
    results["pp"] = executor.comm.index("pp")
    return results


def _held(executor, optimizer) -> tuple[int, int, int]:
    """(model-state bytes the rank counts after its steps, full gradient bytes it holds, the
    optimizer's scratch bytes), each storage once."""
    from dhelix.interpreter.training.train import _storage_bytes, model_state_bytes

    full = _storage_bytes(list(executor.grads().values()))
    return model_state_bytes(executor, optimizer), full, _storage_bytes(optimizer.scratch_tensors())


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    pytest.importorskip("torch")
    from distributed import gloo_results

    return gloo_results(_runs, 4, tmp_path_factory.mktemp("zero2"), timeout=240)


# Rank 0 holds 2 layers: each handed over after each of the 4 micro-batches' backwards, in
# both steps; folded into a U it holds the last stage too, whose final norm and LM head
# are handed over once per step (then dropped, as the layers' are).
@pytest.mark.parametrize(("name", "calls_expected"), [("1f1b", 2 * 2 * 4), ("zb_h1", 2 * 2 * 4),
                                                      ("w_helix_si", 2 * (2 * 4 + 1))])
def test_zero2_runs_exactly_reducing_after_every_micro_batch(world, name, calls_expected):
    from distributed import TOL, assert_steps_match

    checks, calls = world[0][name]
    assert_steps_match(checks, 2, TOL)
    assert calls == calls_expected


def test_zero2_drops_the_layers_full_gradients_and_holds_less_than_zero1(world):
    # ZeRO-1 keeps every full gradient of the step; ZeRO-2 only the model ends' (handed
    # over at the step's end) besides the optimizer's 1/dp slices of the layers'.
    for rank in world:
        (states1, full1, scratch1), (states2, full2, scratch2) = rank["states"][1], rank["states"][2]
        assert full2 < full1 / 2
        assert states2 < states1
        # ... and never makes the flat fp32 buffer of the layers' gradients (each micro-batch
        # is reduce-scattered from a buffer of its own): besides the flat parameters both
        # update, only the model ends' gradient buffer is scratch.
        assert scratch2 - scratch1 < full1 / 2


@pytest.mark.parametrize("zero", [1, 2])
def test_predicted_model_states_within_ten_percent_of_what_the_ranks_count(world, zero):
    predicted = simulate(program(zero)).ranks
    for rank in world:
        counted = rank["states"][zero][0]
        assert abs(predicted[rank["pp"]].states.total / counted - 1) < 0.10, (zero, rank["pp"], counted)


def test_model_states_count_zero2_layer_gradients_over_dp():
    from dhelix.dsl.simulator.memory import model_states

    one = model_states(1000, 0, "fp32", zero1=True, dense_group=4, expert_group=1)
    two = model_states(1000, 0, "fp32", zero1=True, dense_group=4, expert_group=1, grads_sharded=800)
    assert (one.params, one.optimizer) == (two.params, two.optimizer)
    assert two.grads == (200 + 800 / 4) * 4


def test_search_bound_counts_zero2_gradients_sharded_and_stays_below_the_simulated_peak():
    from dhelix.dsl.search.bound import layout_bound
    from dhelix.dsl.planner.paircost import PairCost

    bounds = {}
    for zero in (1, 2):
        prog = program(zero)
        bounds[zero] = layout_bound(prog, PairCost(prog.profile, prog.model.dtype, seq=prog.model.get("seq"))).memory
        sim = simulate(prog)
        assert bounds[zero] <= max(r.states.total + r.activations for r in sim.ranks)
    assert bounds[2] < bounds[1]
