"""Kernels: explicit backward formulas against autograd, the dispatch table, weight
layout and seeding, the single-rank communicator."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from dhelix.dsl.core.dtypes import DTYPES as DSL_DTYPES  # noqa: E402
from dhelix.dsl.core.oplib import OPS, SPLIT_OPS, base_kind, part_of  # noqa: E402
from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.interpreter.ops import handlers as h, kernels as k  # noqa: E402
from dhelix.interpreter.ops.comm import Pending, SingleRankComm, resolve  # noqa: E402
from dhelix.interpreter.ops.weights import (  # noqa: E402
    DTYPES, EMBEDDING, LM_HEAD, ShardSpec, ShardingError, WeightPlan, param_name, param_seed, torch_dtype)

TOL = 1e-10  # float64: the explicit formulas must agree with autograd to rounding


def program_text(layer: str = "llama", tp: int = 1, hidden: int = 32, vocab: int = 64) -> str:
    return f"""
import "stdlib/layers.dhx"
model m {{ layers = 2  hidden = {hidden}  ffn = 64  heads = 4  kv_heads = 2  seq = 8  vocab = {vocab}
  experts = 4  top_k = 2  dtype = fp32  layer = {layer} }}
cluster {{ nodes = 1  gpus_per_node = {tp} }}
mesh {{ tp = {tp} }}
train {{ micro_batch = 2  microbatches = 2 }}
pipeline p
pipeline p {{ repeat m {{ F }} repeat m {{ B }} }}
"""


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def check_against_autograd(name, inputs, weight, ctx, differentiable, seed=99):
    """Compare a kernel's dgrad/wgrad with autograd through its own forward."""
    kernel = h.KERNELS[name]
    out, saved = kernel.forward(inputs, weight, ctx)
    grad = randn(*out.shape, seed=seed)
    leaves = [x.clone().requires_grad_(i in differentiable) for i, x in enumerate(inputs)]
    wleaf = weight.clone().requires_grad_(True) if weight is not None else None
    again, _ = kernel.forward(leaves, wleaf, ctx)
    wanted = [leaves[i] for i in differentiable] + ([wleaf] if kernel.wgrad else [])
    expected = torch.autograd.grad(again, wanted, grad)
    got = kernel.dgrad(grad, saved, weight)
    assert len(got) == len(inputs)
    for i in range(len(inputs)):
        if i in differentiable:
            assert (got[i] - expected[differentiable.index(i)]).abs().max() < TOL, f"{name} dgrad {i}"
        else:
            assert got[i] is None, f"{name} input {i} gets no gradient"
    if kernel.wgrad:
        assert (kernel.wgrad(grad, saved) - expected[-1]).abs().max() < TOL, f"{name} wgrad"
    return out


@pytest.mark.parametrize("name, weight", [
    ("rmsnorm", lambda: 1 + 0.1 * randn(16, seed=1)),
    ("layernorm", lambda: torch.stack((1 + 0.1 * randn(16, seed=1), 0.1 * randn(16, seed=2)))),
    ("gemm", lambda: randn(16, 24, seed=1)),
    ("router", lambda: randn(16, 4, seed=1)),
    ("swiglu", lambda: None),
    ("gelu", lambda: None),
])
def test_elementwise_and_gemm_kernels_match_autograd(name, weight):
    check_against_autograd(name, [randn(12, 16)], weight(), k.KernelCtx(), [0])


def test_add_fans_the_gradient_out_to_both_operands():
    check_against_autograd("add", [randn(6, 8), randn(6, 8, seed=1)], None, k.KernelCtx(), [0, 1])


def test_rmsnorm_forward_is_torchs():
    x, w = randn(5, 16), randn(16, seed=1)
    out, _ = h.KERNELS["rmsnorm"].forward([x], w, k.KernelCtx())
    assert (out - F.rms_norm(x, (16,), w, eps=k.EPS)).abs().max() < TOL


