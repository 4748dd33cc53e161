"""`dhelix tune` settles a choice over the memory by another of its peak class
(dhelix.dsl.search.peaks): the two facts that rests on, and the search unchanged by it."""

from __future__ import annotations

import collections
from pathlib import Path

import attrs
import pytest

from dhelix.dsl.frontend.check import check_program
from dhelix.dsl.frontend.imports import load_modules, read_source
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.search.branch import bound_schedule
from dhelix.dsl.search.peaks import OverPeaks, peak_class
from dhelix.dsl.search.space import Choice, space_of
from dhelix.dsl.search.tune import Pricer, Refused, TooBig, search

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny_llama_cpu.dhx"


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    """The tiny model on 8 GPUs in four nodes of 2 (several placements per mesh), its space
    (tp and cp up to 2, b 2, no recomputation) with both ZeRO-1 gathers, offload searched,
    a few schedules."""
    path = tmp_path_factory.mktemp("peaks") / "eight.dhx"
    path.write_text(TINY.read_text().replace("nodes = 2", "nodes = 4").replace("pp = 2", "pp = 2\n  dp = 2")
                    .replace("microbatches = 8", "microbatches = 4").replace('"../docs/*.md"', f'"{ROOT / "docs"}/*.md"'))
    modules = load_modules(read_source(str(path)), str(path))
    base = passes.rerun(check_program(modules), after="check")
    space = space_of(base)
    schedules = tuple(s for s in space.schedules if s[1] in ("one_f_one_b", "w_helix", "interleaved_1f1b"))
    space = attrs.evolve(space, tp=(1, 2), cp=(1, 2), micro_batch=(2,), recompute=("none",),
                         param_gather=("step", "forward"), schedules=schedules)
    return (lambda: Pricer(modules, base, base.mesh.world)), space


def _unshared(monkeypatch):
    monkeypatch.setattr(OverPeaks, "get", lambda self, choice: None)


def test_a_peak_class_is_checked_alike_and_has_one_peak(eight, monkeypatch):
    # Choices that differ only in the mesh axes' order or param_gather, of layouts their
    # bound accepts: the checks refuse all or none of them (for one reason), and their peaks
    # (untimed, each walked on its own) are one.
    _unshared(monkeypatch)
    make, space = eight
    pricer = make()
    pricer.memory_gb = 1e-9  # every choice the checks accept is over: its peak reported
    schedule = bound_schedule(space)
    found: dict = collections.defaultdict(set)
    for layout in space.layouts():
        if isinstance(pricer.bound(layout, schedule), str):
            continue
        for choice in (Choice(layout, *schedule) for schedule in space.schedules):
            result = pricer.price(choice, memory_first=True)
            assert isinstance(result, (TooBig, Refused)), result
            found[peak_class(choice)].add(result.memory if isinstance(result, TooBig) else result.why)
    assert all(len(outcomes) == 1 for outcomes in found.values()), [k for k, v in found.items() if len(v) > 1][:3]
    assert any(isinstance(o, float) for outcomes in found.values() for o in outcomes)
    assert any(isinstance(o, str) for outcomes in found.values() for o in outcomes)
    classes = collections.Counter(peak_class(c) for c in space.choices())
    assert max(classes.values()) >= 4  # several placements and gathers in one class


def test_the_search_counts_alike_with_and_without_sharing_peaks(eight, monkeypatch):
    # Where the memory binds, a search that settles choices by their class's peak finds the
    # same top and counts what it looked at alike, reason by reason, as one that walks each.
    make, space = eight
    fastest = search(make(), space, top=1).top[0]
    memory_gb = max(r.memory for r in fastest.sim.ranks) * (1 - 1e-6) / 1e9  # the fastest just over
    shared = make()
    shared.memory_gb = memory_gb
    settled = []
    found = OverPeaks.get
    monkeypatch.setattr(OverPeaks, "get", lambda self, choice: settled.append(found(self, choice)) or settled[-1])
    first = search(shared, space, top=5)
    assert sum(peak is not None for peak in settled) > 10  # choices settled by their class
    _unshared(monkeypatch)
    alone = make()
    alone.memory_gb = memory_gb
    second = search(alone, space, top=5)
    assert first.too_big > 0 and first.fit > 0
    assert [(p.choice, p.seconds) for p in first.top] == [(p.choice, p.seconds) for p in second.top]
    assert (first.simulated, first.fit, first.refused, first.pruned, first.too_big, first.reasons, first.nearest_gb) \
        == (second.simulated, second.fit, second.refused, second.pruned, second.too_big, second.reasons,
            second.nearest_gb)
