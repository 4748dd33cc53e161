"""A profile's per-kernel terms: what the roofline of one op leaves out.

The cost model prices an op at ``max(FLOPs / (peak · achieved), bytes / HBM)``. That holds for
large kernels; published runs show where it does not (``benchmarks/published_runs.py``):

* **Fixed time per kernel** (``overhead_us``): the launch, the prologue and the tail of every
  kernel, and the host's time between kernels when the host is the slower side. A layer of
  14 forward and 18 backward ops pays it 32 times per micro-batch, whatever its size: a small
  model's step holds a larger share of it.
* **GEMM tiles and waves** (``sms``, ``gemm_tile``): a GEMM's output is cut into tiles of
  ``gemm_tile`` elements and the tiles run in waves of one per streaming multiprocessor; the
  last wave's idle SMs and the padded edges of the tiles are lost (NVIDIA's *Matrix
  Multiplication Background User's Guide*: tile and wave quantization). cuBLAS picks among
  several tile shapes, so the model takes the best of the tile, its transpose and its half.
* **Attention implementation** (``attention``): ``flash`` (one fused kernel that never writes
  the scores: FlashAttention, cuDNN's fused attention) or ``materialized`` (Megatron-LM before
  flash attention: two batched GEMMs around a softmax, a mask and a dropout that each read and
  write the ``heads · T · s`` scores in HBM, and a causal mask that saves no FLOPs).
* **Loss implementation** (``loss``), a memory term: ``vocab_parallel`` (Megatron-LM's
  vocab-parallel cross-entropy, and the interpreter's: one fp32 softmax of the local logits,
  computed in place, kept for the backward, which writes the gradient into it), ``upcast``
  (PyTorch's ``cross_entropy`` on the logits cast to fp32, as torchtitan and Hugging Face's
  trainers call it: the cast, the log-probabilities it keeps and, in the backward, the dense
  gradient of the loss and the log-softmax's own each take a whole fp32 copy of the logits)
  or ``fused`` (one kernel each way that never writes the fp32 logits — that loss compiled,
  as torchtitan compiles it with its model, or a fused cross-entropy kernel: it keeps the
  16-bit logits and writes their 16-bit gradient) (:data:`LOSS_COPIES`).

Every term is optional and absent by default: a profile without a ``kernels`` section prices
ops as before. ``dhelix calibrate`` fits ``overhead_us`` (and the ``achieved`` fractions) to
measured runs.
"""

from __future__ import annotations

import math

import attrs

ATTENTION_IMPLS = ("flash", "materialized")
LOSS_IMPLS = ("vocab_parallel", "upcast", "fused")
KERNEL_KEYS = ("overhead_us", "sms", "gemm_tile", "attention", "loss")

#: Copies of the fp32 ``[T, V/tp]`` logits a loss keeps from its forward to its backward, and
#: holds for a moment beyond those in its forward and in its backward: (kept, forward,
#: backward). ``upcast`` (torchtitan 9dec370 train.py: ``cross_entropy(pred.flatten(0,
#: 1).float(), labels)``, then ``del pred`` before the backward) keeps the log-softmax's fp32
#: output; its forward holds the 16-bit logits (half a copy), their fp32 cast and that output
#: at once, its backward the kept output, the nll loss's dense gradient and the log-softmax's
#: input gradient. ``vocab_parallel`` keeps the fp32 softmax and works in place. ``fused``
#: keeps the 16-bit logits (half a copy) and writes their 16-bit gradient.
LOSS_COPIES = {"vocab_parallel": (1.0, 0.0, 0.0), "upcast": (1.0, 1.5, 2.0), "fused": (0.5, 0.0, 0.5)}

#: Score-sized HBM passes of materialized attention (elements of ``heads · T · s`` read or
#: written, the dropout mask counted as half a pass of 16-bit elements): forward — the QK^T
#: GEMM writes the scores, the fused scale-mask-softmax reads and writes them, the dropout
#: reads them and writes them and its mask, the PV GEMM reads them (6.5); backward — the
#: dO·V^T GEMM writes the probability gradient, the dropout's backward reads it and the mask
#: and writes, the softmax's backward reads the probabilities and the gradient and writes the
#: score gradient, the dQ and dK GEMMs read it, the dV GEMM reads the probabilities (10).
SCORE_PASSES_FORWARD = 6.5
SCORE_PASSES_BACKWARD = 10.0
#: The score GEMMs of materialized attention, each one of the passes above (forward: QK^T
#: writes the scores, PV reads them; backward: dO·V^T writes the probability gradient, dQ and
#: dK read the score gradient, dV reads the probabilities): each is priced as its own roofline.
SCORE_GEMMS = {False: 2, True: 4}
#: Kernels of materialized attention: forward QK^T, softmax, dropout, PV; backward dV, dP,
#: dropout, softmax, dQ, dK.
ATTENTION_KERNELS = {("materialized", False): 4, ("materialized", True): 6,
                     ("flash", False): 1, ("flash", True): 1}


@attrs.frozen
class Kernels:
    """The per-kernel terms of a profile (module docstring); the defaults change nothing."""

    overhead_us: float = 0.0
    sms: int | None = None
    gemm_tile: tuple[int, int] = (128, 256)
    attention: str = "flash"
    loss: str = "vocab_parallel"

    def overhead(self, kernels: int = 1) -> float:
        """Seconds of fixed time for ``kernels`` kernels."""
        return self.overhead_us * 1e-6 * kernels

    def gemm_fill(self, m: float, n: float, batch: int = 1) -> float:
        """The share in (0, 1] of the SMs' tile slots a GEMM with an ``m × n`` output (``batch``
        of them, as a grouped GEMM's experts) fills with useful work: the best of the
        profile's tile, its transpose and its half (1 without ``sms``)."""
        if self.sms is None or m <= 0 or n <= 0:
            return 1.0
        tm, tn = self.gemm_tile
        best = 0.0
        for a, b in ((tm, tn), (tn, tm), (max(tm // 2, 1), tn), (tm, max(tn // 2, 1))):
            tiles = batch * math.ceil(m / a) * math.ceil(n / b)
            waves = math.ceil(tiles / self.sms)
            best = max(best, batch * m * n / (waves * self.sms * a * b))
        return best


NONE = Kernels()


def read_kernels(reader, node) -> Kernels | None:
    """The ``kernels`` section of a profile, read with the profile's ``reader`` (every
    mistake a located error there); None when it has errors."""
    keys = reader.mapping(node, "kernels", KERNEL_KEYS, ())
    if keys is None:
        return None
    fields = {}
    if "overhead_us" in keys:
        fields["overhead_us"] = reader.number(keys["overhead_us"], "kernels.overhead_us", nonneg=True)
    if "sms" in keys:
        fields["sms"] = reader.integer(keys["sms"], "kernels.sms")
    if "gemm_tile" in keys:
        items = reader.sequence(keys["gemm_tile"], "kernels.gemm_tile")
        sizes = [reader.integer(item, "kernels.gemm_tile") for item in items]
        if len(items) != 2:
            reader.error(keys["gemm_tile"], "'kernels.gemm_tile' must be two whole numbers: [rows, columns]")
            return None
        fields["gemm_tile"] = tuple(sizes)
    if "attention" in keys:
        fields["attention"] = reader.choice(keys["attention"], "kernels.attention", ATTENTION_IMPLS)
    if "loss" in keys:
        fields["loss"] = reader.choice(keys["loss"], "kernels.loss", LOSS_IMPLS)
    if None in fields.values() or (fields.get("gemm_tile") and None in fields["gemm_tile"]):
        return None
    return Kernels(**fields)
