"""benchmarks/centauri_table4.py: the programs it predicts are Centauri's configurations."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import centauri_table4 as bench  # noqa: E402
from dhelix.dsl.simulator.report import unpartitioned  # noqa: E402


def test_llama_1_sizes_and_the_cluster_a_mesh():
    assert [bench.ffn_of(h) for h, _, _ in bench.SIZES.values()] == [11008, 13824, 17920, 22016]
    prog = bench.program("Small", mesh="dp = 16", nodes=2, batch=1, microbatches=4, zero=3,
                         partition="group weights")
    assert prog.profile.name == "a100" and prog.mesh.world == 16 and prog.mesh.per_node("dp") == 8
    assert (prog.model.get("hidden"), prog.model.get("heads"), prog.model.get("kv_heads")) == (4096, 32, 32)
    assert any(op.axis == "dp.inter" for op in prog.forward.ops)


def test_group_weights_predicts_faster_fsdp_across_two_nodes_bounded_by_the_volume_ratio():
    # Comm-bound at b = 1: the hierarchy moves 1/2 of a weight through a node's port, the flat
    # 16-rank ring 15/16 (the bound is 1.875x).
    prog = bench.program("Large", mesh="dp = 16", nodes=2, batch=1, microbatches=4, zero=3,
                         partition="group weights")
    times, _ = bench.four(prog, unpartitioned(prog))
    speedup = times[0] / times[1]
    assert 1.3 < speedup < 15 / 16 / (1 / 2), times


def test_medium_runs_with_fold_none_and_a_layer_count_that_does_not_interleave_is_reported(capsys):
    # Medium's 15 layers do not fold into a U on one pipeline rank: 1F1B without folding, no SI
    # columns; nor into loop(2): those rows say so instead of raising.
    prog = bench.program("Medium", mesh="dp = 16", nodes=2, batch=1, microbatches=4, zero=3)
    assert (prog.fold.kind, prog.pipeline.name) == ("none", "one_f_one_b")
    assert bench.main(["--sizes", "Medium"]) == 0
    out = capsys.readouterr().out
    fsdp = next(line for line in out.splitlines() if line.startswith("FSDP16, 2 nodes, b=1 "))
    assert fsdp.count("no SI (fold none)") == 2 and "not run" not in fsdp
    assert "not run: 15 layers do not split into 2 stages (2 per rank) for fold loop(2)" in out
    assert "DP6+FSDP8 (HSDP), 6 nodes, b=1" in out


def test_the_fsdp_plus_dp_rows_shard_inside_the_node_and_replicate_across():
    prog = bench.program("Small", mesh="dp = 48", nodes=6, batch=1, microbatches=4, zero=3, train="shard = 8")
    gather = next(op for op in prog.forward.ops if op.name == "qkv.gather_w")
    assert (gather.axis, gather.group_size, gather.lane) == ("dp.shard", 8, "local")
    assert prog.mesh.size("dp.replicate") == 6 and prog.mesh.lane("dp.replicate") == "cross"
