"""The cost model: FLOPs and bytes per op against NOTES §3 formulas, collective times, MFU count."""

from __future__ import annotations

import attrs
import pytest

from dhelix.dsl.core.dtypes import dtype_bytes
from dhelix.dsl.planner.costmodel import (
    collective_time, comm_bytes, megatron_flops_per_iteration, op_bytes, op_flops,
    op_tasks, op_time, optimizer_bytes_per_param, optimizer_time,
)
from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.core.mesh import Mesh
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.frontend.kernel_terms import Kernels
from dhelix.dsl.frontend.profiles import Collective, Measured, load_profile


def program(hidden=8192, ffn=28672, heads=64, kv_heads=64, seq=8192, micro_batch=4, mesh="tp = 8",
            nodes=1, layer="llama"):
    """A one-stage program: by default the DHelix demo layer of NOTES §3.9."""
    return check_text(f"""
import "stdlib/layers.dhx"
pipeline seq1 {{ repeat m {{ F }} repeat m {{ B }} }}
model demo {{
  layers = 4  hidden = {hidden}  ffn = {ffn}  heads = {heads}  kv_heads = {kv_heads}
  seq = {seq}  vocab = 32000  dtype = bf16  layer = {layer}
}}
cluster {{ nodes = {nodes}  gpus_per_node = 8  profile = "h100" }}
mesh {{ {mesh} }}
train {{ micro_batch = {micro_batch}  microbatches = 8 }}
fold none
pipeline seq1
""", "demo.dhx")


@pytest.fixture(scope="module")
def demo():
    return program()


def ops_of(prog):
    return {op.name: op for dag in (prog.forward, prog.backward) for op in dag.ops}


# The worked example of NOTES §3.9: h = 8192, f = 28672, a = 64 (MHA), b = 4, s = 8192, t = 8.
H, F, A, B, S, T = 8192, 28672, 64, 4, 8192, 8
N, KV = B * S, 2 * H  # tokens on the TP group; MHA K+V width


def test_gemm_flops_of_the_worked_example(demo):
    ops = ops_of(demo)
    gflop = {name: op_flops(ops[name], seq=S) / 1e9 for name in ("qkv", "prj", "fc1", "fc2")}
    assert gflop == pytest.approx({"qkv": 1649.3, "prj": 549.8, "fc1": 3848.3, "fc2": 1924.1}, abs=0.1)
    assert op_flops(ops["qkv"]) == 2 * N * H * (H + KV) / T  # NOTES §3.1 F3
    assert op_flops(ops["fc1"]) == 4 * N * H * F / T  # F10: gate and up fused
    assert op_flops(ops["prj"]) == 2 * N * H * H / T  # F5
    assert op_flops(ops["fc2"]) == 2 * N * H * F / T  # F12


def test_dgrad_and_wgrad_cost_what_the_forward_gemm_costs(demo):
    ops = ops_of(demo)
    for name in ("qkv", "prj", "fc1", "fc2"):
        assert op_flops(ops[f"{name}.dgrad"]) == op_flops(ops[f"{name}.wgrad"]) == op_flops(ops[name])


def test_gqa_shrinks_only_the_qkv_gemm():
    ops = ops_of(program(kv_heads=8))
    assert op_flops(ops["qkv"]) / 1e9 == pytest.approx(687.2, abs=0.1)  # NOTES §3.9, GQA g = 8
    assert op_flops(ops["fc1"]) / 1e9 == pytest.approx(3848.3, abs=0.1)


def test_attention_flops_are_causal_and_the_backward_is_2_5_times(demo):
    ops = ops_of(demo)
    forward = 4 * B * S * S * H * 0.5 / T  # NOTES §3.1 F4 with γ = 1/2
    assert op_flops(ops["att"], seq=S) == forward
    assert forward / 1e9 == pytest.approx(549.8, abs=0.1)
    assert op_flops(ops["att.bwd"], seq=S) == 2.5 * forward
    # The attention op carries the model's seq, so no override is needed.
    assert op_flops(ops["att"]) == forward


def test_bytes_of_the_worked_example(demo):
    ops = ops_of(demo)
    mb = {name: op_bytes(ops[name], "bf16", seq=S) / 1e6 for name in ("ln1", "qkv", "prj", "fc1", "act", "fc2", "h1")}
    assert mb == pytest.approx({"ln1": 134.2, "qkv": 788.5, "prj": 620.8, "fc1": 1124.1, "act": 704.6,
                                "fc2": 830.5, "h1": 201.3}, abs=0.1)
    assert op_bytes(ops["att"], "bf16") == 2 * N * (2 * H + KV) / T + 4 * B * (A / T) * S  # F4 + LSE
    assert op_bytes(ops["act.bwd"], "bf16") == 2 * 5 * N * F / T  # B5
    assert op_bytes(ops["ag1"], "bf16") == 0  # a collective moves wire bytes, not HBM bytes here


