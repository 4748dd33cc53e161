"""Layer execution against the single-process autograd reference: one process at tp = 1,
and two gloo ranks at tp = 2 with sequence parallelism (fp32, max abs diff <= 1e-5)."""

from __future__ import annotations

import attrs
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from distributed import assert_close, drive_layer, join, run_ranks  # noqa: E402
from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.interpreter.ops.comm import AXES, DistComm, SingleRankComm  # noqa: E402
from dhelix.interpreter.execute.layer_exec import LayerPlan, LayerRun  # noqa: E402
from dhelix.interpreter.execute.sequential import sequential_step, sum_partial_grads  # noqa: E402
from dhelix.interpreter.verify.reference import make_batch, reference_layer, reference_step  # noqa: E402
from dhelix.interpreter.ops.weights import WeightPlan, param_name  # noqa: E402

LAYERS = ("llama", "gpt", "moe")
SEED, DATA_SEED, MICRO_BATCH = 11, 5, 2


def program(layer: str, tp: int = 1, extra: str = ""):
    return check_text(f"""
import "stdlib/layers.dhx"
model m {{ layers = 2  hidden = 32  ffn = 64  heads = 4  kv_heads = 2  seq = 8  vocab = 64
  experts = 4  top_k = 2  dtype = fp32  layer = {layer} {extra} }}
cluster {{ nodes = 1  gpus_per_node = {tp} }}
mesh {{ tp = {tp} }}
train {{ micro_batch = {MICRO_BATCH}  microbatches = 2 }}
pipeline p
pipeline p {{ repeat m {{ F }} repeat m {{ B }} }}
""", "t.dhx")


