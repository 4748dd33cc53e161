"""The step simulator: its event engine against the unit-time reference, its exact small
cases, and what it must show on the paper's configurations (examples/*.dhx):

* SI peak memory within 5% of the single strand, taken as **the same schedule with SI off**
  (every SI block runs its forward, then its backward: same placement, same model states);
  and at most one layer plus the LM head's activations above 1F1B without folding;
* the W schedule with SI has no larger bubble share than 1F1B without folding, on the ideal
  pipeline the paper's claim is about (free transfers, no embedding / LM head); with them the
  W's doubled crossings and its first-and-last-stage rank 0 do cost bubble (see the report);
* exposed communication never grows along the Fig. 15 ablation TP → +CP → +comm-with-comm →
  +wgrad on llama39b_cp2_a40.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

import attrs
import pytest

from dhelix.cli import main
from dhelix.dsl.core.dtypes import dtype_bytes
from dhelix.dsl.simulator.memory import head_activations, layer_activations
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.simulator.costs import HeadCosts, LayerCosts, Work, cost_of, step_costs
from dhelix.dsl.simulator.report import compare, format_comparison, unfolded_1f1b
from dhelix.dsl.simulator.events import schedule_plan, simulate
from dhelix.dsl.passes.unittime import unit_time
from conftest import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.dhx"))
#: The examples on the W schedule (fold u), which the tests below compare with their 1F1B; the
#: others (an interleaved 1F1B) are simulated by the CLI tests and their own.
EXAMPLE_IDS = [path.stem for path in EXAMPLES if re.search(r"^fold u$", path.read_text(), re.M)]


@lru_cache(maxsize=None)
def example(name: str):
    path = ROOT / "examples" / f"{name}.dhx"
    return check_text(path.read_text(), str(path))


def replicated_text(name: str) -> str:
    """The example's text without its ``zero = 1`` (the optimizer states replicated)."""
    text = (ROOT / "examples" / f"{name}.dhx").read_text()
    assert "  zero = 1\n" in text
    return text.replace("  zero = 1\n", "")


@lru_cache(maxsize=None)
def replicated(name: str):
    """The example checked with its optimizer states replicated (no ZeRO-1)."""
    return check_text(replicated_text(name), str(ROOT / "examples" / f"{name}.dhx"))


@lru_cache(maxsize=None)
def compared(name: str):
    """The example as written, without SI and as 1F1B without folding (the first three
    columns of --compare; the examples all run SI on a folded pipeline)."""
    return compare(example(name))[:3]


def _peak_activations(sim) -> float:
    return max(rank.activations for rank in sim.ranks)


# ---------------------------------------------------------------- the must-shows

@pytest.mark.parametrize("name", EXAMPLE_IDS)
def test_si_peak_memory_is_within_5_percent_of_the_single_strand(name):
    si, off, _ = compared(name)
    assert si.si and not off.si
    assert si.peak_rank.memory <= 1.05 * off.peak_rank.memory
    for with_si, without in zip(si.ranks, off.ranks, strict=True):
        assert with_si.states == without.states
        assert with_si.memory <= 1.05 * without.memory


@pytest.mark.parametrize("name", EXAMPLE_IDS)
def test_si_holds_at_most_one_layer_and_the_lm_head_more_than_1f1b(name):
    program = example(name)
    si, _, unfolded = compared(name)
    layer = layer_activations(program.forward, program.backward, program.model.dtype, False).total
    head = head_activations(program, False).total
    assert _peak_activations(si) <= _peak_activations(unfolded) + layer + head + 1.0


def _ideal(program, plan=None):
    """The program's step costs with free pipeline transfers and no embedding / LM head."""
    costs = step_costs(program, plan, cost_of(program))
    return attrs.evolve(costs, p2p_seconds=0.0, heads=HeadCosts())


