"""``train { launch = auto }``: the planner chooses how many micro-batches run each model chunk
in a row (the pipelines' ``g``; Centauri's model-level scheduling, Eq. 2) by simulating the
step for every count the pipeline accepts, under the profile's device memory."""

from __future__ import annotations

import attrs
import pytest

from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.simulator.launch import choose_launch
from dhelix.dsl.simulator.events import simulate

TEXT = """
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m { layers = 8  hidden = 1024  ffn = 4096  heads = 8  kv_heads = 8  seq = 1024  vocab = 32000
  dtype = bf16  layer = llama }
cluster { nodes = 2  gpus_per_node = 2  profile = "a40" }
mesh { pp = 2  dp = 2 }
train { micro_batch = 1  microbatches = 8  zero = 1  param_gather = forward  launch = auto }
fold loop(2)
pipeline interleaved_1f1b
"""


def checked(memory_gb=None):
    program = passes.check_text(TEXT, "t.dhx")
    if memory_gb is not None:
        program = passes.rerun(attrs.evolve(program, profile=attrs.evolve(program.profile, memory_gb=memory_gb)),
                               after="check")
    return program


def test_every_count_from_p_that_divides_m_is_simulated_and_the_fastest_kept():
    program = checked()
    chosen, (choice,) = choose_launch(program)
    assert [t.launch for t in choice.tries] == [2, 4, 8]
    for t in choice.tries:  # brute force: each count simulated on its own
        sim = simulate(passes.rerun(attrs.evolve(program, launch=t.launch), after="check"))
        assert (t.seconds, t.peak) == pytest.approx((sim.step_time, sim.peak_rank.memory))
    assert choice.chosen == min(choice.tries, key=lambda t: (t.seconds, t.launch)).launch
    assert chosen.launch == choice.chosen and chosen.lowered.chunks == 2
    assert choice.describe().startswith(f"launch = auto: {choice.chosen} micro-batches per chunk together (2: ")
    # More micro-batches in flight hold more activations.
    assert [t.peak for t in choice.tries] == sorted(t.peak for t in choice.tries)


def test_a_count_whose_peak_does_not_fit_the_device_is_not_chosen():
    tries = choose_launch(checked())[1][0].tries
    # A device just below the largest count's peak: that count is shown, not chosen.
    cap = (tries[-1].peak + tries[-2].peak) / 2 / 1e9
    _, (choice,) = choose_launch(checked(memory_gb=cap))
    assert choice.chosen != tries[-1].launch and "(does not fit)" in choice.describe()
    fitting = [t for t in choice.tries if t.peak / 1e9 <= cap]
    assert choice.chosen == min(fitting, key=lambda t: (t.seconds, t.launch)).launch


def test_without_auto_nothing_is_chosen():
    program = passes.check_text(TEXT.replace("launch = auto", "launch = 4"), "t.dhx")
    assert choose_launch(program) == (program, ())
    assert program.lowered is not None
