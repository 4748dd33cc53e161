"""`dhelix run --metrics OUT.json`: the summary's figures as JSON, for benchmark scripts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from commands import dhelix_here  # noqa: E402

pytest.importorskip("torch")
pytest.importorskip("tqdm")

ROOT = Path(__file__).resolve().parent.parent

PROGRAM = """
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model tiny { layers = 2  hidden = 32  ffn = 64  heads = 4  kv_heads = 2  seq = 16
  vocab = 64  dtype = fp32  layer = llama }
cluster { nodes = 2  gpus_per_node = 1 }
mesh { tp = 2 }
train { micro_batch = 1  microbatches = 2 }
fold u
pipeline w_helix
"""


def test_metrics_hold_the_summary_figures_and_every_rank_s_steps(tmp_path):
    program, metrics = tmp_path / "tiny.dhx", tmp_path / "metrics.json"
    program.write_text(PROGRAM)
    result = dhelix_here("run", str(program), "--steps", "3", "--no-si", "--metrics", str(metrics), "--json",
                         "--eval-every", "2")
    assert result.returncode == 0, result.stderr
    data = json.loads(metrics.read_text())
    assert (data["si"], data["steps"], len(data["losses"])) == (False, 3, 3)
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for rank in data["ranks"]:
        assert len(rank["step_s"]) == len(rank["collective_s"]) == len(rank["p2p_s"]) == 3
        assert all(c <= s for c, s in zip(rank["collective_s"], rank["step_s"], strict=True))
    # The summary's step time: the median over steps 2 and 3 of the slowest rank's time.
    slowest = [max(times) for times in zip(*(r["step_s"] for r in data["ranks"]), strict=True)]
    assert data["step_s"] == pytest.approx(sum(slowest[1:]) / 2)
    assert 0 < data["exposed_comm_s"] < data["step_s"]
    assert json.loads(result.stdout) == data  # --json: the same figures, alone on standard output
    # The held-out losses (every 2 steps and after the last), steps counted from 1 as the summary counts them.
    assert [row["step"] for row in data["held_out"]] == [2, 3] and data["held_out"][0]["loss"] > 0
    assert "dhelix run: " in result.stderr  # the header, before the ranks started
