"""`dhelix tune`'s pre-filter: the schedules the checks refuse on their sizes, taken out of a
layout's visit before pricing, are exactly those pricing refuses so, for the same reason."""

from __future__ import annotations

import random
import textwrap
from pathlib import Path

import attrs
import pytest

from dhelix.dsl.core.errors import DhelixError, first_message
from dhelix.dsl.frontend.check import check_program
from dhelix.dsl.frontend.imports import load_modules, read_source
from dhelix.dsl.frontend.parser import parse
from dhelix.dsl.frontend.stdlib import stdlib_pipelines
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.passes.fold import placement_for
from dhelix.dsl.passes.lower import leading_failure, lower_pipeline
from dhelix.dsl.search.branch import bound_schedule
from dhelix.dsl.search.space import Choice, space_of
from dhelix.dsl.search.tune import Pricer, Refused, search

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny_llama_cpu.dhx"


def _pricer(path: Path, stages: bool = False, offload: bool = False):
    text = read_source(str(path))
    modules = load_modules(text, str(path))
    base = passes.rerun(check_program(modules), after="check")
    keep = () if offload else ("offload",)  # (searched where a test says: the spaces twice over)
    return Pricer(modules, base, base.mesh.world), space_of(base, keep=keep, partitions=True, stages=stages)


def _strands_file(tmp_path: Path) -> Path:
    """The tiny example with a strands selector (``ag1``, the tensor-parallel all-gather)
    that layouts without tensor parallelism lack: the strands pass refuses their programs."""
    path = tmp_path / "strands.dhx"
    path.write_text(TINY.read_text().replace("  movable wgrad", "  movable wgrad\n  movable ag1").replace(
        '"../docs/*.md"', f'"{ROOT / "docs"}/*.md"'))
    return path


def _checked(pricer: Pricer, choice: Choice) -> str | None:
    """Why pricing ``choice`` refuses it at the checks (the reason it is counted for), None
    when they pass it."""
    try:
        pricer.checked(choice)
    except DhelixError as exc:
        return first_message(exc)
    return None


@pytest.mark.parametrize("strands, stages", [(False, False), (True, False), (False, True)])
def test_the_prefilter_refuses_what_the_checks_refuse_for_the_same_reason(tmp_path, strands, stages):
    # Every schedule of layouts of every pp and micro-batch count of the tiny space (two
    # layouts each, written and generated partitions, with and without a strands block the
    # passes refuse): the pre-filter refuses exactly the choices the checks refuse, with the
    # first message pricing counts them under (with uneven stages tried too: their splits,
    # and fold bidir's, which keeps equal ones). (Complete here: the stdlib pipelines'
    # requires open their bodies; a deadlock would be left to the pricer.)
    pricer, space = _pricer(_strands_file(tmp_path) if strands else TINY, stages)
    picked: dict[tuple, list] = {}
    for layout in space.layouts():
        bound = pricer.bound(layout, bound_schedule(space))
        if not isinstance(bound, str):
            picked.setdefault((layout.pp, layout.microbatches, layout.partition, bound.strands, layout.stage_ends),
                              []).append((layout, bound.strands))
    assert any(key[3] is not None for key in picked) == strands
    assert any(key[4] != (0, 0) for key in picked) == stages
    refused = passed = 0
    for entries in picked.values():
        for layout, why in (entries[0], entries[-1]):
            for schedule in space.schedules:
                choice = Choice(layout, *schedule)
                found = pricer.schedule_checks.refusal(choice, why)
                assert found == _checked(pricer, choice), choice
                refused += found is not None
                passed += found is None
    assert refused > 100 and passed > 100


def _recorded_search(pricer: Pricer, space, prefilter: bool):
    """The search of ``space`` in one process, what it priced (choice: result), and the
    choices the pre-filter refused with why (none: ``prefilter`` False)."""
    priced, prefiltered = {}, {}
    price, refusal = pricer.price, pricer.schedule_checks.refusal

    def recorded_price(choice, *args, **kwargs):
        priced[choice] = result = price(choice, *args, **kwargs)
        return result

    def recorded_refusal(choice, strands):
        found = refusal(choice, strands) if prefilter else None
        if found is not None:
            prefiltered[choice] = found
        return found

    pricer.price = recorded_price
    pricer.schedule_checks.refusal = recorded_refusal
    return search(pricer, space, top=5), priced, prefiltered


