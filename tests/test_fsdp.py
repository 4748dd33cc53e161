"""ZeRO-3 / FSDP in the layer DAGs (``train { zero = 3 }``): the ops the autodiff stage adds,
what the planner and the simulator make of them, and exact runs on one world of 4 gloo ranks
against the single-process reference (fp32, 1e-5), with the weights really kept in dp pieces.
"""

from __future__ import annotations

import math

import pytest

from dhelix.dsl.core.errors import CheckError, DhelixError
from dhelix.dsl.core.oplib import REGROUP, in_weight_pass
from dhelix.dsl.passes.pipeline import run_until
from dhelix.dsl.planner.costmodel import op_time
from dhelix.dsl.planner.pairing import plan_program
from dhelix.dsl.simulator.costs import cost_of
from dhelix.dsl.simulator.events import simulate
from dhelix.dsl.simulator.memory import largest_gathered

HEADER = """
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m {{ layers = 4  hidden = {hidden}  ffn = {ffn}  heads = {heads}  kv_heads = {kv}  seq = {seq}  vocab = 64
  dtype = fp32  layer = llama }}
cluster {{ nodes = 2  gpus_per_node = 2  profile = "a40" }}
mesh {{ {mesh} }}
train {{ micro_batch = 2  microbatches = 4  zero = {zero}  {train} }}
fold {fold}
pipeline {pipeline}
"""


def program(mesh: str = "tp = 2  dp = 2", zero: int = 3, pipeline: str = "w_helix", fold: str = "u",
            partition: str = "", train: str = "", hidden: int = 32, ffn: int = 64, heads: int = 4, kv: int = 2,
            seq: int = 8, stop: str = "validate"):
    text = HEADER.format(mesh=mesh, zero=zero, pipeline=pipeline, fold=fold, train=train, hidden=hidden,
                         ffn=ffn, heads=heads, kv=kv, seq=seq)
    if partition:
        text += "partition {\n" + "\n".join(f"  {line}" for line in partition.split(";")) + "\n}\n"
    return run_until(text, "t.dhx", stop)


# -- the DAGs ---------------------------------------------------------------------------------

def test_without_zero_3_or_with_one_dp_rank_the_layer_keeps_14_and_18_ops():
    for prog in (program(zero=1), program(mesh="tp = 2  pp = 2")):
        assert (len(prog.forward.ops), len(prog.backward.ops)) == (14, 18)
        assert not any(op.waits for op in prog.forward.ops + prog.backward.ops)


