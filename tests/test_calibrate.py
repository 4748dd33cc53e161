"""Deriving a profile from timings: synthetic timings with known rates, OEFs, slowdown and
launch gap are recovered; what the program cannot measure comes from the base profile; the
derived profile is written, read back equal, and a program naming it checks and plans."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from dhelix.dsl.frontend.profile_writer import render_profile
from dhelix.dsl.frontend.profiles import load_profile, parse_profile, profile_names
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.planner.calibrate import SweepPoint, Stamp, Timings, derive_profile, pool
from dhelix.dsl.planner.costmodel import achieved_class, op_bytes, op_flops, op_time
from dhelix.dsl.simulator.events import schedule_plan

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny_llama_cpu.dhx"
PROGRAM = check_text(EXAMPLE.read_text(), str(EXAMPLE))
OPS = PROGRAM.forward.ops + PROGRAM.backward.ops
SEQ = PROGRAM.model.get("seq")

# The machine the synthetic timings describe.
FLOP_RATE, BYTE_RATE = 50e9, 100e9  # FLOP/s and bytes/s at 100 % of the class
FRACTION = {"gemm": 0.8, "attention": 0.4, "norm": 0.5, "add": 1.0, "activation": 0.25}
LINKS = {"local": (30e-6, 2e9, "tp"), "cross": (50e-6, 0.5e9, "pp")}  # α s/step, B bytes/s
OEF = {"comp_intra": 0.6, "intra_intra": 0.1}
GAP_US, STRETCH = 5.0, 0.25
STAMP = Stamp(source="tiny.dhx", machine="box: test CPU, 2 CPU cores", torch="2.0", backend="gloo",
              date="2025-01-01T00:00:00+00:00", command="dhelix profile tiny.dhx -o m.yaml", repeats=3)


def true_us(op) -> float:
    """The synthetic machine's time for ``op`` alone (collectives: 100 µs)."""
    if op.kind == "comm":
        return 100.0
    cls = achieved_class(op, load_profile("a40"))
    if cls in ("gemm", "attention"):
        return op_flops(op, seq=SEQ) / (FLOP_RATE * FRACTION[cls]) * 1e6
    return op_bytes(op, "fp32", seq=SEQ) / (BYTE_RATE * FRACTION[cls]) * 1e6


def synthetic() -> Timings:
    ops = {op.name: true_us(op) for op in OPS}
    pairs, stretched = {}, {}
    for f in PROGRAM.forward.ops:
        for b in PROGRAM.backward.ops:
            if "comm" not in (f.kind, b.kind):
                continue
            tf, tb = ops[f.name], ops[b.name]
            oef = OEF["intra_intra"] if f.kind == b.kind == "comm" else OEF["comp_intra"]
            pairs[(f.name, b.name)] = tf + tb - oef * min(tf, tb) + GAP_US
            compute = f if f.kind == "compute" else b if b.kind == "compute" else None
            if compute is not None:
                stretched[(f.name, b.name)] = ops[compute.name] * (1 + STRETCH)
    sweep = tuple(SweepPoint(lane, axis, 2, float(size), (alpha + size / 2 / bw) * 1e6)
                  for lane, (alpha, bw, axis) in LINKS.items() for size in (8e3, 128e3, 2e6, 16e6))
    issued = {op.name: ops[op.name] + GAP_US for op in OPS if op.kind == "comm"}
    return Timings(ops=ops, issued=issued, pairs=pairs, stretched=stretched, sweep=sweep)


@pytest.fixture(scope="module")
def derived():
    return derive_profile(PROGRAM, synthetic(), STAMP, load_profile("a40"), name="box")


def test_compute_rates_price_every_op_as_measured(derived):
    profile, notes = derived
    assert profile.peak_tflops == {"fp32": pytest.approx(FLOP_RATE * 0.8 / 1e12, rel=1e-3)}
    assert profile.achieved["attention"] == pytest.approx(0.5, rel=1e-3)
    assert notes["peak_tflops.fp32"].startswith("[measured] the fastest op, ")
    rates_only = attrs.evolve(profile, measured=None)  # the model alone, as for another program
    for op in OPS:
        if op.kind == "compute":
            assert op_time(op, rates_only, "fp32", seq=SEQ) * 1e6 == pytest.approx(true_us(op), rel=2e-3), op.name


