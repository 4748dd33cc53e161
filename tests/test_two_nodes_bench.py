"""benchmarks/two_nodes.py without root or a link: its program, the collectives its replay
issues, where each rank runs, and the arithmetic of its summary. (The benchmark itself, which
needs root and takes minutes, is run by hand; see benchmarks/results/cpu_two_nodes.txt.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import collective_replay  # noqa: E402
import two_node_link  # noqa: E402
import two_nodes  # noqa: E402
from dhelix.dsl.core.errors import DhelixError  # noqa: E402
from dhelix.dsl.passes.pipeline import check_text  # noqa: E402


def built_in(**overrides):
    args = two_nodes.parse_args([f"--{k}={v}" for k, v in overrides.items()])
    return check_text(two_nodes.benchmark_program(args, "a40"), str(ROOT / "bench.dhx"))


def test_the_built_in_program_puts_tp_across_the_two_nodes():
    program = built_in()
    assert (program.cluster.nodes, program.cluster.gpus_per_node, program.mesh.world) == (2, 1, 2)
    assert program.mesh.lane("tp") == "cross"
    assert (program.pipeline.name, program.fold.kind) == ("w_helix", "u")


def test_the_replay_issues_every_layer_collective_of_a_step():
    program = built_in(layers=4, microbatches=4)
    collectives = collective_replay.replay_schedule(program, rank=0)
    # 4 micro-batches × 2 chunks × (F + B) × 2 layers per chunk × 4 collectives per pass
    assert len(collectives) == 4 * 2 * 2 * 2 * 4
    assert {(c.op, c.axis, c.group_size) for c in collectives} == {("all_gather", "tp", 2),
                                                                 ("reduce_scatter", "tp", 2)}
    ag = next(c for c in collectives if c.name == "ag1")
    assert ag.shape == (256 // 2, 1024)  # the sequence-parallel shard of one micro-batch
    # an all_gather sends its input once to the peer; a reduce_scatter the peer's half
    assert collective_replay.bytes_sent([ag], "fp32") == 128 * 1024 * 4
    rs = next(c for c in collectives if c.name == "rs1")
    assert collective_replay.bytes_sent([rs], "fp32") == 128 * 1024 * 4


def test_the_replay_follows_the_rank_s_pipeline_stage_and_skips_weight_gradients():
    text = (ROOT / "examples" / "tiny_llama_cpu.dhx").read_text()
    program = check_text(text, str(ROOT / "examples" / "tiny_llama_cpu.dhx"))  # tp 2 × pp 2, fold u
    per_rank = [collective_replay.replay_schedule(program, rank) for rank in range(4)]
    assert len({len(c) for c in per_rank}) == 1  # every rank holds one layer per chunk
    zb = check_text(text.replace("fold u", "fold none").replace("pipeline w_helix", "pipeline zb_h1"),
                    str(ROOT / "examples" / "zb.dhx"))
    # W actions carry no collective: the same count as with full backwards
    onefoneb = check_text(text.replace("fold u", "fold none").replace("pipeline w_helix", "pipeline one_f_one_b"),
                          str(ROOT / "examples" / "1f1b.dhx"))
    assert (len(collective_replay.replay_schedule(zb, 0))
            == len(collective_replay.replay_schedule(onefoneb, 0)) == 8 * 2 * 2 * 4)


@pytest.mark.parametrize("cluster", [
    'cluster {\n  nodes = 2\n  gpus_per_node = 1\n  profile = "a40"\n}',
    "cluster { nodes = 2  gpus_per_node = 1 }",
    "cluster {\n  nodes = 2\n  gpus_per_node = 1  # one rank per node\n}",
])
def test_with_profile_sets_the_cluster_s_profile(cluster):
    text = PROGRAM.replace("CLUSTER", cluster)
    program = check_text(text, str(ROOT / "b.dhx"))
    changed = check_text(two_nodes.with_profile(program, "h100"), str(ROOT / "b.dhx"))
    assert changed.cluster.profile == "h100"
    assert (changed.cluster.nodes, changed.cluster.gpus_per_node) == (2, 1)
    assert changed.mesh == program.mesh and changed.train == program.train


PROGRAM = """
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m { layers = 2  hidden = 64  ffn = 128  heads = 4  kv_heads = 2  seq = 32  vocab = 64
  dtype = fp32  layer = llama }
