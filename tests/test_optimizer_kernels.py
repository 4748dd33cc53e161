"""The optimizer's update is torch's AdamW kernels: the same results as the per-tensor loop
it replaced (kept here as the reference), on the in-place fp32 path and on the flat master
path of a low-precision model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dhelix.interpreter.ops.comm import SingleRankComm  # noqa: E402
from dhelix.interpreter.training.optim import AdamWConfig, DistributedAdamW  # noqa: E402

CONFIG = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SHAPES = {"a": (8, 12), "b": (12,), "c": (5, 3, 4), "d": (7,)}


def loop_reference(params, grads_per_step, lrs):
    """The per-tensor AdamW loop the optimizer ran before torch's kernels, on fp32 copies."""
    params = {n: p.float().clone() for n, p in params.items()}
    state = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in params.items()}
    beta1, beta2 = CONFIG.betas
    for step, (grads, lr) in enumerate(zip(grads_per_step, lrs, strict=True), start=1):
        step_size, correction2 = lr / (1 - beta1 ** step), 1 - beta2 ** step
        for name, param in params.items():
            exp_avg, exp_avg_sq = state[name]
            grad = grads[name].float()
            param.mul_(1 - lr * CONFIG.weight_decay)
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            param.addcdiv_(exp_avg, (exp_avg_sq / correction2).sqrt_().add_(CONFIG.eps), value=-step_size)
    return params


def _run(dtype: torch.dtype, steps: int = 4):
    generator = torch.Generator().manual_seed(3)
    params = {n: torch.randn(s, generator=generator).to(dtype) for n, s in SHAPES.items()}
    start = {n: p.clone() for n, p in params.items()}
    grads = [{n: torch.randn(s, generator=generator).to(dtype) for n, s in SHAPES.items()} for _ in range(steps)]
    lrs = [CONFIG.lr * (1 - 0.1 * k) for k in range(steps)]
    optimizer = DistributedAdamW(params, SingleRankComm(), config=CONFIG)
    for step_grads, lr in zip(grads, lrs, strict=True):
        optimizer.step(step_grads, lr)
    return params, loop_reference(start, grads, lrs), optimizer


def test_fp32_parameters_are_updated_in_place_as_the_loop_did():
    params, want, optimizer = _run(torch.float32)
    for name in SHAPES:
        torch.testing.assert_close(params[name], want[name], rtol=1e-6, atol=1e-7)
    moments = optimizer.moments()
    assert set(moments) == set(SHAPES)


def test_bf16_parameters_follow_their_fp32_masters_as_the_loop_did():
    params, want, optimizer = _run(torch.bfloat16)
    masters = optimizer.masters()
    for name in SHAPES:
        torch.testing.assert_close(masters[name], want[name], rtol=1e-6, atol=1e-7)
        assert params[name].dtype == torch.bfloat16
        torch.testing.assert_close(params[name], want[name].to(torch.bfloat16))