def test_the_time_between_ops_is_the_layer_pass_less_its_compute_ops_per_compute_op(derived):
    # Without a pass of the layer nothing is added; with one taking 30 µs per compute op more
    # than its compute ops alone, every compute op is priced 30 µs longer, measured or by the
    # rates. The layer's collectives (100 µs each alone) are not in the pass as timed.
    from dhelix.dsl.core.oplib import LAYER_PASS

    profile, notes = derived
    assert profile.kernels.overhead_us == 0 and notes["kernels.overhead_us"].endswith("none")
    timings = synthetic()
    compute = [op for op in OPS if op.kind == "compute"]
    alone = sum(timings.ops[op.name] for op in compute)  # the pass is timed outside its collectives
    timings = attrs.evolve(timings, ops={**timings.ops, LAYER_PASS: alone + 30.0 * len(compute)})
    passed, notes = derive_profile(PROGRAM, timings, STAMP, load_profile("a40"), name="box")
    assert passed.kernels.overhead_us == pytest.approx(30.0)
    assert LAYER_PASS not in passed.measured.ops
    rates_only = attrs.evolve(passed, measured=None)
    for op in compute:
        assert passed.measured.ops[op.name] == pytest.approx(true_us(op) + 30.0, abs=1e-3), op.name
        assert op_time(op, rates_only, "fp32", seq=SEQ) * 1e6 == pytest.approx(true_us(op) + 30.0, rel=2e-3), op.name
    assert all(passed.measured.ops[op.name] == pytest.approx(100.0) for op in OPS if op.kind == "comm")
    faster = attrs.evolve(timings, ops={**timings.ops, LAYER_PASS: alone * 0.9})  # a pass faster than its ops
    assert derive_profile(PROGRAM, faster, STAMP, load_profile("a40"), name="box")[0].kernels.overhead_us == 0


def test_links_are_fitted_to_the_ring_model(derived):
    profile, notes = derived
    for lane, (alpha, bandwidth, axis) in LINKS.items():
        assert profile.links[lane].latency_us == pytest.approx(alpha * 1e6, abs=0.01)
        assert profile.links[lane].bw_gbps == pytest.approx(bandwidth / 1e9, rel=1e-3)
        assert f"all_gather sizes over {axis} (2 ranks)" in notes[f"links.{lane}"]


def test_each_collective_s_efficiency_is_its_time_against_the_fitted_link():
    # On the cross lane an all_reduce and a p2p move their bytes 1.5 times as fast as the model of
    # the all_gather fit says and a reduce_scatter 0.75 times (as gloo on the emulated link):
    # the lane's bandwidth becomes the fastest's, every efficiency relative to it, so each
    # collective is priced at its time, the all_gather at the fit's.
    from dhelix.dsl.planner.costmodel import collective_time

    alpha, bandwidth, axis = LINKS["cross"]
    speed = {"all_reduce": 1.5, "p2p": 1.5, "reduce_scatter": 0.75}
    fit = attrs.evolve(load_profile("a40"), links={**load_profile("a40").links, "cross": _link(alpha, bandwidth)})
    fit = attrs.evolve(fit, collectives={k: attrs.evolve(c, efficiency=1.0, lanes={}) for k, c in fit.collectives.items()})
    fast = attrs.evolve(fit, collectives={k: attrs.evolve(c, efficiency=speed.get(k, 1.0)) for k, c in fit.collectives.items()})
    kinds = tuple(SweepPoint("cross", axis, 2, size, collective_time(kind, size, 2, "cross", fast) * 1e6, kind)
                  for kind in speed for size in (1 << 20, 8 << 20))
    profile, notes = derive_profile(PROGRAM, attrs.evolve(synthetic(), kinds=kinds), STAMP, load_profile("a40"), name="box")
    assert profile.links["cross"].bw_gbps == pytest.approx(1.5 * bandwidth / 1e9, rel=1e-3)
    assert profile.links["cross"].latency_us == pytest.approx(alpha * 1e6, abs=0.01)
    assert profile.links["local"].bw_gbps == pytest.approx(LINKS["local"][1] / 1e9, rel=1e-3)  # nothing timed there
    for kind in ("all_gather", "all_reduce", "p2p", "reduce_scatter", "all_to_all"):
        for size in (1 << 20, 8 << 20):
            expected = collective_time(kind, size, 2, "cross", fast)
            assert collective_time(kind, size, 2, "cross", profile) == pytest.approx(expected, rel=2e-3), (kind, size)
        assert profile.collectives[kind].efficiency_on("local") == 1.0
    assert notes["collectives"].startswith("[measured] efficiency") and "all_reduce 1.5" in notes["collectives"]
    rendered = render_profile(profile, notes)
    assert parse_profile(rendered, "box.yaml") == profile and "all_reduce 1.5" in rendered