@pytest.mark.parametrize("seed", range(3))
def test_a_search_prices_what_it_did_less_what_the_prefilter_refuses(tmp_path, seed):
    # The same search with the pre-filter and without: the same top and the same counts,
    # refusals by reason included; the choices it prices are those it priced before less those
    # the pre-filter refused, each of which pricing refused for that very reason.
    path = _strands_file(tmp_path) if seed == 2 else TINY
    rng = random.Random(seed)
    full = _pricer(path, offload=seed == 0)[1]  # offloading too: refused as their twins are
    space = attrs.evolve(full, micro_batch=tuple(b for b in full.micro_batch if rng.random() < 0.7) or (1,),
                         recompute=("none", rng.choice(("selective", "full"))))
    before, priced_before, _ = _recorded_search(_pricer(path)[0], space, prefilter=False)
    after, priced_after, prefiltered = _recorded_search(_pricer(path)[0], space, prefilter=True)
    assert prefiltered
    assert [(p.choice, p.seconds) for p in after.top] == [(p.choice, p.seconds) for p in before.top]
    counts = ("simulated", "fit", "refused", "pruned", "too_big", "same", "reasons", "choices", "layouts")
    assert [getattr(after, name) for name in counts] == [getattr(before, name) for name in counts]
    assert not set(prefiltered) & set(priced_after)
    # Without the pre-filter an offloading choice whose twin on the device pricing refused is
    # refused as its twin, unpriced; with it, the pre-filter refuses both for that reason.
    settled = (set(priced_after) | set(prefiltered)) - set(priced_before)
    for choice in settled:
        twin = priced_before[attrs.evolve(choice, layout=attrs.evolve(choice.layout, offload="none"))]
        assert choice.layout.offload != "none" and isinstance(twin, Refused)
        assert twin.why == (prefiltered[choice] if choice in prefiltered else priced_after[choice].why)
    assert set(priced_after) | set(prefiltered) == set(priced_before) | settled
    for choice, why in prefiltered.items():
        if choice not in settled:
            assert isinstance(priced_before[choice], Refused) and priced_before[choice].why == why, choice


def _pipeline(text: str):
    return parse(textwrap.dedent(text).lstrip(), "test.dhx", start="pipeline_def")


@pytest.mark.parametrize("name, ranks, microbatches", [
    ("dualpipe_v", 2, 3), ("w_helix", 4, 2), ("interleaved_1f1b", 2, 3), ("dualpipe_v", 2, 4), ("w_helix", 2, 2)])
def test_a_failure_in_the_opening_requires_is_the_lowerings(name, ranks, microbatches):
    pipeline = stdlib_pipelines()[name]
    kind = pipeline.fold
    placement = placement_for(kind, 2 if kind == "loop" else None, 12 * ranks, ranks)
    found = leading_failure(pipeline, ranks=ranks, microbatches=microbatches, placement=placement)
    try:
        lower_pipeline(pipeline, ranks=ranks, microbatches=microbatches, placement=placement)
    except DhelixError as exc:
        assert found is not None and found.render() == exc.render()
    else:
        assert found is None


def test_a_require_some_ranks_pass_is_left_to_the_lowering():
    # rank 0 gets past `require r < 1`: what the others do after it is the lowering's to say.
    pipeline = _pipeline("""
        pipeline lopsided {
          require r < 1
          repeat m { F }
          repeat m { B }
        }""")
    placement = placement_for("none", None, 4, 2)
    assert leading_failure(pipeline, ranks=2, microbatches=2, placement=placement) is None
    with pytest.raises(DhelixError, match="on rank 1"):
        lower_pipeline(pipeline, ranks=2, microbatches=2, placement=placement)
    # Every rank failing, each its own way: the lowering's group of errors.
    apart = _pipeline("""
        pipeline apart {
          require r < 0
          repeat m { F }
        }""")
    found = leading_failure(apart, ranks=2, microbatches=2, placement=placement)
    with pytest.raises(DhelixError) as info:
        lower_pipeline(apart, ranks=2, microbatches=2, placement=placement)
    assert found is not None and found.render() == info.value.render()


@pytest.mark.parametrize("name", ["tiny_llama_cpu.dhx", "tiny_llama_centauri_cpu.dhx"])
def test_a_zero3_layout_derives_from_its_zero0_twin_as_it_does_whole(name):
    # The pricer derives a ZeRO-3 layout's layer DAGs (or finds its refusal: ZeRO-3 with ep;
    # none in these dense spaces) from its ZeRO-0 twin's, running only ZeRO-3's pass again:
    # the same DAGs and names, or the same refusal, as the passes run whole — with cp (the
    # pieces over dp x cp) and with selective recomputation (the norms re-gathered first) too.
    pricer, space = _pricer(ROOT / "examples" / name)
    schedule = bound_schedule(space)
    derived = refused = 0
    kinds = set()
    for layout in space.layouts():
        if layout.zero != 3 or layout.shard or layout.partition != "written":
            continue
        twin = attrs.evolve(layout, zero=0, param_gather="step", recompute="none")
        try:
            pricer.layer_dags(twin, schedule)
        except DhelixError:
            pass
        program = attrs.evolve(check_program(pricer.variant(Choice(layout, *schedule))), profile=pricer.profile)
        try:
            whole = passes.rerun(program, after="check", stop="autodiff")
        except DhelixError as exc:
            whole = first_message(exc)
        try:
            sharded = pricer._sharded(program, layout)
        except DhelixError as exc:
            sharded = first_message(exc)
        if sharded is None:
            continue
        if isinstance(whole, str):
            assert sharded == whole, layout
            refused += 1
        else:
            assert (sharded.env, sharded.forward, sharded.backward) == (whole.env, whole.forward, whole.backward)
            derived += 1
            kinds.add((layout.cp > 1, layout.recompute))
    assert derived and not refused
    assert {(True, "none"), (False, "selective")} <= kinds, kinds