@pytest.mark.parametrize("name", EXAMPLE_IDS)
def test_w_with_si_has_no_larger_bubble_share_than_1f1b_on_the_ideal_pipeline(name):
    # The ideal pipeline has no weight gathers either: under param_gather = forward a
    # forward's wait for them would count as bubble, the schedule's or not.
    program = example(name)
    program = attrs.evolve(program, train=attrs.evolve(program.train, param_gather="step"))
    plan = schedule_plan(program)
    unfolded = unfolded_1f1b(program)
    w_si = simulate(program, costs=_ideal(program, plan))
    w_off = simulate(program, si=False, costs=_ideal(program, plan))
    one_f_one_b = simulate(unfolded, costs=_ideal(unfolded))
    assert w_si.bubble_ratio <= one_f_one_b.bubble_ratio + 1e-9
    # Without SI the W is the 1F1B pipeline folded: the same bubble (pipelines.dhx, unit time).
    assert w_off.bubble_ratio == pytest.approx(one_f_one_b.bubble_ratio, abs=1e-9)


@pytest.mark.parametrize("name", EXAMPLE_IDS)
def test_the_w_schedule_doubles_the_pipeline_crossings(name):
    si, _, unfolded = compared(name)
    assert sum(r.sends for r in si.ranks) == 2 * sum(r.sends for r in unfolded.ranks)


ABLATION = {
    "TP": "overlap tp\n  comm_with_comm off",
    "+CP": "overlap tp, cp\n  comm_with_comm off",
    "+comm-with-comm": "overlap tp, cp\n  comm_with_comm on",
    "+wgrad": "overlap tp, cp\n  comm_with_comm on\n  movable wgrad",
}


def test_exposed_communication_shrinks_along_the_ablation_order():
    path = ROOT / "examples" / "llama39b_cp2_a40.dhx"
    text = path.read_text()
    sims = []
    for body in ABLATION.values():
        variant = re.sub(r"strands \{.*?\}", "strands {\n  " + body + "\n}", text, flags=re.S)
        assert variant != text or body == ABLATION["+wgrad"]
        sims.append(simulate(check_text(variant, str(path))))
    layer = [s.mean("layer_exposed") for s in sims]
    total = [s.mean("layer_exposed") + s.mean("pp_exposed") + s.mean("dp_exposed") for s in sims]
    for earlier, later in zip(sims, sims[1:]):
        assert later.mean("layer_exposed") <= earlier.mean("layer_exposed") + 1e-12, layer
        assert later.step_time <= earlier.step_time + 1e-12
    assert all(b <= a + 1e-12 for a, b in zip(total, total[1:])), total
    assert layer[-1] < layer[0]


# ---------------------------------------------------------------- the engine, exactly

def tiny_program(pipeline: str, fold: str, p: int, m: int, layers_per_stage: int = 2, dp: int = 1):
    chunks = {"none": 1, "u": 2}.get(fold, 2)
    text = f"""
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model tiny {{
  layers = {layers_per_stage * p * chunks}  hidden = 64  ffn = 128  heads = 4  kv_heads = 2
  seq = 32  vocab = 256  dtype = fp32  layer = llama
}}
cluster {{ nodes = 1  gpus_per_node = {p * dp}  profile = "a40" }}
mesh {{ dp = {dp}  pp = {p} }}
train {{ micro_batch = 1  microbatches = {m} }}
fold {fold}
pipeline {pipeline}
"""
    return check_text(text, f"{pipeline}.dhx")


def unit_costs(program):
    """Costs making every chunk action cost its unit time (F 1, B 2 or 1 + W 1, SI the sum)."""
    n = len(program.placement.stages[0].layers)
    split = program.lowered.split
    layer = LayerCosts(forward=Work(1 / n), backward=Work(2 / n), backward_input=Work(1 / n),
                       weight=Work(1 / n), pair=Work((2 if split else 3) / n))
    costs = step_costs(program, None, cost_of(program))
    return attrs.evolve(costs, layer=layer, heads=HeadCosts(), p2p_seconds=0.0)


SCHEDULES = [("gpipe", "none"), ("one_f_one_b", "none"), ("zb_h1", "none"), ("interleaved_1f1b", "loop(2)"),
             ("w_helix", "u"), ("dualpipe_v", "u"), ("looped_bfs", "loop(2)"), ("interleaved_zb", "loop(2)"),
             ("zbv", "u"), ("one_f_one_b_overlap", "none")]