def _link(alpha: float, bandwidth: float):
    from dhelix.dsl.frontend.profiles import Link

    return Link(bandwidth / 1e9, alpha * 1e6)


def test_overlap_slowdown_and_launch_gap_are_recovered(derived):
    profile, notes = derived
    assert profile.launch_gap.fixed_us == GAP_US and profile.launch_gap.comm_fraction == 0
    assert profile.slowdown == pytest.approx(STRETCH)
    assert profile.oef_classes["comp_intra"] == pytest.approx(OEF["comp_intra"])
    assert profile.oef_classes["intra_intra"] == pytest.approx(OEF["intra_intra"])
    assert profile.oef_pairs[("qkv", "rs2.bwd")] == pytest.approx(OEF["comp_intra"])
    assert profile.oef_pairs[("ag1", "rs2.bwd")] == pytest.approx(OEF["intra_intra"])
    assert len(profile.measured.pairs) == 10 * 4 + 4 * 14 + 4 * 4
    assert notes["oef.classes.comp_intra"] == "[measured] median of 96 pair(s)"


def test_what_cannot_be_measured_comes_from_the_base(derived):
    profile, notes = derived
    a40 = load_profile("a40")
    for cls in ("comp_inter", "inter_inter", "intra_inter"):
        assert profile.oef_classes[cls] == a40.oef_classes[cls]
        assert notes[f"oef.classes.{cls}"] == "[from a40] not measured: no such pair in this program"
    assert profile.achieved["router"] == a40.achieved["router"]
    assert notes["achieved.permute"] == "[from a40] not measured: no permute op in the layer"
    assert profile.oef_classes["comp_comp"] == 0


def test_the_measured_section_is_stamped_and_records_shapes(derived):
    measured = derived[0].measured
    assert measured.stamp == {"machine": STAMP.machine, "torch": "2.0", "backend": "gloo", "date": STAMP.date,
                              "command": STAMP.command}
    assert measured.repeats == 3 and measured.mesh == {"tp": 2, "pp": 2} and measured.dtype == "fp32"
    assert measured.shapes["ag1"] == "[32, 64] -> [64, 64] over tp 2 local"
    assert set(measured.ops) == {op.name for op in OPS}


def test_the_derived_profile_round_trips_and_a_program_plans_with_it(derived, tmp_path):
    profile, notes = derived
    text = render_profile(profile, notes, ["synthetic"])
    (tmp_path / "measured.yaml").write_text(text)
    assert parse_profile(text, "measured.yaml") == profile
    program_file = tmp_path / "tiny.dhx"
    program_file.write_text(EXAMPLE.read_text().replace('profile = "a40"', 'profile = "measured.yaml"'))
    program = check_text(program_file.read_text(), str(program_file))
    assert program.profile == profile
    plan = schedule_plan(program)
    assert plan.total < plan.sequential  # comm overlaps compute (OEF 0.6), so SI pairs something
    assert any(pair.forward and pair.backward for pair in plan.pairs)


def test_pool_takes_medians_over_ranks_and_repeats():
    ranks = [{"ops": {"qkv": [1.0, 9.0]}, "sweep": {("local", "tp", 2, 8.0): [3.0]}},
             {"ops": {"qkv": [2.0]}, "pairs": {("qkv", "rs2.bwd"): [4.0, 6.0]},
              "sweep": {("local", "tp", 2, 8.0): [5.0]}, "kinds": {("local", "tp", 2, 8.0, "p2p"): [7.0]}}]
    timings = pool(ranks)
    assert timings.ops == {"qkv": 2.0} and timings.pairs == {("qkv", "rs2.bwd"): 5.0}
    assert timings.sweep == (SweepPoint("local", "tp", 2, 8.0, 4.0),)
    assert timings.kinds == (SweepPoint("local", "tp", 2, 8.0, 7.0, "p2p"),)