def test_every_weight_is_gathered_first_and_its_readers_wait_for_it():
    fwd = program().forward
    gathers = [op for op in fwd.ops if op.op == "param_gather"]
    weighted = [op for op in fwd.ops if op.weight]
    assert [op.name for op in fwd.ops[:len(gathers)]] == [f"{op.name}.gather_w" for op in weighted]
    for op in weighted:
        assert op.waits == (f"{op.name}.gather_w",) and op.inputs  # the activations stay its inputs
    for gather, op in zip(gathers, weighted):
        elements = math.ceil(math.prod(op.weight) / 2) * 2
        assert (gather.axis, gather.group_size, gather.lane, gather.kind) == ("dp", 2, "cross", "comm")
        assert (gather.in_shapes, gather.shape, gather.inputs) == (((elements // 2, 1),), (elements, 1), ())


def test_the_backward_regathers_first_and_scatters_each_gradient_after_its_last_producer():
    bwd = program().backward
    names = [op.name for op in bwd.ops]
    regathers = [op.name for op in bwd.ops if op.name.endswith(".regather_w")]
    assert names[:len(regathers)] == regathers and len(regathers) == 6
    for op in bwd.ops:
        if op.op == "grad_scatter":
            producers = op.waits
            assert producers and all(names.index(p) < names.index(op.name) for p in producers)
            assert names.index(op.name) == max(names.index(p) for p in producers) + 1
        elif op.op.endswith("_dgrad") or op.op in ("rmsnorm_bwd",):
            assert op.waits == (op.forward + ".regather_w",)
        elif op.op.endswith("_wgrad"):
            assert not op.waits  # a wgrad reads activations only
    # A GEMM's gradient goes with W when the schedule splits it off; a norm's with B.
    assert in_weight_pass(next(op for op in bwd.ops if op.name == "fc2.scatter_dw"))
    assert not in_weight_pass(next(op for op in bwd.ops if op.name == "ln1.scatter_dw"))


def test_the_chunks_of_a_partitioned_gemm_share_one_gather_and_one_scatter():
    prog = program(partition="chunk ag2 + fc1 + act + fc2 + rs2 by 2")
    fwd, bwd = prog.forward, prog.backward
    assert [op.waits for op in fwd.ops if op.name in ("fc1.c0", "fc1.c1")] == [("fc1.gather_w",)] * 2
    scatter = next(op for op in bwd.ops if op.name == "fc1.scatter_dw")
    assert set(scatter.waits) == {"fc1.c0.wgrad", "fc1.c1.wgrad"}


def test_a_gemm_chunked_along_outputs_gathers_and_scatters_each_block_of_columns_on_its_own():
    prog = program(mesh="dp = 4", partition="chunk fc1 along outputs by 2;group weights")
    whole = program(mesh="dp = 4", partition="group weights")
    fwd, bwd = {op.name: op for op in prog.forward.ops}, {op.name: op for op in prog.backward.ops}
    fc1 = whole.forward.op("fc1")
    (rows, cols), (inner, outer) = fc1.shape, fc1.weight
    # Each chunk computes its half of fc1's output features from its half of the weight's
    # columns, gathered on its own (across nodes first, then inside), and the concat joins them.
    for i in range(2):
        chunk = fwd[f"fc1.c{i}"]
        assert (chunk.inputs, chunk.shape, chunk.weight, chunk.columns) == (
            fc1.inputs, (rows, cols // 2), (inner, outer // 2), (i, 2))
        assert chunk.waits == (f"fc1.c{i}.gather_w",)
        gather = fwd[f"fc1.c{i}.gather_w"]
        assert (gather.shape, gather.inputs, dict(gather.params)["columns"]) == (
            (inner * outer // 2, 1), (f"fc1.c{i}.gather_w.inter",), (i, 2))
        assert bwd[f"fc1.c{i}.dgrad"].waits == (f"fc1.c{i}.regather_w",)
        first = bwd[f"fc1.c{i}.scatter_dw.intra"]  # inside the node first, then across
        assert (first.waits, bwd[f"fc1.c{i}.scatter_dw"].inputs) == ((f"fc1.c{i}.wgrad",), (first.name,))
    assert (fwd["fc1"].op, fwd["fc1"].inputs, fwd["act"].inputs) == ("concat", ("fc1.c0", "fc1.c1"), ("fc1",))
    assert "fc1.gather_w" not in fwd and "fc1.scatter_dw" not in bwd
    # The same weights, gathered in smaller pieces: the same model states, and less held while
    # a layer runs (the largest gather is half of fc1's weight now).
    assert prog.forward.weight_elements() == whole.forward.weight_elements()
    assert simulate(prog).ranks[0].states == simulate(whole).ranks[0].states
    assert largest_gathered(prog.forward) * 2 == largest_gathered(whole.forward)
    assert simulate(prog).ranks[0].activations < simulate(whole).ranks[0].activations


def test_a_piece_of_a_weight_chunked_along_outputs_holds_each_block_and_gathers_back():
    torch = pytest.importorskip("torch")
    from dhelix.interpreter.ops.fsdp import FlatShards, block_of, piece

    weight = torch.arange(5 * 6, dtype=torch.float32).reshape(5, 6)  # 3 blocks of 10 elements: padded to 12

    class Gather:  # every rank's piece, in rank order, as the all-gather over dp returns them
        def all_gather(self, mine, axis):
            return torch.cat([piece(weight, 4, r, 3) for r in range(4)])

    flat = FlatShards(True, 4, 1, columns={"fc1": 3})
    mine = flat.add("layers.0.fc1", weight)
    assert mine.numel() == 3 * 3
    for b in range(3):  # block b of this rank's piece is its piece of the columns of block b
        assert torch.equal(block_of(mine, (b, 3)), piece(weight[:, 2 * b:2 * b + 2], 4, 1))
    assert torch.equal(flat.gather(Gather(), {"layers.0.fc1": mine})["layers.0.fc1"], weight)


@pytest.mark.parametrize("first", ["inter", "intra"])
def test_a_gemm_split_at_its_weight_gathers_stages_computes_first_on_what_the_first_stage_brought(first):
    # Algorithm 1's uneven split for FSDP: dp 4 on 2 nodes of 2, each rank's piece of fc1 a
    # block of its columns; the first stage brings 2 of the 4 blocks (this rank's place on
    # both nodes, or its node's), fc1.c0 computes on them while the second stage runs.
    order = "" if first == "inter" else " first intra"
    prog = program(mesh="dp = 4", partition=f"group weights{order};chunk fc1 along outputs by stages")
    whole = program(mesh="dp = 4", partition=f"group weights{order}")
    fwd, bwd = {op.name: op for op in prog.forward.ops}, {op.name: op for op in prog.backward.ops}
    fc1 = whole.forward.op("fc1")
    (rows, cols), (inner, outer) = fc1.shape, fc1.weight
    for i in range(2):
        chunk = fwd[f"fc1.c{i}"]
        assert (chunk.inputs, chunk.shape, chunk.weight, chunk.staged) == (
            fc1.inputs, (rows, cols // 2), (inner, outer // 2), (i, first, outer))
        assert (chunk.weight_name, chunk.weight_unit, chunk.unit_weight) == ("fc1", "fc1", (inner, outer))
    # One gather of the whole weight, cut by columns; chunk 0 waits for its first stage only.
    assert fwd["fc1.c0"].waits == (f"fc1.gather_w.{first}",) and fwd["fc1.c1"].waits == ("fc1.gather_w",)
    gather = dict(fwd["fc1.gather_w"].params)
    assert (gather["shape"], gather["column_pieces"], fwd["fc1.gather_w"].shape) == ((inner, outer), True,
                                                                                      (inner * outer, 1))
    merge = fwd["fc1"]
    assert (merge.op, merge.inputs, fwd["act"].inputs) == ("merge", ("fc1.c0", "fc1.c1"), ("fc1",))
    assert dict(merge.params) == {"axis": "dp", "first": first, "blocks": 4, "dim": 1}
    # The backward re-gathers the whole weight for both dgrads and reduce-scatters one gradient.
    assert bwd["fc1.c0.dgrad"].waits == bwd["fc1.c1.dgrad"].waits == ("fc1.regather_w",)
    scatter = bwd["fc1.scatter_dw.intra" if first == "inter" else "fc1.scatter_dw.inter"]
    assert set(scatter.waits) == {"fc1.c0.wgrad", "fc1.c1.wgrad"}
    assert prog.forward.weight_elements() == whole.forward.weight_elements()
    assert simulate(prog).ranks[0].states == simulate(whole).ranks[0].states
    assert largest_gathered(prog.forward) == largest_gathered(whole.forward)


def test_a_gemm_split_three_ways_at_its_weight_gathers_stages_computes_on_each_stages_columns():
    # Algorithm 1, lines 19-20, for FSDP: dp 4 on 2 nodes of 2, the node-local stage first
    # (the default under stages3); the cross-node stage cut into this place's piece of the
    # other node (fc1.gather_w.place) and the node-mates' pieces (fc1.gather_w).
    prog = program(mesh="dp = 4", partition="group weights;chunk fc1 along outputs by stages3")
    two = program(mesh="dp = 4", partition="group weights first intra;chunk fc1 along outputs by stages")
    fwd = {op.name: op for op in prog.forward.ops}
    (rows, cols), (inner, outer) = fwd["fc1"].shape, (32, 128)
    piece = inner * outer // 4
    assert [(fwd[f"fc1.c{i}"].shape, fwd[f"fc1.c{i}"].waits, fwd[f"fc1.c{i}"].staged) for i in range(3)] == [
        ((rows, cols // 2), ("fc1.gather_w.intra",), (0, "intra", outer)),
        ((rows, cols // 4), ("fc1.gather_w.place",), (1, "intra", outer)),
        ((rows, cols // 4), ("fc1.gather_w",), (2, "intra", outer))]
    gathers = [fwd[name] for name in ("fc1.gather_w.intra", "fc1.gather_w.place", "fc1.gather_w")]
    assert [(g.axis, g.inputs, g.in_shapes[0][0], g.shape[0], dict(g.params).get("part")) for g in gathers] == [
        ("dp.intra", (), piece, 2 * piece, None), ("dp.inter", (), piece, 2 * piece, "place"),
        ("dp.inter", ("fc1.gather_w.intra",), piece, 2 * piece, "mates")]
    merge = fwd["fc1"]
    assert (merge.op, merge.inputs, dict(merge.params)) == ("merge", ("fc1.c0", "fc1.c1", "fc1.c2"),
                                                           {"axis": "dp", "first": "intra", "blocks": 4, "dim": 1})
    # Across nodes, the bytes of the two-stage gather; the backward re-gathers in two stages.
    across = [op.in_shapes[0][0] for op in prog.forward.ops if op.lane == "cross"]
    assert sum(across) == sum(op.in_shapes[0][0] for op in two.forward.ops if op.lane == "cross")
    assert {op.name for op in prog.backward.ops} == {op.name for op in two.backward.ops} | {"fc1.c2.dgrad",
                                                                                           "fc1.c2.wgrad"}
    assert simulate(prog).ranks[0].states == simulate(two).ranks[0].states


def test_by_auto_along_outputs_tries_the_weight_gathers_stages_under_group_weights():
    import attrs

    from dhelix.dsl.passes import pipeline as passes
    from dhelix.dsl.planner.chunking import choose_chunks

    prog = program(mesh="dp = 4", partition="group weights;chunk fc1 along outputs by auto")
    _, (choice,) = choose_chunks(prog)
    priced = {c.value: c.seconds for c in choice.candidates}
    assert priced["stages"] is not None and priced["stages3"] is not None
    staged = passes.rerun(attrs.evolve(prog, chunk_counts=((0, "stages"),)), after="check", stop="autodiff")
    assert staged.forward.op("fc1.c0").staged == (0, "inter", staged.forward.op("fc1.c0").staged[2])
    # stages3 is priced with the node-local stage first, the only order it runs in.
    fine = passes.rerun(attrs.evolve(prog, chunk_counts=((0, "stages3"),), group_orders=(("weights", "intra"),)),
                        after="check", stop="autodiff")
    assert fine.forward.op("fc1.c2").staged[0] == 2
    from dhelix.dsl.planner.chunking import issue_order
    from dhelix.dsl.planner.paircost import PairCost
    cost = PairCost(fine.profile, fine.model.dtype, seq=fine.model.get("seq"))
    assert priced["stages3"] == pytest.approx(cost.solo(issue_order(fine.forward.ops))
                                              + cost.solo(issue_order(fine.backward.ops)))
    # Without group weights the gather has no stages: not a candidate.
    _, (plain,) = choose_chunks(program(mesh="dp = 4", partition="chunk fc1 along outputs by auto"))
    assert "stages" not in {c.value for c in plain.candidates}


def test_a_weight_cut_into_column_pieces_gathers_back_whole_and_by_stage():
    torch = pytest.importorskip("torch")
    from dhelix.interpreter.ops.fsdp import FlatShards, column_piece, from_column_pieces

    weight = torch.arange(3 * 8, dtype=torch.float32).reshape(3, 8)

    class Gather:
        def all_gather(self, mine, axis):
            return torch.cat([column_piece(weight, 4, r) for r in range(4)])

    flat = FlatShards(True, 4, 2, by_columns={"fc1"})
    mine = flat.add("layers.0.fc1", weight)
    assert torch.equal(mine, weight[:, 4:6].reshape(-1))
    assert torch.equal(flat.gather(Gather(), {"layers.0.fc1": mine})["layers.0.fc1"], weight)
    # A first stage's pieces (blocks 1 and 3) side by side: those columns, in block order.
    stage = torch.cat([column_piece(weight, 4, 1), column_piece(weight, 4, 3)])
    assert torch.equal(from_column_pieces(stage, (3, 8), 4), weight[:, [2, 3, 6, 7]])


def test_group_weights_gathers_across_nodes_first_and_reduces_inside_the_node_first():
    prog = program(mesh="dp = 4", partition="group weights")  # 2 nodes of 2: dp.intra 2, dp.inter 2
    fwd = {op.name: op for op in prog.forward.ops}
    bwd = {op.name: op for op in prog.backward.ops}
    first, second = fwd["qkv.gather_w.inter"], fwd["qkv.gather_w"]
    elements = 32 * (4 + 2 * 2) * 32 // 4  # hidden x qkv width, over 4 ranks
    assert (first.axis, first.lane, first.inputs, first.in_shapes, first.shape) == (
        "dp.inter", "cross", (), ((elements // 4, 1),), (elements // 2, 1))
    assert (second.axis, second.lane, second.inputs, second.shape) == ("dp.intra", "local", (first.name,), (elements, 1))
    assert fwd["qkv"].waits == ("qkv.gather_w",)
    rs1, rs2 = bwd["qkv.scatter_dw.intra"], bwd["qkv.scatter_dw"]
    assert (rs1.axis, rs1.lane, rs1.waits, rs1.shape) == ("dp.intra", "local", ("qkv.wgrad",), (elements // 2, 1))
    assert (rs2.axis, rs2.lane, rs2.inputs, rs2.shape) == ("dp.inter", "cross", (rs1.name,), (elements // 4, 1))
    assert bwd["qkv.regather_w"].inputs == ("qkv.regather_w.inter",)
    # The cross-node stage moves half of what the flat ring's does through a node (2 nodes).
    flat = {op.name: op for op in program(mesh="dp = 4").forward.ops}["qkv.gather_w"]
    assert (flat.axis, flat.lane, flat.per_node) == ("dp", "cross", 2)
    profile = prog.profile
    assert op_time(first, profile, "fp32") < op_time(flat, profile, "fp32")
    assert dict(second.params)[REGROUP] and dict(rs1.params)[REGROUP] and REGROUP not in dict(first.params)


def test_wgrad_first_runs_each_weight_gradient_and_its_reduce_scatter_before_the_dgrad():
    names = [op.name for op in program(partition="backward wgrad first").backward.ops]
    for gemm in ("fc2", "fc1", "prj", "qkv"):
        at = names.index(f"{gemm}.wgrad")
        assert names[at + 1:at + 3] == [f"{gemm}.scatter_dw", f"{gemm}.dgrad"], names[at - 1:at + 3]
    default = [op.name for op in program().backward.ops]
    assert default.index("fc2.dgrad") < default.index("fc2.wgrad")  # autodiff's: dgrad first
    assert sorted(default) == sorted(names)


def test_group_weights_first_intra_reverses_both_and_carries_more_across_nodes():
    prog = program(mesh="dp = 4", partition="group weights first intra")
    fwd = {op.name: op for op in prog.forward.ops}
    bwd = {op.name: op for op in prog.backward.ops}
    assert (fwd["qkv.gather_w.intra"].axis, fwd["qkv.gather_w"].axis) == ("dp.intra", "dp.inter")
    assert (bwd["qkv.scatter_dw.inter"].axis, bwd["qkv.scatter_dw"].axis) == ("dp.inter", "dp.intra")
    assert not any(REGROUP in dict(op.params) for op in prog.forward.ops + prog.backward.ops)
    cheap = {op.name: op for op in program(mesh="dp = 4", partition="group weights").forward.ops}
    time = lambda op: op_time(op, prog.profile, "fp32")  # noqa: E731
    assert time(fwd["qkv.gather_w"]) > time(cheap["qkv.gather_w.inter"])  # intra_size x the bytes across


def test_group_weights_splits_a_hybrid_shard_group_that_spans_nodes():
    # dp 8 on 4 nodes of 2, shard groups of 4 dp ranks: each spans 2 nodes (Centauri's
    # DP3+FSDP16 shape, small). Its collectives run over its own sub-groups.
    text = HEADER.replace("nodes = 2  gpus_per_node = 2", "nodes = 4  gpus_per_node = 2").format(
        mesh="dp = 8", zero=3, pipeline="one_f_one_b", fold="none", train="shard = 4", hidden=32, ffn=64, heads=4,
        kv=2, seq=8)
    plain = run_until(text, "t.dhx")
    grouped = run_until(text + "partition {\n  group weights\n}\n", "t.dhx")
    fwd = {op.name: op for op in grouped.forward.ops}
    bwd = {op.name: op for op in grouped.backward.ops}
    first, second = fwd["qkv.gather_w.inter"], fwd["qkv.gather_w"]
    assert [(op.axis, op.group_size, op.lane) for op in (first, second)] == \
        [("dp.shard.inter", 2, "cross"), ("dp.shard.intra", 2, "local")]
    assert [bwd["qkv.scatter_dw.intra"].axis, bwd["qkv.scatter_dw"].axis] == ["dp.shard.intra", "dp.shard.inter"]
    assert grouped.mesh.groups("dp.shard.inter")[:2] == [(0, 2), (1, 3)]
    flat = {op.name: op for op in plain.forward.ops}["qkv.gather_w"]
    assert (flat.axis, flat.lane, flat.per_node) == ("dp.shard", "cross", 2)
    # Across nodes the first stage carries half of what the flat ring does through a node.
    assert op_time(first, grouped.profile, "fp32") < op_time(flat, plain.profile, "fp32")
    # Inside one node (shard 2 on nodes of 2) there is nothing to split.
    with pytest.raises(CheckError, match="its dp.shard group .* lies inside one node"):
        run_until(text.replace("shard = 4", "shard = 2") + "partition {\n  group weights\n}\n", "t.dhx")


def test_zero_3_with_ep_is_a_located_error():
    text = HEADER.format(mesh="ep = 2  dp = 4", zero=3, pipeline="one_f_one_b", fold="none", train="", hidden=32,
                         ffn=64, heads=4, kv=2, seq=8).replace("layer = llama", "layer = moe  experts = 4  top_k = 2  capacity = 2")
    with pytest.raises(CheckError) as caught:
        run_until(text, "t.dhx")
    assert "zero = 3 with ep = 2 is not supported" in caught.value.message
    assert (caught.value.span.line, caught.value.span.column) == (8, 44)  # at `zero = 3`


def test_with_cp_the_weights_are_cut_over_dp_x_cp_one_group_across_the_node_boundary():
    # torchtitan's dp_shard_cp: a weight is replicated over cp as over dp, so its pieces,
    # gathers and reduce-scatters span both; cp 2 x dp 2 on 2 nodes of 2.
    prog = program(mesh="cp = 2  dp = 2")
    fwd, bwd = {op.name: op for op in prog.forward.ops}, {op.name: op for op in prog.backward.ops}
    gather, scatter = fwd["qkv.gather_w"], bwd["qkv.scatter_dw"]
    assert prog.mesh.groups("dp.cp") == [(0, 1, 2, 3)]
    assert [(op.axis, op.group_size, op.lane, op.per_node) for op in (gather, scatter)] == [("dp.cp", 4, "cross", 2)] * 2
    assert dict(gather.params)["pieces"] == 4 and gather.in_shapes[0][0] * 4 == gather.shape[0]
    # group weights splits the dp x cp group at the node: across first (one rank a node), then inside.
    grouped = {op.name: op for op in program(mesh="cp = 2  dp = 2", partition="group weights").forward.ops}
    assert [(grouped[n].axis, grouped[n].lane) for n in ("qkv.gather_w.inter", "qkv.gather_w")] == [
        ("dp.cp.inter", "cross"), ("dp.cp.intra", "local")]
    # cp alone (dp = 1) shards too; the simulator keeps a quarter of the layers either way.
    alone = program(mesh="cp = 4", pipeline="one_f_one_b", fold="none")
    assert {op.axis for op in alone.forward.ops if op.op == "param_gather"} == {"dp.cp"}
    held = [simulate(program(mesh=m, pipeline="one_f_one_b", fold="none")).ranks[0].states.params
            for m in ("dp = 4", "cp = 2  dp = 2", "cp = 4")]
    assert held[1] == pytest.approx(held[0]) and held[2] == pytest.approx(held[0])
    # Where cp and dp are not neighbours the dp x cp ranks are not one evenly spaced group.
    text = HEADER.replace("gpus_per_node = 2", "gpus_per_node = 4").format(
        mesh="cp = 2  tp = 2  dp = 2", zero=3, pipeline="one_f_one_b", fold="none", train="", hidden=32, ffn=64,
        heads=4, kv=2, seq=8)
    with pytest.raises(CheckError, match="the mesh puts tp between cp and dp"):
        run_until(text, "t.dhx", "check")


def test_selective_recomputation_regathers_the_norms_first_and_their_readers_wait_for_them():
    prog = program(mesh="dp = 4", train="recompute = selective")
    bwd = prog.backward.ops
    # The rebuild computes ln1 and ln2 again from their re-gathered weights: those come first,
    # and every op reading a dropped output (the wgrads of act, ln2, ln1) waits for both.
    assert [op.name for op in bwd[:2]] == ["ln1.regather_w", "ln2.regather_w"]
    readers = {op.name: op.waits for op in bwd if "ln1.regather_w" in op.waits}
    assert readers == {"fc2.wgrad": ("ln1.regather_w", "ln2.regather_w"),
                       "fc1.wgrad": ("ln1.regather_w", "ln2.regather_w"),
                       "qkv.wgrad": ("ln1.regather_w", "ln2.regather_w"),
                       "ln1.bwd": ("ln1.regather_w",)}
    # The simulator's rebuilt norms wait for those re-gathers; what the rebuild adds to the
    # backward, with the other weights still arriving, is no more than its compute.
    from dhelix.dsl.simulator.costs import cost_of, layer_costs, rebuild_ops
    assert [(op.name, op.waits) for op in rebuild_ops(prog.forward, prog.backward)] == [
        ("ln1", ("ln1.regather_w",)), ("ln2", ("ln2.regather_w",)), ("act", ())]
    plain = program(mesh="dp = 4", zero=1, train="recompute = selective")
    assert [op.waits for op in rebuild_ops(plain.forward, plain.backward)] == [()] * 3
    cost = cost_of(prog)
    rebuilt = [op for op in prog.forward.ops if op.name in ("ln1", "ln2", "act")]
    again = layer_costs(prog, cost, None).again.seconds
    assert 0 < again <= cost.solo(tuple(rebuilt)) + 1e-12


# -- planner and simulator --------------------------------------------------------------------

def test_the_planner_pairs_weight_gathers_and_gradient_scatters_with_the_other_strand():
    # Llama-8B-sized layers: the dp traffic is worth hiding.
    prog = program(hidden=4096, ffn=14336, heads=32, kv=8, seq=2048)
    plan = plan_program(prog, cost_of(prog))
    fwd = {op.name: op for op in prog.forward.ops}
    bwd = {op.name: op for op in prog.backward.ops}
    paired = [(pair.forward, pair.backward) for pair in plan.pairs if pair.forward and pair.backward]
    assert any(any(fwd[n].op == "param_gather" for n in f) and any(bwd[n].kind == "compute" for n in b)
               or any(bwd[n].op in ("param_gather", "grad_scatter") for n in b)
               and any(fwd[n].kind == "compute" for n in f) for f, b in paired), plan.pairs


def test_the_simulator_keeps_a_dp_piece_of_the_layers_and_syncs_only_the_ends_after_the_pipeline():
    one, three = (simulate(program(mesh="dp = 4", zero=z, pipeline="one_f_one_b", fold="none")) for z in (1, 3))
    assert three.fsdp and not one.fsdp
    r1, r3 = one.ranks[0], three.ranks[0]
    # ZeRO-1 and 3 shard the optimizer alike; ZeRO-3 holds a quarter of the layers' weights
    # (dp = 4) plus one gathered layer per strand: 3 layers' worth of 4 (and the ends).
    assert r3.states.optimizer == pytest.approx(r1.states.optimizer)
    assert r3.states.params < r1.states.params
    assert r3.dp_comm < r1.dp_comm  # the layers' gradients were reduce-scattered in the layers
    assert r3.layer_comm > r1.layer_comm


# -- runs ------------------------------------------------------------------------------------

RUNS = {
    # name: (mesh, pipeline, fold, partition, train, si plan, sizes)
    "tp2_dp2_w_helix_planned": ("tp = 2  dp = 2", "w_helix", "u", "", "", "planned", {}),
    "dp2_pp2_dualpipe_split_w": ("dp = 2  pp = 2", "dualpipe_v", "u", "", "", "op_by_op", {}),
    "dp4_1f1b_padded": ("dp = 4", "one_f_one_b", "none", "", "", None,
                        {"hidden": 42, "ffn": 66, "heads": 6, "kv": 3}),
    "tp2_dp2_chunked_planned": ("tp = 2  dp = 2", "w_helix", "u", "chunk ag2 + fc1 + act + fc2 + rs2 by 2", "",
                                "planned", {}),
    "tp2_dp2_recompute": ("tp = 2  dp = 2", "w_helix", "u", "", "recompute = full", "op_by_op", {}),
    # group weights: gathers over dp.inter then dp.intra, reduce-scatters the other way round.
    "dp4_group_weights_planned": ("dp = 4", "w_helix", "u", "group weights", "", "planned", {}),
    "dp4_group_weights_padded": ("dp = 4", "one_f_one_b", "none", "group weights", "", None,
                                 {"hidden": 42, "ffn": 66, "heads": 6, "kv": 3}),
    # ... and the other order: pieces in dp order, nothing regrouped; each GEMM's weight
    # gradient (and its reduce-scatter) before its activation gradient (Centauri's T2).
    "dp4_group_weights_intra_first": ("dp = 4", "one_f_one_b", "none", "group weights first intra;backward wgrad first",
                                      "", None, {}),
    # Hybrid sharding: pieces over each node's 2 dp ranks, their gradients all-reduced across.
    "dp4_hsdp_planned": ("dp = 4", "w_helix", "u", "", "shard = 2", "planned", {}),
    "dp4_hsdp_padded": ("dp = 4", "one_f_one_b", "none", "", "shard = 2", None,
                        {"hidden": 42, "ffn": 66, "heads": 6, "kv": 3}),
    # Centauri's workload partition of the weight gathers: each chunk gathers its own columns.
    "tp2_dp2_outputs_planned": ("tp = 2  dp = 2", "w_helix", "u",
                                "chunk qkv along outputs by 2;chunk fc1 along outputs by 2", "", "planned", {}),
    "dp4_outputs_group_padded": ("dp = 4", "one_f_one_b", "none",
                                 "chunk fc1 along outputs by 2;chunk fc2 along outputs by 3;group weights", "", None,
                                 {"hidden": 42, "ffn": 66, "heads": 6, "kv": 3}),
    # Algorithm 1's uneven split of a gemm at its weight gather's stages (fc1: the first
    # stage's columns, then the rest), in both orders of the stages.
    "dp4_outputs_stages_planned": ("dp = 4", "w_helix", "u", "group weights;chunk fc1 along outputs by stages", "",
                                   "planned", {}),
    "dp4_outputs_stages_intra_first": ("dp = 4", "one_f_one_b", "none",
                                       "group weights first intra;chunk qkv along outputs by stages;"
                                       "chunk fc2 along outputs by stages", "", None, {}),
    # ... and three ways (Algorithm 1, lines 19-20), the node-local stage first.
    "dp4_outputs_stages3_planned": ("dp = 4", "w_helix", "u",
                                    "group weights;chunk fc1 along outputs by stages3;chunk qkv along outputs by stages3",
                                    "", "planned", {}),
    "dp4_outputs_hsdp_planned": ("dp = 4", "w_helix", "u", "chunk prj along outputs by 2", "shard = 2", "planned", {}),
    # The block scheduler's order: each layer's weights waited for as the layer starts, the
    # forward strand running ahead of the backward; with recomputation and with weight chunks.
    "tp2_dp2_recompute_scheduled": ("tp = 2  dp = 2", "w_helix", "u", "", "recompute = full", "scheduled", {}),
    # ... and recomputing only the first layer of each of fold u's two chunks of 2.
    "tp2_dp2_recompute_layers_scheduled": ("tp = 2  dp = 2", "w_helix", "u", "",
                                           "recompute = full  recompute_layers = 1", "scheduled", {}),
    "dp4_outputs_hsdp_scheduled": ("dp = 4", "w_helix", "u", "chunk prj along outputs by 2", "shard = 2",
                                   "scheduled", {}),
    # With cp > 1 the pieces are cut over dp x cp (torchtitan's dp_shard_cp), beside ring
    # attention over cp, split at the node boundary by group weights; selective
    # recomputation rebuilds the norms from their re-gathered weights before the first op
    # reading a dropped output. Then cp = 4 alone (dp = 1) cutting the pieces.
    "cp2_dp2_group_weights_selective_planned": ("cp = 2  dp = 2", "w_helix", "u", "group weights",
                                                "recompute = selective", "planned", {}),
    "cp4_selective_padded": ("cp = 4", "one_f_one_b", "none", "", "recompute = selective", None,
                             {"hidden": 42, "ffn": 66, "heads": 6, "kv": 3}),
}


def _runs(rank: int, world: int) -> dict:
    from dhelix.interpreter.ops.comm import DistComm
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.verify.harness import broadcast_from_first, check_steps
    from dhelix.interpreter.training.optim import AdamWConfig, for_executor
    from dhelix.dsl.planner.si_plan import fixed_plan, op_by_op_plan
    from dhelix.dsl.simulator.events import planned_pairs
    from dhelix.dsl.simulator.events import block_orders

    results = {}
    for name, (mesh, pipeline, fold, partition, train, si, sizes) in RUNS.items():
        prog = program(mesh, 3, pipeline, fold, partition, train, **sizes)
        comm = DistComm(prog.mesh, timeout_s=60)
        plan_for = fixed_plan(broadcast_from_first(planned_pairs(prog) if rank == 0 else None)) \
            if si == "planned" else op_by_op_plan
        orders = broadcast_from_first(block_orders(prog) if rank == 0 else None) if si == "scheduled" else None
        taken = []  # per hand-over: the ZeRO-3 pieces the optimizer took

        def observed(executor, taken=taken):
            # As `dhelix run` builds it: the dense gradients reduced under the backward.
            optimizer = for_executor(executor, zero1=True, config=AdamWConfig(clip=0.5))
            reduce = optimizer.reduce

            def reduce_logged(grads):
                names = reduce(grads)
                taken.append(sorted(n for n in names if n in executor.flat))
                return names
            optimizer.reduce = reduce_logged
            return optimizer

        executor = Executor(prog, comm, seed=7, si=si is not None, plan_for=plan_for, block_orders=orders,
                            optimizer=observed)
        optimizer = executor.optimizer
        held = sum(p.numel() for n, p in executor.params.items() if n in executor.flat)
        full = sum(math.prod(shape) for shape in executor.flat.shapes.values())
        results[name] = (check_steps(executor, optimizer, 2, 3), held, full,
                         (executor.flat.pieces, comm.size("dp") * comm.size("cp")),
                         [names for names in taken if names])
    return results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    pytest.importorskip("torch")
    from distributed import gloo_results

    return gloo_results(_runs, 4, tmp_path_factory.mktemp("fsdp"), timeout=240.0)


@pytest.mark.parametrize("name", list(RUNS))
def test_fsdp_runs_match_the_reference_and_keep_a_dp_piece_of_each_weight(world, name):
    from distributed import TOL, assert_steps_match

    checks, _, _, _, _ = world[0][name]
    assert_steps_match(checks, 2, TOL)
    for rank_results in world:
        _, held, full, (pieces, dp), taken = rank_results[name]
        assert pieces == (dp // 2 if "hsdp" in name else dp)  # hsdp: shard = 2 of dp = 4; else dp x cp
        assert full and held == pytest.approx(full / pieces, abs=pieces * 8)  # padding: < pieces per weight
        # Hybrid sharding: each layer's pieces handed over for their all-reduce across the
        # shard groups under the backward, once per step and layer; plain ZeRO-3's none.
        layers = {name.split(".")[1] for names in taken for name in names}
        assert (len(taken), len(layers)) == ((2 * 4, 4) if "hsdp" in name else (0, 0)), taken  # 2 steps, 4 layers


def test_hybrid_sharding_gathers_inside_the_shard_group_and_syncs_pieces_across_it():
    prog = program(mesh="dp = 4", train="shard = 2")  # 2 nodes of 2: each node one shard group
    fwd = {op.name: op for op in prog.forward.ops}
    gather = fwd["qkv.gather_w"]
    elements = 32 * (4 + 2 * 2) * 32 // 4
    assert (gather.axis, gather.group_size, gather.lane, gather.shape) == ("dp.shard", 2, "local", (elements, 1))
    assert dict(gather.params)["pieces"] == 2
    assert prog.mesh.groups("dp.shard")[0] == (0, 1) and prog.mesh.groups("dp.replicate")[0] == (0, 2)
    hybrid, full = simulate(prog), simulate(program(mesh="dp = 4"))
    # Half of each layer weight per rank (against a quarter), its states too; the gathers stay
    # inside the node, and the pieces' gradients are all-reduced across it after the pipeline.
    layer_params = sum(math.prod(op.weight) for op in prog.forward.ops if op.weight and "gather" not in op.name)
    assert hybrid.ranks[0].states.params - full.ranks[0].states.params == pytest.approx(
        4 * 4 * layer_params * (1 / 2 - 1 / 4))  # 4 layers, fp32
    synced = [e for e in hybrid.events if e.args and e.args.get("kind") == "DP" and "layer" in e.name]
    assert len(synced) == 4 and all(e.name.startswith("all_reduce grads layer") for e in synced)
    assert synced[0].args["group"] == 2 and synced[0].lane == "cross"
    assert hybrid.step_time < full.step_time  # the tiny layers' gathers across nodes dominate


@pytest.mark.parametrize(("train", "message"), [
    ("zero = 1  shard = 2", "shard = 2 needs zero = 3, not zero = 1"),
    ("zero = 3  shard = 3", "shard = 3 does not divide dp = 4"),
    ("zero = 3  shard = 4", "shard = 4 is the whole dp group (dp = 4): that is plain ZeRO-3"),
])
def test_a_shard_that_does_not_cut_dp_into_groups_is_a_located_error(train, message):
    text = HEADER.format(mesh="dp = 4", zero=3, pipeline="gpipe", fold="none", train="", hidden=32, ffn=64,
                         heads=4, kv=2, seq=8).replace("zero = 3", train)
    with pytest.raises(DhelixError) as info:
        run_until(text, "t.dhx", "check")
    assert message in str(info.value)