@pytest.mark.parametrize("pipeline, fold", SCHEDULES)
def test_free_transfers_and_unit_costs_reproduce_the_unit_time_run(pipeline, fold):
    for p, m in ((1, 4), (2, 4), (3, 6), (4, 8)):
        program = tiny_program(pipeline, fold, p, m)
        sim = simulate(program, costs=unit_costs(program))
        timing = unit_time(program.lowered)
        assert sim.pipeline_time == pytest.approx(timing.makespan, rel=1e-9)
        assert sum(r.busy for r in sim.ranks) == pytest.approx(timing.busy, rel=1e-9)
        assert sim.bubble_ratio == pytest.approx(float(timing.bubble_ratio), abs=1e-9)


def test_two_stage_1f1b_of_one_microbatch_pays_each_transfer_once():
    program = tiny_program("one_f_one_b", "none", 2, 1)
    costs = attrs.evolve(unit_costs(program), p2p_seconds=0.25)
    sim = simulate(program, costs=costs)
    # F on r0, send, F and B on r1, send back, B on r0.
    assert sim.pipeline_time == pytest.approx(1 + 0.25 + 3 + 0.25 + 2)
    assert [r.pp_exposed for r in sim.ranks] == pytest.approx([0.25, 0.25])
    assert [r.sends for r in sim.ranks] == [1, 1]


def test_1f1b_keeps_p_minus_r_microbatches_of_activations():
    p, m = 4, 8
    program = tiny_program("one_f_one_b", "none", p, m)
    sim = simulate(program, costs=unit_costs(program))
    layer = layer_activations(program.forward, program.backward, "fp32", False).total
    head = head_activations(program, False).total
    per_stage = len(program.placement.stages[0].layers) * layer
    expected = [min(p - r, m) * per_stage for r in range(p)]
    expected[-1] += head
    assert [r.activations for r in sim.ranks] == pytest.approx(expected)


def test_si_frees_a_layer_as_it_allocates_one():
    program = tiny_program("w_helix", "u", 2, 8)
    costs = unit_costs(program)
    with_si = simulate(program, costs=costs)
    without = simulate(program, si=False, costs=costs)
    layer = layer_activations(program.forward, program.backward, "fp32", False).total
    per_chunk = len(program.placement.stages[0].layers) * layer
    # Rank 1 holds 2p chunks of activations before its first SI block; inside it, each paired
    # backward layer frees what its forward layer allocates (memory.interleaved): nothing more.
    assert with_si.ranks[1].activations == pytest.approx(2 * 2 * per_chunk)
    assert layer > 0
    assert without.ranks[1].activations == pytest.approx((2 * 2 + 1) * per_chunk)


def test_zero1_shards_the_optimizer_states_over_data_parallel():
    program = replicated("llama39b_a40")
    plain = simulate(program)
    sharded = simulate(program, zero1=True)
    dp = program.mesh.size("dp")
    for a, b in zip(plain.ranks, sharded.ranks, strict=True):
        assert b.states.optimizer * dp == pytest.approx(a.states.optimizer)
        assert b.states.params == a.states.params
        assert b.activations == a.activations
    assert sharded.mean("dp_comm") < plain.mean("dp_comm")  # reduce-scatter + all-gather < all-reduce + …


def test_step_figures_follow_megatrons_count():
    sim = compared("llama39b_a40")[0]
    program = example("llama39b_a40")
    assert sim.tokens == 4 * 16 * 1 * 8192
    assert sim.tflops_per_gpu == pytest.approx(sim.flops / 64 / sim.step_time / 1e12)
    assert sim.mfu == pytest.approx(sim.tflops_per_gpu * 1e12 / program.profile.peak_flops("bf16"))
    assert sim.step_time > sim.pipeline_time > 0
    assert 0 < sim.bubble_ratio < 1


@pytest.mark.parametrize("pipeline, fold", [("one_f_one_b", "none"), ("zb_h1", "none"), ("w_helix", "u"),
                                            ("dualpipe_v", "u"), ("looped_bfs", "loop(2)"),
                                            ("interleaved_zb", "loop(2)"), ("zbv", "u")])
