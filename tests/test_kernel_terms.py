"""The profile's per-kernel terms (dsl/frontend/kernel_terms.py) and what they add to an op's
time: a fixed time per kernel, GEMM tile and wave quantization, materialized attention."""

from __future__ import annotations

import math

import attrs
import pytest

from dhelix.dsl.core.dtypes import dtype_bytes
from dhelix.dsl.frontend.kernel_terms import (
    ATTENTION_KERNELS, SCORE_PASSES_BACKWARD, SCORE_PASSES_FORWARD, Kernels,
)
from dhelix.dsl.frontend.profile_writer import render_profile
from dhelix.dsl.frontend.profiles import load_profile, parse_profile
from dhelix.dsl.planner.costmodel import op_bytes, op_flops, op_time
from test_costmodel import ops_of, program


@pytest.fixture(scope="module")
def demo():
    return program(hidden=4096, ffn=14336, heads=32, kv_heads=32, seq=4096, micro_batch=1)


def with_kernels(prog, **fields):
    return attrs.evolve(prog.profile, kernels=Kernels(**fields))


def test_the_default_terms_are_the_plain_roofline(demo):
    plain = with_kernels(demo)
    assert Kernels() == Kernels(0.0, None, (128, 256), "flash")
    for op in ops_of(demo).values():
        if op.kind != "comm" and op.op not in ("gemm", "gemm_dgrad", "gemm_wgrad"):
            # only GEMMs' fill depends on the SM count; nothing else the shipped terms set
            assert op_time(op, plain, "bf16") == op_time(op, attrs.evolve(plain, kernels=Kernels(sms=132)), "bf16")


def test_a_fixed_time_per_kernel_is_added_to_every_compute_op(demo):
    profile, plain = with_kernels(demo, overhead_us=7.0), with_kernels(demo)
    for op in ops_of(demo).values():
        if op.kind == "comm":
            continue
        assert op_time(op, profile, "bf16") == pytest.approx(op_time(op, plain, "bf16") + 7e-6, rel=1e-12)


def test_gemm_fill_is_nvidia_s_tile_and_wave_quantization():
    terms = Kernels(sms=108, gemm_tile=(128, 256))
    # One 128 x 256 output: the best tiling is two half tiles on 2 of 108 SMs.
    assert terms.gemm_fill(128, 256) == pytest.approx(2 / 108)
    # 12 x 9 = 108 full tiles: one full wave.
    assert terms.gemm_fill(128 * 12, 256 * 9) == pytest.approx(1.0)
    # 109 tiles of 128 x 256: two waves (0.505), or 218 half tiles in 3 waves (0.673): the better.
    m, n = 128 * 109, 256
    expected = max(m * n / (math.ceil(math.ceil(m / a) * math.ceil(n / b) / 108) * 108 * a * b)
                   for a, b in ((128, 256), (256, 128), (64, 256), (128, 128)))
    assert expected == pytest.approx(218 * 128 * 128 / (3 * 108 * 128 * 128))
    assert terms.gemm_fill(m, n) == pytest.approx(expected)
    # Padded edges: a 100-row output fills 100/128 of its tile rows at best.
    assert Kernels(sms=1, gemm_tile=(128, 256)).gemm_fill(100, 256) == pytest.approx(100 / 128)
    assert Kernels().gemm_fill(1, 1) == 1.0  # no SM count: no quantization


def test_a_gemm_s_time_is_divided_by_its_fill(demo):
    terms = Kernels(sms=108, gemm_tile=(128, 256))
    profile = attrs.evolve(demo.profile, kernels=terms)
    for op in ops_of(demo).values():
        if op.op in ("gemm", "gemm_dgrad", "gemm_wgrad"):
            m, k = op.in_shapes[0][0], op.weight[-2]
            n = op.weight[-1]
            out = {"gemm": (m, n), "gemm_dgrad": (m, k), "gemm_wgrad": (k, n)}[op.op]
            fill = terms.gemm_fill(*out)
            assert fill < 1  # these shapes leave SMs idle: the term is exercised
            compute = op_flops(op) / (profile.peak_flops("bf16") * profile.achieved["gemm"] * fill)
            memory = op_bytes(op, "bf16") / (profile.hbm_gbps * 1e9)
            assert op_time(op, profile, "bf16") == pytest.approx(max(compute, memory), rel=1e-9)