def layer_io(plan: WeightPlan):
    """The full layer input and output gradient (tokens in (batch, seq) order)."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    tokens, hidden = MICRO_BATCH * plan.program.model.get("seq"), plan.program.model.get("hidden")
    return torch.randn(tokens, hidden, generator=gen), 0.1 * torch.randn(tokens, hidden, generator=gen)


def reference_layer_grads(plan: WeightPlan, layer: int = 0):
    """Output, input gradient and weight gradients (by op) of the autograd reference."""
    x, dout = layer_io(plan)
    weights = {op: plan.full(param_name(layer, op)).requires_grad_(True) for op in plan.layer_specs}
    x.requires_grad_(True)
    out = reference_layer(plan.full_forward, weights, x, MICRO_BATCH)
    out.backward(dout)
    return out.detach(), x.grad, {op: w.grad for op, w in weights.items()}


def run_layer(plan, layer_plan, comm, index, async_comm=False, backward_order=None):
    x, dout = layer_io(plan)
    tp = plan.program.mesh.size("tp")
    x, dout = x.chunk(tp)[index["tp"]], dout.chunk(tp)[index["tp"]]  # this rank's SP rows
    return drive_layer(layer_plan, plan.layer_weights(0, index), comm, x, dout, async_comm, backward_order)


# -- one process ---------------------------------------------------------------------------

@pytest.mark.parametrize("layer", LAYERS)
def test_layer_matches_autograd_reference(layer):
    plan = WeightPlan(program(layer), SEED)
    layer_plan = LayerPlan.build(plan.program.forward, plan.program.backward, MICRO_BATCH)
    out, dx, grads, run = run_layer(plan, layer_plan, SingleRankComm(), {"tp": 0})
    want_out, want_dx, want_grads = reference_layer_grads(plan)
    assert_close(out, want_out, "output")
    assert_close(dx, want_dx, "input gradient")
    assert set(grads) == set(want_grads)
    for op, grad in grads.items():
        assert_close(grad, want_grads[op], f"gradient of {op}")
    # Everything the backward needed has been released.
    assert not run.saved and set(run.bgrads) == {layer_plan.bwd.output}


@pytest.mark.parametrize("layer", LAYERS)
def test_heads_narrower_or_wider_than_hidden_over_heads_match_the_reference(layer):
    # head_dim set apart from hidden / heads (8 here), as Qwen3 and GPT-OSS do: q, k, v and the
    # attention output are heads * head_dim wide, the projection takes them back to hidden.
    for head_dim in (4, 16):
        plan = WeightPlan(program(layer, extra=f"head_dim = {head_dim}"), SEED)
        qkv = next(op for op in plan.program.forward.ops if op.name == "qkv")
        assert qkv.shape[1] == (4 + 2 * 2) * head_dim  # 4 heads, 2 KV heads (gpt attends with kv_heads too)
        layer_plan = LayerPlan.build(plan.program.forward, plan.program.backward, MICRO_BATCH)
        out, dx, grads, _ = run_layer(plan, layer_plan, SingleRankComm(), {"tp": 0})
        want_out, want_dx, want_grads = reference_layer_grads(plan)
        assert_close(out, want_out, "output")
        assert_close(dx, want_dx, "input gradient")
        for op, grad in grads.items():
            assert_close(grad, want_grads[op], f"gradient of {op}")


@pytest.mark.parametrize("layer", ["llama", "moe"])
def test_moving_every_wgrad_to_the_end_changes_nothing(layer):
    plan = WeightPlan(program(layer), SEED)
    layer_plan = LayerPlan.build(plan.program.forward, plan.program.backward, MICRO_BATCH)
    ops = layer_plan.bwd.ops
    moved = [op for op in ops if not op.movable] + [op for op in ops if op.movable]
    assert moved != list(ops)
    _, dx, grads, _ = run_layer(plan, layer_plan, SingleRankComm(), {"tp": 0})
    _, moved_dx, moved_grads, _ = run_layer(plan, layer_plan, SingleRankComm(), {"tp": 0}, backward_order=moved)
    assert moved_dx.equal(dx)
    assert all(moved_grads[op].equal(grad) for op, grad in grads.items())


def test_micro_batches_accumulate_weight_gradients():
    plan = WeightPlan(program("llama"), SEED)
    layer_plan = LayerPlan.build(plan.program.forward, plan.program.backward, MICRO_BATCH)
    x, dout = layer_io(plan)
    grads: dict = {}
    for _ in range(2):
        run = LayerRun(layer_plan, plan.layer_weights(0, {}), SingleRankComm(), grads)
        run.forward(x)
        run.backward(dout)
    _, _, once = reference_layer_grads(plan)
    assert_close(grads["qkv"], 2 * once["qkv"], "twice the qkv gradient")


def test_the_runtime_follows_the_gradient_flow_autodiff_recorded():
    prog = program("llama")
    fwd, bwd = prog.forward, prog.backward

    def changed(name, **fields):
        return attrs.evolve(bwd, ops=tuple(attrs.evolve(op, **fields) if op.name == name else op for op in bwd.ops))

    with pytest.raises(ValueError, match="fc2.wgrad has no gradient flow"):
        LayerPlan.build(fwd, changed("fc2.wgrad", grad=None), MICRO_BATCH)
    # A wgrad whose record names no weight computes none: the runtime does not guess it.
    flow = attrs.evolve(bwd.op("fc2.wgrad").grad, weight=None)
    plan = WeightPlan(prog, SEED)
    layer_plan = LayerPlan.build(fwd, changed("fc2.wgrad", grad=flow), MICRO_BATCH)
    _, _, grads, _ = run_layer(plan, layer_plan, SingleRankComm(), {"tp": 0})
    assert "fc2" not in grads and "fc1" in grads


@pytest.mark.parametrize("layer", LAYERS)
def test_whole_model_step_matches_reference_step(layer):
    prog = program(layer)
    batch = make_batch(prog, DATA_SEED)
    loss, grads = sequential_step(prog, batch, SingleRankComm(), seed=SEED)
    want_loss, want_grads = reference_step(prog, batch, seed=SEED)
    assert_close(loss, want_loss, "loss")
    assert set(grads) == set(want_grads)
    for name, grad in grads.items():
        assert_close(grad, want_grads[name], f"gradient of {name}")


# -- two gloo ranks, tp = 2 with sequence parallelism -----------------------------------------

def _tp2_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    join(rank, world, port)
    try:
        results = {}
        for layer in LAYERS:
            prog = program(layer, tp=2)
            comm = DistComm(prog.mesh)
            plan = WeightPlan(prog, SEED)
            index = {axis: comm.index(axis) for axis in AXES}
            layer_plan = LayerPlan.build(prog.forward, prog.backward, MICRO_BATCH)
            out, dx, grads, _ = run_layer(plan, layer_plan, comm, index)
            async_out, async_dx, _, _ = run_layer(plan, layer_plan, comm, index, async_comm=True)
            loss, model_grads = sequential_step(prog, make_batch(prog, DATA_SEED), comm, plan)
            summed = {name: grad.clone() for name, grad in model_grads.items()}
            sum_partial_grads(plan, summed, comm)
            results[layer] = dict(out=out, dx=dx, grads=grads, async_out=async_out, async_dx=async_dx,
                                  loss=loss, model_grads=model_grads, summed=summed)
        comm = DistComm(program("llama", tp=2).mesh)
        sent = torch.full((3,), float(rank))
        pending = comm.recv((3,), torch.float32, comm.peer("tp", -1), async_op=True)
        comm.send(sent, comm.peer("tp", 1), async_op=True).wait()
        results["received"] = pending.wait()
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def assemble(plan: WeightPlan, name: str, pieces: list) -> torch.Tensor:
    """The full gradient of ``name`` from the tp ranks' pieces."""
    spec = plan.spec(name)
    if spec.axis == "tp":
        return plan.join(name, pieces)
    if "tp" in spec.grad_sum:
        return sum(pieces)
    assert_close(pieces[0], pieces[1], f"replicated gradient of {name} on both ranks")
    return pieces[0]


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tp2")
    run_ranks(_tp2_worker, 2, str(out_dir))
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("layer", LAYERS)
def test_tp2_sp_layer_matches_reference(tp2_results, layer):
    ranks = [result[layer] for result in tp2_results]
    plan = WeightPlan(program(layer, tp=2), SEED)
    want_out, want_dx, want_grads = reference_layer_grads(plan)
    assert_close(torch.cat([r["out"] for r in ranks]), want_out, "gathered output")
    assert_close(torch.cat([r["dx"] for r in ranks]), want_dx, "gathered input gradient")
    for r in ranks:
        assert r["async_out"].equal(r["out"]) and r["async_dx"].equal(r["dx"])
    for op in plan.layer_specs:
        got = assemble(plan, param_name(0, op), [r["grads"][op] for r in ranks])
        assert_close(got, want_grads[op], f"gradient of {op}")


@pytest.mark.parametrize("layer", LAYERS)
def test_tp2_sp_model_step_matches_reference_step(tp2_results, layer):
    ranks = [result[layer] for result in tp2_results]
    prog = program(layer, tp=2)
    plan = WeightPlan(prog, SEED)
    want_loss, want_grads = reference_step(prog, make_batch(prog, DATA_SEED), seed=SEED)
    for r in ranks:
        assert_close(r["loss"], want_loss, "loss")
    for name in plan.names():
        got = assemble(plan, name, [r["model_grads"][name] for r in ranks])
        assert_close(got, want_grads[name], f"gradient of {name}")
        if "tp" in plan.spec(name).grad_sum:  # sum_partial_grads completes them on every rank
            for r in ranks:
                assert_close(r["summed"][name], want_grads[name], f"summed gradient of {name}")


def test_tp2_send_recv_pass_around_the_ring(tp2_results):
    assert [r["received"].tolist() for r in tp2_results] == [[1.0] * 3, [0.0] * 3]
