"""one_f_one_b_overlap, Megatron-Core's combined 1F1B (`--overlap-moe-expert-parallel-comm`):
1F1B whose steady-state forward and backward run as one SI block, so that the MoE dispatch and
combine all-to-alls of one micro-batch hide behind the other's compute. Held to what its
comment in stdlib_schedules/pipelines.dhx says: unit-time make-span and bubble (1F1B's), the
activations in flight (2(p - r) - 1 between actions, one more inside a block), why the warm-up
is 2(p - r) - 1 and not 1F1B's plus one; simulated on a MoE program with ep (SI on hides the
all-to-alls that SI off and 1F1B expose, and holds the activations the comment says); drawn,
checked and searched by `dhelix tune` as every stdlib pipeline; and run on gloo ranks with
`dhelix run --check` on a tiny MoE model with ep = 2 and SI on, exact against the
single-process reference."""

from __future__ import annotations

import textwrap
from fractions import Fraction

import pytest

from commands import dhelix_here
from dhelix.cli import main
from dhelix.dsl.core.schedule import Interleaved
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.passes.unittime import peak_in_flight, unit_time
from dhelix.dsl.search.space import space_of
from dhelix.dsl.simulator.events import simulate
from test_lower import lower_stdlib, lower_text

NAME = "one_f_one_b_overlap"
#: p = 1..8, m from 1 to 5p (a warm-up capped by m, no steady phase, and long steady phases).
SIZES = [(p, m) for p in range(1, 9) for m in sorted({1, 2, p, p + 1, 2 * p - 1, 2 * p, 3 * p + 1, 5 * p})]


def test_unit_time_is_one_f_one_b_s_and_the_first_rank_holds_2p_minus_1():
    for p, m in SIZES:
        lowered = lower_stdlib(NAME, p, m)
        timing = unit_time(lowered)
        assert timing.makespan == 3 * (m + p - 1) == unit_time(lower_stdlib("one_f_one_b", p, m)).makespan, (p, m)
        assert timing.bubble_ratio == Fraction(p - 1, m + p - 1)
        assert peak_in_flight(lowered) == tuple(min(2 * (p - r) - 1, m) for r in range(p)), (p, m)
        # Inside a block both of its micro-batches are held: one more (1F1B: p - r during its F).
        assert peak_in_flight(lowered, inside_blocks=True) == tuple(min(2 * (p - r), m) for r in range(p)), (p, m)
        assert peak_in_flight(lower_stdlib("one_f_one_b", p, m), inside_blocks=True) == tuple(min(p - r, m) for r in range(p))


def test_the_steady_phase_is_all_si_blocks_of_two_micro_batches():
    p, m = 4, 12
    lowered = lower_stdlib(NAME, p, m)
    for r, row in enumerate(lowered.actions):
        warm = 2 * (p - r) - 1
        blocks = [a for a in row if isinstance(a, Interleaved)]
        assert len(blocks) == m - warm
        # Block k pairs F of micro-batch k + warm with B of k: never the same micro-batch.
        assert [(a.fwd.microbatch, a.bwd.microbatch) for a in blocks] == [(k + warm, k) for k in range(m - warm)]


#: 1F1B's warm-up plus one (Megatron's "one extra micro-batch forward step" over its
#: non-interleaved 1F1B): each block's forward and backward are independent too.
PLUS_ONE = """
    pipeline one_f_one_b_plus_one for none {
      warm = min(p - r, m)
      repeat warm { F }
      repeat m - warm { SI(F, B) }
      repeat warm { B }
    }
"""


def test_one_f_one_b_s_warm_up_plus_one_waits_a_block_per_micro_batch():
    # A block sends its outputs when both halves end: with w_r - w_{r+1} = 1 rank r's block k
    # waits for rank r + 1's block k, which waited for rank r's block k - 1, so the steady
    # state takes two blocks (6 units) per micro-batch and the bubble nears 1/2; with the
    # stdlib's 2(p - r) - 1 it takes one, as 1F1B.
    for p in range(2, 9):
        for m in (p, p + 1, 2 * p, 3 * p + 1, 5 * p):
            timing = unit_time(lower_text(PLUS_ONE, p, m))
            assert timing.makespan == 6 * m + 3 * p - 9, (p, m)
            if m > p:  # with a steady phase longer than one block
                assert timing.makespan > unit_time(lower_stdlib(NAME, p, m)).makespan
            assert peak_in_flight(lower_text(PLUS_ONE, p, m)) == tuple(min(p - r, m) for r in range(p))
    assert unit_time(lower_text(PLUS_ONE, 4, 40)).bubble_ratio == Fraction(41, 81)


# --- simulated: a MoE program with expert parallelism --------------------------------------------

