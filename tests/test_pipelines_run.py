"""`dhelix run --check` of the stdlib pipelines from torch 2.13 that the executor tests do
not cover (ZB-V, interleaved zero bubble, LoopedBFS): the tiny Llama on local gloo ranks,
every step's loss, gradients and update checked against the single-process reference.

None of the three pairs a forward with a backward (torch's orders have no OVERLAP_F_B), so
each runs without SI blocks; two of them split every backward into B and W, and the meshes
put data parallelism beside the pipeline so that the split gradients are reduced too.
"""

from __future__ import annotations

import pytest
from commands import dhelix_here
from conftest import tiny_example_text

pytest.importorskip("torch")

#: pipeline → (fold, mesh, micro-batches): 4 layers over 2 pipeline ranks of 2 chunks.
RUNS = {
    # The V over 2 ranks at m = 2p (ZB-V's steady phase runs), beside dp = 2.
    "zbv": ("u", "dp = 2\n  pp = 2", 4),
    # Interleaved zero bubble on loop(2) at m = 2p, beside dp = 2.
    "interleaved_zb": ("loop(2)", "dp = 2\n  pp = 2", 4),
    # LoopedBFS: each chunk's backwards last micro-batch first (B[c, k]), beside tp = 2.
    "looped_bfs": ("loop(2)", "tp = 2\n  pp = 2", 4),
}


def test_interleaved_1f1b_on_five_chunks_per_rank_is_exact(tmp_path):
    # Virtual stages beyond 4 (tune tries v up to 8): 10 layers over 2 pipeline ranks of 5
    # chunks, one layer a chunk, beside tp = 2.
    text = tiny_example_text().replace("layers = 4", "layers = 10").replace("fold u", "fold loop(5)") \
        .replace("pipeline w_helix", "pipeline interleaved_1f1b")
    assert "layers = 10" in text and "fold loop(5)" in text
    path = tmp_path / "loop5.dhx"
    path.write_text(text)
    result = dhelix_here("run", str(path), "--steps", "2", "--check", "--timeout", "120", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check: passed: 2 step(s) match the single-process reference" in result.stdout + result.stderr


@pytest.mark.parametrize("pipeline", list(RUNS))
def test_run_check_is_exact_on_gloo_ranks(tmp_path, pipeline):
    fold, mesh, microbatches = RUNS[pipeline]
    text = tiny_example_text().replace("tp = 2\n  pp = 2", mesh).replace("fold u", f"fold {fold}") \
        .replace("pipeline w_helix", f"pipeline {pipeline}") \
        .replace("microbatches = 8", f"microbatches = {microbatches}")
    assert f"pipeline {pipeline}" in text and mesh in text
    path = tmp_path / f"{pipeline}.dhx"
    path.write_text(text)
    result = dhelix_here("run", str(path), "--steps", "2", "--check", "--timeout", "120", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert f"{pipeline}, " in output and "SI none" in output
    assert "check: passed: 2 step(s) match the single-process reference" in output
