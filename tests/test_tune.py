"""`dhelix tune`: the search equals an exhaustive pricing, its bounds hold, its output runs."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from commands import dhelix_here

from dhelix.dsl.core.errors import DhelixError, first_message
from dhelix.dsl.frontend.check import check_program
from dhelix.dsl.frontend.imports import load_modules, read_source
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.search.space import Choice, Layout, Space, space_of
from dhelix.dsl.frontend.config import OFFLOAD
from dhelix.dsl.search.tune import Pricer, Priced, exhaustive, search

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny_llama_cpu.dhx"


def _pricer(path: Path = TINY) -> tuple[Pricer, Space]:
    text = read_source(str(path))
    modules = load_modules(text, str(path))
    base = passes.rerun(check_program(modules), after="check")
    # (offload kept: the tests that search it say so, the others' spaces stay as small)
    return Pricer(modules, base, base.mesh.world), space_of(base, keep=("offload",), partitions=True)


def _sub(rng: random.Random, values: tuple) -> tuple:
    """A random non-empty subset of ``values`` in their order."""
    picked = [v for v in values if rng.random() < 0.5]
    return tuple(picked) or (rng.choice(values),)


@pytest.fixture(scope="module")
def tiny():
    return _pricer()


class _Memo:
    """A pricer of its own that prices each choice once: the exhaustive side of the tests
    whose search runs on a fresh pricer (pricing depends on the choice alone, not on what a
    pricer priced before; these tests hold that too)."""

    def __init__(self):
        self.pricer = _pricer()[0]
        self.prices: dict[Choice, object] = {}

    def price(self, choice: Choice):
        found = self.prices.get(choice)
        if found is None:
            found = self.prices[choice] = self.pricer.price(choice)
        return found


@pytest.fixture(scope="module")
def memo():
    return _Memo()


@pytest.mark.parametrize("seed", range(6))
def test_search_equals_exhaustive_on_random_spaces(tiny, seed):
    pricer, full = tiny
    rng = random.Random(seed)
    space = attrs.evolve(full, tp=_sub(rng, full.tp), pp=_sub(rng, full.pp), micro_batch=_sub(rng, full.micro_batch),
                         zero=_sub(rng, full.zero), recompute=_sub(rng, full.recompute),
                         schedules=_sub(rng, full.schedules), cp=(1,), partition=_sub(rng, full.partition),
                         param_gather=_sub(rng, full.param_gather))
    top = rng.choice((1, 3, 5))
    space = attrs.evolve(space, offload=_sub(rng, OFFLOAD))
    expected = exhaustive(pricer, space, top=top)
    found = search(pricer, space, top=top)
    assert [p.choice for p in found.top] == [p.choice for p in expected]
    assert [p.seconds for p in found.top] == [p.seconds for p in expected]
    assert found.fit + found.refused + found.pruned + found.too_big + found.same == found.choices
    # The placements are searched as any setting: two axes of 2 on nodes of 2 sit two ways.
    two_axes = [layout for layout in space.layouts() if len(layout.axes()) == 2]
    assert not two_axes or {layout.order for layout in two_axes} >= {("tp", "pp"), ("pp", "tp")} & {
        layout.order for layout in two_axes} and len({layout.order for layout in two_axes}) > 1


@pytest.mark.parametrize("seed", range(3))
def test_a_search_that_defers_planning_equals_exhaustive(seed, memo):
    # A fresh pricer, so no SI layer pair is planned before the search: choices that need
    # one wait with their floor as bound and are planned best first.
    from dhelix.dsl.search.tune import Deferred

    rng = random.Random(200 + seed)
    deferred: list = []
    while not deferred:  # a space where some choice waits for its plan
        pricer, full = _pricer()
        space = attrs.evolve(full, tp=_sub(rng, full.tp), zero=_sub(rng, full.zero),
                             recompute=_sub(rng, full.recompute), cp=(1,), micro_batch=(1,),
                             partition=_sub(rng, full.partition),
                             schedules=tuple(s for s in full.schedules if s[1] in ("w_helix", "dualpipe_v")))
        price = pricer.price

        def counted(*args, price=price, **kwargs):
            result = price(*args, **kwargs)
            deferred.extend([result] if isinstance(result, Deferred) else [])
            return result

        pricer.price = counted
        top = rng.choice((1, 3, 5))
        found = search(pricer, space, top=top)
    expected = exhaustive(memo, space, top=top)
    assert deferred
    assert [p.choice for p in found.top] == [p.choice for p in expected]
    assert [p.seconds for p in found.top] == [p.seconds for p in expected]
    assert found.fit + found.refused + found.pruned + found.too_big + found.same == found.choices


@pytest.mark.parametrize("seed", range(2))
def test_a_search_with_chains_under_si_equals_exhaustive(seed, memo):
    # Generated partitions keep their chunk chains under SI: such a choice waits with the
    # bound of its step before the planner settles its counts (which plans several SI
    # pairs), and the search still equals the exhaustive pricing.
    from dhelix.dsl.search.pricer import _has_chains
    from dhelix.dsl.search.tune import Deferred
    from dhelix.dsl.simulator.events import has_si

    rng = random.Random(300 + seed)
    pricer, full = _pricer()
    space = attrs.evolve(full, tp=(2,), zero=_sub(rng, full.zero), recompute=_sub(rng, full.recompute), cp=(1,),
                         micro_batch=(1,), partition=("auto",),
                         schedules=tuple(s for s in full.schedules if s[1] in ("w_helix", "dualpipe_v")))
    chained: list = []
    price = pricer.price

    def counted(choice, *args, price=price, **kwargs):
        result = price(choice, *args, **kwargs)
        if isinstance(result, Deferred) and choice.si == "on":
            program = pricer.checked(choice)
            chained.extend([choice] if has_si(program) and _has_chains(program.partition) else [])
        return result

    pricer.price = counted
    top = rng.choice((1, 3))
    found = search(pricer, space, top=top)
    expected = exhaustive(memo, space, top=top)
    assert chained
    assert [p.choice for p in found.top] == [p.choice for p in expected]
    assert [p.seconds for p in found.top] == [p.seconds for p in expected]
    assert any(p.choice.si == "on" and p.choice.layout.partition == "auto" for p in expected)


def _held_back_search(space: Space, top: int, scale: float = 1.0) -> tuple[Pricer, object, list[Choice]]:
    """A search of ``space`` by a fresh pricer, and the choices it held back (Deferred) until
    their chunk counts were settled; ``scale`` multiplies the bound they wait with."""
    from dhelix.dsl.search.tune import Deferred

    pricer, _ = _pricer()
    held: list[Choice] = []
    price, unsettled = pricer.price, pricer.unsettled_bound

    def counted(choice, *args, **kwargs):
        result = price(choice, *args, **kwargs)
        held.extend([choice] if isinstance(result, Deferred) and kwargs.get("defer") else [])
        return result

    pricer.price = counted
    pricer.unsettled_bound = lambda choice, program: unsettled(choice, program) * scale
    found = search(pricer, space, top=top)
    pricer.price, pricer.unsettled_bound = price, unsettled
    return pricer, found, held


@pytest.mark.parametrize("seed", range(3))
def test_partitions_held_back_for_their_counts_enter_the_top_exactly(seed, memo):
    # A choice whose generated partition has chunk chains, SI on or off, waits with the
    # bound of its step (chains whole, layer passes at their busiest lane) and has its
    # counts settled only when that bound can still enter the top: some held back enter
    # the top, some do not, and the search equals the exhaustive pricing. The test holds
    # the bound to being a bound: doubled, it cuts a choice of the top.
    rng = random.Random(seed)
    full = _pricer()[1]
    space = attrs.evolve(full, tp=(2,), cp=(1,), micro_batch=_sub(rng, full.micro_batch), zero=_sub(rng, full.zero),
                         recompute=_sub(rng, full.recompute), partition=("written", "auto"),
                         schedules=tuple(s for s in full.schedules
                                         if s[1] in ("w_helix", "dualpipe_v", "one_f_one_b", "zb_h1")))
    top = rng.choice((1, 3, 5))
    pricer, found, held = _held_back_search(space, top)
    expected = exhaustive(memo, space, top=top)
    assert [p.choice for p in found.top] == [p.choice for p in expected]
    assert [p.seconds for p in found.top] == [p.seconds for p in expected]
    best = {p.choice for p in expected}
    assert any(c in best for c in held) and any(c not in best for c in held)
    assert any(c.si == "off" for c in held) and any(c.si == "on" for c in held)
    doubled = _held_back_search(space, top, scale=2.0)[1]
    assert [p.choice for p in doubled.top] != [p.choice for p in expected]


def test_a_chained_choice_is_simulated_for_its_bound_only_when_it_comes_up():
    # A choice waiting for its chunk counts waits by its untimed floor (loose); its step
    # before the planner's choices is simulated only when it comes up, before it is settled,
    # and many choices never come up: fewer simulations than such choices.
    from dhelix.dsl.search.pricer import _has_chains
    from dhelix.dsl.search.tune import Deferred

    full = _pricer()[1]
    space = attrs.evolve(full, tp=(2,), cp=(1,), partition=("written", "auto"),
                         schedules=tuple(s for s in full.schedules if s[1] in ("w_helix", "one_f_one_b")))
    pricer = _pricer()[0]
    loose, bound, settled = set(), [], []
    price, unsettled, chosen = pricer.price, pricer.unsettled_bound, pricer.chosen

    def counted(choice, *args, **kwargs):
        result = price(choice, *args, **kwargs)
        if isinstance(result, Deferred) and result.loose:
            loose.add(choice)
        return result

    def simulated(choice, program):
        bound.append(choice)
        return unsettled(choice, program)

    def settles(program, layout):
        if _has_chains(program.partition):
            settled.append(next(c for c in bound if c.layout == layout))
        return chosen(program, layout)

    pricer.price, pricer.unsettled_bound, pricer.chosen = counted, simulated, settles
    found = search(pricer, space, top=1)
    pricer.price, pricer.unsettled_bound, pricer.chosen = price, unsettled, chosen
    assert settled and set(settled) <= set(bound) <= loose
    assert len(set(bound)) < len(loose)
    assert found.top and found.complete  # the top equals the exhaustive pricing: the tests above
    assert 0 < found.found <= found.seconds  # when the best was priced


def test_the_unsettled_bounds_hold_for_the_settled_choice(tiny):
    # Before the planner settles a chained choice's counts (chains whole, substitutions
    # undone, layer passes at their busiest lane), its simulated step and untimed floor are
    # at most the settled step, and its untimed peak at most the settled peak: what rules it
    # out over the device memory without settling it.
    from dhelix.dsl.search.pricer import _has_chains
    from dhelix.dsl.simulator.events import untimed

    pricer, space = tiny
    checked, si = 0, set()
    for choice in [c for c in space.choices() if c.layout.partition == "auto" and c.layout.tp == 2][::97]:
        try:
            program = pricer.checked(choice)
        except DhelixError:
            continue
        result = pricer.price(choice)
        if not _has_chains(program.partition) or not isinstance(result, Priced):
            continue
        seen = untimed(program, pricer.unsettled_costs(program, choice.layout))
        step = pricer.unsettled_bound(choice, program)
        assert seen.floor <= step * (1 + 1e-12) and step <= result.seconds * (1 + 1e-12), choice.describe()
        assert max(seen.memory) <= max(r.memory for r in result.sim.ranks) * (1 + 1e-12), choice.describe()
        checked += 1
        si.add(choice.si)
    assert checked > 10 and si == {"on", "off"}


def test_the_bound_never_exceeds_a_priced_step(tiny):
    # A schedule that pairs no layers (no SI block, or SI off) is held to its own, higher
    # bound too (each layer pass at its time alone).
    from dhelix.dsl.search.partitions import writes_si

    pricer, space = tiny
    schedule = next(s for s in space.schedules if s[0] == "none")
    checked, si_off, alone, above = 0, 0, 0, 0
    for choice in list(space.choices())[::97]:  # a prime stride: every kind of schedule is sampled
        result = pricer.price(choice)
        if not isinstance(result, Priced):
            continue
        bound = pricer.bound(choice.layout, schedule)
        assert bound.seconds <= result.seconds * (1 + 1e-9), choice.describe()
        assert bound.memory <= max(r.memory for r in result.sim.ranks) * (1 + 1e-9), choice.describe()
        if choice.si == "off" or not writes_si(pricer.pipelines[choice.pipeline]):
            assert bound.alone <= result.seconds * (1 + 1e-9), choice.describe()
            alone += 1
            above += bound.alone > bound.seconds * 1.05
        checked += 1
        si_off += choice.si == "off"
    assert checked > 20 and si_off > 5 and alone > 10 and above > 5


def _si_space(full: Space, rng: random.Random) -> Space:
    """A random space of the SI pipelines where SI off is faster (ZeRO-3 on dp 4, m > 1)."""
    return attrs.evolve(full, tp=(1,), cp=(1,), pp=(1,), micro_batch=_sub(rng, (1, 2)), zero=(3,),
                        recompute=_sub(rng, full.recompute), partition=_sub(rng, full.partition),
                        schedules=tuple(s for s in full.schedules if s[1] in ("w_helix", "dualpipe_v")))


@pytest.mark.parametrize("seed", range(3))
def test_si_off_is_searched_and_its_choice_exact(tiny, seed):
    # SI on and off are both priced for each schedule with SI blocks (SI off's step is the
    # "without SI" of simulate --compare); the search finds the top the exhaustive
    # pricing does.
    from dhelix.dsl.simulator.report import compare

    pricer, full = tiny
    rng = random.Random(300 + seed)
    space = _si_space(full, rng)
    assert {s[2] for s in space.schedules} == {"on", "off"}
    top = rng.choice((3, 5))
    expected = exhaustive(pricer, space, top=top)
    found = search(pricer, space, top=top)
    assert [p.choice for p in found.top] == [p.choice for p in expected]
    assert [p.seconds for p in found.top] == [p.seconds for p in expected]
    # SI off enters the top, the best is the faster of its SI twins (steps equal to 12
    # digits are ties, SI on first), and SI off is priced as simulate --compare's "without
    # SI" prices it.
    assert any(p.choice.si == "off" for p in found.top)
    best = found.top[0]
    on, off = (pricer.price(attrs.evolve(best.choice, si=si)) for si in ("on", "off"))
    assert best.seconds == pytest.approx(min(on.seconds, off.seconds), rel=1e-12)
    without = next(s for s in compare(pricer.checked(on.choice)) if s.label == "without SI")
    assert off.seconds == pytest.approx(without.step_time, rel=1e-12)
    assert not off.sim.si and on.sim.si


def test_written_si_is_kept(tiny, tmp_path):
    path = tmp_path / "off.dhx"
    path.write_text(TINY.read_text().replace("warmup = 5", "warmup = 5\n  si = off").replace(
        '"../docs/*.md"', f'"{ROOT / "docs"}/*.md"'))
    pricer, space = _pricer(path)
    assert {s[2] for s in space.schedules} == {"off"}
    outcome = search(pricer, space, top=3)
    assert outcome.top and all(p.choice.si == "off" and not p.sim.si for p in outcome.top)
    base = passes.rerun(check_program(tiny[0].modules), after="check")
    assert {s[2] for s in space_of(base, keep=("si",)).schedules} == {"on"}


def test_placements_one_per_class_the_written_first():
    from dhelix.dsl.search.placement import placement_key, placement_text, placements

    sizes = {"tp": 8, "pp": 4, "dp": 2}
    found = placements(sizes, ("tp", "pp", "dp"), (8,))
    assert found[0] == ("tp", "pp", "dp") and len(found) == 4
    keys = [placement_key(order, sizes, (8,)) for order in found]
    assert len(set(keys)) == len(found)
    assert all(placement_key(order, sizes, (8,)) in keys for order in itertools.permutations(sizes))
    assert [placement_text(order, sizes, 8) for order in found] == [
        "tp8 | pp4 dp2", "pp4 tp2|4 dp2", "pp4 dp2 | tp8", "dp2 tp4|2 pp4"]
    # A level inside the node (islands of 4) tells apart what the node alone does not.
    assert len(placements(sizes, ("tp", "pp", "dp"), (4, 8))) > len(found)
    # Groups that do not align with the nodes (tp 3 inside nodes of 8): no two such orders are
    # taken to agree; with tp outermost (across, aligned) cp dp and dp cp are one placement.
    assert len(placements({"tp": 3, "cp": 2, "dp": 4}, ("tp", "cp", "dp"), (8,))) == 5
    # One node, or the file's order kept: the written order alone.
    assert placements(sizes, ("dp", "tp"), ()) == (("dp", "tp", "pp"),)


def test_orders_of_one_placement_price_alike_and_others_do_not(tmp_path):
    # tp 2, pp 2, dp 2 on four nodes of 2: orders with tp inside a node are one placement
    # (the same step and peak); orders with pp or dp inside are others.
    from dhelix.dsl.search.placement import placement_key

    path = tmp_path / "eight.dhx"
    path.write_text(TINY.read_text().replace("nodes = 2", "nodes = 4").replace("pp = 2", "pp = 2\n  dp = 2")
                    .replace("microbatches = 8", "microbatches = 4").replace('"../docs/*.md"', f'"{ROOT / "docs"}/*.md"'))
    pricer, space = _pricer(path)
    layout = next(layout for layout in space.layouts() if (layout.tp, layout.pp, layout.dp) == (2, 2, 2)
                  and layout.zero == 1 and layout.recompute == "none" and layout.partition == "written")
    priced = {}
    for order in itertools.permutations(("tp", "pp", "dp")):
        result = pricer.price(Choice(attrs.evolve(layout, order=order), "u", "w_helix"))
        priced[order] = (result.seconds, max(r.memory for r in result.sim.ranks))
    sizes = {"tp": 2, "pp": 2, "dp": 2}
    for a, b in itertools.combinations(priced, 2):
        if placement_key(a, sizes, (2,)) == placement_key(b, sizes, (2,)):
            assert priced[a] == priced[b], (a, b)
    assert len(set(priced.values())) > 1
    assert {layout.order for layout in space.layouts() if (layout.tp, layout.pp, layout.dp) == (2, 2, 2)} == {
        ("tp", "pp", "dp"), ("pp", "tp", "dp"), ("dp", "tp", "pp")}


def test_a_file_written_in_two_orders_gives_one_best(tmp_path):
    from dhelix.dsl.search.placement import placement_key

    bests = []
    for mesh in ("tp = 2\n  pp = 2", "pp = 2\n  tp = 2"):
        path = tmp_path / "order.dhx"
        path.write_text(TINY.read_text().replace("tp = 2\n  pp = 2", mesh).replace(
            '"../docs/*.md"', f'"{ROOT / "docs"}/*.md"'))
        pricer, space = _pricer(path)
        space = attrs.evolve(space, micro_batch=(2, 4), recompute=("none",), partition=("written",))
        best = search(pricer, space, top=1).top[0]
        layout = best.choice.layout
        bests.append((best.seconds, placement_key(layout.order, layout.mesh(), (2,)),
                      attrs.evolve(layout, order=()), best.choice.schedule()))
    assert bests[0] == bests[1]


def test_kept_settings_stay_as_written(tiny):
    pricer, _ = tiny
    base = passes.rerun(check_program(pricer.modules), after="check")
    space = space_of(base, keep=("mesh", "pipeline"))
    outcome = search(pricer, space, top=3)
    assert outcome.top
    for p in outcome.top:
        assert (p.choice.layout.tp, p.choice.layout.pp, p.choice.layout.dp) == (2, 2, 1)
        assert p.choice.layout.order == ("tp", "pp")  # the file's order
        assert p.choice.pipeline == "w_helix"


def test_memory_cap_refuses_what_does_not_fit(tmp_path):
    # The a40's 48 GB cannot hold Llama-39B's states on 8 GPUs without sharding them.
    text = (ROOT / "examples" / "llama39b_a40.dhx").read_text().replace("nodes = 8", "nodes = 1").replace(
        "dp = 4", "dp = 1").replace("pp = 2", "pp = 1")
    path = tmp_path / "small.dhx"
    path.write_text(text.replace('import "stdlib', 'import "stdlib'))
    pricer, space = _pricer(path)
    outcome = search(pricer, space, top=1)
    assert outcome.top == () and outcome.too_big > 0


@pytest.mark.parametrize("whole", [True, False])
def test_the_untimed_peak_is_the_simulated_one_and_its_floor_a_bound(tiny, whole, monkeypatch):
    # What the search holds to the device memory before simulating (untimed) is, to the
    # last bit, the peak of every rank the simulation reports, and its floor never exceeds
    # the simulated step: with and without SI blocks (their pairs planned, or at their lane
    # bound), recomputation, ZeRO stages, param_gather, and generated partitions after the
    # planner's choices.
    from dhelix.dsl.search.tune import relaxed_costs
    from dhelix.dsl.simulator.costs import step_costs
    from dhelix.dsl.simulator.events import has_si, untimed

    from dhelix.dsl.simulator import events

    if not whole:  # every change added step by step, as if some were not whole bytes
        made = events._Changes.of
        monkeypatch.setattr(events._Changes, "of", classmethod(lambda cls, pieces: attrs.evolve(
            made(pieces), whole=False)))
    pricer, space = tiny
    kinds = set()
    for choice in list(space.choices())[::47]:  # a prime stride, so that every kind below is sampled
        result = pricer.price(choice)
        if not isinstance(result, Priced):
            continue
        program = pricer.checked(choice)
        if program.partition is not None:
            program = pricer.chosen(program, choice.layout)
        si = has_si(program)
        priced = [step_costs(program, pricer.plans.plan(program) if si else None, pricer.cost)]
        for costs in priced + ([relaxed_costs(program, pricer.cost)] if si else []):
            seen = untimed(program, costs)
            assert seen.memory == tuple(r.memory for r in result.sim.ranks), choice.describe()
            assert seen.floor <= result.seconds * (1 + 1e-12), choice.describe()
        kinds.add((si, choice.layout.recompute, choice.layout.zero, choice.layout.param_gather))
    assert len(kinds) > 12


@pytest.mark.parametrize("seed", range(2))
def test_search_equals_exhaustive_where_the_memory_cap_binds(seed):
    # A device just too small for the fastest choice: it and every choice over the device
    # are settled by their peak alone in the search, by a whole simulation in the
    # exhaustive pricing.
    pricer, full = _pricer()
    rng = random.Random(100 + seed)
    smaller = []
    while not smaller:  # a space where some choice needs less memory than the fastest
        # At most 6 schedules: the stdlib's 20-odd make a half-drawn subset cost half a minute a seed.
        space = attrs.evolve(full, tp=_sub(rng, full.tp), micro_batch=_sub(rng, full.micro_batch),
                             recompute=_sub(rng, full.recompute), schedules=_sub(rng, full.schedules)[:6], cp=(1,),
                             partition=_sub(rng, full.partition))
        peaks = {p.choice: max(r.memory for r in p.sim.ranks) for p in map(pricer.price, space.choices())
                 if isinstance(p, Priced)}
        if peaks:
            fastest = peaks[exhaustive(pricer, space, top=1)[0].choice]
            smaller = [peak for peak in peaks.values() if peak < fastest]
    pricer.memory_gb = max(smaller) / 1e9
    top = rng.choice((1, 3, 5))
    expected = exhaustive(pricer, space, top=top)
    found = search(pricer, space, top=top)
    assert [p.choice for p in found.top] == [p.choice for p in expected]
    assert [p.seconds for p in found.top] == [p.seconds for p in expected]
    assert found.too_big > 0 and found.fit > 0
    assert found.fit + found.refused + found.pruned + found.too_big + found.same == found.choices


@pytest.mark.parametrize("seed", range(2))
def test_search_equals_exhaustive_where_only_offloading_fits(seed):
    # A device that holds some choices only with a share of their optimizer states on the
    # host, and a host that holds only some shares: the search (twins settling their
    # offloading copies, the shares chosen when priced) equals the exhaustive pricing.
    from dhelix.dsl.search.offload import OFFLOAD_PERCENTS

    pricer, full = _pricer()
    rng = random.Random(300 + seed)
    space = attrs.evolve(full, tp=_sub(rng, full.tp), micro_batch=(2, 4), zero=(0, 1), recompute=("none",), cp=(1,),
                         partition=("written",), param_gather=("step",), offload=OFFLOAD,
                         schedules=tuple(rng.sample(full.schedules, 4)))
    device = [p for p in map(pricer.price, space.choices()) if isinstance(p, Priced)]
    peaks = sorted(max(r.memory for r in p.sim.ranks) for p in device)
    pricer.memory_gb = peaks[len(peaks) // 3] / 1e9  # two thirds of them over on the device alone
    if seed:  # hosts that hold 30 % of the biggest choice's states, not all (two GPUs a node)
        biggest = max(device, key=lambda p: max(r.memory for r in p.sim.ranks)).choice
        whole = pricer.price(attrs.evolve(biggest, layout=attrs.evolve(biggest.layout, offload="optimizer",
                                                                        offload_percent=100)))
        host = 2 * 0.3 * max(r.states.host for r in whole.sim.ranks)
        pricer.profile = attrs.evolve(pricer.profile, host=attrs.evolve(pricer.profile.host, memory_gb=host / 1e9))
    top = rng.choice((3, 5))
    expected = exhaustive(pricer, space, top=top)
    found = search(pricer, space, top=top)
    assert [p.choice for p in found.top] == [p.choice for p in expected]
    assert [p.seconds for p in found.top] == [p.seconds for p in expected]
    assert any(p.choice.layout.offload_percent in OFFLOAD_PERCENTS for p in found.top)
    assert not seed or any("host memory" in why for why, _ in found.reasons)
    assert found.fit + found.refused + found.pruned + found.too_big + found.same == found.choices


def test_the_memory_reserve_is_held_free_by_the_search_and_the_planner():
    # A reserve that leaves less than the fastest choice's peak: the search's best is the
    # exhaustive best under the device less the reserve, and every choice in its top fits there.
    from dhelix.dsl.search.headroom import Reserve

    pricer, full = _pricer()
    # Every third schedule (the search equals the exhaustive pricing on whole spaces in the
    # tests above; here what the reserve takes away matters, not how many choices there are).
    space = attrs.evolve(full, tp=(1, 2), micro_batch=(1, 4), recompute=("none", "full"), partition=full.partition[:1],
                         schedules=full.schedules[::3])
    fastest = exhaustive(pricer, space, top=1)[0]
    peak = max(r.memory for r in fastest.sim.ranks)
    reserve = Reserve(gb=pricer.memory_gb - peak * 0.999 / 1e9)
    held = Pricer(pricer.modules, passes.rerun(check_program(pricer.modules), after="check"), pricer.world, reserve)
    assert held.capacity == pytest.approx(peak * 0.999)
    assert held.profile.memory_gb == pytest.approx(peak * 0.999 / 1e9)  # what the planner's own checks read
    expected = exhaustive(held, space, top=3)
    found = search(held, space, top=3)
    assert [p.choice for p in found.top] == [p.choice for p in expected]
    assert fastest.choice not in [p.choice for p in found.top] and found.too_big > 0
    assert all(max(r.memory for r in p.sim.ranks) <= held.capacity for p in found.top)
    assert found.reserve_gb == pytest.approx(reserve.gb) and found.usable_gb == pytest.approx(peak * 0.999 / 1e9)
    # The nearest choice over the memory needs no more than the fastest (which is over), and more than what is left.
    assert held.capacity < found.nearest_gb * 1e9 <= peak


@pytest.mark.parametrize("text, gb, percent", [("2.5", 2.5, 0), ("4GB", 4, 0), (" 4 gb ", 4, 0), ("8%", 0, 8),
                                               ("0", 0, 0)])
def test_memory_reserves_parse_as_gigabytes_or_a_part_of_the_device(text, gb, percent):
    from dhelix.dsl.search.headroom import DEFAULT, Reserve, parse_reserve

    reserve = parse_reserve(text)
    assert reserve == Reserve(gb, percent)
    assert reserve.bytes_of(80) == pytest.approx((gb + 0.8 * percent) * 1e9)
    assert DEFAULT.bytes_of(48) == pytest.approx(3.4e9) and DEFAULT.describe() == "1 GB + 5 %"


def test_cli_shows_the_reserve_and_holds_choices_to_what_it_leaves():
    proc = dhelix_here("tune", str(TINY), "--top", "2", "-j", "1", "--keep", "mesh", "--memory-margin", "10%")
    assert proc.returncode == 0, proc.stderr
    assert "kept free on each device: 4.80 GB (--memory-margin 10 %" in proc.stdout
    assert "over the 43.20 GB usable (device 48 GB less a 4.80 GB reserve)" in proc.stdout
    assert "of usable" in proc.stdout
    # The whole device reserved but a sliver: nothing fits, and the message says what it was held to.
    proc = dhelix_here("tune", str(TINY), "--top", "2", "-j", "1", "--keep", "mesh", "--memory-margin", "47.99999", "--json")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["reserve_gb"] == pytest.approx(47.99999)
    assert "no choice fits" in proc.stderr
    assert "over the memory: the nearest needs at least " in proc.stderr  # a layout's bound: all were cut by theirs
    assert "against the 10.00 kB usable (device 48 GB less a 48.00 GB reserve)" in proc.stderr


def test_cli_says_the_budget_ran_out_before_anything_was_priced():
    proc = dhelix_here("tune", str(TINY), "--top", "2", "-j", "1", "--budget", "0.0001")
    assert proc.returncode == 1
    assert "no choice fits: --budget 0.0001 s ran out before any choice that fits was priced" in proc.stderr
    assert "refused by the checks" not in proc.stderr.splitlines()[0]


def test_divisors_up_to_the_square_root():
    from dhelix.dsl.search.space import divisors

    for n in (1, 2, 12, 36, 49, 97, 1024, 720720):
        assert divisors(n) == tuple(d for d in range(1, n + 1) if n % d == 0)
    assert len(divisors(10**9)) == 100  # instant: a scan to n took minutes


def test_one_program_under_two_names_takes_one_row(tmp_path):
    # On one pipeline stage gpipe (fold none) and gpipe_u (fold u) run the same layer passes:
    # the top keeps the first; orders that differ (1F1B, interleaved chunks) stay apart.
    from dhelix.dsl.search.duplicates import layer_passes

    one = tmp_path / "one.dhx"
    one.write_text(TINY.read_text().replace("tp = 2\n  pp = 2", "tp = 2\n  dp = 2").replace(
        '"../docs/*.md"', f'"{ROOT / "docs"}/*.md"'))
    pricer, space = _pricer(one)
    space = attrs.evolve(space, tp=(2,), pp=(1,), cp=(1,), micro_batch=(8,), zero=(1,), recompute=("none",),
                         param_gather=("forward",), partition=space.partition[:1], boundaries=())
    priced = {c.schedule(): pricer.price(c) for c in space.choices()}
    assert priced["fold none  gpipe"].program == priced["fold u  gpipe_u"].program
    assert priced["fold none  one_f_one_b"].program != priced["fold loop(2)  interleaved_1f1b"].program
    gpipe = pricer.checked(next(c for c in space.choices() if c.pipeline == "gpipe"))
    assert layer_passes(gpipe) == ((("F", 0, 0, 3), ("F", 1, 0, 3), ("B", 0, 0, 3), ("B", 1, 0, 3)),)
    found = search(pricer, space, top=len(priced))
    assert [p.choice for p in found.top] == [p.choice for p in exhaustive(pricer, space, top=len(priced))]
    assert len({p.program for p in found.top}) == len(found.top) < len(priced)
    assert {"fold none  gpipe", "fold u  gpipe_u"} & {p.choice.schedule() for p in found.top} == {"fold none  gpipe"}


def test_cli_writes_a_program_that_checks(tmp_path):
    out = tmp_path / "t.dhx"
    proc = subprocess.run([sys.executable, "-m", "dhelix", "tune", str(TINY), "-o", str(out), "--top", "2"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert ("the best is" in proc.stdout or "the best ties" in proc.stdout) and f"wrote {out}" in proc.stdout
    check = dhelix_here("check", str(out))
    assert check.returncode == 0, check.stdout + check.stderr
    assert "Predicted step" in out.read_text()
    # The mesh is written in the best's order (innermost first), which the table shows.
    written = passes.rerun(check_program(load_modules(read_source(str(out)), str(out))), after="check").mesh
    shown = next(line for line in proc.stdout.splitlines() if line.startswith("1 ")).split("  ")[1]
    assert shown.replace(" |", "").split() == [f"{axis}{written.size(axis)}" for axis in written.order
                                               if written.size(axis) > 1]
    # The written file names its data relative to itself: it trains, and matches the reference.
    run = dhelix_here("run", str(out), "--steps", "2", "--check", cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_cli_writes_si_off_when_the_file_pins_it(tmp_path):
    # A file that says si = off keeps it: the best is written with it, checks and runs.
    pinned = tmp_path / "pinned.dhx"
    pinned.write_text(TINY.read_text().replace("warmup = 5", "warmup = 5\n  si = off").replace(
        '"../docs/*.md"', f'"{ROOT / "docs"}/*.md"'))
    out = tmp_path / "t.dhx"
    proc = subprocess.run([sys.executable, "-m", "dhelix", "tune", str(pinned), "-o", str(out), "--top", "2",
                           "--keep", "mesh,pipeline,micro_batch"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "w_helix  SI off" in proc.stdout
    assert "si = off" in out.read_text()
    run = dhelix_here("run", str(out), "--steps", "2", "--check", cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "SI off (the train block's si = off)" in run.stdout


def test_cli_json(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dhelix", "tune", str(TINY), "--json", "--top", "2",
                           "--keep", "mesh", "--partitions"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert len(data["top"]) == 2 and data["complete"]
    assert 0 < data["searched"]["best_found_s"] <= data["searched"]["seconds"]
    # --partitions doubles the layouts: the file's partition (none) and a generated one.
    base = passes.rerun(check_program(load_modules(read_source(str(TINY)), str(TINY))), after="check")
    assert data["searched"]["choices"] == 2 * len(list(space_of(base, keep=("mesh",)).choices()))
    assert data["top"][0]["step_s"] <= data["top"][1]["step_s"]
    assert data["top"][0]["choice"]["tp"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--keep", "tq"], "--keep: unknown setting 'tq' to keep (did you mean 'tp'?)"),
    (["--gpus", "3"], "--gpus 3: give a positive multiple of the cluster's gpus_per_node (2)"),
    (["--top", "0"], "--top must be between 1 and 100, got 0"),
    (["--jobs", "0"], "--jobs must be at least 1, got 0"),
    (["--memory-margin", "5 MB"], "--memory-margin: '5 MB' is not a memory reserve: give gigabytes"),
    (["--memory-margin", "120%"], "--memory-margin: a reserve of 120 % leaves nothing of the device's memory"),
    (["--memory-margin", "48"], "--memory-margin 48 GB: it leaves nothing of the device's 48 GB"),
    (["--gpus", "10000000"], "--gpus 10000000: at most 16,384 nodes of 2 (32,768 GPUs), the cluster block's limit"),
])
def test_cli_usage_errors(argv, message):
    proc = dhelix_here("tune", str(TINY), *argv)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_a_relaxed_simulation_bounds_the_step_and_has_its_memory(tiny):
    from dhelix.dsl.search.tune import relaxed_costs
    from dhelix.dsl.simulator.events import has_si, simulate

    pricer, space = tiny
    checked = relaxed_partitions = 0
    for choice in list(space.choices())[::11]:  # a prime stride: partitions and SI blocks both sampled
        result = pricer.price(choice)
        if not isinstance(result, Priced):
            continue
        program = pricer.checked(choice)
        if program.partition is not None:  # before the planner's choices: every layer pass relaxed
            loose = simulate(program, costs=relaxed_costs(program, pricer.cost, layers=True))
            assert loose.step_time <= result.seconds * (1 + 1e-9), choice.describe()
            relaxed_partitions += 1
        if not has_si(program):
            continue
        relaxed = simulate(program, costs=relaxed_costs(program, pricer.cost))
        assert relaxed.step_time <= result.seconds * (1 + 1e-9), choice.describe()
        assert [r.memory for r in relaxed.ranks] == pytest.approx([r.memory for r in result.sim.ranks], rel=1e-12)
        checked += 1
    assert checked > 5 and relaxed_partitions > 5


def test_a_generated_partition_prints_checks_and_runs_exactly(tiny, tmp_path):
    from dhelix.dsl.core import syntax as s
    from dhelix.dsl.search.variant import relocate, variant_text

    pricer, _ = tiny
    choice = Choice(Layout(2, 1, 2, 1, 1, 2, 8, 0, 0, "none", "auto"), "none", "one_f_one_b")
    priced = pricer.price(choice)
    assert isinstance(priced, Priced), priced
    out = tmp_path / "auto.dhx"
    text = read_source(str(TINY))
    out.write_text(variant_text(relocate(pricer.variant(choice), str(TINY), str(out)), text, "generated"))
    written = out.read_text()
    assert "chunk ag2 + fc1 + act + fc2 + rs2 by auto" in written and "chunk ag1 + qkv by auto" in written
    # With SI blocks the chains are kept (the planner settles their counts under SI too);
    # the layout's bounds still come from the whole block, whichever schedule checks it.
    si = pricer.price(attrs.evolve(choice, fold="u", pipeline="w_helix"))
    assert isinstance(si, Priced) and si.sim.si, si
    assert any(isinstance(st, s.Chunk) for st in pricer.checked(si.choice).partition.body)
    assert not isinstance(pricer.bound(attrs.evolve(choice.layout, microbatches=4, micro_batch=4),
                                       ("u", "w_helix")), str)
    run = dhelix_here("run", str(out), "--steps", "2", "--check", cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_generated_partitions_follow_the_layer(tiny):
    from dhelix.dsl.core import syntax as s
    from dhelix.dsl.search.partitions import generated_partition

    pricer, _ = tiny
    base = passes.rerun(check_program(pricer.modules), after="check", stop="shapes")
    block = generated_partition(base)
    chains = [st.ops for st in block.body if isinstance(st, s.Chunk)]
    # Attention ends the first chain (tokens are ND for it); the MLP is one chain.
    assert chains == [("ag1", "qkv"), ("prj", "rs1"), ("ag2", "fc1", "act", "fc2", "rs2")]
    tp_to_sp = ROOT / "examples" / "tiny_llama_tp_to_sp_cpu.dhx"
    modules = load_modules(read_source(str(tp_to_sp)), str(tp_to_sp))
    megatron = passes.rerun(check_program(modules), after="check", stop="shapes")
    assert [st.op for st in generated_partition(megatron).body if isinstance(st, s.Substitute)] == ["ar1", "ar2"]


def test_an_si_off_choice_is_its_own_variant_checked(tiny):
    # The search checks an SI-off choice as its SI-on twin with si = off: the same program
    # as checking the variant it writes (refused alike).
    pricer, space = tiny
    offs = [c for c in space.choices() if c.si == "off" and c.layout.partition == "written"][::11]
    refused = accepted = 0
    for choice in offs:
        try:
            shared = pricer.checked(choice)
        except DhelixError as exc:
            with pytest.raises(DhelixError) as own:
                pricer.checked(choice, share=False)
            assert first_message(own.value) == first_message(exc)
            refused += 1
            continue
        own = pricer.checked(choice, share=False)
        assert own.train.si == shared.train.si == "off"
        assert attrs.evolve(own, env=None, placement=None, lowered=None) == attrs.evolve(
            shared, env=None, placement=None, lowered=None)
        assert own.lowered == shared.lowered and own.placement == shared.placement
        accepted += 1
    assert refused > 3 and accepted > 3


def test_layouts_share_only_equal_layer_dags(tiny):
    # Layouts that differ in ZeRO 0-2, param_gather or recomputation share their derived
    # layer DAGs (and refusals): each equals what the passes derive for it alone.
    pricer, space = tiny
    schedule = next(s for s in space.schedules if s[0] == "none")
    layouts = list(space.layouts())[::3]
    compared = refused = 0
    for layout in layouts:
        try:
            alone = check_program(pricer.variant(Choice(layout, *schedule)))
            own = passes.rerun(attrs.evolve(alone, profile=pricer.profile), after="check", stop="autodiff")
        except DhelixError as exc:
            with pytest.raises(DhelixError) as shared:
                pricer.layer_dags(layout, schedule)
            assert first_message(shared.value) == first_message(exc)
            refused += 1
            continue
        shared = pricer.layer_dags(layout, schedule)
        assert (shared.env, shared.forward, shared.backward, shared.train) == (own.env, own.forward, own.backward,
                                                                               own.train), layout
        compared += 1
    assert compared > 20 and refused > 5


@pytest.mark.parametrize(("shard", "grouped"), [(4, True), (2, False)])
def test_a_generated_group_weights_splits_as_a_written_one_and_only_where_it_can(shard, grouped):
    # Hybrid sharding on four nodes of 2: shard groups of 4 span two nodes (split), of 2 lie
    # inside one (nothing to split: a generated `group weights` there failed `check` once
    # written, while the search had priced it as if absent).
    from dhelix.dsl.core import syntax as s
    from dhelix.dsl.passes.partition import WEIGHTS
    from dhelix.dsl.search.partitions import generated_partition

    path = ROOT / "examples" / "tiny_llama_hsdp_group_cpu.dhx"
    text = read_source(str(path)).replace("shard = 4", f"shard = {shard}")
    written = check_program(load_modules(text, str(path)))
    base = passes.rerun(attrs.evolve(written, partition=None), after="check", stop="shapes")
    block = generated_partition(base)  # None: nothing to partition
    assert (s.Group((WEIGHTS,), None) in (block.body if block else ())) == grouped
    if grouped:  # the generated statement (no spans) splits ZeRO-3's collectives as the written one does
        generated = passes.rerun(attrs.evolve(written, partition=s.PartitionDef((s.Group((WEIGHTS,), None),))),
                                 after="check", stop="autodiff")
        parsed = passes.rerun(written, after="check", stop="autodiff")
        assert [op.name for op in generated.forward.ops] == [op.name for op in parsed.forward.ops]
        assert any(op.axis == "dp.shard.inter" for op in generated.forward.ops)


#: Examples whose partition blocks chain collectives ``by auto`` (group stages, FSDP gathers,
#: declared levels among them).
CHAINED = ("tiny_llama_centauri_cpu.dhx", "tiny_llama_stages_cpu.dhx", "tiny_llama_fsdp_chunk_cpu.dhx",
           "tiny_llama_fsdp_stages_cpu.dhx", "tiny_llama_levels_stages_cpu.dhx", "llama8b_centauri_a40.dhx")


@pytest.mark.parametrize("name", CHAINED)
def test_the_chain_bounds_hold_for_every_count(name):
    # A layer pass's bound with its chains whole (the busiest lane, two lanes less what their
    # OEFs save, the longest path through chains that may run in pieces) is at most the pass
    # run alone, and the SI pair's at most its plan, with the chains cut in any count.
    from dhelix.dsl.core import syntax
    from dhelix.dsl.core.program import AUTO
    from dhelix.dsl.passes.workload import STAGES, STAGES3, chunk_statements, is_auto
    from dhelix.dsl.search.bound import chain_groups, chained_path, relaxed_costs
    from dhelix.dsl.simulator.costs import cost_of, layer_costs
    from dhelix.dsl.simulator.events import has_si
    from dhelix.dsl.simulator.si_pairs import schedule_plan

    path = ROOT / "examples" / name
    checked = check_program(load_modules(read_source(str(path)), str(path)))
    block = checked.partition  # every chain's count left to choose
    checked = attrs.evolve(checked, partition=attrs.evolve(block, body=tuple(
        attrs.evolve(st, parts=syntax.Name(AUTO)) if isinstance(st, syntax.Chunk) else st for st in block.body)))
    autos = [i for i, st in enumerate(chunk_statements(checked.partition)) if is_auto(st)]
    assert autos

    def at(counts: dict) -> object:
        return passes.rerun(attrs.evolve(checked, chunk_counts=tuple(sorted(counts.items()))), after="check")
    whole = at({i: 1 for i in autos})
    cost, chains = cost_of(whole), chain_groups(whole)
    bound = relaxed_costs(whole, cost, layers=True).layer
    rng = random.Random(name)
    values = (2, 3, 4, 8, STAGES, STAGES3)
    tried = [{i: 1 for i in autos}] + [{**{j: 1 for j in autos}, i: v} for i in autos for v in values] \
        + [{i: rng.choice(values) for i in autos} for _ in range(4)]
    priced = 0
    for counts in tried:
        try:
            cut = at(counts)
        except DhelixError:
            continue  # a count the chain does not take (stages without a staged collective)
        real = layer_costs(cut, cost, None)
        for part in ("forward", "backward", "backward_input", "weight", "again"):
            assert getattr(bound, part).seconds <= getattr(real, part).seconds * (1 + 1e-9), (counts, part)
        for dag, part in ((whole.forward, "forward"), (whole.backward, "backward")):  # the path alone
            assert chained_path(cost, dag.ops, chains) <= getattr(real, part).seconds * (1 + 1e-9), (counts, part)
        if has_si(cut):
            plan = schedule_plan(cut, cost)
            assert bound.pair.seconds <= bound.again.seconds + plan.total * (1 + 1e-9), counts
        priced += 1
    assert priced >= len(autos) * 3


def test_a_generated_partition_that_gains_nothing_loses_the_tie(tiny):
    # The same predicted step with and without a generated partition: the file's own (here
    # none) comes first, as the simpler program (the choice order alone would put "auto" first).
    from dhelix.dsl.search.branch import insert as _insert

    pricer, _ = tiny
    layout = Layout(2, 1, 2, 1, 1, 2, 8, 0, 0, "none", "written")
    written = pricer.price(Choice(layout, "none", "one_f_one_b"))
    auto = attrs.evolve(written, choice=attrs.evolve(written.choice, layout=attrs.evolve(layout, partition="auto")),
                        program=None)  # another program (its partition block), the same step
    assert auto.choice < written.choice and auto.seconds == written.seconds
    assert [p.choice.layout.partition for p in _insert([auto], written, 2)] == ["written", "auto"]


def test_a_schedules_refusal_of_a_generated_partition_stays_its_own():
    # A layout whose generated partition was first asked with a fold its layers do not split
    # into is refused for that fold only (the refusal was kept for every schedule, so a
    # search process that met the fold first refused the layout's every schedule).
    pricer, _ = _pricer()
    layout = Layout(2, 1, 2, 1, 1, 4, 4, 0, 0, "none", "auto")
    refused = pricer.price(Choice(layout, "loop(4)", "interleaved_1f1b"))
    assert "do not split into 8 stages" in refused.why
    assert not isinstance(pricer.bound(layout, ("u", "w_helix")), str)
    assert isinstance(pricer.price(Choice(layout, "u", "w_helix")), Priced)


@pytest.mark.parametrize("seed", range(3))
def test_a_search_across_processes_equals_exhaustive(seed, memo):
    # --jobs 2: the layouts bounded in two processes, the choices that wait (SI pairs to
    # plan, chunk counts to settle) priced there with the plans of their family handed
    # along; the top is the exhaustive pricing's, the counts add up, every plan comes back.
    rng = random.Random(400 + seed)
    pricer, full = _pricer()
    space = attrs.evolve(full, tp=(2,), zero=_sub(rng, full.zero), recompute=_sub(rng, full.recompute),
                         cp=(1,), micro_batch=(1,), partition=("written", "auto"),
                         schedules=tuple(s for s in full.schedules if s[1] in ("w_helix", "dualpipe_v", "one_f_one_b")))
    top = rng.choice((3, 5))
    found = search(pricer, space, top=top, jobs=2)
    assert found.jobs == 2 and found.complete and 0 < found.found <= found.seconds
    assert found.plans == len(pricer.plans) > 0  # computed there, merged here
    expected = exhaustive(memo, space, top=top)
    assert [p.choice for p in found.top] == [p.choice for p in expected]
    assert [p.seconds for p in found.top] == [p.seconds for p in expected]
    assert found.fit + found.refused + found.pruned + found.too_big + found.same == found.choices


def test_a_search_process_that_dies_is_reported():
    import os
    import signal

    pricer, space = _pricer()
    parent, bound = os.getpid(), pricer.bound

    def dying(*args, **kwargs):
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return bound(*args, **kwargs)

    pricer.bound = dying
    with pytest.raises(DhelixError, match="a search process .one of 2. was killed"):
        search(pricer, attrs.evolve(space, tp=(2,), cp=(1,)), top=1, jobs=2)


def test_a_search_across_processes_keeps_its_budget():
    pricer, space = _pricer()
    found = search(pricer, space, top=3, budget=1e-6, jobs=2)
    assert not found.complete and found.top == ()


_ORPHAN_SCRIPT = """
import os, sys, time
sys.path.insert(0, {tests!r})
from test_tune import _pricer
from dhelix.dsl.search.tune import search
pricer, space = _pricer()
bound = pricer.bound
def slow(*args, **kwargs):
    os.write(1, f"{{os.getpid()}}\\n".encode())  # one write: the two processes' lines stay whole
    time.sleep(120)
