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
from dhelix.dsl.planner.chunking import MAX_CHUNKS, choose_chunks, issue_order
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
    assert {c.count: c.seconds for c in choice.candidates} == pytest.approx(priced)


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