def test_tp_collectives_send_the_same_wire_bytes(demo):
    comms = [op for dag in (demo.forward, demo.backward) for op in dag.ops if op.kind == "comm"]
    assert len(comms) == 8
    for op in comms:
        assert comm_bytes(op, "bf16") == 2 * N * H * (T - 1) / T  # 469.8 MB (NOTES §3.9)
        assert op_flops(op) == 0


def test_collective_time_models_follow_notes_3_6():
    h100 = load_profile("h100")
    alpha, bw = 3e-6, 450e9
    size = 2 * N * H
    assert collective_time("all_gather", size, 8, "local", h100) == pytest.approx(7 * alpha + size * 7 / 8 / bw)
    assert collective_time("all_reduce", size, 8, "local", h100) == pytest.approx(2 * (7 * alpha + size * 7 / 8 / bw))
    assert collective_time("all_to_all", size, 4, "cross", h100) == pytest.approx(3 * 10e-6 + size * 3 / 4 / 50e9)
    assert collective_time("p2p", size, 2, "cross", h100) == pytest.approx(10e-6 + size / 50e9)
    slower = attrs.evolve(h100, collectives={**h100.collectives,
                                             "all_gather": attrs.evolve(h100.collectives["all_gather"], efficiency=0.5)})
    assert collective_time("all_gather", size, 8, "local", slower) == pytest.approx(7 * alpha + size * 7 / 8 / (bw / 2))
    # A per-lane efficiency slows only its lane.
    per_lane = attrs.evolve(h100, collectives={**h100.collectives, "p2p": Collective("p2p", lanes={"local": 0.25})})
    assert collective_time("p2p", size, 2, "local", per_lane) == pytest.approx(3e-6 + size / (bw / 4))
    assert collective_time("p2p", size, 2, "cross", per_lane) == collective_time("p2p", size, 2, "cross", h100)


def test_a_ring_across_nodes_gets_the_share_of_its_ranks_on_each_node():
    # NOTES §3.6: the cross link's bandwidth is per GPU (the node's NICs over its GPUs); a ring
    # with k ranks on each node shares the node's NICs with gpus_per_node / k equal rings.
    h100, size = load_profile("h100"), 2 * N * H
    alpha, cross, local = 10e-6, 50e9, 450e9
    assert collective_time("all_gather", size, 16, "cross", h100, per_node=8) == pytest.approx(
        15 * alpha + size * 15 / 16 / min(8 * cross, local))
    assert collective_time("reduce_scatter", size, 16, "cross", h100, per_node=2) == pytest.approx(
        15 * alpha + size * 15 / 16 / (2 * cross))
    assert collective_time("all_reduce", size, 4, "cross", h100, per_node=1) == pytest.approx(
        2 * (3 * alpha + size * 3 / 4 / cross))
    # Not for P2P (one pair), nor on a local lane.
    assert collective_time("p2p", size, 2, "cross", h100, per_node=2) == collective_time("p2p", size, 2, "cross", h100)
    assert collective_time("all_gather", size, 8, "local", h100, per_node=8) == collective_time("all_gather", size, 8, "local", h100)
    # The hierarchy of a 16-rank gather on 2 nodes: 8 inter-node gathers of S/8 over 2 ranks carry
    # S/2 per node, the flat ring 15/16 of S (both at the node's cross bandwidth).
    flat = collective_time("all_gather", size, 16, "cross", h100, per_node=8) - 15 * alpha
    inter = collective_time("all_gather", size / 8, 2, "cross", h100, per_node=1) - alpha
    assert flat / inter == pytest.approx(15 / 16 / (1 / 2))


def test_the_mesh_counts_a_group_s_ranks_on_each_node():
    mesh = Mesh(("tp", "cp", "dp", "pp"), (1, 1, 16, 1), gpus_per_node=8)
    assert mesh.per_node("dp") == 8
    assert (mesh.per_node("dp.intra"), mesh.lane("dp.intra")) == (1, "local")
    assert (mesh.per_node("dp.inter"), mesh.lane("dp.inter")) == (1, "cross")
    wide = Mesh(("tp", "cp", "dp", "pp"), (4, 1, 16, 1), gpus_per_node=8)
    assert (wide.per_node("tp"), wide.per_node("dp")) == (1, 2)
    inside = Mesh(("tp", "cp", "dp", "pp"), (8, 1, 2, 1), gpus_per_node=8)
    assert (inside.per_node("tp"), inside.per_node("dp")) == (1, 1)


