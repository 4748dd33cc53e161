"""Centauri's communication partitioning: the partition pass's rewrite of the forward DAG, what
the later passes, the planner and the simulator make of it, and its exact execution on one
world of 4 gloo ranks against the single-process reference (fp32, 1e-5).
"""

from __future__ import annotations

import pytest

from dhelix.dsl.core.oplib import REGROUP
from dhelix.dsl.passes.pipeline import check_text, run_until
from dhelix.dsl.planner.pairing import plan_program
from dhelix.dsl.simulator.costs import cost_of
from dhelix.dsl.simulator.report import compare

HEADER = """
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m {{ layers = {layers}  hidden = 32  ffn = 64  heads = 4  kv_heads = {kv_heads}  seq = 8  vocab = 64
  dtype = fp32  layer = {layer} }}
cluster {{ nodes = {nodes}  gpus_per_node = {per_node}  profile = "a40" }}
mesh {{ {mesh} }}
train {{ micro_batch = 2  microbatches = 4 }}
fold {fold}
pipeline {pipeline}
"""

MLP_BY_4 = "chunk ag2 + fc1 + act + fc2 + rs2 by 4"
QKV_BY_2 = "chunk ag1 + qkv by 2"
MLP_BY_2 = "chunk ag2 + fc1 + act + fc2 + rs2 by 2"
GROUP_ALL = "group ag1 + rs1 + ag2 + rs2"
QKV_BY_STAGES = "chunk ag1 + qkv by stages"
MLP_BY_STAGES = "chunk ag2 + fc1 + act + fc2 by stages"

TP_TO_SP = "substitute ar1 as reduce_scatter + all_gather;substitute ar2 as reduce_scatter + all_gather;" \
    "move ar1 + ar2 later"


def program(partition: str = "", mesh: str = "tp = 2  pp = 2", pipeline: str = "w_helix", fold: str = "u",
            layers: int = 4, layer: str = "llama", extra: str = "", stop: str = "validate"):
    """A tiny Llama (or ``layer``) with ``partition`` statements (no block when empty)."""
    world = 1
    for size in [int(word) for word in mesh.split() if word.isdigit()]:
        world *= size
    per_node = min(world, 2)  # "nodes" of 2 ranks: both the local and the cross lane are used
    text = extra + HEADER.format(layers=layers, layer=layer, nodes=world // per_node, per_node=per_node,
                                 mesh=mesh, fold=fold, pipeline=pipeline, kv_heads=4 if "tp = 4" in mesh else 2)
    if partition:
        text += "partition {\n" + "\n".join(f"  {line}" for line in partition.split(";")) + "\n}\n"
    return run_until(text, "t.dhx", stop)


# -- the rewrite ------------------------------------------------------------------------------

def test_without_a_partition_block_the_pass_changes_nothing_and_llama_keeps_14_and_18_ops():
    plain = program()
    assert plain.partition is None
    assert len(plain.forward.ops) == 14 and len(plain.backward.ops) == 18
    assert program(stop="partition").forward == program(stop="shapes").forward


def test_a_chain_becomes_slices_its_head_gathers_chunk_major_chunks_and_a_concat_that_keeps_its_name():
    fwd = program(QKV_BY_2, stop="partition").forward
    names = [op.name for op in fwd.ops]
    # Every chunk's gather first (a lane runs its ops in their listed order: chunk 1's gather
    # under chunk 0's GEMM), then the rest chunk-major.
    assert names[:8] == ["ln1", "ln1.s0", "ln1.s1", "ag1.c0", "ag1.c1", "qkv.c0", "qkv.c1", "qkv"]
    concat = fwd.op("qkv")
    assert concat.op == "concat" and concat.inputs == ("qkv.c0", "qkv.c1")
    # The gathered chunks hold one block per tp rank: the concat interleaves them back.
    assert dict(concat.params) == {"parts": 2, "dim": 0, "blocks": 2}
    chunk = fwd.op("qkv.c1")
    assert chunk.origin == "qkv" and chunk.weight_name == "qkv" and chunk.shape == (8, 32)
    assert fwd.op("ag1.c0").lane == "local" and fwd.op("ag1.c0").shape == (8, 32)  # 2 blocks of 4 rows
    assert fwd.op("att").inputs == ("qkv",)  # the rest of the layer is unchanged


