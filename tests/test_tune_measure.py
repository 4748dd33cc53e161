"""`dhelix tune --measure K`: the search's K fastest run on local ranks, re-ranked by the measured
step; the choice (the table's last line, --json's ``chosen``, ``-o``) is the measured fastest.

The runs are the tiny example on 2 ranks (``--gpus 2``) for 2 steps: a few seconds each. The
tests assert on the order of the figures printed, never on wall time."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from commands import dhelix_here

from dhelix.dsl.core.errors import DhelixError, UsageError

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny_llama_cpu.dhx"
#: A row of the measured table: measured #, predicted #, …, predicted ms, measured ms.
ROW = re.compile(r"^\s+(\d+|-)\s+(\d+)\s+.*?\s([\d.,]+) ms\s+([\d.,]+) ms")


def test_measure_2_chooses_the_measured_fastest(tmp_path):
    out = tmp_path / "best.dhx"
    proc = dhelix_here("tune", str(TINY), "--gpus", "2", "--measure", "2", "--measure-steps", "2", "-o", str(out),
                       timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = proc.stdout.split("measured on this machine", 1)[1]
    rows = [ROW.match(line).groups() for line in table.splitlines() if ROW.match(line)]
    assert len(rows) == 2, table
    assert [int(measured) for measured, *_ in rows] == [1, 2]
    assert sorted(int(predicted) for _, predicted, *_ in rows) == [1, 2]
    seconds = [float(ms.replace(",", "")) for *_, ms in rows]
    assert seconds == sorted(seconds)  # fastest measured first
    best = int(rows[0][1])
    final = table.strip().splitlines()[-2]  # the last line is -o's
    assert final.startswith(f"measured best: predicted #{best}")
    assert ("the same as the predicted best" in final) == (best == 1)
    assert proc.stderr.count("dhelix tune: measuring ") == 2
    # -o writes the measured fastest, and says so.
    assert f"(predicted #{best} of" in out.read_text() and "# Measured step" in out.read_text()
    assert proc.stdout.endswith(f"wrote {out}\n")


def test_json_keeps_both_orders_and_a_candidate_that_fails(monkeypatch):
    # The predicted best fails before its ranks start (as one over this machine's memory does):
    # its row says why, the other is measured and chosen, the command still succeeds.
    import dhelix.cli.launch as launch

    calls = []

    def check_memory(program, local, backend, *, force=False):
        calls.append(local)
        if len(calls) == 1:
            raise DhelixError("the simulator predicts 9.00 GB per rank at its peak")

    monkeypatch.setattr(launch, "check_memory", check_memory)
    proc = dhelix_here("tune", str(TINY), "--gpus", "2", "--measure", "2", "--measure-steps", "2", "--json",
                       timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = json.loads(proc.stdout)
    measured = found["measured"]
    first, second = measured["candidates"]
    assert first["failure"].startswith("the simulator predicts 9.00 GB") and first["measured_s"] is None
    assert second["failure"] is None and second["measured_rank"] == 1 and len(second["step_s"]) == 2
    assert second["measured_s"] == second["step_s"][1] and second["ratio"] == pytest.approx(
        second["measured_s"] / second["predicted_s"])
    assert measured["measured_order"] == [2] and measured["best_predicted_rank"] == 2
    assert measured["differs_from_predicted"] and measured["kept_steps"] == [2]
    assert [c["choice"] for c in measured["candidates"]] == [t["choice"] for t in found["top"][:2]]
    assert found["chosen"] == second["choice"]
    assert "not measured: the simulator predicts 9.00 GB" in proc.stderr


def test_nothing_measured_is_an_error_and_writes_nothing(monkeypatch, tmp_path):
    import dhelix.cli.launch as launch

    def check_memory(program, local, backend, *, force=False):
        raise DhelixError("the simulator predicts 9.00 GB per rank at its peak")

    monkeypatch.setattr(launch, "check_memory", check_memory)
    out = tmp_path / "best.dhx"
    proc = dhelix_here("tune", str(TINY), "--gpus", "2", "--measure", "1", "-o", str(out))
    assert proc.returncode == 1
    assert "no candidate could be measured here (see each row)" in proc.stdout
    assert f"nothing chosen ({out} not written)" in proc.stderr and not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--measure", "0"], "--measure must be between 1 and 100, got 0"),
    (["--measure", "101"], "--measure must be between 1 and 100, got 101"),
    (["--measure", "2", "--measure-steps", "1"], "--measure-steps must be between 2 and 100 (the first warms up), got 1"),
    (["--measure-steps", "3"], "--measure-steps goes with --measure K"),
    (["--measure", "1", "--gpus", "128"], "--measure runs each candidate on its 128 ranks, and this machine starts at "
                                          "most 64 local ones"),
])
def test_usage_errors(argv, message):
    proc = dhelix_here("tune", str(TINY), *argv)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_a_program_no_candidate_can_run_is_refused_before_the_search(tmp_path):
    fp8 = tmp_path / "fp8.dhx"
    fp8.write_text(TINY.read_text().replace("dtype = fp32", "dtype = fp8").replace('"a40"', '"h100"'))
    proc = dhelix_here("tune", str(fp8), "--measure", "1")
    assert proc.returncode == 1
    assert "dtype = fp8 can be checked, planned, drawn and simulated, but not run" in proc.stderr
    assert "--measure runs the candidates: tune without it to search only" in proc.stderr
    assert "searched" not in proc.stdout


def test_torchrun_worlds_are_checked_before_the_search(monkeypatch):
    from dhelix.cli.tune_measure import check_launchable
    from dhelix.dsl.frontend.check import check_program
    from dhelix.dsl.frontend.imports import load_modules, read_source

    program = check_program(load_modules(read_source(str(TINY)), str(TINY)))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="torchrun's 2 processes, and the search is for 4 GPUs"):
        check_launchable(program, 4, None)
    with pytest.raises(UsageError, match="--budget under torchrun"):
        check_launchable(program, 2, 10.0)
