"""The kernels on a GPU (fused RMSNorm and SwiGLU from :mod:`dhelix.interpreter.ops.gpu_kernels`,
attention through SDPA) against the CPU kernels in float64. Skipped without a CUDA GPU;
`benchmarks/device_checks.sh` runs it on one."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dhelix.interpreter.ops import handlers as h, kernels as k  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MICRO_BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 128, 4, 2, 64
ATTENTION = {"heads": HEADS, "kv_heads": KV_HEADS, "mask": "causal"}


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def case(name: str):
    """Inputs, weight and context of a kernel call (float64, on the CPU)."""
    tokens = MICRO_BATCH * SEQ
    if name == "rmsnorm":
        return [randn(tokens, 512, seed=1)], 1 + 0.1 * randn(512, seed=2), k.KernelCtx()
    if name == "swiglu":
        return [randn(tokens, 1024, seed=3)], None, k.KernelCtx()
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return [randn(tokens, width, seed=4)], None, k.KernelCtx(params=ATTENTION, micro_batch=MICRO_BATCH)


def run(name, inputs, weight, ctx, grad):
    """Forward, data gradients and weight gradient (or None) of kernel ``name``."""
    kernel = h.KERNELS[name]
    out, saved = kernel.forward(inputs, weight, ctx)
    dgrads = kernel.dgrad(grad, saved, weight)
    return [out, *dgrads, kernel.wgrad(grad, saved) if kernel.wgrad else None]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", ["rmsnorm", "swiglu", "attention"])
def test_the_gpu_kernel_agrees_with_the_cpu_kernel_in_float64(name, dtype, tolerance):
    inputs, weight, ctx = case(name)
    out, _ = h.KERNELS[name].forward(inputs, weight, ctx)
    grad = randn(*out.shape, seed=9)
    expected = run(name, inputs, weight, ctx, grad)
    cuda = lambda t: None if t is None else t.to("cuda", dtype)  # noqa: E731
    got = run(name, [cuda(x) for x in inputs], cuda(weight), ctx, cuda(grad))
    for what, want, have in zip(("forward", "dgrad", "wgrad"), expected, got, strict=True):
        if want is None:
            assert have is None
            continue
        assert have.device.type == "cuda" and have.dtype == dtype, what
        error = (have.double().cpu() - want).abs().max().item() / want.abs().max().item()
        assert error < tolerance, f"{name} {what} in {dtype}: relative error {error:.2e}"