def test_materialized_attention_prices_the_whole_score_matrix_in_hbm(demo):
    profile = with_kernels(demo, attention="materialized", overhead_us=2.0)
    plain = with_kernels(demo)
    hbm, peak = profile.hbm_gbps * 1e9, profile.peak_flops("bf16")
    for op in ops_of(demo).values():
        if op.op not in ("attention", "attention_bwd"):
            continue
        backward = op.op == "attention_bwd"
        tokens, heads = op.shape[0], dict(op.params)["heads"]
        head_dim = 4096 // 32
        # No causal saving; the backward is four GEMMs of the forward's two sizes (2x).
        flops = 4.0 * tokens * 4096 * heads * head_dim * (2.0 if backward else 1.0)
        scores = heads * tokens * 4096
        passes = SCORE_PASSES_BACKWARD if backward else SCORE_PASSES_FORWARD
        qkv = heads * 3 * head_dim
        elements = tokens * (2 * qkv + 2 * heads * head_dim) if backward else \
            tokens * (qkv + heads * head_dim) + 2 * tokens * heads
        # Each score GEMM is its own roofline: its FLOPs or the one score pass it moves.
        gemms = 4 if backward else 2
        stream = hbm * profile.achieved["activation"]
        one_gemm = max(flops / gemms / (peak * profile.achieved["gemm"]), scores * dtype_bytes("bf16") / stream)
        expected = (gemms * one_gemm
                    + (scores * (passes - gemms) + elements) * dtype_bytes("bf16") / stream
                    + 2e-6 * ATTENTION_KERNELS[("materialized", backward)])
        assert op_time(op, profile, "bf16") == pytest.approx(expected, rel=1e-9)
        assert op_time(op, profile, "bf16") > op_time(op, plain, "bf16")


def test_a_score_gemm_waits_for_the_larger_of_its_flops_and_its_score_pass(demo):
    """With a head dimension of 128 the score GEMMs are bound by their pass over the scores on
    the demo's profile, and by their FLOPs once the GEMM fraction is cut tenfold: the op's time
    moves with the GEMM fraction only in the second case (a sum of the two would move in both)."""
    profile = with_kernels(demo, attention="materialized")
    op = next(o for o in ops_of(demo).values() if o.op == "attention")
    slower = attrs.evolve(profile, achieved={**profile.achieved, "gemm": profile.achieved["gemm"] * 0.9})
    assert op_time(op, slower, "bf16") == pytest.approx(op_time(op, profile, "bf16"), rel=1e-12)
    starved = attrs.evolve(profile, achieved={**profile.achieved, "gemm": profile.achieved["gemm"] * 0.1})
    assert op_time(op, starved, "bf16") > op_time(op, profile, "bf16") * 1.01


def test_a_profile_reads_and_writes_its_kernel_terms():
    profile = attrs.evolve(load_profile("a100"), kernels=Kernels(3.5, 108, (128, 128), "materialized"))
    assert parse_profile(render_profile(profile), "copy.yaml") == profile


def test_wrong_kernel_terms_are_located_errors():
    bare = attrs.evolve(load_profile("a100"), kernels=Kernels())
    text = render_profile(bare) + "\nkernels:\n  attention: flashy\n  sms: 0\n  speed: 3\n"
    with pytest.raises(Exception) as info:
        parse_profile(text, "bad.yaml")
    message = str(info.value)
    assert "bad.yaml:" in message
    assert "'kernels.attention' must be one of flash, materialized, got 'flashy'" in message
    assert "'kernels.sms' must be at least 1" in message
    assert "unknown key 'speed' in kernels" in message
