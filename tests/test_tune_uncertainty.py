"""`dhelix tune --uncertainty`: the top choices priced again at every corner of the profile's
uncertainty (dsl/search/uncertainty.py), their median and worst steps, the ranks they take,
and `--robust`'s choice of the best worst case."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from commands import dhelix_here

from dhelix.dsl.frontend.profiles import load_profile
from dhelix.dsl.search.space import Choice, Layout
from dhelix.dsl.search.uncertainty import KNOBS, Spread, corners, most_robust, perturbed, spreads

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny_llama_cpu.dhx"


def test_a_perturbed_profile_moves_the_three_knobs_only():
    h100 = load_profile("h100")
    low = perturbed(h100, (0.7, 0.85, 3.0))
    assert all(c.efficiency == pytest.approx(0.7) for c in low.collectives.values())
    assert low.achieved["gemm"] == pytest.approx(0.71 * 0.85) and low.achieved["norm"] == h100.achieved["norm"]
    assert {lane: link.latency_us for lane, link in low.links.items()} == {"local": 9, "cross": 30}
    assert {lane: link.bw_gbps for lane, link in low.links.items()} == {"local": 450, "cross": 50}
    high = perturbed(h100, (1.0, 1.5, 1.0))
    assert high.achieved["gemm"] == 1.0  # an efficiency stays at most the peak
    assert perturbed(h100, (1.0, 1.0, 1.0)) == h100
    assert len(corners()) == 2 ** len(KNOBS) + 1 and corners()[0] == (1.0,) * len(KNOBS)


@attrs.frozen
class _Fake:
    """What spreads reads of a priced choice: its choice and its step."""

    choice: Choice
    seconds: float


def _priced(name: str, seconds: float) -> _Fake:
    return _Fake(Choice(Layout(2, 1, 2, 1, 1, 2, 8, 0, 0, "none"), "none", name), seconds)


def test_ranks_that_change_within_the_box_are_marked_and_the_best_worst_case_chosen():
    # A choice fast at the profile's values but slow when collectives are slower (its
    # communication is exposed) against one that hides it.
    exposed, hidden = _priced("exposed", 1.0), _priced("hidden", 1.1)

    def price_at(factors):
        return lambda p: p.seconds * (1.5 if p.choice.pipeline == "exposed" and factors[0] < 1 else 1.0)

    found = spreads((exposed, hidden), price_at)
    assert [s.flips for s in found] == [True, True]
    assert found[0].ranks[0] == 1 and max(found[0].ranks) == 2
    assert found[0].worst == pytest.approx(1.5) and found[1].worst == pytest.approx(1.1)
    assert found[0].median == pytest.approx(1.0)  # 4 of the 9 steps at the low collective efficiency
    assert [s.priced.choice.pipeline for s in most_robust(found)] == ["hidden", "exposed"]
    steady = spreads((exposed, hidden), lambda factors: lambda p: p.seconds * (2 if factors[2] > 1 else 1))
    assert not any(s.flips for s in steady) and isinstance(steady[0], Spread)


def test_cli_uncertainty_prices_the_top_at_every_corner_and_robust_chooses_the_best_worst_case(tmp_path):
    out = tmp_path / "robust.dhx"
    proc = dhelix_here("tune", str(TINY), "--keep", "mesh", "--top", "3", "-j", "1", "--robust", "--json", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    top = data["uncertainty"]["top"]
    assert len(top) == 3 and data["uncertainty"]["robust"]
    for entry in top:
        assert len(entry["steps_s"]) == 9 and entry["median_s"] <= entry["worst_s"]
        # slower collectives and GEMMs, longer latencies never make a step shorter
        assert entry["worst_s"] >= entry["steps_s"][0]
        assert entry["rank_changes"] == (len(set(entry["ranks"])) > 1)
    assert [e["worst_s"] for e in top] == sorted(e["worst_s"] for e in top)
    assert data["chosen"] == top[0]["choice"]
    text = dhelix_here("tune", str(TINY), "--keep", "mesh", "--top", "3", "-j", "1", "--uncertainty")
    assert text.returncode == 0, text.stderr
    assert "within the profile's uncertainty (collective efficiency x0.7-1, GEMM efficiency x0.85-1.1, " \
           "link latency x0.5-3" in text.stdout
    assert "median" in text.stdout and "worst" in text.stdout