def test_backward_is_derived_from_the_chunks_with_one_wgrad_per_chunk():
    prog = program(f"{QKV_BY_2};{MLP_BY_4}", stop="autodiff")
    bwd = {op.name: op for op in prog.backward.ops}
    assert {f"fc1.c{i}.wgrad" for i in range(4)} <= set(bwd)
    assert bwd["ag2.c3.bwd"].op == "reduce_scatter" and bwd["rs2.c0.bwd"].op == "all_gather"
    assert bwd["rs2.bwd"].op == "concat_bwd" and bwd["ln2.s0.bwd"].op == "slice_bwd"
    assert bwd["fc1.c2.wgrad"].grad.weight == "fc1.c2"  # the runtime adds it into fc1's gradient


def test_a_collective_elided_by_a_size_1_axis_drops_out_of_its_chain():
    fwd = program(MLP_BY_4, mesh="tp = 1", pipeline="gpipe", fold="none", stop="partition").forward
    names = [op.name for op in fwd.ops]
    assert "ag2.c0" not in names and "fc1.c0" in names and fwd.op("h2").inputs[0] == "fc2"
    assert fwd.op("fc2").op == "concat"


def test_group_partition_splits_each_collective_and_its_chunks_with_fewest_bytes_across_nodes():
    # Unchosen, an all_gather crosses nodes first with each rank's piece and a reduce_scatter
    # reduces inside the node first; the node-local stage regroups the rank blocks.
    fwd = program(f"{MLP_BY_2};{GROUP_ALL}", mesh="tp = 4", stop="partition").forward
    ops = {op.name: op for op in fwd.ops}
    first, second = ops["ag1.inter"], ops["ag1"]
    assert (first.axis, first.lane, first.group_size, first.shape) == ("tp.inter", "cross", 2, (8, 32))
    assert (second.axis, second.lane, second.inputs, second.shape) == ("tp.intra", "local", ("ag1.inter",), (16, 32))
    assert dict(first.params) == {"axis": "tp.inter"} and dict(second.params) == {"axis": "tp.intra", REGROUP: True}
    assert (ops["rs1.intra"].lane, ops["rs1"].axis, ops["rs1"].shape) == ("local", "tp.inter", (4, 32))
    assert dict(ops["rs1.intra"].params)[REGROUP] and REGROUP not in dict(ops["rs1"].params)
    assert {"ag2.c1.inter", "rs2.c0.intra"} <= set(ops)
    bwd = {op.name: op for op in program(GROUP_ALL, mesh="tp = 4", stop="autodiff").backward.ops}
    # The transpose runs the stages in reverse and keeps the regrouping on the local one.
    assert (bwd["ag1.bwd"].op, bwd["ag1.bwd"].axis, dict(bwd["ag1.bwd"].params)[REGROUP]) == \
        ("reduce_scatter", "tp.intra", True)
    assert (bwd["ag1.inter.bwd"].op, bwd["ag1.inter.bwd"].inputs) == ("reduce_scatter", ("ag1.bwd",))


def test_first_fixes_which_sub_group_runs_first_and_only_out_of_order_stages_regroup():
    ops = {op.name: op for op in program(f"{GROUP_ALL} first intra", mesh="tp = 4", stop="partition").forward.ops}
    assert (ops["ag1.intra"].axis, ops["ag1"].axis) == ("tp.intra", "tp.inter")
    assert (ops["rs1.intra"].axis, ops["rs1"].axis) == ("tp.intra", "tp.inter")
    assert not any(REGROUP in dict(op.params) for op in ops.values() if op.name.startswith("ag"))
    assert dict(ops["rs1.intra"].params)[REGROUP]
    ops = {op.name: op for op in program(f"{GROUP_ALL} first inter", mesh="tp = 4", stop="partition").forward.ops}
    assert (ops["rs1.inter"].axis, ops["rs1"].axis) == ("tp.inter", "tp.intra")
    assert not any(REGROUP in dict(op.params) for op in ops.values() if op.name.startswith("rs"))


