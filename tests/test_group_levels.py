"""Group partition over a topology of more than two levels (Centauri §3.1.2's d-dimensional
mesh): the cluster's levels block, its located errors, the stages of a group partition (their
sub-axes, lanes, links and block layouts), the planner's orders, the profile's link per level
in the cost model and the simulator, and exact runs on 8 gloo ranks with three levels."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from commands import dhelix_here
from conftest import HANG_S, ROOT
from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.core.mesh import Mesh
from dhelix.dsl.core.oplib import LINK, REGROUP
from dhelix.dsl.frontend.fmt import format_source
from dhelix.dsl.frontend.parser import parse
from dhelix.dsl.passes.group_levels import split_over_levels
from dhelix.dsl.passes.pipeline import check_text, run_until
from dhelix.dsl.planner.chunking import choose_orders
from dhelix.dsl.planner.costmodel import collective_time, op_time
from dhelix.dsl.simulator.events import simulate

EXAMPLE = ROOT / "examples" / "tiny_llama_levels_cpu.dhx"

PROGRAM = """import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m {{ layers = 2  hidden = 32  ffn = 64  heads = 8  kv_heads = 8  seq = 16  vocab = 64  dtype = fp32
  layer = {layer} }}
cluster {{ nodes = {nodes}  gpus_per_node = {per_node}  levels {{ {levels} }}  profile = "{profile}" }}
mesh {{ {mesh} }}
train {{ micro_batch = 1  microbatches = 2 }}
fold none
pipeline one_f_one_b
partition {{
{partition}
}}
"""


def text(partition: str = "group ag1 + rs1", levels: str = "island = 2", mesh: str = "tp = 8", nodes: int = 2,
         per_node: int = 4, layer: str = "llama", profile: str = "a40") -> str:
    """A tiny program on ``nodes`` x ``per_node`` GPUs with ``levels`` and ``partition`` (";"
    between statements)."""
    return PROGRAM.format(partition="\n".join(f"  {line}" for line in partition.split(";")), levels=levels,
                          mesh=mesh, nodes=nodes, per_node=per_node, layer=layer, profile=profile)


def comms(program) -> dict:
    return {op.name: op for op in program.forward.ops if op.kind == "comm"}


def first_error(source: str, stop: str = "partition") -> str:
    with pytest.raises(DhelixError) as caught:
        run_until(source, "t.dhx", stop)
    return caught.value.render().splitlines()[0]


# -- the levels block ---------------------------------------------------------------------------

def test_the_levels_block_prints_canonically_and_parses_back():
    source = 'cluster { nodes = 2  gpus_per_node = 4  levels { island = 2  node = 2 * island }  profile = "a40" }\n'
    printed = format_source(source)
    assert "  levels {\n    island = 2\n    node = 2 * island\n  }\n" in printed
    assert parse(printed, "t.dhx") == parse(source, "t.dhx")


def test_the_topology_adds_the_node_and_the_whole_cluster():
    program = run_until(text(), "t.dhx", "check")
    assert program.cluster.levels == (("island", 2), ("node", 4), ("cluster", 8))
    assert program.mesh.levels == program.cluster.levels
    # A last level of the whole cluster stands for it.
    program = run_until(text(levels="island = 2  node = 4  rack = 8"), "t.dhx", "check")
    assert program.mesh.levels == (("island", 2), ("node", 4), ("rack", 8))


@pytest.mark.parametrize(("levels", "message"), [
    ("island = 1", "t.dhx:5:50: level 'island' must hold at least 2 GPUs, got 1"),
    ("island = 3", "t.dhx:5:50: level 'island' = 3 does not divide the cluster's 8 GPUs"),
    ("rack = 16", "t.dhx:5:50: level 'rack' = 16 does not divide the cluster's 8 GPUs"),
    ("node = 2", "t.dhx:5:50: node = 2, but gpus_per_node = 4"),
    ("island = 2  half = 4", "t.dhx:5:62: level 'half' = 4 is the node (gpus_per_node = 4)"),
    ("cluster = 8", "t.dhx:5:50: 'cluster' cannot name a level"),
    ("c0 = 2", "t.dhx:5:50: 'c0' cannot name a level"),
    ("place = 2", "t.dhx:5:50: 'place' cannot name a level"),  # by stages3 names ag2.place
    ("mates = 2", "t.dhx:5:50: 'mates' cannot name a level"),
    ("island = 2  island = 2", "t.dhx:5:62: 'island' is set twice"),
])
def test_bad_levels_are_located_errors(levels, message):
    assert first_error(text(levels=levels), "check") == message


def test_levels_out_of_order_or_not_nested_are_located_errors():
    # 16 GPUs: nodes of 8, so 2 and 4 both fit inside a node.
    assert first_error(text(levels="quad = 4  pair = 2", mesh="tp = 16", per_node=8), "check") \
        == "t.dhx:5:60: level 'pair' = 2 follows 'quad' = 4"
    # 24 GPUs: nodes of 6 hold neither a unit of 4 nor, then, a node of 6 of them.
    assert first_error(text(levels="quad = 4", mesh="tp = 24", nodes=4, per_node=6), "check") \
        == "t.dhx:5:50: level 'node' = 6 is not a multiple of 'quad' = 4"


# -- the mesh's stages --------------------------------------------------------------------------

def test_a_group_over_three_levels_is_a_2x2x2_mesh_of_sub_groups():
    mesh = run_until(text(), "t.dhx", "check").mesh
    assert mesh.level_stages("tp") == (("island", 2, 1), ("node", 2, 2), ("cluster", 2, 4))
    assert mesh.groups("tp.island") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert mesh.groups("tp.node") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert mesh.groups("tp.cluster") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [mesh.lane(f"tp.{level}") for level in ("island", "node", "cluster")] == ["local", "local", "cross"]
    assert {"tp.island", "tp.node", "tp.cluster"} <= set(mesh.sub_axes())


def test_a_group_with_unequal_ranks_in_a_level_has_no_stages():
    from dhelix.dsl.passes.group_levels import stages_of

    mesh = Mesh(("tp", "dp"), (3, 4), gpus_per_node=4, levels=(("island", 2), ("node", 4), ("cluster", 12)))
    assert mesh.level_stages("tp") == "the tp group [0, 1, 2] has 2 in island 0, 1 in island 1"
    error = stages_of("ag1", "tp", mesh, None)
    assert error.message == "cannot group-partition 'ag1': its tp groups do not split evenly over the levels"
    assert error.notes[0] == mesh.level_stages("tp")


# -- the partition ------------------------------------------------------------------------------

def test_each_collective_runs_one_stage_per_level_on_its_lane_and_link():
    ops = comms(run_until(text("group ag1 + rs1"), "t.dhx", "partition"))
    # An all_gather's largest level first, a reduce_scatter's smallest: fewest bytes on slow links.
    assert [(n, ops[n].axis, ops[n].lane) for n in ("ag1.cluster", "ag1.node", "ag1")] == \
        [("ag1.cluster", "tp.cluster", "cross"), ("ag1.node", "tp.node", "local"), ("ag1", "tp.island", "local")]
    assert [ops[n].shape[0] for n in ("ag1.cluster", "ag1.node", "ag1")] == [4, 8, 16]
    assert [ops[n].inputs[0] for n in ("rs1.island", "rs1.node", "rs1")] == ["prj", "rs1.island", "rs1.node"]
    assert [dict(ops[n].params)[LINK] for n in ("rs1.island", "rs1.node", "rs1")] == ["island", "node", "cluster"]
    # Both orders leave the blocks out of the group's order: the gather's last stage and the
    # reduce-scatter's first put them back (the layout, outermost first).
    assert dict(ops["ag1"].params)[REGROUP] == ("tp.island", "tp.node", "tp.cluster")
    assert dict(ops["rs1.island"].params)[REGROUP] == ("tp.island", "tp.node", "tp.cluster")
    assert REGROUP not in dict(ops["ag1.cluster"].params) and REGROUP not in dict(ops["rs1"].params)


def test_first_runs_a_level_first_and_the_others_in_the_default_order():
    ops = comms(run_until(text("group ag1 + rs1 first node"), "t.dhx", "partition"))
    assert [ops[n].inputs[0] for n in ("ag1.node", "ag1.cluster", "ag1")] == ["ln1", "ag1.node", "ag1.cluster"]
    assert [ops[n].inputs[0] for n in ("rs1.node", "rs1.island", "rs1")] == ["prj", "rs1.node", "rs1.island"]


def test_a_group_inside_one_node_splits_over_its_islands():
    ops = comms(run_until(text("group ag1", mesh="tp = 4  dp = 2"), "t.dhx", "partition"))
    assert [(ops[n].axis, ops[n].lane) for n in ("ag1.node", "ag1")] == [("tp.node", "local"), ("tp.island", "local")]


@pytest.mark.parametrize(("partition", "mesh", "message"), [
    ("group ag1 first rack", "tp = 8", "t.dhx:11:19: unknown level 'rack' to run first"),
    ("group ag1 first inter", "tp = 8", "t.dhx:11:19: unknown level 'inter' to run first"),
    # tp = 4 inside a node spans the island and the node, not the cluster.
    ("group ag1 first cluster", "tp = 4  dp = 2",
     "t.dhx:11:9: cannot run 'ag1' over level 'cluster' first: its tp group spans island and node"),
    ("group ag1", "tp = 2  dp = 4",
     "t.dhx:11:9: cannot group-partition 'ag1': its tp group [0, 1] lies inside one island: it spans one level "
     "only"),
    # tp's ranks 4 apart: one on each node, nothing inside a node to split off.
    ("group ag1", "dp = 4  tp = 2",
     "t.dhx:11:9: cannot group-partition 'ag1': its tp group [0, 4] has one rank in each of 2 nodes of one cluster: "
     "it spans one level only"),
    ("group ag1 first node;chunk ag1 + qkv by stages3", "tp = 8",
     "t.dhx:12:22: 'by stages3' splits a gather whose stages run smallest level first, and ag1 runs node, cluster "
     "and island in that order"),
    ("group ag1;chunk ag1 + qkv by stages", "tp = 2  dp = 4",
     "t.dhx:11:9: cannot group-partition 'ag1': its tp group [0, 1] lies inside one island: it spans one level "
     "only"),
])
def test_group_mistakes_over_levels_are_located_errors(partition, mesh, message):
    assert first_error(text(partition, mesh=mesh)) == message


@pytest.mark.parametrize("chunk", ["chunk ag1 + qkv by stages", "chunk ag1 + qkv by stages3"])
def test_a_wrong_group_statement_is_the_only_error_of_its_staged_chain(chunk):
    # The chain's gather is not split because its group statement is wrong: one error, at that
    # statement, not a second one telling the user to add the group they wrote.
    with pytest.raises(DhelixError) as caught:
        run_until(text(f"group ag1 first inter;{chunk}"), "t.dhx", "partition")
    rendered = caught.value.render()
    assert rendered.splitlines()[0] == "t.dhx:11:19: unknown level 'inter' to run first"
    assert "add: group ag1" not in rendered and "has no stages" not in rendered


def test_stages3_after_first_the_smallest_level_says_to_leave_first_out():
    # Named first, the smallest level is followed by the others largest first: stages3 needs
    # them smallest first, which only leaving 'first' out gives.
    with pytest.raises(DhelixError) as caught:
        run_until(text("group ag1 first island;chunk ag1 + qkv by stages3", mesh="tp = 8"), "t.dhx", "partition")
    lines = caught.value.render().splitlines()
    assert lines[0] == ("t.dhx:12:22: 'by stages3' splits a gather whose stages run smallest level first, and ag1 "
                        "runs island, cluster and node in that order")
    assert any("leave 'first' out of group ag1: under 'by stages3' it then runs island, node and cluster" in line
               for line in lines)


# -- Algorithm 1's uneven split over the levels: one chunk per stage ---------------------------

def test_by_stages_over_levels_computes_one_chunk_per_stage_on_the_blocks_it_brought():
    # tp = 8 as 2 x 2 x 2, ag1 over the node, then the cluster, then the island.
    fwd = run_until(text("group ag1 first node;chunk ag1 + qkv by stages"), "t.dhx", "partition").forward
    ops = {op.name: op for op in fwd.ops}
    assert [(ops[f"qkv.c{i}"].inputs[0], ops[f"qkv.c{i}"].shape[0]) for i in range(3)] == [
        ("ag1.node", 4), ("ag1.cluster.new", 4), ("ag1.rest", 8)]  # 2, 2 then 4 of 8 blocks of 2 rows
    new, rest, merge = ops["ag1.cluster.new"], ops["ag1.rest"], ops["qkv"]
    assert (new.op, new.inputs, dict(new.params)) == ("others", ("ag1.cluster",), {"axis": "tp.cluster", "groups": 2})
    assert (rest.op, rest.inputs) == ("rest", ("ag1",))
    assert (merge.op, merge.inputs, dict(merge.params)) == ("merge", ("qkv.c0", "qkv.c1", "qkv.c2"), {
        "axis": "tp", "order": ("node", "cluster", "island"), "blocks": 8})
    assert ops["att"].inputs == ("qkv",)


def test_by_stages3_over_levels_cuts_the_largest_levels_stage_in_two_with_the_same_bytes_across():
    program = run_until(text("group ag1;chunk ag1 + qkv by stages3"), "t.dhx", "partition")
    ops = {op.name: op for op in program.forward.ops}
    # smallest level first where nothing fixes the order
    assert [ops[n].inputs[0] for n in ("ag1.island", "ag1.node", "ag1.place", "ag1.mates", "ag1")] == [
        "ln1", "ag1.island", "ln1", "ag1.node", "ag1.mates"]
    assert [(ops[f"qkv.c{i}"].inputs[0], ops[f"qkv.c{i}"].shape[0]) for i in range(4)] == [
        ("ag1.island", 4), ("ag1.node.new", 4), ("ag1.near", 2), ("ag1.rest", 6)]
    assert dict(ops["ag1.mates"].params) == {"axis": ("tp.island", "tp.node"), "groups": 4}
    assert REGROUP not in dict(ops["ag1"].params)  # smallest first: the blocks lie in the group's order

    # Across nodes: this rank's block and its 3 node-mates', what the cluster stage of the
    # unsplit island>node>cluster gather sends (the node stage's output).
    across = [(op.name, op.in_shapes[0][0]) for op in program.forward.ops
              if op.lane == "cross" and op.name.startswith("ag1")]
    assert across == [("ag1.place", 2), ("ag1", 6)] and ops["ag1.node"].shape[0] == 2 + 6


def test_by_stages_and_stages3_over_three_levels_run_exactly():
    out = _run_check(ROOT / "examples" / "tiny_llama_levels_stages_cpu.dhx")
    assert "tp 8 on 8 gloo rank(s)" in out and "check: passed" in out


def test_weight_gathers_split_at_the_node_over_levels_and_run_exactly_three_ways(tmp_path):
    # group weights splits ZeRO-3's gathers at the node whatever the levels: dp = 8 over
    # 2 nodes of 4 (islands of 2) gathers inside the node (4 pieces) then across, three ways.
    example = (ROOT / "examples" / "tiny_llama_fsdp_stages3_cpu.dhx").read_text()
    source = example.replace("gpus_per_node = 2", "gpus_per_node = 4\n  levels { island = 2 }").replace(
        "dp = 4", "dp = 8")
    path = tmp_path / "w.dhx"
    path.write_text(source)
    fwd = {op.name: op for op in check_text(source, str(path)).forward.ops}
    assert [fwd[f"fc1.c{i}"].shape[1] for i in range(3)] == [128, 32, 96]  # 4, 1 and 3 of 8 column blocks
    assert "check: passed" in _run_check(path)


def test_every_group_of_the_axis_must_span_the_levels_alike():
    # dp groups [0, 3] (both in rack 0) and [1, 4] (racks 0 and 1) on 6 nodes x 2, racks of 4.
    from dhelix.dsl.passes.group_levels import stages_of
    mesh = Mesh(("tp", "cp", "dp", "pp"), (3, 1, 2, 2), gpus_per_node=2,
                levels=(("node", 2), ("rack", 4), ("cluster", 12)))
    error = stages_of("weights", "dp", mesh, None)
    assert isinstance(error, DhelixError)
    assert "its dp groups do not split evenly over the levels" in error.message
    assert any("[0, 3] splits at the rack (2), [1, 4] splits at the cluster (2)" in note for note in error.notes)


# -- the blocks' layout: every order composes to the whole collective ----------------------------

class _Place:
    """A communicator's view of one rank (sizes, strides), without torch.distributed."""

    def __init__(self, mesh: Mesh, rank: int):
        self.mesh, self.rank = mesh, rank

    def size(self, axis: str) -> int:
        return self.mesh.size(axis)


