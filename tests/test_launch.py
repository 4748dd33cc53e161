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


# -- Eq. 2's L1 != L2: the backward's own count (launch_backward, the pipelines' gb) ----------

def _chunks_in_order(lowered, rank: int, kind: str) -> list[int]:
    return [a.chunk for a in lowered.actions[rank] if a.kind == kind]


def test_launch_backward_groups_the_backwards_apart_from_the_forwards():
    program = passes.check_text(TEXT.replace("launch = auto", "launch = 2  launch_backward = 4"), "t.dhx")
    lowered = program.lowered
    # Forwards take the chunks 2 micro-batches at a time, backwards 4 (chunk 1 first).
    assert _chunks_in_order(lowered, 0, "F") == [0, 0, 1, 1] * 4
    assert _chunks_in_order(lowered, 0, "B") == [1, 1, 1, 1, 0, 0, 0, 0] * 2
    same = passes.check_text(TEXT.replace("launch = auto", "launch = 2"), "t.dhx").lowered
    assert _chunks_in_order(same, 0, "B") == [1, 1, 0, 0] * 4  # gb defaults to g


def test_launch_backward_auto_is_chosen_after_launch_by_simulating_each_count():
    program = passes.check_text(TEXT.replace("launch = auto", "launch = 2  launch_backward = auto"), "t.dhx")
    chosen, (choice,) = choose_launch(program, "launch_backward")
    assert [t.launch for t in choice.tries] == [2, 4, 8]
    for t in choice.tries:
        sim = simulate(passes.rerun(attrs.evolve(program, launch_backward=t.launch), after="check"))
        assert t.seconds == pytest.approx(sim.step_time)
    assert chosen.launch_backward == choice.chosen == min(choice.tries, key=lambda t: (t.seconds, t.launch)).launch
    assert choice.describe().startswith(f"launch_backward = auto: {choice.chosen} micro-batches per chunk together "
                                        "in the backward (2: ")
    assert choose_launch(program)[1] == ()  # launch is written: nothing to choose for it


def test_launch_backward_needs_a_pipeline_that_reads_gb():
    from dhelix.dsl.core.errors import DhelixError

    text = TEXT.replace("launch = auto", "launch_backward = 4").replace("fold loop(2)", "fold none") \
        .replace("pipeline interleaved_1f1b", "pipeline one_f_one_b")
    with pytest.raises(DhelixError, match="launch_backward = 4 sets gb, which pipeline one_f_one_b does not read"):
        passes.check_text(text, "t.dhx")


def _l1_l2_run(rank: int, world: int) -> list:
    from dhelix.interpreter.ops.comm import DistComm
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.verify.harness import check_steps
    from dhelix.interpreter.training.optim import DistributedAdamW

    small = TEXT.replace("hidden = 1024  ffn = 4096  heads = 8  kv_heads = 8  seq = 1024  vocab = 32000",
                         "hidden = 32  ffn = 64  heads = 4  kv_heads = 4  seq = 8  vocab = 64") \
        .replace("dtype = bf16", "dtype = fp32").replace("launch = auto", "launch = 2  launch_backward = 4") \
        .replace("zero = 1  param_gather = forward", "")
    program = passes.check_text(small, "t.dhx")
    executor = Executor(program, DistComm(program.mesh, timeout_s=60), seed=7)
    return check_steps(executor, DistributedAdamW(executor.params, executor.comm), 1, 3)


def test_l1_different_from_l2_runs_exactly_on_4_gloo_ranks(tmp_path):
    pytest.importorskip("torch")
    from distributed import TOL, assert_steps_match, gloo_results

    assert_steps_match(gloo_results(_l1_l2_run, 4, tmp_path)[0], 1, TOL)