def test_op_time_is_a_roofline(demo):
    # The roofline alone: the profile's per-kernel terms (tests/test_kernel_terms.py) left out.
    h100 = attrs.evolve(load_profile("h100"), kernels=Kernels())
    ops, achieved = ops_of(demo), h100.achieved
    assert op_time(ops["fc1"], h100, "bf16") == pytest.approx(op_flops(ops["fc1"]) / (989.4e12 * achieved["gemm"]))
    assert op_time(ops["ln1"], h100, "bf16") == pytest.approx(op_bytes(ops["ln1"], "bf16") / (3350e9 * achieved["norm"]))
    assert op_time(ops["ag1"], h100, "bf16") == collective_time("all_gather", 2 * N * H, 8, "local", h100)
    fp8 = achieved.get("gemm_fp8", achieved["gemm"])
    assert op_time(ops["fc1"], h100, "fp8") == pytest.approx(op_flops(ops["fc1"]) / (1978.9e12 * fp8), rel=1e-3)
    # Under fp8 only GEMMs run in fp8: a norm streams bf16 elements, a gather sends them.
    assert op_time(ops["ln1"], h100, "fp8") == op_time(ops["ln1"], h100, "bf16")
    assert op_time(ops["ag1"], h100, "fp8") == op_time(ops["ag1"], h100, "bf16")


def test_measured_op_times_replace_the_model(demo):
    ops = ops_of(demo)
    h100 = attrs.evolve(load_profile("h100"), measured=Measured("bf16", ops={"fc1": 5000.0}))
    assert op_time(ops["fc1"], h100, "bf16") == pytest.approx(5e-3)
    assert op_time(ops["fc1"], h100, "fp16") != pytest.approx(5e-3)  # measured for bf16 only


def test_ring_attention_splits_flops_over_its_steps_and_passes_kv_blocks():
    prog = program(hidden=4096, ffn=14336, heads=32, kv_heads=8, seq=16384, micro_batch=1,
                   mesh="tp = 8  cp = 2", nodes=2)
    ops = ops_of(prog)
    tokens, seq, cp = 16384 // 2, 16384, 2
    local_heads, head_dim, kv_local = 32 // 8, 128, 2 * (8 // 8) * 128
    total = 4 * tokens * seq * local_heads * head_dim * 0.5  # NOTES §3.3: 4·b·(s/c)·s·h·γ/t
    forward = [ops["att.step0"], ops["att"]]
    backward = [ops["att.bwd.step0"], ops["att.bwd.step1"], ops["att.bwd"]]
    assert [op.kind for op in forward] == ["comm", "compute"]
    assert sum(op_flops(op, seq=seq) for op in forward) == pytest.approx(total)
    assert sum(op_flops(op, seq=seq) for op in backward) == pytest.approx(2.5 * total)
    block = 2 * tokens * kv_local  # β·N·kv/t
    assert comm_bytes(ops["att.step0"], "bf16") == block  # forward: (c-1) blocks in all
    assert sum(comm_bytes(op, "bf16") for op in backward) == 2 * (cp - 1) * block  # KV and dKV
    assert ops["att.step0"].lane == "cross"
    lanes = [task.lane for task in op_tasks(ops["att.step0"], load_profile("h100"), "bf16", seq=seq)]
    assert lanes == ["compute", "cross"]  # a carrying step computes while it passes KV


def test_ring_step_time_overlaps_its_compute_and_p2p_with_the_slowdown():
    prog = program(hidden=4096, ffn=14336, heads=32, kv_heads=8, seq=16384, micro_batch=1,
                   mesh="tp = 8  cp = 2", nodes=2)
    step, h100 = ops_of(prog)["att.step0"], load_profile("h100")
    compute, p2p = (t.seconds for t in op_tasks(step, h100, "bf16"))
    assert op_time(step, h100, "bf16") == pytest.approx(compute + p2p - 0.75 * min(compute, p2p))


def test_megatron_flops_match_the_gpt3_closed_form():
    # Narayanan et al. (SC'21): 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) without recomputation.
    prog = check_text("""
import "stdlib/layers.dhx"
pipeline seq1 { repeat m { F } repeat m { B } }
model gpt3 { layers = 96  hidden = 12288  ffn = 49152  heads = 96  seq = 2048  vocab = 51200
             dtype = bf16  layer = gpt }
cluster { nodes = 1  gpus_per_node = 8 }
mesh { tp = 8 }
train { micro_batch = 1  microbatches = 8 }
fold none
pipeline seq1
""", "gpt3.dhx")
    b, s, l, h, v = 1536, 2048, 96, 12288, 51200
    expected = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert megatron_flops_per_iteration(prog.model, b) == pytest.approx(expected, rel=1e-12)


def test_megatron_flops_count_swiglu_and_gqa():
    model = program(kv_heads=8).model
    b, s, l, h, f, a, g, v = 16, 8192, 4, 8192, 28672, 64, 8, 32000
    expected = 12 * b * s * l * h * h * ((1 + g / a + s / h) + f / h * 1.5 + v / (2 * l * h))
    assert megatron_flops_per_iteration(model, b) == pytest.approx(expected, rel=1e-12)
    assert megatron_flops_per_iteration(model, b, swiglu=False) < expected


