"""The derived backward DAG: the paper's operator counts, transposed collectives, order."""

from __future__ import annotations

import pytest

from dhelix.dsl.core.program import GradFlow
from dhelix.dsl.passes.pipeline import check_text

TRANSPOSE = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_to_all": "all_to_all"}


def program(layer: str, mesh: str, extra: str = "", gpus: int = 8, nodes: int = 1) -> str:
    return f"""
import "stdlib/layers.dhx"
model m {{
  layers = 4  hidden = 1024  ffn = 4096  heads = 16  kv_heads = 8  seq = 4096  vocab = 32000
  experts = 8  top_k = 2  dtype = bf16  layer = {layer} {extra}
}}
cluster {{ nodes = {nodes}  gpus_per_node = {gpus} }}
mesh {{ {mesh} }}
train {{ micro_batch = 1  microbatches = 8 }}
pipeline p
pipeline p {{ repeat m {{ F }} repeat m {{ B }} }}
"""


def dags(layer="llama", mesh="tp = 8", **kw):
    prog = check_text(program(layer, mesh, **kw), "t.dhx")
    return prog.forward, prog.backward


def test_llama_tp_sp_has_the_papers_14_forward_and_18_backward_operators():
    fwd, bwd = dags()
    assert len(fwd.ops) == 14
    assert len(bwd.ops) == 18
    assert [op.kind for op in fwd.ops].count("comm") == 4
    assert [op.kind for op in bwd.ops].count("comm") == 4  # the gathered input is saved: no re-gather


