"""``chunk … by auto``: the planner chooses the chunk count (Centauri's Algorithm 1,
dsl/planner/chunking.py) from the cost model; checked against pricing every count by hand
and against what the profile's link should do to the choice."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings, strategies as st

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.frontend.profiles import Link
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.planner.chunking import (MAX_CHUNKS, Candidate, OrderChoice, choose_chunks, choose_orders, choose_priority,
                                         issue_order)
from dhelix.dsl.planner.paircost import PairCost

from conftest import ROOT

EXAMPLE = ROOT / "examples" / "llama8b_centauri_a40.dhx"


def auto_program(link: Link | None = None, statement: str = "chunk ag2 + fc1 + act + fc2 + rs2 by auto"):
    text = EXAMPLE.read_text().replace("chunk ag2 + fc1 + act + fc2 + rs2 by 2", statement)
    program = passes.check_text(text, str(EXAMPLE))
    if link is not None:  # the TP group's lane (local here) with another link
        profile = attrs.evolve(program.profile, links={**program.profile.links, "local": link})
        program = passes.rerun(attrs.evolve(program, profile=profile), after="check")
    return program


def layer_seconds(program, count: int) -> float | None:
    try:
        tried = passes.rerun(attrs.evolve(program, chunk_counts=((0, count),)), after="check")
    except DhelixError:
        return None
    cost = PairCost(tried.profile, tried.model.dtype, seq=tried.model.get("seq"))
    return cost.solo(issue_order(tried.forward.ops)) + cost.solo(issue_order(tried.backward.ops))


def test_check_leaves_an_auto_chain_whole_and_the_planner_chunks_it():
    program = auto_program()
    assert not any(".c0" in op.name for op in program.forward.ops)  # not chosen: whole
    chosen, (choice,) = choose_chunks(program)
    assert choice.ops == ("ag2", "fc1", "act", "fc2", "rs2") and choice.chosen > 1
    assert f"ag2.c{choice.chosen - 1}" in [op.name for op in chosen.forward.ops]
    assert choice.describe().startswith(f"chunk ag2 + fc1 + act + fc2 + rs2 by auto: {choice.chosen} (1: ")


@settings(max_examples=12, deadline=None)
@given(bw=st.floats(0.5, 400.0), latency=st.floats(0.0, 200.0))
def test_the_choice_is_the_cheapest_count_priced_one_by_one(bw, latency):
    program = auto_program(Link(bw, latency))
    _, (choice,) = choose_chunks(program)
    # Brute force: every count from 1 to MAX_CHUNKS the passes accept, priced on its own.
    priced = {k: s for k in range(1, MAX_CHUNKS + 1) if (s := layer_seconds(program, k)) is not None}
    best = min(priced.values())
    assert choice.chosen == min(k for k, s in priced.items() if s == best)
    assert {c.value: c.seconds for c in choice.candidates} == pytest.approx(priced)


def test_latency_per_collective_means_fewer_chunks_and_comm_like_compute_more():
    def chosen(bw, latency):
        return choose_chunks(auto_program(Link(bw, latency)))[1][0].chosen

    # A link whose MLP collectives take about as long as the MLP's GEMMs: chunk i + 1's
    # all_gather hides behind chunk i's GEMMs, more chunks hide more.
    assert chosen(20.0, 5.0) == MAX_CHUNKS
    assert chosen(20.0, 5.0e4) == 1  # 50 ms per collective step: every chunk pays it
    # Communication far beyond the compute: chunks can hide no more than the GEMMs.
    assert 1 < chosen(0.5, 5.0) < MAX_CHUNKS


def test_an_auto_chain_through_an_indivisible_dimension_is_refused_at_once():
    with pytest.raises(DhelixError) as info:
        auto_program(statement="chunk ag2 + fc1 + act + fc2 + rs2 along features by auto")
    assert "cannot chunk" in info.value.render()


# -- group orders: which sub-group a group-partitioned collective runs over first ------------

GROUP_EXAMPLE = ROOT / "examples" / "tiny_llama_group_cpu.dhx"


def group_program(local: Link | None = None, cross: Link | None = None, statement: str = "group ag1 + rs1 + ag2 + rs2"):
    text = GROUP_EXAMPLE.read_text().replace("group ag1 + rs1 + ag2 + rs2", statement)
    program = passes.check_text(text, str(GROUP_EXAMPLE))
    links = dict(program.profile.links) | ({"local": local} if local else {}) | ({"cross": cross} if cross else {})
    return passes.rerun(attrs.evolve(program, profile=attrs.evolve(program.profile, links=links)), after="check")


def orders_seconds(program, orders: dict[str, str]) -> float:
    tried = passes.rerun(attrs.evolve(program, group_orders=tuple(sorted(orders.items()))), after="check")
    cost = PairCost(tried.profile, tried.model.dtype, seq=tried.model.get("seq"))
    return cost.solo(issue_order(tried.forward.ops)) + cost.solo(issue_order(tried.backward.ops))


def test_the_planner_orders_gathers_across_nodes_first_and_reduce_scatters_inside_first():
    program = group_program()
    chosen, choices = choose_orders(program)
    assert {c.what: c.chosen for c in choices} == {"group ag1": "inter", "group rs1": "intra", "group ag2": "inter", "group rs2": "intra"}
    assert choices[0].describe().startswith("group ag1: inter first (inter: ")
    names = [op.name for op in chosen.forward.ops]
    assert "ag1.inter" in names and "rs1.intra" in names
    # An explicit order is the program's: nothing to choose.
    assert choose_orders(group_program(statement="group ag1 + rs1 + ag2 + rs2 first intra"))[1] == ()


@settings(max_examples=8, deadline=None)
@given(local_bw=st.floats(0.5, 400.0), cross_bw=st.floats(0.5, 400.0))
def test_each_order_is_the_cheaper_one_priced_both_ways(local_bw, cross_bw):
    # Brute force, one collective at a time in block order with the earlier choices kept;
    # a local link slower than the cross one (no real machine) turns the orders round.
    program = group_program(Link(local_bw, 5.0), Link(cross_bw, 5.0))
    _, choices = choose_orders(program)
    kept: dict[str, str] = {}
    for choice in choices:
        priced = {order: orders_seconds(program, {**kept, choice.what.split()[1]: order}) for order in ("inter", "intra")}
        assert {c.value: c.seconds for c in choice.candidates} == pytest.approx(priced)
        assert priced[choice.chosen] == min(priced.values())
        kept[choice.what.split()[1]] = choice.chosen


STAGED = "group ag1 + rs1 + ag2 + rs2\n  chunk ag2 + fc1 + act + fc2 by auto"


@pytest.mark.parametrize(("local_bw", "chosen"), [(0.5, "stages"), (100.0, 1)])
def test_an_auto_chain_from_a_split_gather_also_tries_its_stages_with_either_stage_first(local_bw, chosen):
    # Algorithm 1's uneven partition: chunk 0 on what the first stage (across nodes here)
    # brought, while the node-local stage runs; it pays where that stage is slow.
    program = group_program(Link(local_bw, 5.0), Link(5.0, 5.0), statement=STAGED)
    _, (choice,) = choose_chunks(program)
    priced = {c.value: c.seconds for c in choice.candidates}
    staged = attrs.evolve(program, chunk_counts=((0, "stages"),))
    both = [orders_seconds(staged, {"ag2": order}) for order in ("inter", "intra")]
    assert priced["stages"] == pytest.approx(min(both))
    # Algorithm 1's finer split beside it, its gather inside the node first (the other order refused).
    fine = attrs.evolve(program, chunk_counts=((0, "stages3"),))
    assert priced["stages3"] == pytest.approx(orders_seconds(fine, {"ag2": "intra"}))
    assert priced[1] == pytest.approx(orders_seconds(program, {}))
    assert choice.chosen == chosen and priced[chosen] == min(priced.values())
    # Without a group statement the gather has no stages: not a candidate, nothing reported.
    _, (plain,) = choose_chunks(group_program(statement="chunk ag2 + fc1 + act + fc2 by auto"))
    assert not {"stages", "stages3"} & {c.value for c in plain.candidates}


def test_refused_candidates_with_one_reason_are_said_once():
    why = "'by stages3' splits a gather whose stages run smallest level first, and ag2 runs {} in that order"
    candidates = (Candidate("a>b>c", 1e-3), Candidate("b>a>c", None, why.format("b, a and c")),
                  Candidate("c>b>a", None, why.format("c, b and a")), Candidate("c>a>b", None, "another reason"))
    assert OrderChoice("group ag2", "a>b>c", candidates).describe() == (
        "group ag2: a>b>c (a>b>c: 1.000 ms, b>a>c and c>b>a: refused ('by stages3' splits a gather whose stages "
        "run smallest level first), c>a>b: refused (another reason); forward + backward of a layer alone)")


# -- layer level: dgrad or wgrad first (Eq. 1) ------------------------------------------------

def test_the_planner_prices_both_backward_priorities_and_keeps_the_faster():
    program = auto_program(statement="chunk ag2 + fc1 + act + fc2 + rs2 by 2")
    chosen, (choice,) = choose_priority(program)
    priced = {}
    for first in ("dgrad", "wgrad"):
        tried = passes.rerun(attrs.evolve(program, backward_first=first), after="check")
        cost = PairCost(tried.profile, tried.model.dtype, seq=tried.model.get("seq"))
        priced[first] = cost.solo(issue_order(tried.forward.ops)) + cost.solo(issue_order(tried.backward.ops))
    assert {c.value: c.seconds for c in choice.candidates} == pytest.approx(priced)
    assert priced[choice.chosen] == min(priced.values()) and choice.what == "backward"
    names = [op.name for op in chosen.backward.ops if op.name.startswith("fc1.c0.")]
    assert names.index(f"fc1.c0.{choice.chosen}") < names.index(f"fc1.c0.{'wgrad' if choice.chosen == 'dgrad' else 'dgrad'}")
    # Written in the block, or without a block: nothing to choose.
    fixed = auto_program(statement="chunk ag2 + fc1 + act + fc2 + rs2 by 2\n  backward wgrad first")
    assert choose_priority(fixed)[1] == ()
    assert [op.name for op in fixed.backward.ops].index("fc1.c0.wgrad") < \
        [op.name for op in fixed.backward.ops].index("fc1.c0.dgrad")


def test_without_its_partition_block_a_program_drops_the_planner_s_choices_too():
    from dhelix.dsl.simulator.report import unpartitioned

    program = passes.rerun(attrs.evolve(auto_program(statement="chunk ag2 + fc1 + act + fc2 + rs2 by 2"),
                                        backward_first="wgrad"), after="check")
    names = [op.name for op in program.backward.ops]
    assert names.index("fc1.c0.wgrad") < names.index("fc1.c0.dgrad")
    plain = unpartitioned(program)
    names = [op.name for op in plain.backward.ops]
    assert plain.backward_first is None and names.index("fc1.dgrad") < names.index("fc1.wgrad")


# -- substitute … as auto: Table 2's substitutions, pruned where they do not pay -------------

AUTO_SUBSTITUTION = """
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m { layers = 2  hidden = 256  ffn = 512  heads = 4  kv_heads = 4  seq = 256  vocab = 256  dtype = bf16
  layer = llama }
