"""The simulator's price of the step's global checks (:mod:`dhelix.dsl.simulator.optimizer_check`):
the gradient norm's world-wide all-reduce holds every rank's optimizer back (sync), or, with
``train { optimizer_check = post }``, the optimizer runs beside it after a copy of its states.
The simulated step is shorter by what the norm hid where there is a norm to hide, and the same
where there is none (one rank)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.simulator.events import simulate, step_costs, untimed
from dhelix.dsl.simulator.optimizer_check import norm_sync_seconds

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = (ROOT / "examples" / "tiny_llama_cpu.dhx").read_text()


def _program(mesh: str, train: str = "", nodes: int = 2, per_node: int = 2):
    text = EXAMPLE.replace("mesh {\n  tp = 2\n  pp = 2\n}", f"mesh {{ {mesh} }}")
    text = text.replace("nodes = 2", f"nodes = {nodes}").replace("gpus_per_node = 2", f"gpus_per_node = {per_node}")
    text = text.replace('data = "../docs/*.md"', train)
    return check_text(text, str(ROOT / "examples" / "postval.dhx"))


def _both(program, **more):
    return (simulate(program, optimizer_check="sync", **more), simulate(program, optimizer_check="post", **more))


def test_the_norm_is_a_latency_bound_tree_over_the_world():
    # 4 ranks on 2 nodes of the a40 profile: one cross level (10 us) and one local (5 us), up and down.
    assert norm_sync_seconds(_program("dp = 4")) == pytest.approx(2 * (10e-6 + 5e-6))
    assert norm_sync_seconds(_program("dp = 4", nodes=1, per_node=4)) == pytest.approx(2 * 2 * 5e-6)
    assert norm_sync_seconds(_program("", nodes=1, per_node=1)) == 0.0


@pytest.mark.parametrize("zero", ["", "zero = 1", "zero = 1  param_gather = forward"])
def test_post_validation_hides_the_norm_behind_the_optimizer(zero):
    # One pipeline stage: every rank runs the same tail, so the saving is exact — the norm and the
    # optimizer one after the other, or the copy and the optimizer beside the norm.
    program = _program("dp = 4", zero)
    sync, post = _both(program)
    norm = norm_sync_seconds(program)
    optimizer, copied = sync.ranks[0].optimizer, post.ranks[0].optimizer  # (post: the copy included)
    hidden = norm + optimizer - max(copied, norm)
    assert copied > optimizer and hidden > 0
    assert sync.step_time - post.step_time == pytest.approx(hidden, rel=1e-9, abs=1e-15)
    assert sync.pipeline_time == post.pipeline_time  # nothing before the step's end moves
    # The copy a rollback restores: the rank's optimizer states twice.
    assert post.ranks[0].states.optimizer == 2 * sync.ranks[0].states.optimizer > 0
    names = [event.name for event in post.events if event.rank == 0]
    assert "optimizer state copy" in names and "all_reduce grad norm" in names
    assert "optimizer state copy" not in [event.name for event in sync.events]


def test_a_pipeline_s_ranks_update_while_the_last_rank_finishes():
    # tp2 pp2 (the example): under sync no rank updates before every rank's gradients are
    # averaged and the norm summed; under post each updates as soon as its own are.
    program = _program("tp = 2  pp = 2")
    sync, post = _both(program)
    norm = norm_sync_seconds(program)
    assert post.step_time < sync.step_time
    assert sync.step_time - post.step_time <= norm + max(r.optimizer for r in sync.ranks) + 1e-15
    known = max(r.end - r.optimizer for r in sync.ranks)  # ZeRO-0, no gathers: the optimizer ends the step
    assert all(r.end == pytest.approx(known + r.optimizer) for r in sync.ranks)
    for costs_check in ("sync", "post"):  # the search's floor stays below the simulated step
        floor = untimed(program, step_costs(program, None, None), si=False, optimizer_check=costs_check).floor
        assert floor <= simulate(program, si=False, optimizer_check=costs_check).step_time + 1e-12


def test_nothing_is_hidden_on_one_rank():
    program = _program("", nodes=1, per_node=1)
    sync, post = _both(program)
    assert sync.step_time == post.step_time and sync.ranks == post.ranks
    assert not [event for event in post.events if event.name in ("optimizer state copy", "all_reduce grad norm")]


def test_the_train_block_sets_it_and_a_run_s_option_wins():
    program = _program("dp = 4", "optimizer_check = post")
    assert program.train.setting("optimizer_check") == "post"
    written, post, sync = (simulate(program), simulate(program, optimizer_check="post"),
                           simulate(program, optimizer_check="sync"))
    assert written.step_time == post.step_time < sync.step_time