def test_every_gradient_is_synchronised_once(pipeline, fold):
    program = tiny_program(pipeline, fold, 2, 4, dp=2)
    sim = simulate(program, zero1=True)
    synced = sorted(e.name for e in sim.events if e.args and e.args.get("kind") == "DP")
    layers = program.model.get("layers")
    expected = sorted([f"reduce_scatter grads layer {i}" for i in range(layers)]
                      + ["reduce_scatter grads embedding", "reduce_scatter grads LM head"]
                      + ["all_gather weights"] * 2)
    assert synced == expected
    # The optimizer of a rank starts once its last gradient bucket is reduced.
    for rank in range(2):
        optimizer = next(e for e in sim.events if e.rank == rank and e.name == "optimizer")
        reduced = [e.start + e.duration for e in sim.events if e.rank == rank and e.name.startswith("reduce")]
        assert optimizer.start >= max(reduced)


def test_grad_reduce_books_the_layers_reductions_under_the_backward_or_after_it():
    import attrs

    program = tiny_program("w_helix", "u", 2, 4, dp=2)
    late = attrs.evolve(program, train=attrs.evolve(program.train, grad_reduce="step"))
    sims = {mode: simulate(prog, zero1=True) for mode, prog in (("backward", program), ("step", late))}

    def starts(sim, rank, what):  # start times of the rank's DP reductions named with ``what``
        return [e.start for e in sim.events if e.rank == rank and e.args and e.args.get("kind") == "DP"
                and e.name.startswith("reduce") and what in e.name]
    def last(sim, rank):  # when the rank's last action ends
        return max(e.start + e.duration for e in sim.events
                   if e.rank == rank and e.lane == "compute" and e.name != "optimizer")
    for rank in range(2):
        # step: every bucket after the rank's last action; backward: the embedding's still after it.
        assert min(starts(sims["step"], rank, "grads")) >= last(sims["step"], rank)
        assert all(start >= last(sims["backward"], rank) for start in starts(sims["backward"], rank, "embedding"))
    # backward: on rank 0 (stages 0 and 3 of the U) chunk 1's layers finish their backward
    # first and start reducing before its last action ends (rank 1's last two actions are
    # back to back and its lane carries their sends: its reductions queue behind them).
    assert min(starts(sims["backward"], 0, "grads layer")) < last(sims["backward"], 0)
    assert sims["backward"].step_time <= sims["step"].step_time


def test_compare_runs_the_three_variants_on_the_same_batch():
    si, off, unfolded = compared("llama39b_cp2_a40")
    assert (si.label, off.label, unfolded.label) == ("as written", "without SI", "1F1B, fold none")
    assert (unfolded.pipeline, unfolded.fold) == ("one_f_one_b", "none")
    assert si.tokens == off.tokens == unfolded.tokens
    assert si.step_time < off.step_time
    text = format_comparison((si, off, unfolded))
    assert "as written" in text and "1F1B, fold none" in text


# ---------------------------------------------------------------- the command line

def test_simulate_cli_compare(golden, capsys):
    assert main(["simulate", "examples/llama39b_a40.dhx", "--compare"]) == 0
    golden("simulate/llama39b_a40_compare.txt", capsys.readouterr().out)


def test_simulate_cli_report(golden, capsys):
    assert main(["simulate", "examples/tiny_llama_cpu.dhx", "--zero1"]) == 0
    golden("simulate/tiny_llama_cpu_zero1.txt", capsys.readouterr().out)


