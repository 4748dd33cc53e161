"""The shipped a40 profile keeps matching Megatron-LM's published time breakdown (the paper's
Fig. 3), as benchmarks/calibration_a40.py calibrated it; the breakdown adds up to the step."""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import attrs
import pytest

from conftest import ROOT
from dhelix.dsl.frontend.profiles import load_profile


@lru_cache(maxsize=None)
def calibration_module():
    path = ROOT / "benchmarks" / "calibration_a40.py"
    spec = importlib.util.spec_from_file_location("calibration_a40", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=None)
def breakdowns(calibrated: bool):
    bench = calibration_module()
    calibration = bench.Calibration(bench.published_runs("breakdown"))
    profile = load_profile("a40")
    if not calibrated:
        profile = bench.with_knobs(profile, bench.UNCALIBRATED)
    return calibration.runs, calibration.steps(profile)


def test_the_breakdown_is_a_partition_of_the_step():
    runs, steps = breakdowns(True)
    assert [run.name for run in runs] == ["Llama-8B", "Llama-25B", "Llama-39B", "GPT-6.7B", "GPT-18B",
                                          "GPT-30B", "Phi-31B"]
    for run, step in zip(runs, steps, strict=True):
        assert sum(step.shares.values()) == pytest.approx(1.0)
        assert all(share >= 0 for share in step.shares.values()), run.name
        # Only the axes a run has communicate: dense runs tp and cp, Phi ep.
        assert (step.shares["ep"] > 0) == (run.name == "Phi-31B")
        assert (step.shares["cp"] > 0) == (run.name != "Phi-31B")


def test_calibrated_a40_matches_the_published_breakdown():
    bench = calibration_module()
    runs, steps = breakdowns(True)
    residuals = {run.name: bench.residual(step, run.published["shares"]) for run, step in zip(runs, steps)}
    # GPT-6.7B's is the largest (0.055), then Phi-31B's (0.045: its DP ring, 8 ranks on each of
    # 2 nodes, gets the node's cross bandwidth, and the published "others", 22.7 %, is above
    # every prediction; 0.060 while the gradients were priced in bf16, not fp32).
    assert max(residuals.values()) < 0.06, residuals
    for run, step in zip(runs, steps, strict=True):
        for key in ("tp", "cp", "ep"):
            assert step.shares[key] == pytest.approx(run.published["shares"][key], abs=0.1), (run.name, key)
    _, before = breakdowns(False)
    after_rms = sum(r ** 2 for r in residuals.values()) ** 0.5
    before_rms = sum(bench.residual(s, r.published["shares"]) ** 2 for s, r in zip(before, runs)) ** 0.5
    assert after_rms < before_rms / 2


def test_knobs_read_back_what_they_set():
    bench = calibration_module()
    shipped = load_profile("a40")
    assert bench.with_knobs(shipped, bench.knob_values(shipped)) == shipped
    changed = bench.with_knobs(shipped, {"p2p.local": 0.5})
    assert bench.knob_values(changed) == {**bench.knob_values(shipped), "p2p.local": 0.5}
    assert changed.collectives["p2p"].efficiency_on("cross") == shipped.collectives["p2p"].efficiency_on("cross")
    assert attrs.evolve(changed, collectives=shipped.collectives) == shipped