cluster { nodes = 2  gpus_per_node = 2  profile = "a40" }
mesh { tp = 4 }
train { micro_batch = 1  microbatches = 4 }
fold none
pipeline one_f_one_b
partition {
  substitute rs1 as auto
  substitute ag2 as auto
  backward dgrad first
}
"""


def _with_collective(program, kind: str, efficiency: float):
    from dhelix.dsl.frontend.profiles import Collective

    collectives = {**program.profile.collectives, kind: Collective("ring", efficiency)}
    profile = attrs.evolve(program.profile, collectives=collectives)
    return passes.rerun(attrs.evolve(program, profile=profile), after="check")


# Each substitution replaces a collective and, in the backward, its transpose: a slow
# reduce_scatter makes both pay (rs1 forward, ag2's backward), and so does a slow all_gather.
@pytest.mark.parametrize(("slow", "expected"), [(None, ("whole", "whole")),
                                                ("reduce_scatter", ("reduce", "broadcast")),
                                                ("all_gather", ("reduce", "broadcast"))])
def test_a_substitution_is_kept_only_where_it_makes_the_layer_faster(slow, expected):
    from dhelix.dsl.planner.chunking import choose_substitutions

    program = passes.check_text(AUTO_SUBSTITUTION, "t.dhx")
    assert program.forward.op("rs1").op == "reduce_scatter"  # check shows it whole
    if slow is not None:  # a collective far below its link's bandwidth (gloo's reduce_scatter)
        program = _with_collective(program, slow, 0.05)
    chosen, choices = choose_substitutions(program)
    assert tuple(c.chosen for c in choices) == expected
    for choice in choices:  # brute force: the faster of the two, ties to whole
        whole, form = (c.seconds for c in choice.candidates)
        assert choice.chosen == ("whole" if whole <= form else choice.candidates[1].value)
    ops = {op.name: op.op for op in chosen.forward.ops}
    assert ops["rs1"] == ("pick" if expected[0] == "reduce" else "reduce_scatter")
    assert ops["ag2"] == ("concat" if expected[1] == "broadcast" else "all_gather")
    assert choices[0].describe().startswith(f"substitute rs1 as auto: {expected[0]} (whole: ")


def test_by_auto_counts_are_passed_over_again_while_a_count_changes():
    """Two auto chains, a step whose counts interact: the first statement keeps the layer's
    count, the second then changes, and only a second pass finds that the first statement's
    other count is now faster (a single pass ends at 9, the passes at 5)."""
    from dhelix.dsl.planner.chunking import ChunkChoice, choose_all
    from dhelix.dsl.simulator.launch import choose_counts_by_step

    program = auto_program(statement="chunk ag1 + qkv by auto\n  chunk ag2 + fc1 + act + fc2 + rs2 by auto")
    program, choices = choose_all(program)
    chunks = [c for c in choices if isinstance(c, ChunkChoice)]
    assert len(chunks) == 2

    def other(choice):
        priced = sorted((c for c in choice.candidates if c.seconds is not None), key=lambda c: c.seconds)
        return next(c.value for c in priced if c.value != choice.chosen)
    (v0, u0), (w, u) = (chunks[0].chosen, chunks[1].chosen), (other(chunks[0]), other(chunks[1]))
    table = {(v0, u0): 10.0, (w, u0): 11.0, (v0, u): 9.0, (w, u): 5.0}
    stepped = []

    def step(p):
        counts = dict(p.chunk_counts)
        stepped.append((counts[0], counts[1]))
        return table.get((counts[0], counts[1]), 20.0)
    chosen, updated = choose_counts_by_step(program, choices, step, rerun=lambda p: p)
    assert dict(chosen.chunk_counts) == {0: w, 1: u}
    assert [c.chosen for c in updated if isinstance(c, ChunkChoice)] == [w, u]
    assert len(stepped) == len(set(stepped))  # each set of counts stepped once
    assert stepped[:2] == [(v0, u0), (w, u0)]  # the first pass starts from the layer's counts


def test_by_auto_counts_that_do_not_fit_the_device_are_neither_stepped_nor_chosen():
    """The step's fastest count does not fit: the fastest that fits is chosen, the other
    never stepped (nor planned); with none fitting, the count held stays, nothing stepped."""
    from dhelix.dsl.planner.chunking import ChunkChoice, choose_all
    from dhelix.dsl.simulator.launch import choose_counts_by_step

    program, choices = choose_all(auto_program())
    (chunk,) = [c for c in choices if isinstance(c, ChunkChoice)]
    priced = sorted((c for c in chunk.candidates if c.seconds is not None), key=lambda c: c.seconds)
    held, other = chunk.chosen, next(c.value for c in priced if c.value != chunk.chosen)
    table = {held: 2.0, other: 3.0}  # the layer's count is the step's fastest too, unless over

    def run(fits):
        stepped = []

        def step(p):
            stepped.append(dict(p.chunk_counts)[0])
            return table.get(stepped[-1], 5.0)
        chosen, updated = choose_counts_by_step(program, choices, step, rerun=lambda p: p, fits=fits)
        (choice,) = [c for c in updated if isinstance(c, ChunkChoice)]
        return dict(chosen.chunk_counts)[0], choice, stepped
    count, choice, stepped = run(lambda p: True)
    assert count == held and choice.over == () and held in stepped and other in stepped
    count, choice, stepped = run(lambda p: dict(p.chunk_counts)[0] != held)
    assert count == other and held not in stepped and choice.over == (held,)
    assert choice.describe().endswith(f"; over the device memory: {held}")
    count, choice, stepped = run(lambda p: False)
    assert count == held and stepped == [] and choice.steps == () and held in choice.over


def test_peak_memory_is_the_simulated_peak_without_a_plan():
    """:func:`peak_memory` (untimed, SI pairs unplanned) equals the simulation's peak, on a
    program with SI blocks and with its counts chunked or whole; and ``fits_device`` reads
    the profile's memory figure: a device just below the peak refuses the program."""
    from dhelix.dsl.simulator.events import has_si, peak_memory, simulate
    from dhelix.dsl.simulator.launch import fits_device

    program = auto_program()
    assert has_si(program)
    for count in (1, 2, 4):
        counted = passes.rerun(attrs.evolve(program, chunk_counts=((0, count),)), after="check")
        peak = max(rank.memory for rank in simulate(counted, trace=False).ranks)
        assert peak_memory(counted) == pytest.approx(peak, rel=1e-12)
        assert fits_device(counted) == (peak <= counted.profile.memory_gb * 1e9)
        smaller = attrs.evolve(counted, profile=attrs.evolve(counted.profile, memory_gb=peak / 1e9 * 0.999))
        assert not fits_device(smaller)
        assert fits_device(attrs.evolve(counted, profile=attrs.evolve(counted.profile, memory_gb=None)))


