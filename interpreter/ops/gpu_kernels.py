"""GPU forms of the kernels whose eager form wastes a GPU: RMSNorm and SwiGLU.

Written as eager elementwise ops, RMSNorm and SwiGLU make one pass over memory per op: on an
H200 `dhelix profile` measured RMSNorm at 7 % and SwiGLU at 17 % of the memory bandwidth
(``benchmarks/results/h200_profile_one_gpu_llama.yaml``). Here each of their forward, data
gradient and weight gradient is one function that ``torch.compile`` fuses into Triton kernels,
computing in fp32 inside whatever the tensors' dtype: on the H200 the fused forms took the
SwiGLU's forward from 369 to 192 µs and its backward from 729 to 299 µs, RMSNorm's from
173 to 143 µs and 381 to 267 µs (4096 tokens, Llama-8B widths, bf16;
``benchmarks/results/h200_one_device.txt``).

:mod:`.kernels` calls these for CUDA tensors only; the CPU paths (what the test suite checks
against the reference) are untouched. ``tests/test_gpu_kernels.py`` checks these against
autograd where a GPU is present (`benchmarks/device_checks.sh`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def on_gpu(x: torch.Tensor) -> bool:
    """Whether ``x`` takes the GPU forms."""
    return x.is_cuda


@functools.cache
def _compiled(fn):
    return torch.compile(fn, fullgraph=True)


def _fused(fn):
    """``fn``, compiled on its first call (never on a machine that does not call it)."""

    @functools.wraps(fn)
    def run(*args):
        return _compiled(fn)(*args)

    return run


# -- RMSNorm: saved (x, rstd), rstd in fp32 -------------------------------------------------

@_fused
def rmsnorm_forward(x, weight, eps: float):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype), rstd


@_fused
def rmsnorm_dgrad(grad, x, rstd, weight):
    xhat, gy = x.float() * rstd, grad.float() * weight.float()
    return (rstd * (gy - xhat * (gy * xhat).mean(-1, keepdim=True))).to(grad.dtype)


@_fused
def rmsnorm_wgrad(grad, x, rstd):
    return (grad.float() * x.float() * rstd).sum(0).to(grad.dtype)


# -- SwiGLU: silu(gate) * up, gate the first half of the features ---------------------------

@_fused
def swiglu_forward(x):
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


@_fused
def swiglu_dgrad(grad, x):
    gate, up = x.float().chunk(2, dim=-1)
    g, sig = grad.float(), torch.sigmoid(gate)
    dgate = g * up * sig * (1 + gate * (1 - sig))
    return torch.cat([dgate, g * gate * sig], dim=-1).to(x.dtype)
