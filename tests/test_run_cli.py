"""`dhelix run`: a real run on 4 local gloo ranks (summary and Chrome trace), a rank killed
mid-step (the job ends non-zero naming it, no hang), and the clean messages of bad runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("tqdm")

from dhelix.cli import main  # noqa: E402
from dhelix.interpreter.launch import FAULT_ENV, FAULT_EXIT  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "tiny_llama_cpu.dhx")


def dhelix(*args: str, env: dict | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    """Run ``python -m dhelix ARGS`` in a fresh process (spawned ranks need a real main)."""
    full_env = {**os.environ, **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        full_env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "dhelix", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=ROOT)


def test_run_prints_the_summary_and_writes_a_trace(tmp_path):
    trace = tmp_path / "trace.json"
    result = dhelix("run", EXAMPLE, "--steps", "2", "--trace", str(trace))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "w_helix, tp 2 × pp 2 on 4 gloo rank(s), SI on" in out
    for row in ("step time", "exposed comm", "peak act.", "simulator:"):
        assert row in out
    events = json.loads(trace.read_text())["traceEvents"]
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {f"rank {r}" for r in range(4)}
    lanes = {e["cat"] for e in events if e["ph"] == "X"}
    assert lanes == {"compute", "local", "cross"}  # tp is node-local, pp crosses the 2 "nodes"
    assert any(e["name"].startswith("SI(") for e in events if e["ph"] == "X")


def test_a_killed_rank_ends_the_run_naming_it(tmp_path):
    start = time.monotonic()
    result = dhelix("run", EXAMPLE, "--steps", "3", "--timeout", "20", env={FAULT_ENV: "1:0:3"})
    assert result.returncode == 1
    assert f"rank 1 exited with code {FAULT_EXIT}; stopped the other 3 rank(s)" in result.stderr
    assert time.monotonic() - start < 60


def test_mesh_size_must_match_the_torchrun_world(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["run", EXAMPLE]) == 1
    assert "the mesh has 4 ranks (tp 2 × pp 2) but torchrun started 2" in capsys.readouterr().err


def test_nproc_must_match_the_mesh(capsys):
    assert main(["run", EXAMPLE, "--nproc", "2"]) == 2
    assert "--nproc 2 does not match the mesh: it has 4 ranks (tp 2 × pp 2)" in capsys.readouterr().err


def test_a_schedule_that_does_not_fit_is_reported_before_any_rank_starts(tmp_path, capsys):
    bad = tmp_path / "bad.dhx"
    bad.write_text(Path(EXAMPLE).read_text().replace("microbatches = 8", "microbatches = 1"))
    assert main(["run", str(bad)]) == 1
    assert "pipeline w_helix needs m >= p (m = 1, p = 2)" in capsys.readouterr().err