MOE = """import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model moe_mid {
  layers = 8  hidden = 2048  ffn = 4096  heads = 16  kv_heads = 4  seq = 2048  vocab = 32000
  experts = 8  top_k = 2  dtype = bf16  layer = moe
}
cluster { nodes = 2  gpus_per_node = 8  profile = "a40" }
mesh { dp = 4  pp = 4  ep = 4 }
train { micro_batch = 1  microbatches = 16 }
fold none
pipeline PIPELINE
"""


def test_simulated_si_hides_the_all_to_alls_at_the_activations_the_comment_says():
    overlap = check_text(MOE.replace("PIPELINE", NAME), "moe.dhx")
    on, off = simulate(overlap, si=True), simulate(overlap, si=False)
    baseline = simulate(check_text(MOE.replace("PIPELINE", "one_f_one_b"), "moe.dhx"))
    # SI co-executes each block's forward and backward: the ep all-to-alls of one under the
    # other's compute. SI off runs the same order one after the other, as long as 1F1B.
    assert on.step_time < 0.9 * min(off.step_time, baseline.step_time)
    assert on.mean("layer_exposed") < 0.7 * off.mean("layer_exposed")
    assert off.mean("layer_exposed") == pytest.approx(baseline.mean("layer_exposed"), rel=1e-9)
    assert [r.sends for r in on.ranks] == [r.sends for r in baseline.ranks]  # 1F1B's transfers
    # Activations in whole micro-batches (1F1B's rank r holds p - r): SI off holds a block's
    # two, 2(p - r); SI on frees the backward's layers as the forward takes its own, so
    # 2(p - r) - 1, what the lowering's count says. (The last rank also holds the LM head's.)
    p = 4
    one = baseline.ranks[0].activations / p
    for r in range(p - 1):
        assert baseline.ranks[r].activations == pytest.approx((p - r) * one, rel=1e-6)
        assert off.ranks[r].activations == pytest.approx(2 * (p - r) * one, rel=1e-6)
        assert on.ranks[r].activations == pytest.approx((2 * (p - r) - 1) * one, rel=1e-6)


# --- drawn, checked and searched ----------------------------------------------------------------

def program_text(p: int, m: int, mesh: str = "", experts: bool = False) -> str:
    """A tiny model on p gloo pipeline ranks (MoE with ``experts``), 1 layer per rank."""
    layer = "moe  experts = 4  top_k = 2" if experts else "llama"
    mesh = mesh or f"pp = {p}"
    gpus = p * (2 if "dp" in mesh else 1)
    return textwrap.dedent(f"""\
        import "stdlib/layers.dhx"
        import "stdlib/pipelines.dhx"
        model tiny {{ layers = {p}  hidden = 32  ffn = 64  heads = 4  kv_heads = 2  seq = 8
          vocab = 64  dtype = fp32  layer = {layer} }}
        cluster {{ nodes = 1  gpus_per_node = {gpus}  profile = "a40" }}
        mesh {{ {mesh} }}
        train {{ micro_batch = 1  microbatches = {m}  seed = 7 }}
        fold none
        pipeline {NAME}
        """)


def test_dhelix_check_names_it_and_lowers_si_blocks():
    program = check_text(program_text(4, 8), "t.dhx")
    assert program.pipeline.name == NAME and not program.lowered.split
    assert any(isinstance(a, Interleaved) for row in program.lowered.actions for a in row)


def test_drawn_and_searched_with_si_on_and_off(tmp_path, capsys):
    path = tmp_path / "p.dhx"
    path.write_text(program_text(4, 8))
    assert main(["render", str(path), "--what", "pipeline"]) == 0
    dot = capsys.readouterr().out
    assert all(f"<B>rank {rank}</B>" in dot for rank in range(4))
    # It writes SI blocks, so tune tries it with them co-executed and without.
    schedules = space_of(check_text(program_text(4, 8), "t.dhx")).schedules
    assert {("none", NAME, "on"), ("none", NAME, "off")} <= set(schedules)


def test_run_check_is_exact_on_gloo_ranks_with_ep_and_si_on(tmp_path):
    # The tiny MoE on pp 2 × dp 2 with ep 2 (4 gloo ranks), 6 micro-batches: rank 0 warms up
    # with 3 forwards and runs 3 blocks, rank 1 runs 5; each block's ep all-to-alls
    # interleave with the other strand's ops.
    path = tmp_path / f"{NAME}.dhx"
    path.write_text(program_text(2, 6, mesh="pp = 2  dp = 2  ep = 2", experts=True))
    result = dhelix_here("run", str(path), "--steps", "2", "--check", "--timeout", "120", cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"{NAME}, pp 2 × dp 2 (ep 2)" in output and "SI on" in output
    assert "check: passed: 2 step(s) match the single-process reference" in output