@pytest.mark.parametrize("heads, kv_heads, mask", [(4, 2, "causal"), (4, 4, "causal"), (2, 1, "full")])
def test_attention_backward_and_gqa_layout(heads, kv_heads, mask):
    d, micro_batch, seq = 8, 2, 6
    qkv = randn(micro_batch * seq, (heads + 2 * kv_heads) * d)
    ctx = k.KernelCtx(micro_batch=micro_batch, params={"heads": heads, "kv_heads": kv_heads, "mask": mask})
    out = check_against_autograd("attention", [qkv], None, ctx, [0])
    # Token 0 of sequence 1 under a causal mask sees only itself: its output is its v rows.
    if mask == "causal":
        v = qkv[seq, (heads + kv_heads) * d:].reshape(kv_heads, d)
        expected = v.repeat_interleave(heads // kv_heads, dim=0).reshape(-1)
        assert (out[seq] - expected).abs().max() < TOL


LLAMA3_SCALING = {"rope_factor": 8, "rope_low_freq": 1, "rope_high_freq": 4, "rope_original": 16}


@pytest.mark.parametrize("heads, kv_heads, scaling", [(4, 2, {}), (2, 2, {}), (4, 2, LLAMA3_SCALING)])
def test_rotary_attention_matches_the_reference_and_autograd(heads, kv_heads, scaling):
    from dhelix.interpreter.verify.reference import _attention

    d, micro_batch, seq, theta = 16, 2, 6, 500000
    qkv = randn(micro_batch * seq, (heads + 2 * kv_heads) * d)
    params = {"heads": heads, "kv_heads": kv_heads, "mask": "causal", "rope": theta, **scaling}
    out = check_against_autograd("attention", [qkv], None, k.KernelCtx(micro_batch=micro_batch, params=params), [0])
    # The kernel's cos/sin tables are fp32 (as Hugging Face computes them), the reference's fp64.
    assert (out - _attention(qkv, params, micro_batch)).abs().max() < 1e-6
    plain = h.KERNELS["attention"].forward([qkv], None, k.KernelCtx(micro_batch=micro_batch, params={
        **params, "rope": None}))[0]
    # Position 0 is not turned, so each sequence's first token attends as without RoPE; later ones differ.
    assert (out[::seq] - plain[::seq]).abs().max() < TOL
    assert (out - plain).abs().max() > 1e-3


def test_norm_epsilon_comes_from_inv_eps():
    x, w = randn(6, 16) * 1e-3, 1 + 0.1 * randn(16, seed=1)
    out, _ = h.KERNELS["rmsnorm"].forward([x], w, k.KernelCtx(params={"inv_eps": 1000000}))
    assert (out - F.rms_norm(x, (16,), w, eps=1e-6)).abs().max() < TOL
    assert (out - F.rms_norm(x, (16,), w, eps=1e-5)).abs().max() > 1e-3


def test_grouped_gemm_uses_the_routing_counts():
    x, w = randn(10, 6), randn(3, 6, 5, seed=1)
    ctx = k.KernelCtx(routing={"counts": [4, 0, 6]})
    out = check_against_autograd("grouped_gemm", [x], w, ctx, [0])
    assert (out[4:] - x[4:] @ w[2]).abs().max() < TOL
    with pytest.raises(RuntimeError, match="a permute must run first"):
        h.KERNELS["grouped_gemm"].forward([x], w, k.KernelCtx())


def test_permute_and_unpermute_route_by_top_k_and_differentiate_the_scores():
    tokens, experts, top_k = 7, 4, 2
    x = randn(tokens, 5)
    scores = torch.softmax(randn(tokens, experts, seed=1), dim=-1)
    ctx = k.KernelCtx(params={"top_k": top_k})
    routed = check_against_autograd("permute", [x, scores], None, ctx, [0])
    assert sum(ctx.routing["counts"]) == tokens * top_k
    chosen = scores.topk(top_k, dim=-1).indices
    first = int(chosen.reshape(-1).min())
    assert (routed[0] - x[(chosen == first).any(-1).nonzero()[0, 0]]).abs().max() == 0  # grouped by expert
    combined = check_against_autograd("unpermute", [routed, scores], None, ctx, [0, 1])
    # Unpermuting the permuted tokens weighs each token by its top-k probability mass.
    mass = scores.topk(top_k, dim=-1).values.sum(-1, keepdim=True)
    assert (combined - x * mass).abs().max() < TOL


def test_vocab_parallel_embedding_shard_zeroes_foreign_ids():
    weight = randn(8, 4)
    ids = torch.tensor([3, 9, 12, 15, 0])
    ctx = k.KernelCtx(vocab_start=8)  # this shard holds ids 8..15
    out, saved = h.KERNELS["embedding"].forward((ids,), weight, ctx)
    assert (out[0] == 0).all() and (out[4] == 0).all()
    assert (out[1] - weight[1]).abs().max() == 0
    grad = randn(5, 4, seed=3)
    wgrad = h.KERNELS["embedding"].wgrad(grad, saved)
    assert (wgrad[1] - grad[1]).abs().max() == 0 and (wgrad[0] == 0).all()
    assert h.KERNELS["embedding"].dgrad(grad, saved, weight) == (None,)


def test_lm_head_cross_entropy_matches_torch_on_one_rank():
    h, w = randn(6, 8), randn(8, 10, seed=1)
    targets = torch.tensor([0, 9, 3, 3, 5, 1])
    losses = check_against_autograd("lm_head", [h, targets], w, k.KernelCtx(axis="tp"), [0])
    assert (losses - F.cross_entropy(h @ w, targets, reduction="none")).abs().max() < TOL


def test_every_library_op_and_derived_kind_has_a_handler():
    for op in OPS:
        assert h.handler(op)[0] in (h.FORWARD, h.COMM)
    for layer in ("llama", "gpt", "moe"):
        program = check_text(program_text(layer, tp=2), "t.dhx")
        for op in program.forward.ops + program.backward.ops:
            h.handler(op.op)
    assert h.handler("gemm_wgrad")[0] == h.WGRAD and h.handler("rmsnorm_bwd")[0] == h.BWD
    with pytest.raises(KeyError, match="no kernel for op 'conv'"):
        h.handler("conv")


def test_derived_kinds_resolve_to_the_part_the_op_library_names():
    for kind, (role, _) in h.HANDLERS.items():
        assert role in h.ROLES and role == (part_of(kind) or role), kind
        assert part_of(kind) is None or base_kind(kind) in h.KERNELS
    split = {base_kind(kind) for kind, (role, _) in h.HANDLERS.items() if role == h.WGRAD}
    assert split == SPLIT_OPS


def test_executable_dtypes_are_dsl_dtypes():
    assert set(DTYPES) <= set(DSL_DTYPES)
    with pytest.raises(ShardingError, match="dtype fp8 is not executable; use one of fp32, bf16, fp16"):
        torch_dtype(check_text(program_text().replace("dtype = fp32", "dtype = fp8"), "t.dhx"))


def test_single_rank_collectives_are_the_identity_sync_and_async():
    comm, x = SingleRankComm(), randn(4, 3)
    assert comm.all_gather(x, "tp") is x and comm.reduce_scatter(x, "tp") is x
    pending = comm.all_reduce(x, "tp", "max", async_op=True)
    assert isinstance(pending, Pending) and pending.wait() is x
    assert resolve(pending.then(lambda t: t * 2)).equal(2 * x)
    assert comm.index("tp") == 0 and comm.size("ep") == 1


# -- weights ---------------------------------------------------------------------------------

def test_shard_take_and_join_are_inverse_and_split_each_block():
    spec = ShardSpec((3, 12), "matrix", 1, "tp", (8, 2, 2))
    full = torch.arange(36.0).reshape(3, 12)
    pieces = [spec.take(full, i, 2) for i in range(2)]
    assert pieces[1][0].tolist() == [4, 5, 6, 7, 9, 11]
    assert spec.join(pieces).equal(full)


def test_qkv_shards_give_each_rank_its_query_heads_and_their_kv_heads():
    plan = WeightPlan(check_text(program_text("llama", tp=2), "t.dhx"), seed=1)
    spec = plan.layer_specs["qkv"]
    d = 8  # hidden 32 / heads 4; 4 query heads, 2 kv heads
    assert (spec.dim, spec.axis, spec.blocks) == (1, "tp", (4 * d, 2 * d, 2 * d))
    full = plan.full(param_name(0, "qkv"))
    shard = plan.shard(param_name(0, "qkv"), {"tp": 1})
    assert shard[:, :2 * d].equal(full[:, 2 * d:4 * d])  # query heads 2, 3
    assert shard[:, 2 * d:3 * d].equal(full[:, 5 * d:6 * d])  # kv head 1: k
    assert shard[:, 3 * d:].equal(full[:, 7 * d:])  # and v
    assert plan.layer_specs["fc1"].blocks == (64, 64)  # gate | up
    assert (plan.layer_specs["prj"].dim, plan.layer_specs["fc2"].dim) == (0, 0)  # row-parallel
    assert plan.layer_specs["ln1"].grad_sum == ("tp",) and plan.layer_specs["qkv"].grad_sum == ()


def test_sharded_weights_reassemble_into_the_reference_weights():
    sharded = WeightPlan(check_text(program_text("moe", tp=2), "t.dhx"), seed=7)
    single = WeightPlan(check_text(program_text("moe", tp=1), "t.dhx"), seed=7)
    assert sharded.names() == single.names()
    for name in sharded.names():
        axis = sharded.spec(name).axis
        parts = sharded.program.mesh.size(axis) if axis else 1  # experts split over ep = 1
        pieces = [sharded.shard(name, {axis: i}) for i in range(parts)]
        assert sharded.join(name, pieces).equal(single.full(name)), name
    assert sharded.model_specs[EMBEDDING].dim == 0 and sharded.model_specs[LM_HEAD].dim == 1
    assert sharded.vocab_start({"tp": 1}) == 32


def test_seeds_depend_on_the_run_seed_layer_and_op():
    seeds = {param_seed(s, param_name(i, op)) for s in (0, 1) for i in (0, 1) for op in ("qkv", "fc1")}
    assert len(seeds) == 8
    plan = WeightPlan(check_text(program_text(), "t.dhx"), seed=3)
    assert plan.full(param_name(1, "qkv")).equal(plan.full(param_name(1, "qkv")))
    assert not plan.full(param_name(0, "qkv")).equal(plan.full(param_name(1, "qkv")))