def _staged_gather(mesh, ops, blocks):
    """Each rank's result of the gather stages ``ops`` over the rank blocks ``blocks``."""
    import torch

    from dhelix.interpreter.ops.blocks import regrouped

    held = {rank: blocks[rank] for rank in range(mesh.world)}
    for op in ops:
        groups = mesh.groups(op.axis)
        held = {rank: torch.cat([held[r] for r in next(g for g in groups if rank in g)]) for rank in held}
        if REGROUP in dict(op.params):
            held = {rank: regrouped(x, _Place(mesh, rank), op.axis, True, dict(op.params)[REGROUP])
                    for rank, x in held.items()}
    return held


def _staged_scatter(mesh, ops, inputs):
    """Each rank's result of the reduce-scatter stages ``ops`` of the inputs ``inputs``."""
    from dhelix.interpreter.ops.blocks import regrouped

    held = dict(inputs)
    for op in ops:
        if REGROUP in dict(op.params):
            held = {rank: regrouped(x, _Place(mesh, rank), op.axis, False, dict(op.params)[REGROUP])
                    for rank, x in held.items()}
        groups = mesh.groups(op.axis)
        new = {}
        for rank in held:
            group = next(g for g in groups if rank in g)
            new[rank] = sum(held[r].chunk(len(group))[group.index(rank)] for r in group)
        held = new
    return held


