"""Bidirectional DualPipe (fold bidir, pipeline dualpipe): two model copies, micro-batches fed
from both ends. Held to DualPipe's own order (its step()'s eight phases replayed with its
WeightGradStore as a queue), to what its comment in stdlib_schedules/pipelines.dhx says
(unit-time make-span and in-flight activations), to fold bidir's placement (rank r holds stage
r of copy 0 and stage p - 1 - r of copy 1: 2× the parameters), and simulated, drawn and
searched by `dhelix tune` as every stdlib pipeline, and run on gloo ranks with `dhelix run
--check` (exact against the single-process reference, both copies' gradients summed)."""

from __future__ import annotations

from collections import deque
from fractions import Fraction

import pytest

from commands import dhelix_here
from test_zb_schedules import program_text as zb_program_text
from dhelix.cli import main
from dhelix.dsl.core.errors import DhelixError, ParseError, ScheduleError
from dhelix.dsl.core.schedule import Interleaved, computes, format_lowered, parse_lowered
from dhelix.dsl.passes.fold import fold_bidir, placement_for
from dhelix.dsl.passes.pipeline import check_text, dump_stage
from dhelix.dsl.passes.runcheck import unrunnable
from dhelix.dsl.passes.unittime import peak_in_flight, unit_time
from dhelix.dsl.passes.validate import check_fifo, validate_lowered
from dhelix.dsl.render.torch_csv import torch_csv
from dhelix.dsl.search.space import space_of
from dhelix.dsl.simulator.events import simulate
from test_lower import lower_stdlib
from test_simulate import unit_costs

#: Even p with m from DualPipe's least (2p) up.
SIZES = [(p, m) for p in (2, 4, 6, 8) for m in (2 * p, 2 * p + 2, 4 * p)]
#: Larger pipelines for the unit-time closed form.
LARGER = [(p, m) for p in (10, 12, 16) for m in (2 * p, 3 * p + 2)]