def test_by_auto_counts_are_settled_by_the_whole_step():
    from dhelix.dsl.planner.chunking import ChunkChoice
    from dhelix.dsl.simulator.events import simulate
    from dhelix.dsl.simulator.launch import priced_program

    path = "examples/tiny_llama_stages_cpu.dhx"
    program, choices = priced_program(open(path).read(), path)
    chunk = next(c for c in choices if isinstance(c, ChunkChoice))
    layer_best = min((c for c in chunk.candidates if c.seconds is not None), key=lambda c: c.seconds).value
    steps = dict(chunk.steps)
    assert len(steps) >= 2 and layer_best in steps
    assert chunk.chosen == min(steps, key=steps.get)
    assert simulate(program).step_time == steps[chunk.chosen]
    assert "by the whole step:" in chunk.describe()


def test_the_simulator_prices_a_chunked_chain_in_the_order_the_interpreter_issues_it():
    # The step simulator prices a layer's ops in their listed order, lane by lane; the
    # interpreter issues a collective as soon as its inputs exist (issue_order). The partition
    # lists every chunk's head gather first, so the two agree: chunk i + 1's all_gather does
    # not wait behind chunk i's reduce_scatter on the TP lane.
    program = auto_program(statement="chunk ag2 + fc1 + act + fc2 + rs2 by 4")
    program = passes.rerun(attrs.evolve(program, chunk_counts=((0, 4),)), after="check")
    cost = PairCost(program.profile, program.model.dtype, seq=program.model.get("seq"))
    for dag in (program.forward, program.backward):
        assert cost.solo(dag.ops) == pytest.approx(cost.solo(issue_order(dag.ops)), rel=1e-12)
    names = [op.name for op in program.forward.ops]
    assert names.index("ag2.c3") < names.index("fc1.c0")


def test_a_chunk_of_whole_rows_is_a_view_and_costs_nothing():
    from dhelix.dsl.planner.costmodel import op_time

    program = auto_program(statement="chunk ag2 + fc1 + act + fc2 + rs2 by 4")
    program = passes.rerun(attrs.evolve(program, chunk_counts=((0, 4),)), after="check")
    ops = {op.name: op for dag in (program.forward, program.backward) for op in dag.ops}
    dtype = program.model.dtype
    # ln2's rows cut in four: narrow along the first dimension, no copy (the interpreter's slice).
    assert ops["ln2.s1"].op == "slice" and op_time(ops["ln2.s1"], program.profile, dtype) == 0.0
    assert ops["rs2.bwd"].op == "concat_bwd" and op_time(ops["rs2.bwd"], program.profile, dtype) == 0.0
    # The concat copies every chunk into one tensor; a gathered chunk of rank blocks is a copy too.
    assert op_time(ops["rs2"], program.profile, dtype) > 0.0
    blocks = attrs.evolve(ops["ln2.s1"], params=tuple((k, 2 if k == "blocks" else v) for k, v in ops["ln2.s1"].params))
    assert op_time(blocks, program.profile, dtype) > 0.0
