"""The differential program fuzzer's test part: random tiny programs over the whole language
(:mod:`random_programs`: stdlib and random layer DAGs, meshes up to 8 ranks, every fold and
stdlib pipeline, micro-batches, ZeRO 0/1/3, recomputation, strands settings, partition
statements, SI plan modes). Whatever ``check`` accepts round-trips through ``fmt`` and
finishes ``plan`` and ``simulate`` with no other error than a located one; a few, on at most
4 ranks, also run one step of ``dhelix run --check`` against the single-process reference.
Derandomized: the same programs every run. The long run is benchmarks/fuzz_programs.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from random_programs import RUN_SI_PLANS, SIMULATE_SI_PLANS, differential, program, world_of

FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.function_scoped_fixture])


def _pick(data):
    return lambda options: data.draw(st.sampled_from(list(options)))


@settings(FUZZ, max_examples=30)
@given(data=st.data())
def test_what_check_accepts_formats_back_plans_and_simulates(data, tmp_path_factory):
    text = program(_pick(data))
    status, detail = differential(text, tmp_path_factory.mktemp("fuzz"),
                                  simulate_si_plan=data.draw(st.sampled_from(SIMULATE_SI_PLANS)))
    assert status != "failed", f"{detail}\n{text}"


@settings(FUZZ, max_examples=3)
@given(data=st.data())
def test_what_check_accepts_runs_as_the_reference_does(data, tmp_path_factory):
    pytest.importorskip("torch")
    text = program(_pick(data), max_world=4)
    assert world_of(text) <= 4
    status, detail = differential(text, tmp_path_factory.mktemp("fuzz"),
                                  run_si_plan=data.draw(st.sampled_from(RUN_SI_PLANS)))
    assume(status != "rejected")
    assert status == "passed", f"{detail}\n{text}"
