"""Rotary position embeddings (RoPE) as Hugging Face's Llama computes them.

The pair of features ``i`` and ``i + d/2`` of each query and key head turns by the angle
``position · f_i``, ``f_i = theta^(-2i/d)`` (the "rotate half" convention of Hugging Face's
weights), optionally with Llama 3's scaling of the frequencies. The tables are computed in fp32
as Hugging Face computes them and cast to the tensors' dtype. Used by the attention kernel
(:mod:`.kernels`) and by ring attention (:mod:`.ring_attention`, at each cp rank's own
positions); the reference model has its own formulation (:mod:`dhelix.interpreter.verify.reference`).
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from dhelix.dsl.core.oplib import ROPE_SCALING


def rope_of(params: Mapping[str, object]) -> tuple | None:
    """The rotary embedding an attention op with ``params`` applies: ``(theta, scaling)``,
    ``scaling`` Llama 3's ``(factor, low_freq, high_freq, original)`` or None; None without
    ``rope``."""
    if params.get("rope") is None:
        return None
    scaling = tuple(params.get(name) for name in ROPE_SCALING)
    return int(params["rope"]), None if scaling[0] is None else tuple(int(v) for v in scaling)


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: tuple) -> torch.Tensor:
    # As Hugging Face computes them (modeling_rope_utils, "llama3"), in fp32.
    factor, low, high, original = scaling
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, blended, scaled)


def rope_tables(seq: int, dim: int, rope: tuple, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The cosines and sines ``[seq, dim]`` of rotary position embeddings ``rope`` (see
    :func:`rope_of`) for positions ``0 … seq-1`` (Hugging Face's Llama convention: frequency
    ``theta^(-2i/dim)`` for the pair of features ``i`` and ``i + dim/2``), computed in fp32
    and cast to ``dtype``."""
    theta, scaling = rope
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    if scaling is not None:
        inv_freq = _llama3_frequencies(inv_freq, scaling)
    freqs = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``t`` ``[..., seq, dim]`` with each pair of features ``(i, i + dim/2)`` turned by its
    position's angle; ``rotate(t, cos, -sin)`` turns it back (the rotation's transpose, so
    also the gradient of a rotation)."""
    first, second = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-second, first), dim=-1) * sin
