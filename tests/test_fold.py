"""Model folding: stage placement and layer ranges of fold none, u and loop(v)."""

from __future__ import annotations

import pytest

from dhelix.dsl.core.errors import CheckError
from dhelix.dsl.passes.fold import fold_loop, fold_none, fold_u, placement_for


def test_fold_u_matches_the_paper_example():
    # DHelix §4.1 / Fig. 7: 32 layers on 4 GPUs; G0 {L0–3, L28–31} … G3 {L12–15, L16–19}.
    placement = fold_u(32, 4)
    assert [placement.layers_of(g) for g in range(4)] == [
        (range(0, 4), range(28, 32)),
        (range(4, 8), range(24, 28)),
        (range(8, 12), range(20, 24)),
        (range(12, 16), range(16, 20)),
    ]


def test_fold_u_stage_order_goes_down_then_up():
    placement = fold_u(8, 4)
    assert placement.slots() == ((0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1))
    # The hand-off at the turn stays on the last rank.
    assert placement.stages[3].rank == placement.stages[4].rank == 3


def test_fold_none_is_contiguous():
    placement = fold_none(12, 3)
    assert placement.chunks == 1
    assert [(st.rank, st.chunk, st.layers) for st in placement.stages] == [
        (0, 0, range(0, 4)), (1, 0, range(4, 8)), (2, 0, range(8, 12))]


def test_fold_loop_deals_stages_round_robin():
    placement = fold_loop(12, 3, 2)
    assert placement.slots() == ((0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1))
    assert placement.layers_of(1) == (range(2, 4), range(8, 10))


@pytest.mark.parametrize("kind,arg", [("none", None), ("u", None), ("loop", 1), ("loop", 3)])
@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 8])
def test_every_placement_covers_the_model_once_in_order(kind, arg, ranks):
    chunks = {"none": 1, "u": 2}.get(kind, arg)
    layers = 2 * ranks * chunks
    placement = placement_for(kind, arg, layers, ranks)
    assert [layer for stage in placement.stages for layer in stage.layers] == list(range(layers))
    assert sorted(placement.slots()) == [(g, c) for g in range(ranks) for c in range(chunks)]
    assert [stage.index for stage in placement.stages] == list(range(ranks * chunks))


def test_fold_loop_one_equals_fold_none():
    assert fold_loop(8, 4, 1).stages == fold_none(8, 4).stages


def _message(call) -> str:
    with pytest.raises(CheckError) as info:
        call()
    return info.value.render()


def test_layers_not_divisible_say_which_sizes_work():
    assert _message(lambda: fold_u(30, 4)) == (
        "error: 30 layers do not split into 8 stages (2 per rank) for fold u on 4 ranks\n"
        "  note: with 30 layers, fold u works on 1, 3, 5 or 15 ranks\n"
        "  note: on 4 ranks, fold u needs a multiple of 8 layers (8, 16, 24, …)")
    assert _message(lambda: fold_none(10, 4)) == (
        "error: 10 layers do not split into 4 stages for fold none on 4 ranks\n"
        "  note: with 10 layers, fold none works on 1, 2, 5 or 10 ranks\n"
        "  note: on 4 ranks, fold none needs a multiple of 4 layers (4, 8, 12, …)")
    assert _message(lambda: fold_loop(3, 1, 2)) == (
        "error: 3 layers do not split into 2 stages (2 per rank) for fold loop(2) on 1 rank\n"
        "  note: no number of ranks works: fold loop(2) needs a multiple of 2 layers\n"
        "  note: on 1 rank, fold loop(2) needs a multiple of 2 layers (2, 4, 6, …)")


def test_bad_counts_are_errors():
    assert _message(lambda: fold_loop(8, 4, 0)) == (
        "error: fold loop(0) needs at least 1 chunk per rank\n"
        "  note: write loop(2) or more for Megatron's interleaved schedule; "
        "loop(1) is the same as fold none")
    assert _message(lambda: fold_none(8, 0)) == (
        "error: a pipeline needs at least 1 rank, got 0\n  note: set mesh pp to 1 or more")
    assert _message(lambda: fold_u(0, 2)) == "error: a model needs at least 1 layer, got 0"


def test_placement_for_checks_kind_and_argument():
    assert _message(lambda: placement_for("uu", None, 8, 2)) == (
        "error: unknown fold 'uu'\n  note: did you mean 'u'?\n  note: folds are: none, u, loop(v), bidir")
    assert _message(lambda: placement_for("loop", None, 8, 2)) == (
        "error: fold loop needs the number of chunks per rank\n  note: write fold loop(2)")
    assert _message(lambda: placement_for("u", 2, 8, 2)) == (
        "error: fold u takes no argument\n  note: write fold u")
    assert placement_for("loop", 2, 8, 2) == fold_loop(8, 2, 2)


def test_set_first_and_last_stages_leave_the_others_an_equal_share():
    # Llama 3.1 405B's recipe shape: 126 layers on 16 ranks, 7 on each end, 8 on the others
    # (Megatron's --decoder-first/last-pipeline-num-layers); 126 layers split no other way.
    placement = fold_none(126, 16, ends=(7, 7))
    assert [len(stage.layers) for stage in placement.stages] == [7] + [8] * 14 + [7]
    assert [layer for stage in placement.stages for layer in stage.layers] == list(range(126))
    # The last stage alone lighter; under fold u the ends are model chunks both on rank 0.
    assert [len(s.layers) for s in fold_none(10, 4, ends=(None, 1)).stages] == [3, 3, 3, 1]
    u = fold_u(10, 2, ends=(2, 2))
    assert u.layers_of(0) == (range(0, 2), range(8, 10)) and u.layers_of(1) == (range(2, 5), range(5, 8))
    assert fold_none(8, 4, ends=(2, 2)).stages == fold_none(8, 4).stages


def test_stage_ends_that_leave_no_equal_share_say_what_works():
    assert _message(lambda: fold_none(10, 4, ends=(2, 3))) == (
        "error: first_stage_layers = 2 and last_stage_layers = 3 leave 5 layers for the other 2 stages of fold "
        "none: not an equal share\n"
        "  note: the stages between the ends split the rest of the 10 layers evenly")
    assert _message(lambda: fold_none(10, 4, ends=(3, None))) == (
        "error: first_stage_layers = 3 leaves 7 layers for the other 3 stages of fold none: not an equal share\n"
        "  note: the stages between the ends split the rest of the 10 layers evenly; e.g. first_stage_layers = "
        "1, 4 or 7")
    assert _message(lambda: fold_none(10, 1, ends=(3, 3))) == (
        "error: first_stage_layers = 3 and last_stage_layers = 3: fold none has 1 stage, and the ends' layers must "
        "make the model's 10\n"
        "  note: a first and a last stage need two stages or more: remove one, or add pipeline ranks")
    assert _message(lambda: fold_none(10, 1, ends=(None, 3))).endswith(
        "note: one stage holds every layer: remove it, or add pipeline ranks")
    assert _message(lambda: fold_none(10, 2, ends=(3, 3))).endswith(
        "note: with two stages, write layers that add up to 10")