def test_unknown_dtype_is_a_user_error():
    with pytest.raises(DhelixError, match="unknown dtype 'bf8'"):
        dtype_bytes("bf8")


def _table1():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "table1_volumes.py"
    spec = importlib.util.spec_from_file_location("table1_volumes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.table1_rows()


def test_table1_communication_volumes_of_llama_405b():
    dp64, dp128, cp16 = _table1()
    gib = 2 ** 30
    # Intra-node: the printed "GB" are GiB; row 3 forgot to divide the tokens by CP = 16.
    assert dp64["intra_bytes"] / gib == pytest.approx(441.0, rel=1e-3)
    assert dp128["intra_bytes"] / gib == pytest.approx(220, rel=5e-3)
    assert cp16["intra_bytes"] / gib == pytest.approx(3528 / 16, rel=1e-3)
    # Cross-node: DP reduce-scatter + PP sends (approximate); ring P2P with MHA-size K/V.
    assert dp64["cross_bytes"] / 1e9 == pytest.approx(8.6, rel=0.05)
    assert dp128["cross_bytes"] / 1e9 == pytest.approx(7.7, rel=0.05)
    assert cp16["cross_bytes"] / 1e9 == pytest.approx(376, rel=0.02)
    # Times: the paper divides GiB by 450 (7 % apart from GB/s); row 2's 0.3 s is a misprint.
    assert dp64["intra_model_s"] == pytest.approx(0.98, rel=0.15)
    assert dp64["intra_bw_s"] == pytest.approx(441 * gib / 450e9)
    assert dp128["intra_model_s"] == pytest.approx(0.49, rel=0.15)
    for row in (dp64, dp128, cp16):
        assert row["cross_model_s"] == pytest.approx(row["cross_s"], rel=0.1)


def test_the_optimizer_streams_at_the_measured_rate_when_the_profile_has_one():
    a40 = load_profile("a40")
    # fp32: gradient, weight, two moments (read + write each but the gradient): 28 bytes; bf16: 28 too
    # (fp32 master and moments 24, bf16 gradient read 2, rounded weight write 2).
    assert optimizer_bytes_per_param("fp32") == 28 and optimizer_bytes_per_param("bf16") == 28
    modelled = optimizer_time(1e9, "bf16", a40)
    assert modelled == pytest.approx(28e9 / (a40.hbm_gbps * 1e9 * a40.achieved["activation"]))
    measured = attrs.evolve(a40, optimizer_gbps=7.0)
    assert optimizer_time(1e9, "bf16", measured) == pytest.approx(4.0)


def test_an_all_to_all_across_nodes_sends_only_its_remote_peers_bytes_over_the_nic():
    # A GPU sends S/g to each peer: the g - k peers on other nodes over its own NIC share
    # (every GPU of the node sends at once, so no ring-style pooling of the node's NICs), the
    # k - 1 on its node over NVLink at the same time; the slower set bounds the time.
    h100, size = load_profile("h100"), 2 * N * H
    alpha, cross, local = 10e-6, 50e9, 450e9
    assert collective_time("all_to_all", size, 16, "cross", h100, per_node=8) == pytest.approx(
        15 * alpha + max(size * 8 / 16 / cross, size * 7 / 16 / local))
    # One rank per node: every peer is remote, the flat pairwise model.
    assert collective_time("all_to_all", size, 4, "cross", h100, per_node=1) == pytest.approx(
        3 * alpha + size * 3 / 4 / cross)
    # A slow local link (PCIe) can be the bound.
    slow = attrs.evolve(h100, links={**h100.links, "local": attrs.evolve(h100.links["local"], bw_gbps=5.0)})
    assert collective_time("all_to_all", size, 16, "cross", slow, per_node=8) == pytest.approx(
        15 * alpha + size * 7 / 16 / 5e9)


def test_gpt_layer_attends_with_its_kv_heads():
    # Nemotron-4 is a GPT layer (LayerNorm, a plain MLP) with grouped-query attention: its QKV
    # GEMM is (heads + 2·kv_heads)·head_dim wide and its attention reads kv_heads/tp K/V heads;
    # without kv_heads the layer is GPT-3's multi-head one (3·heads·head_dim).
    gqa = ops_of(program(heads=64, kv_heads=8, layer="gpt"))
    assert gqa["qkv"].weight[-1] == (64 + 2 * 8) * 128 // 8
    assert dict(gqa["att"].params)["kv_heads"] == 1
    mha = ops_of(program(heads=64, kv_heads=64, layer="gpt"))
    assert mha["qkv"].weight[-1] == 3 * 64 * 128 // 8
    assert op_flops(gqa["qkv"]) < op_flops(mha["qkv"])