def _compose_cases():
    """(mesh, axis, order): every order of the stages of tp over three levels on 8 ranks and
    of dp (strided: tp = 2 inside) on 16, and some of tp over four levels on 16."""
    three = (("island", 2), ("node", 4), ("cluster", 8))
    four = (("pair", 2), ("node", 4), ("rack", 8), ("cluster", 16))
    meshes = [("tp8", Mesh(("tp",), (8,), gpus_per_node=4, levels=three), "tp"),
              ("tp2_dp8", Mesh(("tp", "dp"), (2, 8), gpus_per_node=4, levels=three[:2] + (("cluster", 16),)), "dp"),
              ("tp16_four_levels", Mesh(("tp",), (16,), gpus_per_node=4, levels=four), "tp")]
    cases = []
    for name, mesh, axis in meshes:
        stages = tuple(level for level, _, _ in mesh.level_stages(axis))
        orders = list(itertools.permutations(stages))
        step = 1 if len(orders) <= 6 else 5  # four levels: 5 of the 24 orders
        cases += [pytest.param(mesh, axis, order, id=f"{name}:{'>'.join(order)}") for order in orders[::step]]
    return cases


@pytest.mark.parametrize(("mesh", "axis", "order"), _compose_cases())
def test_every_order_of_the_stages_composes_to_the_whole_collective(mesh, axis, order):
    torch = pytest.importorskip("torch")
    from dhelix.dsl.core.program import Op

    n, rows = mesh.size(axis), 2
    gather = Op("ag", "all_gather", "comm", "all_gather", ("x",), ((rows, 3),), (rows * n, 3), axis=axis,
                group_size=n)
    scatter = Op("rs", "reduce_scatter", "comm", "reduce_scatter", ("y",), ((rows * n, 3),), (rows, 3), axis=axis,
                 group_size=n)
    gen = torch.Generator().manual_seed(3)
    blocks = {rank: torch.randn(rows, 3, generator=gen) for rank in range(mesh.world)}
    gathered = _staged_gather(mesh, split_over_levels(gather, mesh, order), blocks)
    inputs = {rank: torch.randn(rows * n, 3, generator=gen) for rank in range(mesh.world)}
    scattered = _staged_scatter(mesh, split_over_levels(scatter, mesh, order), inputs)
    for group in mesh.groups(axis):
        whole = torch.cat([blocks[rank] for rank in group])
        total = sum(inputs[rank] for rank in group)
        for place, rank in enumerate(group):
            assert torch.equal(gathered[rank], whole), rank
            assert torch.allclose(scattered[rank], total[rows * place: rows * (place + 1)], atol=1e-6), rank