def dualpipe_order(p: int, m: int, rank: int) -> list[tuple]:
    """The computations DualPipe's step() runs on ``rank`` (deepseek-ai/DualPipe, dualpipe.py),
    as ('F', chunk), ('B', chunk), ('W', chunk) or ('SI', F chunk, B chunk): its phases replayed
    with the WeightGradStore as a FIFO queue. DualPipe's phase x is chunk x on the first half
    of the ranks and chunk 1 - x on the second; its full backward is B then W."""
    n, h, flip = p // 2, min(rank, p - 1 - rank), int(rank >= p // 2)
    chunk = [flip, 1 - flip]  # chunk of phase 0, phase 1
    out: list[tuple] = []
    store: deque = deque()

    def backward(phase: int, zb: bool) -> None:
        out.append(("B", chunk[phase]))
        if zb:
            store.append(chunk[phase])
        else:
            out.append(("W", chunk[phase]))

    def weight() -> None:
        out.append(("W", store.popleft()))

    def pair(f: int, b: int) -> None:  # _forward_backward_chunk, overlapped
        out.append(("SI", chunk[f], chunk[b]))
        out.append(("W", chunk[b]))

    out += [("F", chunk[0])] * (2 * (n - h - 1))                        # 1: nF0
    for _ in range(h + 1):                                                # 2: nF0F1
        out += [("F", chunk[0]), ("F", chunk[1])]
    for _ in range(n - h - 1):                                            # 3: nB1W1F1
        backward(1, zb=True)
        weight()
        out.append(("F", chunk[1]))
    for i in range(m // 2 - p + h + 1):                                   # 4: nF0B1F1B0
        if i == 0 and h == n - 1:  # the middle ranks do not overlap their first pair
            out.append(("F", chunk[0]))
            backward(1, zb=False)
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(n - h - 1):                                            # 5: nB1F1B0
        backward(1, zb=False)
        pair(1, 0)
    zb = False
    for i in range(h + 1):                                                # 6: nB1B0
        if i == (h + 1) // 2 and h % 2 == 1:
            zb = True
        backward(1, zb)
        if i == (h + 1) // 2 and h % 2 == 0:
            zb = True
        backward(0, zb)
    for _ in range(n - h - 1):                                            # 7: nWB0
        weight()
        backward(0, zb=True)
    for _ in range(h + 1):                                                # 8: nW
        weight()
    assert not store
    return out


def _order(lowered, rank: int) -> list[tuple]:
    row = []
    for action in lowered.actions[rank]:
        if isinstance(action, Interleaved):
            row.append(("SI", action.fwd.chunk, action.bwd.chunk))
        elif computes(action):
            row.append((action.kind, action.chunk))
    return row


@pytest.mark.parametrize("p, m", SIZES)
def test_dualpipe_runs_dualpipes_order_on_every_rank(p, m):
    lowered = lower_stdlib("dualpipe", p, m)
    validate_lowered(lowered)
    assert check_fifo(lowered) == []  # untagged backends (NCCL) pair every message right
    for rank in range(p):
        assert _order(lowered, rank) == dualpipe_order(p, m, rank), (p, m, rank)
    # Copy 0 (chunk 0) runs the first m/2 micro-batches, copy 1 the rest, each in order.
    for rank, row in enumerate(lowered.actions):
        for chunk in (0, 1):
            forwards = [c.microbatch for a in row for c in computes(a) if c.kind == "F" and c.chunk == chunk]
            assert forwards == list(range(chunk * m // 2, (chunk + 1) * m // 2)), (p, m, rank)


def test_unit_time_and_in_flight_are_the_comments():
    lowered = lower_stdlib("dualpipe", 4, 8)
    assert unit_time(lowered).makespan == 25
    assert (unit_time(lower_stdlib("one_f_one_b", 4, 8)).makespan, unit_time(lower_stdlib("zb_h1", 4, 8)).makespan) \
        == (33, 27)
    assert unit_time(lowered).bubble_ratio == Fraction(1, 25)
    assert peak_in_flight(lowered) == (4, 5, 5, 4)
    for p, m in SIZES + LARGER:
        lowered = lower_stdlib("dualpipe", p, m)
        assert unit_time(lowered).makespan == 3 * m + p // 2 - 1, (p, m)  # half of ZB-H1's p - 1 idle steps
        assert unit_time(lowered).bubble_ratio == Fraction(p // 2 - 1, 3 * m + p // 2 - 1), (p, m)
        # p + 1 on the two middle ranks, p on the others: the paper's PP + 1.
        assert peak_in_flight(lowered) == tuple(p + 1 if min(r, p - 1 - r) == p // 2 - 1 else p
                                                for r in range(p)), (p, m)
        # Each rank runs 3m chunk actions, as 1F1B's stage: it beats 1F1B from m = 2p on.
        assert unit_time(lowered).makespan < unit_time(lower_stdlib("one_f_one_b", p, m)).makespan, (p, m)


def test_fold_bidir_places_two_copies_in_opposite_directions():
    placement = fold_bidir(8, 4)
    assert [(s.rank, s.chunk, s.first_layer) for s in placement.stages] == [
        (0, 0, 0), (1, 0, 2), (2, 0, 4), (3, 0, 6), (3, 1, 0), (2, 1, 2), (1, 1, 4), (0, 1, 6)]
    assert placement.layers_of(0) == (range(0, 2), range(6, 8))
    assert [placement.neighbour(3, 1), placement.neighbour(4, -1), placement.neighbour(4, 1)] == [None, None, 5]
    assert [s for s in range(8) if placement.is_first(s)] == [0, 4]
    assert [s for s in range(8) if placement.is_last(s)] == [3, 7]


def test_fold_bidir_needs_even_ranks_dividing_the_layers():
    with pytest.raises(DhelixError) as info:
        placement_for("bidir", None, 9, 3)
    assert info.value.message == "fold bidir needs an even number of pipeline ranks, got pp = 3"
    with pytest.raises(DhelixError) as info:
        placement_for("bidir", None, 6, 4)
    assert info.value.message == "6 layers do not split into 4 stages for fold bidir on 4 ranks"
    assert "works on 2 or 6 ranks" in info.value.render()
    with pytest.raises(ScheduleError) as error:
        lower_stdlib("dualpipe", 4, 9)
    assert error.value.message.startswith("pipeline dualpipe needs m % 2 == 0")


def test_text_form_keeps_the_copies_and_validation_keeps_each_copy_to_its_micro_batches():
    lowered = lower_stdlib("dualpipe", 2, 4)
    text = format_lowered(lowered)
    assert text.startswith("lowered dualpipe p=2 m=4 v=2 copies=2\nstages: r0.0 r1.0 r1.1 r0.1\n")
    assert parse_lowered(text) == lowered
    with pytest.raises(ParseError, match="copies=3 must divide"):
        parse_lowered(text.replace("copies=2", "copies=3"))
    # A mutant: rank 1's first forward of copy 1 (micro-batch 2) renamed micro-batch 0.
    bad = text.replace("r1: F2.1", "r1: F0.1", 1)
    assert bad != text
    with pytest.raises(DhelixError) as info:
        validate_lowered(parse_lowered(bad))
    assert "runs micro-batch 0 on stage 2 of model copy 1, which runs micro-batches 2..3" in info.value.render()


def program_text(p: int, m: int, fold: str = "bidir", pipeline: str = "dualpipe") -> str:
    """A tiny Llama on p pipeline ranks, one layer per stage (test_zb_schedules' program)."""
    return zb_program_text(pipeline, fold, p, m)


def test_check_dumps_the_two_copies():
    program = check_text(program_text(2, 4), "dp.dhx")
    assert dump_stage("fold", program) == (
        "fold bidir: 4 stages (2 model copies) on 2 ranks\n"
        "  stage 0: rank 0 chunk 0  L0  copy 0\n  stage 1: rank 1 chunk 0  L1  copy 0\n"
        "  stage 2: rank 1 chunk 1  L0  copy 1\n  stage 3: rank 0 chunk 1  L1  copy 1\n")
    assert dump_stage("lower", program).startswith("lowered dualpipe p=2 m=4 v=2 copies=2\n")


def test_simulated_with_twice_the_parameters_and_unit_time_reproduced():
    for p, m in ((2, 4), (4, 8)):
        program = check_text(program_text(p, m), "dp.dhx")
        assert program.lowered.copies == 2 and program.lowered.split and program.lowered.interleaved
        sim = simulate(program, costs=unit_costs(program))
        timing = unit_time(program.lowered)
        assert sim.pipeline_time == pytest.approx(timing.makespan, rel=1e-9)
        assert sim.bubble_ratio == pytest.approx(float(timing.bubble_ratio), abs=1e-9)
    bidir = simulate(check_text(program_text(4, 8), "dp.dhx"))
    plain = simulate(check_text(program_text(4, 8, "none", "one_f_one_b"), "1f1b.dhx"))
    # A middle rank holds two stages of one layer each (1F1B's: one); the end ranks hold both
    # model ends (embedding, LM head), each once.
    assert bidir.ranks[1].states.params == pytest.approx(2 * plain.ranks[1].states.params)
    assert bidir.ranks[0].states.params == bidir.ranks[3].states.params == pytest.approx(
        plain.ranks[0].states.params + plain.ranks[3].states.params)
    # The copies' gradient sum: each rank exchanges its gradients with its twin after its last
    # action, on the pipeline lane, before the optimizer.
    exchanges = [e for e in bidir.events if e.name == "exchange gradients with the twin copy"]
    assert sorted(e.rank for e in exchanges) == [0, 1, 2, 3]
    for e in exchanges:
        assert e.start >= bidir.ranks[e.rank].pipeline_end and e.args["bytes"] == pytest.approx(
            bidir.ranks[e.rank].states.grads)  # (fp32 main gradients, as the grads column)
        assert bidir.ranks[e.rank].end >= e.start + e.duration
    assert not [e for e in plain.events if e.name == "exchange gradients with the twin copy"]


def test_drawn_and_searched(tmp_path, capsys):
    path = tmp_path / "dp.dhx"
    path.write_text(program_text(4, 8))
    assert main(["render", str(path), "--what", "pipeline"]) == 0
    dot = capsys.readouterr().out
    assert all(f"<B>rank {rank}</B>" in dot for rank in range(4))
    assert main(["render", str(path), "--what", "placement"]) == 0
    dot = capsys.readouterr().out
    assert "\"s3\" -> \"s4\" [penwidth" not in dot and "\"s4\" -> \"s5\" [penwidth" in dot  # none between copies
    assert '"input1" -> "s4"' in dot and '"s7" -> "loss1"' in dot
    program = check_text(program_text(4, 8), "dp.dhx")
    schedules = space_of(program).schedules
    assert ("bidir", "dualpipe", "on") in schedules
    assert not any(fold == "bidir" and name != "dualpipe" for fold, name, _ in schedules)


#: (pp, mesh, train extra): 4 pipeline ranks; 2 pipeline ranks × dp 2 under ZeRO-1 (the
#: copies' sum, then the optimizer's reduction and slices over dp).
GLOO_RUNS = {"pp4": (4, "pp = 4", ""), "pp2_dp2_zero1": (2, "dp = 2  pp = 2", "  zero = 1")}


@pytest.mark.parametrize("name", sorted(GLOO_RUNS))
def test_run_check_is_exact_on_gloo_ranks_with_si(name, tmp_path):
    # pp4: two middle ranks with their unoverlapped first pair and two end ranks, 8
    # micro-batches, so every phase runs; the SI blocks co-execute a forward of one copy with
    # a backward of the other. Two steps: the second runs on the updated weights, which equal
    # the reference's only if both copies of every stage took the same summed gradient
    # (without the sum: a gradient diff of 9e-2 at step 2).
    p, mesh, extra = GLOO_RUNS[name]
    text = program_text(p, 2 * p).replace(f"mesh {{ pp = {p} }}", f"mesh {{ {mesh} }}")
    text = text.replace(f"gpus_per_node = {p}", "gpus_per_node = 4").replace("seed = 7", "seed = 7" + extra)
    path = tmp_path / "dualpipe.dhx"
    path.write_text(text)
    result = dhelix_here("run", str(path), "--steps", "2", "--check")
    assert result.returncode == 0, result.stderr
    assert "SI on" in result.stderr + result.stdout
    assert result.stdout.splitlines()[-1].startswith("check: passed: 2 step(s) match the single-process reference")


def test_torch_csv_export_is_refused_by_name():
    with pytest.raises(ScheduleError, match="runs 2 model copies .fold bidir.: torch's pipeline stages form one"):
        torch_csv(lower_stdlib("dualpipe", 4, 8))


def test_zero_2_and_3_are_refused_by_name_before_any_rank_starts():
    assert unrunnable(check_text(program_text(4, 8), "dp.dhx")) == []
    text = program_text(4, 8).replace("seed = 7", "seed = 7  zero = 2")
    [warning] = unrunnable(check_text(text, "dp.dhx"))
    assert warning.message.startswith("fold bidir with zero = 2 can be checked, lowered, drawn, simulated and tuned, "
                                      "but not run")


def test_a_tied_lm_head_is_refused_at_the_fold():
    # Each copy's embedding (its first stage) and LM head (its last) sit on ranks 0 and p - 1.
    with pytest.raises(DhelixError) as info:
        check_text(program_text(4, 8).replace("layer = llama }", "layer = llama  tie_embeddings = 1 }"), "dp.dhx")
    assert info.value.message.startswith("tie_embeddings = 1 with fold bidir on 4 pipeline ranks: the embedding "
                                         "(first stage, rank 0) and the LM head (last stage, rank 3)")


def test_uneven_stages_are_refused_at_the_stage_sizes():
    # Each copy's first stage sits on the rank of the other copy's last: the stages stay equal.
    text = program_text(4, 8).replace("layers = 4", "layers = 8").replace("seed = 7", "seed = 7  first_stage_layers = 1")
    with pytest.raises(DhelixError) as info:
        check_text(text, "dp.dhx")
    rendered = info.value.render()
    assert "fold bidir with first_stage_layers or last_stage_layers" in rendered
    assert "dp.dhx:7:54:" in rendered  # at first_stage_layers in the train block