def test_simulate_cli_needs_a_profile(tmp_path, capsys):
    source = (ROOT / "examples" / "tiny_llama_cpu.dhx").read_text()
    path = tmp_path / "noprofile.dhx"
    path.write_text(source.replace('  profile = "a40"\n', ""))
    assert main(["simulate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "the cost model needs a hardware profile, and the cluster block names none" in err
    assert err.rstrip().endswith("note: while running `dhelix simulate`")
    assert 'cluster { profile = "a40" }' in err and "| cluster {" in err


@pytest.mark.parametrize("argv, message", [
    (["--trace", "out.txt"], "a Chrome trace is a .json file"),
    (["--trace", "no/such/folder/out.json"], "does not exist"),
])
def test_simulate_cli_usage_errors(argv, message, capsys):
    assert main(["simulate", "examples/tiny_llama_cpu.dhx", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_peak_over_the_device_memory_is_a_located_warning_or_with_strict_an_error(capsys, tmp_path):
    path = tmp_path / "llama39b_replicated.dhx"  # the example with its optimizer states replicated
    path.write_text(replicated_text("llama39b_a40").replace('import "stdlib/', 'import "stdlib/'))
    assert main(["simulate", str(path)]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:21:13: warning: pipeline rank 0 needs 65.35 GB at its "
                          "predicted peak (as written), more than the 48 GB of one a40 device\n")
    assert "pipeline rank 1 needs 55.07 GB" in err and "gradients 11.67, optimizer 35.00) and live activations 12.86 GB" in err
    assert main(["simulate", str(path), "--strict"]) == 1
    err = capsys.readouterr().err
    assert "warning:" not in err and "21:13: pipeline rank 0 needs 65.35 GB" in err and err.endswith("2 errors\n")
    assert main(["simulate", str(path), "--zero1", "--strict"]) == 0  # ZeRO-1 fits
    assert capsys.readouterr().err == ""
    assert main(["simulate", "examples/llama39b_a40.dhx", "--strict"]) == 0  # as shipped: ZeRO-1


def test_zero_declared_in_the_train_block_is_zero1():
    program = replicated("llama39b_a40")
    declared = attrs.evolve(program, train=attrs.evolve(program.train, zero=1))
    assert simulate(declared) == simulate(program, zero1=True)


def test_measured_embedding_and_lm_head_times_replace_the_model():
    from dhelix.dsl.frontend.profiles import Measured
    from dhelix.dsl.simulator.costs import head_costs

    program = example("tiny_llama_cpu")
    modelled = head_costs(program)
    times = {"embedding": 1500.0, "embedding.bwd": 700.0, "lm_head": 9000.0, "lm_head.bwd": 2000.0}
    measured = attrs.evolve(program.profile, measured=Measured("fp32", ops=times))
    timed = head_costs(attrs.evolve(program, profile=measured))
    assert timed.embed_forward.seconds == pytest.approx(1.5e-3)
    assert timed.embed_backward.seconds == pytest.approx(0.7e-3)
    assert timed.head_forward.seconds == pytest.approx(9e-3)
    assert timed.head_forward.comm == modelled.head_forward.comm  # the model's communication inside
    # The measured backward includes the LM head's weight gradient, which keeps its modelled share.
    assert timed.head_weight == modelled.head_weight
    assert timed.head_backward.seconds + timed.head_weight.seconds == pytest.approx(2e-3)
    other = attrs.evolve(program.profile, measured=Measured("bf16", ops=times))  # another dtype: unused
    assert head_costs(attrs.evolve(program, profile=other)) == modelled


@pytest.mark.parametrize("name", ["tiny_llama_cpu", "llama39b_a40"])
def test_full_recomputation_keeps_layer_inputs_and_pays_a_forward_per_backward(name):
    program = example(name)
    again = attrs.evolve(program, train=attrs.evolve(program.train, recompute="full"))
    plain, recomputed = simulate(program), simulate(again)
    assert simulate(again, si=False).step_time > simulate(program, si=False).step_time
    assert recomputed.step_time > plain.step_time
    layer = layer_activations(program.forward, program.backward, program.model.dtype, program.lowered.split)
    kept = math.prod(program.forward.input_shape) * dtype_bytes(program.model.dtype)
    for a, b in zip(plain.ranks, recomputed.ranks, strict=True):
        assert b.states == a.states
        assert b.activations < a.activations
        # At most: every layer input in flight, the LM head's, and one layer rebuilt in full
        # (two in an SI pair: the forward strand's and the rebuilt one).
        assert b.activations <= a.activations * kept / layer.total + 2 * layer.total + head_activations(
            program, program.lowered.split).total
    costs, plain_costs = step_costs(again, None), step_costs(program, None)
    assert costs.layer.backward_of(True).seconds == pytest.approx(plain_costs.layer.backward.seconds
                                                         + plain_costs.layer.forward.seconds)


def _recomputing(train: str, si: str = "on"):
    """The tiny example with 8 layers (fold u on 2 ranks: 4 chunks of 2) and ``train`` settings."""
    text = (ROOT / "examples" / "tiny_llama_cpu.dhx").read_text().replace("layers = 4", "layers = 8")
    return check_text(text.replace("  seed = 1234", f"  seed = 1234\n  {train}\n  si = {si}"), "eight.dhx")


@pytest.mark.parametrize("si", ["on", "off"])
def test_recomputing_the_first_layers_of_each_chunk_costs_their_share_of_full_recomputation(si):
    # recompute_layers = 1 of chunks of 2: each rank's 2 chunks recompute one layer each, half
    # of full recomputation's extra work; the memory falls between keeping all and full.
    none, partial, full = (simulate(_recomputing(train, si)) for train in (
        "recompute = none", "recompute = full  recompute_layers = 1", "recompute = full"))
    again = step_costs(_recomputing("recompute = full"), None).layer.again.seconds
    microbatches = 8
    for a, b, c in zip(none.ranks, partial.ranks, full.ranks, strict=True):
        assert a.states == b.states == c.states
        assert c.activations < b.activations < a.activations
        if si == "off":  # each layer pass alone: the busy time adds what each recomputing layer runs again
            assert b.busy - a.busy == pytest.approx(microbatches * 2 * again, rel=1e-9)
            assert c.busy - a.busy == pytest.approx(microbatches * 4 * again, rel=1e-9)
    assert none.step_time < partial.step_time < full.step_time
    # A chunk's layers or more: every layer recomputes, the program is full recomputation's.
    every = simulate(_recomputing("recompute = full  recompute_layers = 2", si))
    assert (every.step_time, [r.memory for r in every.ranks]) == (full.step_time, [r.memory for r in full.ranks])


def test_lighter_first_and_last_stages_move_their_layers_onto_the_middle_ranks():
    # 12 layers on 4 ranks: 3 each, or 2 on the embedding's and the LM head's ranks and 4 on
    # the others; each rank's busy time follows its layers, one layer's forward and backward
    # per micro-batch for each layer moved.
    text = (ROOT / "examples" / "tiny_llama_cpu.dhx").read_text().replace("layers = 4", "layers = 12").replace(
        "tp = 2", "tp = 1").replace("pp = 2", "pp = 4").replace("fold u", "fold none").replace(
        "pipeline w_helix", "pipeline one_f_one_b")
    even = check_text(text, "even.dhx")
    ends = check_text(text.replace("  seed = 1234", "  seed = 1234\n  first_stage_layers = 2  last_stage_layers = 2"),
                      "ends.dhx")
    assert [len(s.layers) for s in ends.placement.stages] == [2, 4, 4, 2]
    layer = step_costs(even, None).layer
    moved = 8 * (layer.forward.seconds + layer.backward.seconds)  # 8 micro-batches, one layer each
    a, b = simulate(even), simulate(ends)
    for rank, sign in zip(range(4), (-1, 1, 1, -1), strict=True):
        assert b.ranks[rank].busy - a.ranks[rank].busy == pytest.approx(sign * moved, rel=1e-9)
        assert (b.ranks[rank].states.params > a.ranks[rank].states.params) == (sign > 0)


@pytest.mark.parametrize("name", ["tiny_llama_cpu", "llama39b_a40"])
def test_selective_recomputation_drops_the_cheap_outputs_and_pays_their_forward_again(name):
    from dhelix.dsl.core.oplib import selective_drops

    program = example(name)
    modes = {mode: attrs.evolve(program, train=attrs.evolve(program.train, recompute=mode))
             for mode in ("selective", "full")}
    plain, selective, full = simulate(program), simulate(modes["selective"]), simulate(modes["full"])
    dropped = selective_drops(program.forward.ops, program.backward.ops)
    assert dropped == ("act",)  # sequence parallel: the norms' outputs are gathered, not saved
    for a, b, c in zip(plain.ranks, selective.ranks, full.ranks, strict=True):
        assert c.activations < b.activations < a.activations and b.states == a.states
    again = (step_costs(modes["selective"], None).layer.backward_of(True).seconds
             - step_costs(program, None).layer.backward.seconds)
    act = next(op for op in program.forward.ops if op.name == "act")
    assert again == pytest.approx(cost_of(program).solo((act,)))


def test_json_holds_the_figures_of_the_tables(capsys):
    import json

    from dhelix.dsl.simulator.report import format_simulation

    path = ROOT / "examples" / "tiny_llama_cpu.dhx"
    assert main(["simulate", str(path), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    program = check_text(path.read_text(), str(path))
    sim = simulate(program, schedule_plan(program, cost_of(program)))
    assert figures["step_s"] == pytest.approx(sim.step_time) and figures["label"] == "as written"
    table = format_simulation(sim)
    assert f"bubble ratio   {100 * figures['bubble_ratio']:.1f}%" in table
    assert f"throughput     {figures['tokens_per_s']:,.0f} tokens/s" in table
    assert [r["rank"] for r in figures["ranks"]] == [0, 1]
    assert main(["simulate", str(path), "--json", "--compare"]) == 0
    compared = json.loads(capsys.readouterr().out)
    assert [c["label"] for c in compared] == ["as written", "without SI", "1F1B, fold none"]
    assert compared[0] == figures


def test_param_gather_forward_moves_zero1_s_weight_gather_under_the_next_forward():
    # llama39b_a40 (dp 4 across nodes): one all-gather per layer and model end, booked from the
    # step's start in the order the rank's forwards read them; each layer's first forward
    # starts after its own; nothing is gathered after the optimizer.
    program = example("llama39b_a40")
    after = attrs.evolve(program, train=attrs.evolve(program.train, zero=1))
    under = attrs.evolve(program, train=attrs.evolve(program.train, zero=1, param_gather="forward"))
    plan = schedule_plan(program)
    step, overlapped = simulate(after, plan), simulate(under, plan)
    gathers = [e for e in overlapped.events if e.rank == 0 and e.name.startswith("all_gather weights")]
    stages = [program.placement.stages[program.lowered.stage_of(0, c)] for c in range(program.lowered.chunks)]
    assert len(gathers) == sum(len(s.layers) for s in stages) + 2  # + the embedding and the LM head
    assert gathers[0].name == "all_gather weights embedding" and gathers[0].start == 0.0
    assert all(b.start >= a.start + a.duration - 1e-12 for a, b in zip(gathers, gathers[1:]))
    optimizer = next(e for e in overlapped.events if e.rank == 0 and e.name == "optimizer")
    assert overlapped.ranks[0].end == pytest.approx(optimizer.start + optimizer.duration)
    assert not any(e.name == "all_gather weights" for e in overlapped.events)
    # The same bytes move (a gather per layer pays its latency), but not after the optimizer.
    assert overlapped.step_time < step.step_time
    assert overlapped.mean("dp_comm") > step.mean("dp_comm")
    for a, b in zip(step.ranks, overlapped.ranks, strict=True):
        assert a.states == b.states and b.dp_exposed <= b.dp_comm


def test_compare_has_no_si_column_where_no_si_runs_and_removes_the_model_level_overlap():
    path = "examples/tiny_llama_zero1_overlap_cpu.dhx"
    program = check_text(open(path).read(), path)
    labels = [sim.label for sim in compare(program)]
    assert labels[-1] == "without model-level overlap"
    flat = check_text(open(path).read().replace("fold u", "fold none").replace("w_helix", "one_f_one_b"), path)
    assert [sim.label for sim in compare(flat)] == ["as written", "without model-level overlap"]


def _first_gap(busy: list[tuple[float, float]], ready: float, seconds: float) -> float:
    """The first idle gap of ``seconds`` at or after ``ready``, by the plain scan of every
    interval (the lane's bisection and block skips must find the same)."""
    from dhelix.dsl.simulator.lane import Lane

    return Lane.scan(sorted(busy), ready, seconds)


@pytest.mark.parametrize("seed", range(4))
def test_a_lane_books_a_bucket_in_the_first_gap_a_plain_scan_finds(seed):
    # The lane skips what ends before the bucket is ready by bisection, and runs of gaps too
    # short by their block's largest: the same starts as scanning every interval. First as
    # the simulator books (pipeline traffic, then buckets each ready after the last one's
    # end), then in any order, with overlapping in-order traffic (param_gather = forward
    # books before the sends) and zero-length bookings mixed in.
    import random

    from dhelix.dsl.simulator.lane import Lane

    rng = random.Random(seed)
    lane, busy = Lane(), []
    for _ in range(300):
        busy.append((lane.in_order(rng.uniform(0, 100), rng.choice((0.0, 0.01, rng.uniform(0, 0.5)))), 0.0))
        busy[-1] = (busy[-1][0], lane.fifo)
    ready = 0.0
    for _ in range(300):
        seconds = rng.choice((0.0, 0.05, 0.2, rng.uniform(0, 2)))
        start = lane.fit(ready, seconds)
        assert start == _first_gap(busy, ready, seconds)
        busy.append((start, start + seconds))
        ready = start + seconds + rng.choice((0.0, rng.uniform(0, 1)))
    for _ in range(300):
        ready, seconds = rng.choice((0.0, 1.0, rng.uniform(0, 150))), rng.choice((0.0, 0.5, rng.uniform(0, 3)))
        if rng.random() < 0.3:
            start = lane.in_order(ready, seconds)
        else:
            start = lane.fit(ready, seconds)
            assert start == _first_gap(busy, ready, seconds)
        busy.append((start, start + seconds))
    assert sorted(lane.busy) == sorted(busy)


def test_the_cores_bound_is_the_host_s_cpu_work_over_its_cores():
    # Two pipeline ranks standing for a world of 8 (4 replicas each); 8 ranks on a host of 2
    # cores. CPU work per rank: busy less exposed layer comm, plus the optimizer, plus
    # comm_busy of its layer, pipeline (counted once, at the sender) and DP communication.
    from dhelix.dsl.frontend.host_cores import HostCores
    from dhelix.dsl.simulator.host_cores import cores_bound, cpu_seconds
    from dhelix.dsl.simulator.simulation import RankStats

    def rank(busy, layer, exposed, pp, dp, opt):
        return RankStats(rank=0, busy=busy, pipeline_end=0.0, end=0.0, layer_comm=layer, layer_exposed=exposed,
                         pp_comm=pp, pp_exposed=0.0, sends=0, send_bytes=0.0, dp_comm=dp, dp_exposed=0.0,
                         optimizer=opt, states=None, activations=0.0, activations_at=0.0)

    ranks = (rank(10.0, 4.0, 3.0, 1.0, 2.0, 1.0), rank(6.0, 2.0, 2.0, 0.5, 0.0, 1.0))
    cores = HostCores(usable=2, ranks=8, comm_busy=0.5)
    work = 4 * ((10 - 3 + 1 + 0.5 * (4 + 1.0 + 2)) + (6 - 2 + 1 + 0.5 * (2 + 0.5)))
    assert cpu_seconds(cores, ranks, 8) == pytest.approx(work)
    assert cores_bound(cores, ranks, 8) == pytest.approx(work / 2)
    # 4 of the 8 ranks on each host (the profile's host ran 4): half the work on each.
    assert cores_bound(attrs.evolve(cores, ranks=4), ranks, 8) == pytest.approx(work / 2 / 2)
    # No bound with a core per rank, or without the section (a GPU profile).
    assert cores_bound(attrs.evolve(cores, usable=8), ranks, 8) == 0.0
    assert cores_bound(None, ranks, 8) == 0.0


def test_ranks_sharing_cores_take_at_least_their_cpu_work_over_the_cores():
    # The demo's 4 CPU ranks on a 2-core host: a step cannot end before the cores have done
    # every rank's CPU work. The a40 profile has no cores section: nothing changes.
    from dhelix.dsl.frontend.host_cores import HostCores
    from dhelix.dsl.simulator.host_cores import cpu_seconds

    program = check_text((ROOT / "examples" / "tiny_llama_cpu.dhx").read_text(),
                         str(ROOT / "examples" / "tiny_llama_cpu.dhx"))
    plain = simulate(program, si=False)
    assert plain.cores_bound == 0.0 and plain.step_time == plain.timeline_time
    shared = HostCores(usable=1, ranks=4, comm_busy=1.0)
    on_one = simulate(attrs.evolve(program, profile=attrs.evolve(program.profile, cores=shared)), si=False)
    assert on_one.timeline_time == plain.timeline_time  # each rank's own timeline is unchanged
    assert on_one.cores_bound == pytest.approx(cpu_seconds(shared, on_one.ranks, 4))
    assert on_one.step_time == max(on_one.timeline_time, on_one.cores_bound) > plain.step_time
    roomy = attrs.evolve(shared, usable=4)
    assert simulate(attrs.evolve(program, profile=attrs.evolve(program.profile, cores=roomy)),
                    si=False).step_time == plain.step_time