# -- the planner, the cost model and the simulator -----------------------------------------------

def test_the_planner_prices_every_order_of_three_levels():
    program = check_text(text("group ag1 + rs1"), "t.dhx")
    _, choices = choose_orders(program)
    assert [len(choice.candidates) for choice in choices] == [6, 6]
    assert all(c.seconds is not None for choice in choices for c in choice.candidates)


def _with_island_link(tmp_path, bw_gbps: float) -> str:
    """A copy of the shipped a40 profile with a link for the level ``island``; its path."""
    shipped = (ROOT / "stdlib_schedules" / "a40.yaml").read_text()
    assert "\nlinks:\n" in shipped
    path = tmp_path / f"islands_{bw_gbps:g}.yaml"
    path.write_text(shipped.replace("\nlinks:\n", f"\nlinks:\n  island: {{bw_gbps: {bw_gbps}, latency_us: 1}}\n"))
    return path.name


def test_each_stage_is_priced_with_its_levels_link_and_the_simulator_sees_it(tmp_path):
    steps = []
    for bw in (300.0, 3.0):
        path = tmp_path / "p.dhx"
        path.write_text(text("group ag1 + rs1 + ag2 + rs2", profile=_with_island_link(tmp_path, bw)))
        program = check_text(path.read_text(), str(path))
        profile, ops = program.profile, comms(program)
        island, node = ops["ag1"], ops["ag1.node"]  # the island stage, the node stage
        full = island.shape[0] * island.shape[1] * 4
        assert op_time(island, profile, "fp32") == collective_time("all_gather", full, 2, "local", profile, 1, "island")
        assert profile.links["island"].bw_gbps == bw
        # The node's stage has no link of its own: the local lane's.
        assert op_time(node, profile, "fp32") == collective_time("all_gather", node.shape[0] * 32 * 4, 2, "local",
                                                                 profile)
        steps.append(simulate(program).step_time)
    assert steps[1] > steps[0]  # a slower island link, a slower step