def test_backward_comm_ops_are_transposes_of_forward_ones():
    for layer, mesh, nodes in (("llama", "tp = 8", 1), ("gpt", "tp = 4  dp = 2", 1), ("moe", "tp = 2  dp = 4  ep = 4", 2)):
        fwd, bwd = dags(layer, mesh, nodes=nodes, gpus=8 // nodes)
        comms = [op for op in bwd.ops if op.kind == "comm"]
        assert comms, layer
        for op in comms:
            source = fwd.op(op.forward)
            assert op.op == TRANSPOSE[source.op]
            assert (op.axis, op.group_size, op.lane) == (source.axis, source.group_size, source.lane)
            assert op.shape == source.in_shapes[0]  # the gradient has the forward input's shape
        assert len(comms) == sum(op.kind == "comm" for op in fwd.ops)


def test_every_weighted_op_gets_dgrad_and_a_movable_wgrad():
    fwd, bwd = dags("moe", "tp = 2  dp = 4  ep = 4")
    names = {op.name: op for op in bwd.ops}
    for op in fwd.ops:
        if op.weight and op.op in ("gemm", "grouped_gemm", "router"):
            assert names[f"{op.name}.dgrad"].shape == op.in_shapes[0]
            wgrad = names[f"{op.name}.wgrad"]
            assert wgrad.movable and wgrad.shape == op.weight and wgrad.saved == (op.inputs[0],)


@pytest.mark.parametrize("layer", ["llama", "gpt", "moe"])
def test_backward_is_in_topological_order_and_reaches_the_layer_input(layer):
    fwd, bwd = dags(layer, "tp = 2  dp = 4  ep = 4")
    seen = {bwd.input}
    for op in bwd.ops:
        assert set(op.inputs) <= seen, op.name
        seen.add(op.name)
    assert bwd.output == "ln1.bwd"
    assert bwd.op(bwd.output).shape == fwd.input_shape


def test_residual_gradient_sum_is_fused_into_the_norm_backward():
    _, bwd = dags()
    assert bwd.op("ln2.bwd").inputs == ("ag2.bwd", "h2.bwd")
    assert bwd.op("ln1.bwd").inputs == ("ag1.bwd", "h1.bwd")
    assert bwd.op("h1.bwd").inputs == ("ln2.bwd",)


def test_ring_attention_has_cp_forward_and_cp_plus_one_backward_steps():
    fwd, bwd = dags(mesh="tp = 4  cp = 2", gpus=4, nodes=2)
    assert [op.name for op in fwd.ops if op.name.startswith("att")] == ["att.step0", "att"]
    assert [op.name for op in bwd.ops if op.name.startswith("att.")] == ["att.bwd.step0", "att.bwd.step1", "att.bwd"]
    assert fwd.op("att.step0").kind == "comm" and fwd.op("att.step0").lane == "cross"
    assert bwd.op("att.bwd.step1").lane == "cross" and bwd.op("att.bwd").kind == "compute"


def test_collectives_over_a_size_one_axis_are_elided():
    fwd, bwd = dags(mesh="dp = 8")
    assert fwd.elided == ("ag1", "rs1", "ag2", "rs2")
    assert not any(op.kind == "comm" for op in fwd.ops + bwd.ops)
    assert fwd.op("qkv").inputs == ("ln1",)


def test_lanes_follow_the_node_boundary():
    fwd, _ = dags(mesh="tp = 4  dp = 2", gpus=2, nodes=4)  # a TP group spans two nodes
    assert {op.lane for op in fwd.ops if op.kind == "comm"} == {"cross"}
    fwd, _ = dags(mesh="tp = 2  dp = 4", gpus=2, nodes=4)
    assert {op.lane for op in fwd.ops if op.kind == "comm"} == {"local"}


def test_gradient_flow_is_recorded_per_backward_op():
    _, bwd = dags()
    flow = {op.name: op.grad for op in bwd.ops}
    assert flow["h2.bwd"] == GradFlow(upstream="dh2", produces=("rs2", "h1"))
    assert flow["rs2.bwd"] == GradFlow(upstream="h2.bwd", produces=("fc2",))
    assert flow["fc2.dgrad"] == GradFlow(upstream="rs2.bwd", produces=("act",))
    assert flow["fc2.wgrad"] == GradFlow(upstream="rs2.bwd", weight="fc2")  # no input gradient
    # The residual's two contributions are summed in the norm backward, which owns the weight too.
    assert flow["ln1.bwd"] == GradFlow(upstream="ag1.bwd", produces=("x",), accumulates=(("x", ("h1.bwd",)),),
                                       weight="ln1")


@pytest.mark.parametrize("layer", ["llama", "gpt", "moe"])
def test_gradient_flow_agrees_with_the_dag(layer):
    fwd, bwd = dags(layer, "tp = 2  dp = 4  ep = 4")
    readers = {}
    for op in fwd.ops:
        for value in dict.fromkeys(op.inputs):
            readers.setdefault(value, []).append(op)
    producers = {}
    for op in bwd.ops:
        assert op.grad.upstream in op.inputs + (None,), op.name
        for value in op.grad.produces:
            producers.setdefault(value, []).append(op.name)
        for value, others in op.grad.accumulates:
            assert value in op.grad.produces and set(others) <= set(op.inputs), op.name
    for value, names in producers.items():
        # One contribution per differentiable reader; the first reader's backward (last to run) sums them.
        assert len(names) == len([r for r in readers[value] if not (r.op == "permute" and r.inputs[0] != value)])
        if len(names) > 1:
            summing = bwd.op(names[-1]).grad.accumulates
            assert (value, tuple(names[:-1])) in summing
    weighted = {op.grad.weight for op in bwd.ops if op.grad.weight}
    assert weighted == {op.name for op in fwd.ops if op.weight}


def test_permute_gives_no_gradient_to_the_scores_and_unpermute_does():
    _, bwd = dags("moe", "tp = 2  dp = 4  ep = 4", nodes=2, gpus=4)
    assert bwd.op("pm.bwd").grad.produces == ("ln2",)
    assert bwd.op("up.bwd").grad.produces == ("cmb", "rt")
    assert bwd.op("rt.dgrad").grad.accumulates == (("ln2", ("pm.bwd",)),)


def test_ring_backward_steps_pass_the_ring_on_and_the_last_gives_qkv_its_gradient():
    _, bwd = dags(mesh="tp = 4  cp = 2", gpus=4, nodes=2)
    assert bwd.op("att.bwd.step0").grad == GradFlow(upstream="prj.dgrad")
    assert bwd.op("att.bwd.step1").grad == GradFlow(upstream="att.bwd.step0")
    assert bwd.op("att.bwd").grad == GradFlow(upstream="att.bwd.step1", produces=("qkv",))