@pytest.mark.parametrize("first", ["inter", "intra"])
def test_by_stages_computes_on_the_first_stage_then_on_the_rest_and_merges_in_rank_order(first):
    order = f" first {first}" if first == "intra" else ""
    # The reduce_scatter that ends the chain runs whole on the merged rows.
    prog = program(f"group ag2{order};chunk ag2 + fc1 + act + fc2 + rs2 by stages", mesh="tp = 4", stop="autodiff")
    ops = {op.name: op for op in prog.forward.ops}
    # tp = 4 on 2 nodes of 2: either stage first brings 2 of the 4 rank blocks of 4 rows.
    stage, near = f"ag2.{first}", 8
    assert (ops["fc1.c0"].inputs, ops["fc1.c0"].shape) == ((stage,), (near, 32))
    assert (ops["ag2.rest"].op, ops["ag2.rest"].inputs, ops["ag2.rest"].shape) == ("rest", ("ag2",), (16 - near, 32))
    assert (ops["fc1.c1"].inputs, ops["act.c1"].inputs, ops["fc2.c1"].shape) == (("ag2.rest",), ("fc1.c1",),
                                                                                 (16 - near, 32))
    merge = ops["fc2"]
    assert (merge.op, merge.inputs, merge.shape, ops["rs2"].inputs) == ("merge", ("fc2.c0", "fc2.c1"), (16, 32), ("fc2",))
    assert dict(merge.params) == {"axis": "tp", "first": first, "blocks": 4}
    assert ops["fc1.c0"].origin == "fc1" and ops["fc1.c0"].weight == ops["fc1.c1"].weight  # one weight
    bwd = {op.name: op for op in prog.backward.ops}
    # The first stage's output gets two gradients, its reader chunk 0's and the second
    # stage's transpose's: the latter sums them (as it lands) before the first stage's.
    second = bwd["ag2.bwd"]
    assert second.inputs == ("ag2.rest.bwd", "fc1.c0.dgrad")
    assert second.grad.accumulates == ((stage, ("fc1.c0.dgrad",)),)
    assert bwd[f"{stage}.bwd"].inputs == ("ag2.bwd",)


SUBSTITUTE_LAYER = """
layer ar_block {
  in x [tokens, hidden]
  up = gemm(x, hidden, ffn / tp)
  down = gemm(up, ffn / tp, hidden)
  ar = all_reduce(down, tp)
  y = add(ar, x)
  out y
}
"""


def test_substitution_replaces_an_all_reduce_by_reduce_scatter_then_all_gather():
    prog = program("substitute ar as reduce_scatter + all_gather", mesh="tp = 2", pipeline="gpipe",
                   fold="none", layer="ar_block", extra=SUBSTITUTE_LAYER, stop="autodiff")
    fwd = {op.name: op for op in prog.forward.ops}
    assert (fwd["ar.rs"].op, fwd["ar.rs"].shape) == ("reduce_scatter", (8, 32))
    assert (fwd["ar"].op, fwd["ar"].inputs, fwd["ar"].shape) == ("all_gather", ("ar.rs",), (16, 32))
    bwd = {op.name: op.op for op in prog.backward.ops}
    assert bwd["ar.bwd"] == "reduce_scatter" and bwd["ar.rs.bwd"] == "all_gather"


def test_the_planner_pairs_chunks_with_the_other_strand():
    path = "examples/llama8b_centauri_a40.dhx"  # at real sizes, where pairing pays
    prog = check_text(open(path).read(), path)
    plan = plan_program(prog, cost_of(prog))
    pairs = [pair for pair in plan.pairs if pair.forward and pair.backward]
    assert any(name.startswith(("ag2.c", "rs2.c")) for pair in pairs for name in pair.forward)
    assert any(name.startswith(("ag2.c", "fc1.c", "fc2.c")) for pair in pairs for name in pair.backward)