def test_a_profile_link_must_be_a_plain_name(tmp_path):
    shipped = (ROOT / "stdlib_schedules" / "a40.yaml").read_text()
    bad = shipped.replace("\nlinks:\n", "\nlinks:\n  Island-1: {bw_gbps: 3, latency_us: 1}\n")
    (tmp_path / "bad.yaml").write_text(bad)
    path = tmp_path / "p.dhx"
    path.write_text(text(profile="bad.yaml"))
    with pytest.raises(DhelixError, match="'Island-1' cannot name a level's link"):
        check_text(path.read_text(), str(path))


def test_a_profile_link_for_an_undeclared_level_is_a_located_warning(tmp_path):
    from dhelix.dsl.frontend.profilecheck import undeclared_links
    shipped = (ROOT / "stdlib_schedules" / "a40.yaml").read_text()
    (tmp_path / "typo.yaml").write_text(shipped.replace(
        "\nlinks:\n", "\nlinks:\n  island: {bw_gbps: 300, latency_us: 1}\n  rakc: {bw_gbps: 50, latency_us: 5}\n"))
    path = tmp_path / "p.dhx"
    path.write_text(text(levels="island = 2  rack = 8", nodes=4, mesh="tp = 8  dp = 2", profile="typo.yaml"))
    warnings = undeclared_links(check_text(path.read_text(), str(path)))
    assert [w.render().splitlines()[0] for w in warnings] == [
        f"{path}:5:84: warning: profile 'typo.yaml' has a link for level 'rakc', which the cluster does not "
        "declare: it is not used"]
    assert "did you mean 'rack'?" in warnings[0].render() and "typo.yaml" in warnings[0].notes[-1]
    # check prints it and goes on (exit 0)
    done = subprocess.run([sys.executable, "-m", "dhelix", "check", str(path)], capture_output=True, text=True,
                          timeout=HANG_S)
    assert done.returncode == 0 and "link for level 'rakc'" in done.stderr