pricer.bound = slow
search(pricer, space, top=1, jobs=2)
"""


def test_search_processes_die_with_a_command_killed_outright(tmp_path):
    # A `tune --jobs` killed by SIGKILL leaves no search process computing (nor holding
    # its output pipes): they die with it.
    import os
    import signal
    import time

    script = tmp_path / "orphans.py"
    script.write_text(_ORPHAN_SCRIPT.format(tests=str(Path(__file__).parent)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    children = {int(proc.stdout.readline()), int(proc.stdout.readline())}
    assert all(os.path.exists(f"/proc/{pid}") for pid in children)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)

    def alive(pid: int) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in children)


def test_a_budget_also_stops_the_waiting_choices(monkeypatch):
    # The budget ends after the last layout was visited but before the choices that wait for
    # their SI plan are planned: the search stops there (it used to plan them all, past the
    # budget), incomplete, with the least bound of those left as what it did not reach.
    from dhelix.dsl.search import branch as branch_module
    from dhelix.dsl.search.branch import Incumbent, Inline, Tally, bound_of, branch

    pricer, full = _pricer()
    space = attrs.evolve(full, tp=(2,), cp=(1,), micro_batch=(1,), partition=("written",),
                         schedules=tuple(s for s in full.schedules if s[1] in ("w_helix", "dualpipe_v") and s[2] == "on"))
    first = bound_of(pricer, space, list(space.layouts()), Tally(), None)[:1]
    visited, settled = [], []

    class Counting(Inline):
        def visit(self, layout, schedules, skip):
            visited.append(layout)
            super().visit(layout, schedules, skip)

        def settle(self, choice):
            settled.append(choice)
            super().settle(choice)

    monkeypatch.setattr(branch_module.time, "perf_counter", lambda: 2.0 if visited else 0.0)
    left = branch(pricer, space, first, Incumbent(3), Tally(), 1.0, runner=Counting)
    assert len(visited) == 1 and not settled and len(pricer.plans) == 0
    assert left is not None and left >= first[0][0]


def test_the_torch_schedules_are_searched_and_priced(tiny):
    # ZB-V, interleaved zero bubble and LoopedBFS enter the space with the folds they are
    # written for (loop with each chunk count tried), as every stdlib pipeline does; on
    # pp 2 the search prices each and finds the top that pricing every choice does.
    pricer, full = tiny
    names = ("zbv", "interleaved_zb", "looped_bfs")
    assert {(fold, name) for fold, name, _ in full.schedules if name in names} == {
        ("u", "zbv"), ("loop(2)", "interleaved_zb"), ("loop(4)", "interleaved_zb"),
        ("loop(2)", "looped_bfs"), ("loop(4)", "looped_bfs")}
    space = attrs.evolve(full, tp=(2,), cp=(1,), pp=(2,), micro_batch=full.micro_batch[:2],
                         zero=full.zero[:1], recompute=full.recompute[:1], partition=full.partition[:1],
                         param_gather=full.param_gather[:1],
                         schedules=tuple(s for s in full.schedules if s[1] in names + ("one_f_one_b",)))
    top = len(list(space.choices()))
    expected = exhaustive(pricer, space, top=top)
    found = search(pricer, space, top=top)
    assert [p.choice for p in found.top] == [p.choice for p in expected]
    assert set(names) <= {p.choice.pipeline for p in expected}


def test_the_combined_1f1b_is_searched_with_si_on_and_off_and_priced(tiny):
    # Megatron-Core's combined 1F1B (one_f_one_b_overlap) writes SI blocks: the space holds it
    # with them co-executed and without, on fold none; the search prices it and finds the top
    # that pricing every choice does.
    pricer, full = tiny
    name = "one_f_one_b_overlap"
    assert {s for s in full.schedules if s[1] == name} == {("none", name, "on"), ("none", name, "off")}
    space = attrs.evolve(full, tp=(2,), cp=(1,), pp=(2,), micro_batch=full.micro_batch[:2],
                         zero=full.zero[:1], recompute=full.recompute[:1], partition=full.partition[:1],
                         param_gather=full.param_gather[:1],
                         schedules=tuple(s for s in full.schedules if s[1] in (name, "one_f_one_b")))
    top = len(list(space.choices()))
    expected = exhaustive(pricer, space, top=top)
    found = search(pricer, space, top=top)
    assert [p.choice for p in found.top] == [p.choice for p in expected]
    assert {(p.choice.pipeline, p.choice.si) for p in expected} >= {(name, "on"), (name, "off")}


def test_virtual_stages_beyond_four_where_the_layers_split_evenly(tmp_path):
    # Chunks per rank (Megatron's virtual stages) up to 8, each where some pipeline size of
    # the space gives p·v stages of equal layers: 80 layers on 64 GPUs take v 2, 4, 5 and 8
    # (5 on pp 4 or 16, 8 on pp 2), never 3, 6 or 7; the tiny 4 layers keep 2 and 4; a kept
    # loop(10), past the most tried, stays searched.
    from dhelix.dsl.search.space import loop_chunks

    assert loop_chunks(80, (1, 2, 4, 8, 16, 32, 64)) == (2, 4, 5, 8)
    assert loop_chunks(4, (1, 2, 4)) == (2, 4)
    assert loop_chunks(126, (8,)) == ()
    text = TINY.read_text().replace("layers = 4", "layers = 20").replace('"../', f'"{ROOT}/')
    assert "layers = 20" in text
    twenty = tmp_path / "twenty.dhx"
    twenty.write_text(text)
    modules = load_modules(text, str(twenty))
    base = passes.rerun(check_program(modules), after="check")
    folds = {fold for fold, name, _ in space_of(base).schedules if name == "interleaved_1f1b"}
    assert folds == {"loop(2)", "loop(4)", "loop(5)"}  # pp 1, 2, 4 on 4 GPUs: 20 = 2·2·5 = 4·5
    kept = space_of(base, keep=("fold", "pipeline"))
    assert {fold for fold, _, _ in kept.schedules} == {base.fold.text}
    ten = text.replace("fold u", "fold loop(10)").replace("pipeline w_helix", "pipeline interleaved_1f1b")
    (tmp_path / "ten.dhx").write_text(ten)
    modules = load_modules(ten, str(tmp_path / "ten.dhx"))
    base = passes.rerun(check_program(modules), after="check")
    assert {fold for fold, _, _ in space_of(base, keep=("fold",)).schedules} == {"loop(10)"}


def test_partial_recomputation_is_searched_and_wins_where_only_it_fits_fast(tmp_path):
    # Fold none on one pipeline rank: a chunk of the tiny model's 4 layers, so full
    # recomputation comes with recompute_layers 1, 2 and 3 besides (every layer). On a device
    # that holds a partial recomputation but not the whole activations, the search's best
    # recomputes some layers, faster than full; it equals the exhaustive pricing, and its
    # file runs exactly.
    from dhelix.dsl.search.variant import relocate, variant_text

    pricer, full = _pricer()
    space = attrs.evolve(full, tp=(2,), pp=(1,), cp=(1,), micro_batch=(4,), zero=(0,), recompute=("none", "full"),
                         partition=("written",), param_gather=("step",), boundaries=(),  # the file's order only
                         schedules=tuple(s for s in full.schedules if s[:2] == ("none", "one_f_one_b")))
    layouts = list(space.layouts())
    assert sorted(layout.recompute_layers for layout in layouts) == [0, 0, 1, 2, 3]
    priced = {(layout.recompute, layout.recompute_layers): pricer.price(Choice(layout, *space.schedules[0]))
              for layout in layouts}
    peak = {key: max(r.memory for r in p.sim.ranks) for key, p in priced.items()}
    # Each layer more that recomputes keeps less and runs longer.
    assert peak[("full", 0)] < peak[("full", 3)] < peak[("full", 2)] < peak[("full", 1)] < peak[("none", 0)]
    seconds = [priced[key].seconds for key in (("none", 0), ("full", 1), ("full", 2), ("full", 3), ("full", 0))]
    assert seconds == sorted(seconds) and len(set(seconds)) == 5
    for layout in layouts:  # the layouts' bounds hold below what they price
        bound, result = pricer.bound(layout, space.schedules[0]), priced[(layout.recompute, layout.recompute_layers)]
        assert bound.seconds <= result.seconds and bound.memory <= peak[(layout.recompute, layout.recompute_layers)]
    pricer.memory_gb = (peak[("full", 2)] + peak[("full", 1)]) / 2 / 1e9
    expected = exhaustive(pricer, space, top=3)
    found = search(pricer, space, top=3)
    assert [p.choice for p in found.top] == [p.choice for p in expected]
    assert [p.seconds for p in found.top] == [p.seconds for p in expected]
    best = found.top[0].choice
    assert (best.layout.recompute, best.layout.recompute_layers) == ("full", 2)
    assert "recompute full 2/chunk" in best.describe()
    out = tmp_path / "partial.dhx"
    out.write_text(variant_text(relocate(pricer.variant(best), str(TINY), str(out)), read_source(str(TINY)), "tuned"))
    assert "recompute = full" in out.read_text() and "recompute_layers = 2" in out.read_text()
    run = dhelix_here("run", str(out), "--steps", "2", "--check", cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_uneven_stages_are_searched_with_stages_and_written_as_set():
    # tune --stages: on 2 pipeline ranks of fold none the tiny model's 4 layers split 2 + 2,
    # or 3 + 1 (the LM head's stage lighter). Both are priced; the search equals the
    # exhaustive pricing; the uneven choice's file writes last_stage_layers and checks.
    from dhelix.dsl.search.variant import variant_text

    pricer, _ = _pricer()
    base = passes.rerun(check_program(pricer.modules), after="check")
    assert {layout.stage_ends for layout in space_of(base).layouts()} == {(0, 0)}  # not without --stages
    full = space_of(base, stages=True)
    space = attrs.evolve(full, tp=(1, 2), pp=(2,), cp=(1,), micro_batch=(2,), zero=(0,), recompute=("none",),
                         partition=("written",), param_gather=("step",), boundaries=(),
                         schedules=tuple(s for s in full.schedules if s[0] == "none" and s[1] in ("gpipe", "one_f_one_b")))
    assert {layout.stage_ends for layout in space.layouts()} == {(0, 0), (0, 1)}
    expected = exhaustive(pricer, space, top=5)
    found = search(pricer, space, top=5)
    assert [p.choice for p in found.top] == [p.choice for p in expected]
    assert [p.seconds for p in found.top] == [p.seconds for p in expected]
    uneven = next(p for p in found.top if p.choice.layout.stage_ends == (0, 1))
    even = pricer.price(attrs.evolve(uneven.choice, layout=attrs.evolve(uneven.choice.layout, stage_ends=(0, 0))))
    assert isinstance(even, Priced) and even.seconds != uneven.seconds
    assert "stages =..1" in uneven.choice.describe()
    assert [len(s.layers) for s in pricer.checked(uneven.choice).placement.stages] == [3, 1]
    text = variant_text(pricer.variant(uneven.choice), read_source(str(TINY)), "tuned")
    assert "last_stage_layers = 1" in text and "first_stage_layers" not in text
    checked = passes.check_text(text, str(TINY))
    assert [len(s.layers) for s in checked.placement.stages] == [3, 1]


def test_kept_stages_keep_the_fold_they_split():
    # 10 layers as 2 | 3 | 3 | 2 on fold u over 2 ranks: fold none's 2 stages cannot hold
    # those ends, so keeping the stages keeps the fold (else every layout would be refused
    # by the bound's fold none check).
    text = read_source(str(TINY)).replace("layers = 4", "layers = 10").replace(
        "  seed = 1234", "  seed = 1234\n  first_stage_layers = 2  last_stage_layers = 2")
    base = passes.rerun(check_program(load_modules(text, str(TINY))), after="check")
    space = space_of(base, keep=("stages",))
    assert {fold for fold, _, _ in space.schedules} == {"u"}
    assert {layout.stage_ends for layout in space.layouts()} == {(2, 2)}


def test_optimizer_offload_is_searched_and_wins_where_only_it_fits(tmp_path):
    # One layout on and off the host: offloading leaves the device without (a share of) the
    # optimizer's states and makes the step longer (the gradients' copy, the host's AdamW, the
    # weights' copy). Where the twin on the device fits, the offloading choice is ruled out by
    # it (slower, the same otherwise). On a device that holds the layout only offloaded, the
    # search's best offloads the fastest share that fits -- here the least, as every share
    # priced on its own shows -- and equals the exhaustive pricing.
    from dhelix.dsl.search.offload import OFFLOAD_PERCENTS, offload_slower
    from dhelix.dsl.search.tune import Pruned
    from dhelix.dsl.search.variant import relocate, variant_text

    pricer, full = _pricer()
    space = attrs.evolve(full, tp=(2,), pp=(2,), cp=(1,), micro_batch=(2,), zero=(0,), recompute=("none",),
                         partition=("written",), param_gather=("step",), boundaries=(), offload=OFFLOAD,
                         schedules=tuple(s for s in full.schedules if s[:2] == ("none", "one_f_one_b")))
    base = passes.rerun(check_program(load_modules(read_source(str(TINY)), str(TINY))), after="check")
    # Searched by default where the profile gives the host link (a40's does); --keep offload: as written.
    assert space_of(base).offload == OFFLOAD and space_of(base, keep=("offload",)).offload == ("none",)
    layouts = list(space.layouts())
    assert [(layout.offload, layout.offload_percent) for layout in layouts] == [("none", 0), ("optimizer", 0)]
    twin, offloaded = (Choice(layout, *space.schedules[0]) for layout in layouts)
    assert offload_slower(pricer.profile, "fp32") and pricer.offload_slower
    assert isinstance(pricer.price(offloaded), Pruned)  # the twin fits: offloading adds nothing
    shares = {percent: pricer.price(attrs.evolve(offloaded, layout=attrs.evolve(offloaded.layout,
                                                                                offload_percent=percent)))
              for percent in OFFLOAD_PERCENTS}
    on_device = pricer.price(twin)
    peak = {percent: max(r.memory for r in p.sim.ranks) for percent, p in shares.items()}
    device_peak = max(r.memory for r in on_device.sim.ranks)
    steps = [shares[percent].seconds for percent in OFFLOAD_PERCENTS]
    # (fp32 weights: the device keeps no master but for a share left on it, which takes one)
    assert [peak[p] for p in OFFLOAD_PERCENTS] == sorted(peak.values(), reverse=True) and device_peak > peak[100]
    assert on_device.seconds < steps[0] and steps == sorted(steps)
    for layout in layouts:  # the bounds hold below every share's step and peak
        bound = pricer.bound(layout, space.schedules[0])
        loose = bound.seconds
        priced = [on_device] if layout.offload == "none" else list(shares.values())
        assert bound.seconds <= min(p.seconds for p in priced)
        assert bound.memory <= min(max(r.memory for r in p.sim.ranks) for p in priced)
    # A device that holds the layout only with 40 % or more offloaded.
    pricer.memory_gb = (peak[30] + peak[40]) / 2 / 1e9
    assert device_peak > pricer.memory_gb * 1e9
    expected = exhaustive(pricer, space, top=2)
    found = search(pricer, space, top=2)
    assert [p.choice for p in found.top] == [p.choice for p in expected]
    assert [p.seconds for p in found.top] == [p.seconds for p in expected]
    best = found.top[0]
    fitting = [percent for percent in OFFLOAD_PERCENTS if peak[percent] <= pricer.memory_gb * 1e9]
    fastest = min(fitting, key=lambda percent: (shares[percent].seconds, percent))
    assert fastest == 40 and best.choice.layout.offload_percent == 40 and best.seconds == shares[40].seconds
    # Its layout's time bound takes the fastest share whose memory bound fits the device: no
    # looser than with the device's memory unknown, still below the share chosen.
    assert loose <= pricer.bound(layouts[1], space.schedules[0]).seconds <= best.seconds
    assert "zero0  offload 40%" in best.choice.describe()
    from dhelix.dsl.search.explain import format_outcome

    table = format_outcome(found, "tiny")  # the table says which offload, and their host bytes
    assert "offload 40%" in table and "host GB" in table and "P % of the optimizer's states" in table
    out = tmp_path / "offloaded.dhx"
    out.write_text(variant_text(relocate(pricer.variant(best.choice), str(TINY), str(out)), read_source(str(TINY)),
                                "tuned"))
    train = check_program(load_modules(out.read_text(), str(out))).train
    assert (train.offload, train.offload_share) == ("optimizer", 40)
    # A node's host memory below what 40 % takes on the busiest node: nothing fits, and the
    # refusal names the host memory.
    host = max(r.states.host for r in shares[40].sim.ranks) * 2  # two GPUs a node
    pricer.profile = attrs.evolve(pricer.profile, host=attrs.evolve(pricer.profile.host, memory_gb=host / 2 / 1e9))
    refused = pricer.price(offloaded)
    assert "host memory on node" in refused.why and refused.choice.layout.offload_percent == 40
    assert not search(pricer, space, top=1).top
    pricer.memory_gb = None
    found = search(pricer, space, top=1)
    assert [p.choice for p in found.top] == [p.choice for p in exhaustive(pricer, space, top=1)]
    assert found.top[0].choice.layout.offload == "none"
    # Where the profile makes the offloaded step slower, a priced twin that fits settles it,
    # and the twins' refusals are the offloading choices' own.
    from dhelix.dsl.search.branch import _Dominance
    from dhelix.dsl.search.tune import Refused

    for slower, ruled in ((True, "slower"), (False, None)):
        dominance = _Dominance(slower, offloads=True)
        dominance.saw(attrs.evolve(on_device, choice=twin))
        assert dominance.rules_out(offloaded, cutoff=on_device.seconds / 2) == ruled
    dominance.saw(Refused(twin, "refused so"))
    assert dominance.refusal(offloaded) == "refused so"