@pytest.mark.parametrize("name", profile_names())
def test_every_shipped_profile_is_written_back_equal(name):
    profile = load_profile(name)
    assert parse_profile(render_profile(profile), f"{name}.yaml") == profile


def test_noise_is_said_when_repeats_disagree_or_an_oef_is_negative():
    from dhelix.dsl.planner.calibrate import noise

    steady = {"ops": {"a": [10.0, 10.1, 10.0, 9.9, 10.0]}, "pairs": {("a", "b"): [15.0, 15.2, 14.9, 15.1]}}
    shaky = {"ops": {"a": [10.0, 30.0, 5.0, 12.0, 20.0]}, "pairs": {("a", "b"): [15.0, 15.2, 14.9, 15.1]}}
    assert noise(pool([steady]), {"comp_comm": 0.8}) == []
    said = noise(pool([shaky]), {"comp_comm": -0.956, "local_cross": 0.5})
    assert said[0].startswith("repeated ops timings disagree by ") and "pairs" not in said[0]
    assert said[1] == "OEF below 0 (comp_comm -0.956): pairs ran slower than their ops one after the other"


def test_noise_judges_only_the_figures_measured_not_those_copied_from_the_base(derived):
    # Issue 53, item 13: `dhelix profile` on one node called its overlap figures noise because
    # inter_inter (-0.09) is the a40 profile's, copied: no pair of the program measured it.
    from dhelix.cli.profile import _noise_lines
    from dhelix.dsl.planner.calibrate import measured_classes, noise

    profile, notes = derived
    assert profile.oef_classes["inter_inter"] == -0.09 and "[from a40]" in notes["oef.classes.inter_inter"]
    assert measured_classes(OPS, synthetic()) == {"comp_intra", "intra_intra"}  # tp's collectives only
    assert _noise_lines(synthetic(), profile, PROGRAM) == []
    assert noise(synthetic(), profile.oef_classes) != []  # what it said before: judged by the copy
    negative = attrs.evolve(profile, oef_classes={**profile.oef_classes, "comp_intra": -0.2})
    assert _noise_lines(synthetic(), negative, PROGRAM)[0] == (
        "  noise    these overlap figures are noise: OEF below 0 (comp_intra -0.2): pairs ran slower than their ops "
        "one after the other")


def test_compare_of_a_partitioned_program_measured_on_itself_keeps_the_profile_s_rates(tmp_path):
    """`simulate --compare` of a program whose profile was measured on it with a partition
    block: the column without the partition cannot use the measured chunks (no op of the
    whole layer), so it prices the whole layer with the profile's derived rates, and says so."""
    from dhelix.dsl.simulator.report import compare

    text = EXAMPLE.read_text() + "\npartition {\n  chunk ag2 + fc1 + act + fc2 + rs2 by 2\n}\n"
    chunked = check_text(text, str(EXAMPLE))
    ops = chunked.forward.ops + chunked.backward.ops
    timings = Timings(ops={op.name: 100.0 if op.kind == "comm" else 50.0 for op in ops},
                      sweep=tuple(SweepPoint("local", "tp", 2, size, 30.0 + size / 2 / 2e9 * 1e6)
                                  for size in (8e3, 128e3, 2e6, 16e6)))
    profile, notes = derive_profile(chunked, timings, STAMP, load_profile("a40"), name="box")
    (tmp_path / "measured.yaml").write_text(render_profile(profile, notes, ["synthetic"]))
    program_file = tmp_path / "tiny.dhx"
    program_file.write_text(text.replace('profile = "a40"', 'profile = "measured.yaml"'))
    program = check_text(program_file.read_text(), str(program_file))
    sims = compare(program)
    assert [s.label for s in sims][-1] == "without partition (profile's rates)"
    assert sims[0].step_time > 0 and sims[-1].step_time > 0