# -- exact runs on 8 gloo ranks, three levels ----------------------------------------------------

def _run_check(path) -> str:
    done = dhelix_here("run", str(path), "--check", "--steps", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_all_gathers_and_reduce_scatters_over_three_levels_run_exactly():
    # The example: every order the planner picks for ag1 and rs1, `first node` for the MLP's.
    out = _run_check(EXAMPLE)
    assert "tp 8 on 8 gloo rank(s)" in out and "check: passed" in out


#: A layer of one all_reduce (the interpreter runs tensor parallelism in its sequence-parallel
#: form, so no stdlib layer it runs against the reference holds one): its output must be the
#: sum over the tp group plus the input, its input gradient the same of the output gradient.
AR_LAYER = """layer ar_only {
  in x [tokens, hidden]
  ar = all_reduce(x, tp)
  y = add(ar, x)
  out y
}
"""


def _all_reduce_runs(rank: int, world: int) -> tuple[float, float]:
    """Max differences, over the orders below (the default, each level first, chunked too), of
    the group-partitioned all_reduce layer's output and input gradient from the flat sums."""
    import torch

    from distributed import drive_layer
    from dhelix.interpreter.execute.layer_exec import LayerPlan
    from dhelix.interpreter.ops.comm import DistComm

    partitions = ["group ar", "group ar first node", "group ar first cluster", "chunk ar + y by 2;group ar"]
    programs = [run_until(AR_LAYER + text(p, layer="ar_only"), "t.dhx", "autodiff") for p in partitions]
    comm = DistComm(programs[0].mesh, timeout_s=60)
    gen = torch.Generator().manual_seed(100 + rank)
    x, dout = (torch.randn(programs[0].forward.input_shape, generator=gen) for _ in range(2))
    runs = [drive_layer(LayerPlan.build(p.forward, p.backward, 2), {}, comm, x, dout) for p in programs]
    x_sum, dout_sum = (comm.all_reduce(t.clone(), "tp") for t in (x, dout))
    return (max((run[0] - (x_sum + x)).abs().max().item() for run in runs),
            max((run[1] - (dout_sum + dout)).abs().max().item() for run in runs))


def test_all_reduces_over_three_levels_run_exactly(tmp_path):
    pytest.importorskip("torch")
    from distributed import gloo_results

    program = run_until(AR_LAYER + text("group ar first cluster", layer="ar_only"), "t.dhx", "autodiff")
    assert [op.name for op in program.forward.ops if op.kind == "comm"] == ["ar.cluster", "ar.island", "ar"]
    for rank, (out_diff, grad_diff) in enumerate(gloo_results(_all_reduce_runs, 8, tmp_path)):
        assert out_diff <= 1e-5 and grad_diff <= 1e-5, (rank, out_diff, grad_diff)


def test_nodes_of_another_size_than_the_levels_declare_are_an_error():
    from dhelix.dsl.passes.overrides import with_nodes

    program = run_until(text(), "t.dhx", "check")
    assert with_nodes(program, 4).mesh.levels == program.mesh.levels
    with pytest.raises(DhelixError, match="levels are declared for nodes of 4 GPUs, but the nodes hold 8"):
        with_nodes(program, 8)


def test_check_dump_shows_the_levels_and_each_stages_link(capsys):
    from dhelix.cli import main

    assert main(["check", str(EXAMPLE), "--dump", "check"]) == 0
    assert "levels island 2 < node 4 < cluster 8" in capsys.readouterr().out
    assert main(["check", str(EXAMPLE), "--dump", "partition"]) == 0
    dumped = capsys.readouterr().out
    assert "all_gather(tp.cluster=2) comm/cross" in dumped and "link=island" in dumped


def test_a_levels_link_survives_the_profile_writer(tmp_path):
    from dhelix.dsl.frontend.profile_writer import render_profile
    from dhelix.dsl.frontend.profiles import load_profile

    profile = load_profile(str(tmp_path / _with_island_link(tmp_path, 300.0)))
    (tmp_path / "written.yaml").write_text(render_profile(profile))
    assert load_profile(str(tmp_path / "written.yaml")).links == profile.links


def test_levels_is_a_name_not_a_keyword_outside_the_cluster_block():
    # A model setting may be called `levels` (a layer reads any integer setting it likes).
    from dhelix.dsl.passes.pipeline import check_text

    text = (ROOT / "examples" / "tiny_llama_cpu.dhx").read_text().replace("  layer = llama\n",
                                                                          "  layer = llama\n  levels = 3\n", 1)
    assert "levels = 3" in text
    assert dict(check_text(text, str(ROOT / "examples" / "t.dhx")).env)["levels"] == 3