def test_compare_removes_one_feature_per_column():
    sims = compare(program(MLP_BY_4))
    assert [s.label for s in sims] == ["as written", "without SI", "1F1B, fold none", "without partition"]
    assert sims[0].si and not sims[1].si and not sims[2].si and sims[3].si
    assert sims[3].pipeline == sims[0].pipeline and sims[3].fold == sims[0].fold  # only the block goes
    assert sims[0].step_time != sims[3].step_time  # the chunks are priced, not ignored


def test_moving_the_substituted_gathers_later_turns_tensor_into_sequence_parallelism():
    # The tensor-parallel layer, substituted and moved, is the stdlib's sequence-parallel
    # llama op for op: the same operators, shapes and collectives, its input and output
    # 1/tp of the tokens; the gathers are named for what they gather.
    moved = program(TP_TO_SP, layer="llama_tp")
    llama = program()
    names = {"ln1.ag": "ag1", "ar1.rs": "rs1", "ln2.ag": "ag2", "ar2.rs": "rs2"}
    assert [names.get(op.name, op.name) for op in moved.forward.ops] == [op.name for op in llama.forward.ops]
    for got, want in zip(moved.forward.ops, llama.forward.ops, strict=True):
        assert (got.op, got.shape, got.in_shapes, got.weight, got.lane) == \
            (want.op, want.shape, want.in_shapes, want.weight, want.lane), got.name
        assert [names.get(i, i) for i in got.inputs] == list(want.inputs), got.name
    assert moved.forward.input_shape == llama.forward.input_shape == (16 // 2, 32)
    assert [op.op for op in moved.backward.ops] == [op.op for op in llama.backward.ops]
    # Substituted but not moved: the all_gathers stay where the all_reduces were, every
    # token on every rank between the blocks.
    kept = program(TP_TO_SP.rsplit(";", 1)[0], layer="llama_tp").forward
    assert [op.name for op in kept.ops if op.op == "all_gather"] == ["ar1", "ar2"]
    assert kept.input_shape == (16, 32)


def test_the_partition_block_prints_canonically_and_parses_back():
    from dhelix.dsl.frontend.fmt import format_source

    text = ("partition {\n  chunk ag1 + qkv along tokens by (2 * tp)\n  substitute ar as reduce_scatter + all_gather\n"
            "  move ar + ag2 later\n  group ag1 + rs1 first inter\n  group weights\n  backward wgrad first\n"
            "  chunk ag2 + fc1 + act by stages\n  chunk fc2 along outputs by auto\n}\n")
    assert format_source(text) == text
    assert format_source(text.replace("(2 * tp)", "(((2) * tp))")) == text


# -- exact execution: one world of 4 gloo ranks -----------------------------------------------

#: name -> (partition statements, mesh, pipeline, fold, SI: False | "planned" | "scheduled")
RUNS = {
    "qkv2_mlp4_w_helix_planned_si": (f"{QKV_BY_2};{MLP_BY_4}", "tp = 2  pp = 2", "w_helix", "u", "planned"),
    # tp = 4 over two "nodes" of 2 ranks: hierarchical collectives, chunked too (the
    # row-parallel chunks cut the gathered attention output by rank blocks), with SI.
    "group_tp4_w_helix_planned_si": (f"chunk prj + rs1 by 2;{MLP_BY_2};{GROUP_ALL}", "tp = 4", "w_helix", "u",
                                     "planned"),
    # ... in the block scheduler's order (the chunks' collectives on both lanes).
    "group_tp4_w_helix_scheduled_si": (f"chunk prj + rs1 by 2;{MLP_BY_2};{GROUP_ALL}", "tp = 4", "w_helix", "u",
                                       "scheduled"),
    # The orders the run above does not take: an all_gather inside the node first (blocks
    # in order), a reduce_scatter across nodes first.
    "group_tp4_other_orders_1f1b": ("group ag1 + rs1 first intra;group ag2 + rs2 first inter", "tp = 4",
                                    "one_f_one_b", "none", False),
    # Algorithm 1's uneven partition: each chain computes on what its gather's first stage
    # brought while the second stage runs, then on the rest; both orders of the stages.
    "stages_tp4_w_helix_planned_si": (f"group ag1 + ag2;{QKV_BY_STAGES};{MLP_BY_STAGES}", "tp = 4", "w_helix",
                                      "u", "planned"),
    # ... the MLP's chain ending with its (group-partitioned) reduce_scatter, run whole.
    "stages_intra_first_tp4_1f1b": (f"group ag1 + ag2 + rs2 first intra;{QKV_BY_STAGES};"
                                    "chunk ag2 + fc1 + act + fc2 + rs2 by stages", "tp = 4", "one_f_one_b", "none",
                                    False),
    # Algorithm 1's finer split (lines 19-20): the node's blocks, this place's on the other
    # node (a cross-node gather of one block each), then the rest.
    "stages3_tp4_w_helix_planned_si": ("group ag1 + ag2;chunk ag1 + qkv by stages3;"
                                       "chunk ag2 + fc1 + act + fc2 + rs2 by stages3", "tp = 4", "w_helix", "u",
                                       "planned"),
    # Tensor parallelism without SP, substituted and moved into SP (the llama_tp layer), with
    # the MLP chunked after the move and SI on the W.
    "tp_to_sp_mlp2_w_helix_planned_si": (f"{TP_TO_SP};chunk ln2.ag + fc1 + act + fc2 + ar2.rs by 2",
                                         "tp = 2  pp = 2", "w_helix", "u", "planned"),
}


def _runs(rank: int, world: int) -> dict:
    import torch

    from dhelix.interpreter.ops.comm import DistComm
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.verify.harness import broadcast_from_first, check_steps
    from dhelix.interpreter.training.optim import DistributedAdamW
    from dhelix.dsl.planner.si_plan import fixed_plan, op_by_op_plan
    from dhelix.dsl.simulator.events import planned_pairs
    from dhelix.dsl.simulator.events import block_orders

    results = {}
    for name, (partition, mesh, pipeline, fold, si) in RUNS.items():
        # The stdlib's llama_tp (TP without SP) for the runs that move its gathers later.
        prog = program(partition, mesh, pipeline, fold, layer="llama_tp" if "move" in partition else "llama")
        comm = DistComm(prog.mesh, timeout_s=60)
        # The planner runs on rank 0 only (as `dhelix run` plans once): the ranks share 2 cores.
        plan_for = fixed_plan(broadcast_from_first(planned_pairs(prog) if rank == 0 else None)) \
            if si == "planned" else op_by_op_plan
        orders = broadcast_from_first(block_orders(prog) if rank == 0 else None) if si == "scheduled" else None
        executor = Executor(prog, comm, seed=7, si=bool(si), plan_for=plan_for, block_orders=orders)
        results[name] = check_steps(executor, DistributedAdamW(executor.params, comm), 1, 3)
    results["substitution"] = _substitution(rank, torch)
    return results


def _substitution(rank: int, torch) -> tuple[float, float]:
    """Max differences of the substituted layer's output and input gradient (also with the
    all_gather half chunked with the add after it) from the all_reduce layer's and from the
    sums they must be (over tp = 2)."""
    from dhelix.interpreter.ops.comm import DistComm
    from dhelix.interpreter.execute.layer_exec import LayerPlan
    from distributed import drive_layer

    layer = "layer ar_only {\n  in x [tokens, hidden]\n  ar = all_reduce(x, tp)\n  y = add(ar, x)\n  out y\n}\n"
    substitute = "substitute ar as reduce_scatter + all_gather"
    progs = [program(partition, "tp = 2  dp = 2", "gpipe", "none", layer="ar_only", extra=layer)
             for partition in ("", substitute, f"{substitute};chunk ar + y by 2")]
    comm = DistComm(progs[0].mesh, timeout_s=60)
    gen = torch.Generator().manual_seed(100 + rank)
    x, dout = (torch.randn(progs[0].forward.input_shape, generator=gen) for _ in range(2))
    runs = [drive_layer(LayerPlan.build(p.forward, p.backward, 2), {}, comm, x, dout) for p in progs]
    x_sum, dout_sum = (comm.all_reduce(t.clone(), "tp") for t in (x, dout))
    out_diff = max((run[0] - (x_sum + x)).abs().max().item() for run in runs)
    grad_diff = max((run[1] - (dout_sum + dout)).abs().max().item() for run in runs)
    return out_diff, grad_diff


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    pytest.importorskip("torch")
    from distributed import gloo_results

    return gloo_results(_runs, 4, tmp_path_factory.mktemp("partition"))


@pytest.mark.parametrize("name", list(RUNS))
def test_chunked_runs_match_the_reference(world, name):
    from distributed import TOL, assert_steps_match

    assert_steps_match(world[0][name], 1, TOL)


def test_substituted_all_reduce_matches_on_every_rank(world):
    for rank, results in enumerate(world):
        out_diff, grad_diff = results["substitution"]
        assert out_diff <= 1e-5 and grad_diff <= 1e-5, (rank, out_diff, grad_diff)


def test_the_example_runs_chunks_it_declares():
    prog = check_text(open("examples/tiny_llama_centauri_cpu.dhx").read(), "examples/tiny_llama_centauri_cpu.dhx")
    assert {"ag1.c1", "qkv.c1", "rs2.c3"} <= {op.name for op in prog.forward.ops}


# -- one process: the layout kernels and chunked layers against the reference ------------------

@pytest.mark.parametrize(("parts", "blocks"), [(2, 1), (4, 1), (2, 2), (2, 4), (4, 2)])
def test_slices_and_their_concat_are_inverse_and_so_are_their_gradients(parts, blocks):
    torch = pytest.importorskip("torch")
    from dhelix.interpreter.ops.handlers import KERNELS
    from dhelix.interpreter.ops.kernels import KernelCtx

    x = torch.randn(blocks * parts * 3, 5)
    ctx = lambda **more: KernelCtx(params={"parts": parts, "dim": 0, "blocks": blocks, **more})  # noqa: E731
    pieces = [KERNELS["slice"].forward((x,), None, ctx(index=i)) for i in range(parts)]
    # A chunk of a gathered tensor takes its share of every rank block.
    rows = x.shape[0] // blocks
    assert torch.equal(pieces[1][0][:3], x[rows // parts:rows // parts + 3])
    joined, saved = KERNELS["concat"].forward(tuple(p for p, _ in pieces), None, ctx())
    assert torch.equal(joined, x)
    grads = KERNELS["concat"].dgrad(x, saved, None)
    total = sum(KERNELS["slice"].dgrad(g, s, None)[0] for g, (_, s) in zip(grads, pieces, strict=True))
    assert torch.equal(total, x)


class _Place:
    """The communicator a rest or merge asks: this rank's node and place on it."""

    def __init__(self, node: int, place: int, nodes: int = 2, per_node: int = 2):
        self.at = {"tp.inter": node, "tp.intra": place}
        self.sizes = {"tp.inter": nodes, "tp.intra": per_node}

    def index(self, axis):
        return self.at[axis]

    def size(self, axis):
        return self.sizes[axis]


@pytest.mark.parametrize(("first", "node", "place", "near"), [
    ("inter", 0, 1, [1, 3]), ("inter", 1, 0, [0, 2]), ("intra", 1, 1, [2, 3]), ("intra", 0, 0, [0, 1])])
def test_rest_and_merge_take_the_blocks_the_first_stage_did_not_bring_and_put_them_back(first, node, place, near):
    torch = pytest.importorskip("torch")
    from dhelix.interpreter.ops.handlers import KERNELS
    from dhelix.interpreter.ops.kernels import KernelCtx

    ctx = KernelCtx(comm=_Place(node, place), params={"axis": "tp", "first": first, "blocks": 4})
    x = torch.arange(4 * 3 * 2, dtype=torch.float32).reshape(12, 2)  # 4 rank blocks of 3 rows
    rest, saved = KERNELS["rest"].forward((x,), None, ctx)
    far = [b for b in range(4) if b not in near]
    assert torch.equal(rest, torch.cat([x[3 * b:3 * b + 3] for b in far]))
    mine = torch.cat([x[3 * b:3 * b + 3] for b in near])  # what the first stage brought, in rank order
    merged, merge_saved = KERNELS["merge"].forward((mine, rest), None, ctx)
    assert torch.equal(merged, x)
    back_mine, back_rest = KERNELS["merge"].dgrad(x, merge_saved, None)
    assert torch.equal(back_mine, mine) and torch.equal(back_rest, rest)
    (whole,) = KERNELS["rest"].dgrad(rest, saved, None)  # the others' rows in place, zeros elsewhere
    expected = x.clone()
    for b in near:
        expected[3 * b:3 * b + 3] = 0
    assert torch.equal(whole, expected)


@pytest.mark.parametrize(("node", "place"), [(0, 0), (1, 1), (2, 0)])
def test_three_way_stages_take_the_node_then_this_place_elsewhere_then_the_rest(node, place):
    # 3 nodes of 2: 6 rank blocks; the node's 2, this place's on the 2 other nodes, the last 2.
    torch = pytest.importorskip("torch")
    from dhelix.interpreter.ops.handlers import KERNELS
    from dhelix.interpreter.ops.kernels import KernelCtx

    comm = _Place(node, place, nodes=3, per_node=2)
    x = torch.arange(6 * 3 * 2, dtype=torch.float32).reshape(18, 2)  # 6 rank blocks of 3 rows
    block = lambda b: x[3 * b:3 * b + 3]  # noqa: E731
    # What the stages bring: AG.place (this place on every node), AG (the node-mates' blocks of every node).
    placed = torch.cat([block(n * 2 + place) for n in range(3)])
    near, saved = KERNELS["others"].forward((placed,), None, KernelCtx(comm=comm, params={"axis": "tp.inter",
                                                                                        "groups": 3}))
    across = [n * 2 + place for n in range(3) if n != node]
    assert torch.equal(near, torch.cat([block(b) for b in across]))
    (back,) = KERNELS["others"].dgrad(near, saved, None)
    assert torch.equal(back[3 * node:3 * node + 3], torch.zeros(3, 2)) and torch.equal(back.sum(), near.sum())
    mates = torch.cat([block(n * 2 + (1 - place)) for n in range(3)])
    rest, _ = KERNELS["others"].forward((mates,), None, KernelCtx(comm=comm, params={"axis": "tp.inter", "groups": 3}))
    own = torch.cat([block(node * 2 + p) for p in range(2)])
    ctx = KernelCtx(comm=comm, params={"axis": "tp", "first": "intra", "blocks": 6})
    merged, merge_saved = KERNELS["merge"].forward((own, near, rest), None, ctx)
    assert torch.equal(merged, x)
    parts = KERNELS["merge"].dgrad(x, merge_saved, None)
    assert all(torch.equal(a, b) for a, b in zip(parts, (own, near, rest), strict=True))


SINGLE = ["chunk ag1 + qkv by 2", "chunk ln2 + ag2 + fc1 + act by 4", "chunk fc1 + act + fc2 + rs2 + h2 by 2",
          "chunk prj + rs1 + h1 by 4", "chunk h1 along features by 2;chunk h2 by 2"]


@pytest.mark.parametrize("partition", SINGLE)
def test_a_chunked_layer_on_one_rank_matches_the_reference(partition):
    pytest.importorskip("torch")
    from dhelix.interpreter.ops.comm import SingleRankComm
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.verify.harness import compare, reference_with
    from dhelix.interpreter.verify.reference import make_batch
    from dhelix.interpreter.ops.weights import WeightPlan
    from distributed import TOL

    prog = program(partition, mesh="tp = 1", pipeline="one_f_one_b", fold="none", layers=2)
    assert any(op.op == "concat" for op in prog.forward.ops)
    batch = make_batch(prog, 3)
    executor = Executor(prog, SingleRankComm(), seed=7)
    loss = executor.step(batch)
    weights = WeightPlan(prog, 7)
    reference = reference_with(prog, {name: weights.full(name) for name in weights.names()}, batch, 7)
    check = compare(0, loss.item(), executor.grads(), reference)
    assert check.loss_diff <= TOL and check.grad_diff <= TOL, str(check)