CLUSTER
mesh { tp = 2 }
train { micro_batch = 1  microbatches = 2 }
fold u
pipeline w_helix
"""


class FakeLink:
    def node(self, index):
        return {"namespace": two_node_link.NAMESPACES[index], "device": two_node_link.DEVICES[index],
                "address": two_node_link.ADDRESSES[index]}


@pytest.mark.parametrize("per_node, rank, node, local", [(1, 1, 1, 0), (2, 1, 0, 1), (2, 2, 1, 0)])
def test_each_rank_runs_in_its_node_s_namespace_and_meets_rank_0_on_the_veth(per_node, rank, node, local, tmp_path):
    world = two_nodes.World(FakeLink(), 2 * per_node, per_node, tmp_path, timeout=1)
    env = world.environment(rank)
    assert env["GLOO_SOCKET_IFNAME"] == two_node_link.DEVICES[node]
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (rank, local, 2 * per_node)
    assert env["MASTER_ADDR"] == "10.213.0.1"


def test_the_link_refuses_without_root_or_iproute2(monkeypatch):
    monkeypatch.setattr(two_node_link.os, "geteuid", lambda: 1000)
    with pytest.raises(two_node_link.LinkError, match="need root"):
        two_node_link.check_can_run()
    monkeypatch.setattr(two_node_link.shutil, "which", lambda tool: None if tool == "tc" else "/sbin/ip")
    with pytest.raises(two_node_link.LinkError, match="tc not found"):
        two_node_link.check_can_run()


def runs(*steps, exposed=None):
    return [{"step_s": s, "exposed_comm_s": exposed if exposed is not None else s,
             "ranks": [{"collectives": 8, "bytes_sent": 2**20}]} for s in steps]


class QuietReport(two_nodes.Report):
    def __call__(self, line: str = "") -> None:
        self.lines.append(line)


def test_the_summary_s_ratio_and_hidden_fraction():
    report = QuietReport()
    two_nodes.summarise({"SI planned": runs(7.0, 6.0, 8.0), "SI scheduled": runs(6.5), "SI op_by_op": runs(9.0),
                         "no SI": runs(10.0, exposed=6.0), "comm only": runs(5.0)}, report)
    text = "\n".join(report.lines)
    assert "= 4.000 s" in text  # compute = 10 - 6
    # planned: median 7 s → 7 / 10 = 0.700 (goal met); hidden (10 - 7) / min(4, 5) = 75 %
    assert "SI planned     SI ÷ no-SI 0.700   hidden 75 %   goals: SI ÷ no-SI met, hidden not met" in text
    assert "SI scheduled   SI ÷ no-SI 0.650   hidden 88 %   goals: SI ÷ no-SI met, hidden met" in text
    assert "SI op_by_op    SI ÷ no-SI 0.900   hidden 25 %" in text


def test_skip_leaves_the_other_modes_and_refuses_the_baselines():
    names = [mode.name for mode in two_nodes.selected_modes(two_nodes.parse_args(["--skip", "SI op_by_op"]))]
    assert names == ["SI planned", "SI scheduled", "no SI", "comm only"]
    for bad in ("no SI", "SI nothing"):
        with pytest.raises(two_nodes.BenchError, match="give modes among"):
            two_nodes.selected_modes(two_nodes.parse_args(["--skip", bad]))
    centauri = two_nodes.parse_args(["--centauri", "chunk ag2 + fc1 by 2", "--skip", "SI scheduled,Centauri"])
    assert [mode.name for mode in two_nodes.selected_modes(centauri)] == [
        "SI planned", "SI op_by_op", "no SI", "comm only", "Centauri+SI"]


def test_centauri_is_judged_against_no_si_and_si_alone():
    report = QuietReport()
    two_nodes.summarise({"SI planned": runs(7.0), "no SI": runs(10.0, exposed=6.0), "comm only": runs(5.0),
                         "Centauri+SI": runs(6.4), "Centauri": runs(9.0)}, report)
    text = "\n".join(report.lines)
    assert "Centauri+SI    SI ÷ no-SI 0.640   hidden 90 %   goals: ≤ 0.65 of no SI met, ÷ SI planned 0.914 (met)" in text
    assert "Centauri       ÷ no-SI 0.900   hidden 25 %   (Centauri's partition alone, no SI)" in text


def test_the_link_counters_read_tc_s_statistics(monkeypatch):
    shown = ("qdisc tbf 8001: root refcnt 2 rate 250Mbit burst 256Kb lat 50ms\n"
             " Sent 1234567 bytes 890 pkt (dropped 3, overlimits 45 requeues 0)\n backlog 0b 0p requeues 0\n")
    monkeypatch.setattr(two_node_link, "_run", lambda *command: shown)
    assert two_node_link.TwoNodeLink(None).counters() == {"bytes": 2 * 1234567, "packets": 2 * 890, "dropped": 6,
                                                           "overlimits": 90}
    monkeypatch.setattr(two_node_link, "_run", lambda *command: "qdisc noqueue 0: root\n")
    with pytest.raises(two_node_link.LinkError, match="no counters"):
        two_node_link.TwoNodeLink(None).counters()


def test_centauri_needs_a_program_without_a_partition_block(tmp_path):
    program = tmp_path / "p.dhx"
    program.write_text((ROOT / "benchmarks" / "two_nodes_si_bound.dhx").read_text())
    args = two_nodes.parse_args(["--program", str(program), "--centauri", "chunk ag2 + fc1 by 2"])
    with pytest.raises(two_nodes.BenchError, match="without one"):
        two_nodes.load_program(args, tmp_path)
    # A mistake in the statements is found before the link is made and the program profiled.
    args = two_nodes.parse_args(["--centauri", "chunk ag2 + fc9 by 2"])
    with pytest.raises(DhelixError, match="fc9"):
        two_nodes.load_program(args, tmp_path)


def test_a_trace_folder_holding_an_earlier_trace_is_refused(tmp_path, capsys):
    (tmp_path / "SI_planned.json").write_text("{}")
    with pytest.raises(SystemExit) as info:
        two_nodes.parse_args(["--trace", str(tmp_path)])
    assert info.value.code == 2
    assert "already holds" in capsys.readouterr().err and (tmp_path / "SI_planned.json").read_text() == "{}"


@pytest.mark.parametrize("flags, dp, per_node, zero, shard", [([], 2, 1, 0, None), (["--zero1"], 2, 1, 1, None),
                                                              (["--hsdp"], 4, 2, 3, 2)])
def test_the_dp_overlap_programs_put_the_gradient_reduction_across_the_two_nodes(flags, dp, per_node, zero, shard):
    import dp_overlap_two_nodes as dp_bench

    args = dp_bench.parse_args(flags)
    for mode in dp_bench.MODES:
        program = check_text(dp_bench.program_text(args, mode), str(ROOT / "dp.dhx"))
        assert program.train.grad_reduce == mode
        assert (program.mesh.size("dp"), program.cluster.gpus_per_node, program.train.zero) == (dp, per_node, zero)
        assert program.train.shard == shard
        # What crosses the link: the dp group, or under hybrid sharding the replicas' group.
        crossing = "dp.replicate" if shard else "dp"
        assert program.mesh.lane(crossing) == "cross"
        if shard:
            assert program.mesh.lane("dp.shard") == "local"


def test_kendall_tau_b_and_ranks_of_the_two_node_ranking():
    import two_node_ranking as ranking

    assert ranking.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert ranking.kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    # one swapped pair of 6: (5 - 1) / 6
    assert ranking.kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # τ-b with a tie in x: 5 concordant, 0 discordant, 1 pair tied in x only -> 5 / sqrt(5 * 6)
    assert ranking.kendall_tau([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(5 / (5 * 6) ** 0.5)
    assert ranking.kendall_tau([1, 1], [2, 2]) is None
    with pytest.raises(ValueError):
        ranking.kendall_tau([1, 2], [1])
    assert ranking.ranks([0.3, 0.1, 0.2, 0.1]) == [4, 1.5, 3, 1.5]


def test_the_two_node_ranking_variants_are_programs_at_one_global_batch():
    import two_node_ranking as ranking

    args = ranking.parse_args([])
    names = set()
    for variant in ranking.VARIANTS:
        program = check_text(ranking.program_text(variant, args, "a40"), str(ROOT / f"{variant.name}.dhx"))
        assert (program.cluster.nodes, program.cluster.gpus_per_node, program.mesh.world) == (2, 2, 4)
        assert program.train.micro_batch * program.train.microbatches * program.mesh.size("dp") == 16
        assert program.train.interleaves == variant.si and (program.partition is not None) == bool(variant.partition)
        names.add(variant.name)
    assert len(names) == len(ranking.VARIANTS) >= 8
