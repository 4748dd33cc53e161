"""Per-operator cost: FLOPs, HBM bytes, wire bytes and time on a hardware profile.

Formulas follow the project's reference notes (NOTES §3.1-3.4 for FLOPs and bytes, §3.6 for
collectives, §3.8 for Megatron's FLOP count). Shapes are the per-GPU ``[tokens, features]``
of :class:`~dhelix.dsl.core.program.Op`; a GEMM ``[M, K] x [K, N]`` costs ``2·M·K·N`` FLOPs and
its dgrad and wgrad each cost the same (NOTES §3.2).

Modelling choices, with their reasons:

* **Attention** forward costs ``4·T·s·h_q·γ`` FLOPs, where ``T`` is the op's query tokens
  (``b·s/cp``), ``s`` the full sequence one query attends over, ``h_q = heads·head_dim``
  (local heads) and ``γ = ½`` for a causal mask (the work the kernel does; Megatron's MFU
  counts ``γ = 1``, see :func:`megatron_flops_per_iteration`). The head dim is the qkv width
  divided by ``heads + 2·kv_heads``. ``s`` comes from the op's ``seq`` param if the DAG
  records one, else the caller's ``seq``, else ``T·cp`` (one sequence per micro-batch).
* **Attention backward** costs 2.5× the forward: a FlashAttention-2 backward recomputes the
  probabilities (NOTES §3.2 B13; Megatron counts 2×).
* **Ring attention** (cp > 1) spreads the attention FLOPs and bytes evenly over its steps:
  cp forward ops (cp - 1 carrying steps + the last), cp + 1 backward ops. A carrying step
  also sends a KV block (``β·T·2·kv_heads·head_dim``) to its ring neighbour: forward steps one
  block each, backward steps ``2(cp-1)/cp`` blocks each (KV forward, dKV back: NOTES §3.3).
  Such a step is two tasks that run together: its compute and its P2P on the ring's lane.
* **Compute-bound** classes (gemm, attention, router) take ``max(FLOPs / (peak·achieved),
  bytes / HBM)``; **memory-bound** ones (norm, add, activation, permute) take ``bytes /
  (HBM·achieved)``: elementwise FLOPs are negligible next to the tensor-core peak.
* **The optimizer** is a memory-bound AdamW: per parameter it reads the gradient and reads
  and writes the fp32 master weight and the two fp32 moments (with bf16/fp16 weights it also
  writes the rounded weight; fp32 training has no separate master: the weight is it),
  streamed at the profile's ``optimizer_gbps`` when `dhelix profile` measured one, else at
  ``hbm_gbps × achieved.activation``. Offloaded (``train { offload = optimizer }``), it runs
  on the host instead, at the profile's ``host.optimizer_gbps``, between the gradients' copy to
  the host and the weights' copy back over ``host.link_gbps`` (:func:`offload_time`).
* **FP8** models run their GEMMs in fp8 and every other op, and every collective, in bf16
  (:func:`~dhelix.dsl.core.dtypes.tensor_dtype`): attention at the bf16 peak, a norm moving
  2-byte elements.
* **Collectives** (NOTES §3.6, NCCL ring conventions), with ``S`` the full tensor bytes, ``g``
  the group size, ``α`` the lane's latency and ``B`` its bandwidth times the profile's
  efficiency for that collective on that lane: ring ``α(g-1) + S(g-1)/g/B`` (all_gather,
  reduce_scatter), ring_allreduce twice that, rooted ``α(g-1) + S/B`` (a reduce or broadcast
  of distinct roots: a pipelined chain to or from the root, every byte over every hop), pairwise ``α(g-1) + S_send(g-1)/g/B``
  (all_to_all; across nodes the peers on the GPU's own node take their share over the local link
  while the others' crosses the NICs, :func:`pairwise_split_seconds`), p2p ``α + S/B``.
"""

from __future__ import annotations

import math

import attrs

from dhelix.dsl.core.dtypes import MAIN_GRAD_DTYPE, dtype_bytes, tensor_dtype
from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.core.oplib import LINK, SPLIT_OPS, base_kind
from dhelix.dsl.frontend.kernel_terms import ATTENTION_KERNELS, SCORE_GEMMS, SCORE_PASSES_BACKWARD, SCORE_PASSES_FORWARD
from dhelix.dsl.frontend.profiles import COMPUTE_BOUND, Profile

ATTENTION_BWD_FACTOR = 2.5  # FlashAttention-2 backward recomputes P (NOTES §3.2, B13)
CAUSAL_FRACTION = 0.5  # γ: a causal kernel skips the masked half
_COMM_KIND = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce",
              "all_to_all": "all_to_all", "send": "p2p", "recv": "p2p", "attention": "p2p",
              "attention_bwd": "p2p", "param_gather": "all_gather", "grad_scatter": "reduce_scatter",
              "reduce": "reduce", "broadcast": "broadcast"}
_LANE_CLASS = {"compute": "comp", "local": "intra", "cross": "inter"}


@attrs.frozen
class Task:
    """Work an op puts on one lane: its solo time and the keys an OEF override may name."""

    lane: str  # compute | local | cross
    seconds: float
    keys: tuple[str, ...]  # most specific first: op name, op kind, op class / collective@lane
    cls: str  # comp | intra | inter (the OEF class of the lane)


def _params(op) -> dict:
    return dict(op.params)


def _elements(shape) -> int:
    return math.prod(shape) if shape else 0


# ---------------------------------------------------------------- attention geometry

def _is_attention(op) -> bool:
    return op.op in ("attention", "attention_bwd")


def _attention(op, seq: int | None) -> tuple[float, float, float]:
    """(FLOPs, HBM elements, KV elements per block) of one attention op or ring step,
    already divided over the ring's steps."""
    params = _params(op)
    heads, kv_heads = params["heads"], params["kv_heads"]
    backward = op.op == "attention_bwd"
    qkv_width = op.shape[1] if backward else op.in_shapes[0][1]
    head_dim = qkv_width / (heads + 2 * kv_heads)
    tokens, ring = op.shape[0], op.group_size
    context = params.get("seq") or seq or tokens * ring
    gamma = CAUSAL_FRACTION if params.get("mask") == "causal" else 1.0
    flops = 4.0 * tokens * context * heads * head_dim * gamma
    out_width = heads * head_dim
    # Forward reads q, k, v and writes o (+ fp32 log-sum-exp, counted as 2 elements per row and
    # head); backward reads q, k, v, o, do and writes dq, dk, dv (NOTES §3.1 F4, §3.2 B13).
    elements = tokens * (qkv_width + out_width) + 2 * tokens * heads
    if backward:
        flops *= ATTENTION_BWD_FACTOR
        elements = tokens * (2 * qkv_width + 2 * out_width)
    steps = ring + 1 if backward and ring > 1 else ring
    kv_block = tokens * 2 * kv_heads * head_dim
    return flops / steps, elements / steps, kv_block


def _ring_send_elements(op, kv_block: float) -> float:
    """Elements a carrying ring step sends: one KV block forward; backward, the cp steps
    together move KV and dKV around the ring, 2(cp-1) blocks (NOTES §3.3)."""
    if op.op == "attention_bwd":
        ring = op.group_size
        return kv_block * 2 * (ring - 1) / ring
    return kv_block


# ---------------------------------------------------------------- FLOPs and bytes

def _gemm_dims(op) -> tuple[int, int, int, int]:
    """(M, K, N, experts) of the forward product ``[M, K] x [K, N]`` behind a GEMM-family op."""
    weight = op.weight
    k, n = weight[-2], weight[-1]
    experts = weight[0] if len(weight) == 3 else 1
    return op.in_shapes[0][0], k, n, experts


_ELEMENTWISE = {
    # op kind: (FLOPs per element, element traffic per element) over the op's reference tensor;
    # NOTES §3.1/§3.2 where given (norm 5 FLOPs and 2 passes, its backward 8 and 4, add 3 passes,
    # swiglu 3 passes of [T, F] and 5 backward), else read-and-write (2 passes).
    "rmsnorm": (5, 2), "layernorm": (5, 2), "rmsnorm_bwd": (8, 4), "layernorm_bwd": (8, 4),
    "add": (1, 3), "add_bwd": (0, 3), "gelu": (8, 2), "gelu_bwd": (10, 3),
}


def _compute_cost(op, seq: int | None) -> tuple[float, float]:
    """(FLOPs, HBM elements) of the compute work of ``op`` (zero for pure collectives)."""
    if _is_attention(op):
        flops, elements, _ = _attention(op, seq)
        return flops, elements
    if op.kind == "comm":
        return 0.0, 0.0
    if base_kind(op.op) in SPLIT_OPS:  # the weighted GEMMs: dgrad and wgrad cost the forward's
        m, k, n, experts = _gemm_dims(op)
        return 2.0 * m * k * n, float(m * k + experts * k * n + m * n)
    if op.op in _ELEMENTWISE:
        flops, passes = _ELEMENTWISE[op.op]
        size = _elements(op.shape)
        return flops * size, passes * size
    return _shuffle_cost(op)


def _shuffle_cost(op) -> tuple[float, float]:
    """SwiGLU, permute/unpermute and their backwards (and, as a fallback, any other op:
    one read of its inputs and one write of its output)."""
    inputs = sum(_elements(shape) for shape in op.in_shapes)
    out = _elements(op.shape)
    if op.op == "swiglu":  # [T, 2F] -> [T, F]: 3·T·F bytes, about 4·T·F FLOPs (NOTES F11)
        return 4.0 * out, 3.0 * out
    if op.op == "swiglu_bwd":  # output [T, 2F]: 5·T·F bytes, about 8·T·F FLOPs (NOTES B5)
        return 4.0 * out, 2.5 * out
    if op.op in ("permute", "permute_bwd"):  # gather k copies of each row (NOTES §3.4)
        return 0.0, 2.0 * max(inputs, out)
    if op.op in ("unpermute", "unpermute_bwd"):  # top-k weighted sum: read n·k rows, write n
        return 2.0 * max(inputs, out), float(inputs + out)
    if op.op in ROW_VIEWS and _row_view(op):  # a partitioned chain's chunk of whole rows: a view
        return 0.0, 0.0
    return 0.0, float(inputs + out)


#: Layout ops that take a chunk of a tensor: a forward slice, a concat's backward.
ROW_VIEWS = ("slice", "concat_bwd")


def _row_view(op) -> bool:
    """Whether ``op`` (one of :data:`ROW_VIEWS`) takes its chunks as consecutive whole rows of
    one block (``dim`` 0, ``blocks`` 1): a row-major tensor's view, which the interpreter
    returns without a copy (``narrow`` along the first dimension is already contiguous)."""
    params = _params(op)
    return params.get("dim") == 0 and params.get("blocks", 1) == 1


def op_flops(op, *, seq: int | None = None) -> float:
    """FLOPs of ``op`` on one GPU (0 for a pure collective). ``seq`` is the full sequence
    length an attention query attends over (see the module docstring)."""
    return _compute_cost(op, seq)[0]


def op_bytes(op, dtype: str, *, seq: int | None = None) -> float:
    """HBM bytes moved by the compute work of ``op`` on one GPU (0 for a pure collective)."""
    return _compute_cost(op, seq)[1] * dtype_bytes(dtype)


def _collective_kind(op) -> str | None:
    """The NOTES §3.6 collective an op's communication is: all_gather, …, p2p; or None."""
    if op.kind != "comm":
        return None
    return _COMM_KIND.get(op.op, "p2p")


def _full_bytes(op, dtype: str) -> float:
    """S of NOTES §3.6: the full (gathered / unscattered / sent) tensor in bytes."""
    if op.op_class == "ring_attention":
        _, _, kv_block = _attention(op, None)
        return _ring_send_elements(op, kv_block) * dtype_bytes(dtype)
    largest = max([_elements(op.shape)] + [_elements(shape) for shape in op.in_shapes])
    return float(largest * dtype_bytes(dtype))


def comm_bytes(op, dtype: str) -> float:
    """Bytes one GPU sends over the wire for ``op`` (0 for compute ops): ``S(g-1)/g`` for
    all_gather, reduce_scatter and all_to_all, ``2S(g-1)/g`` for all_reduce, ``S`` for P2P."""
    kind = _collective_kind(op)
    if kind is None or (op.group_size <= 1 and kind != "p2p"):
        return 0.0
    return wire_bytes(kind, _full_bytes(op, dtype), op.group_size)


def wire_bytes(kind: str, size_bytes: float, group: int) -> float:
    """Bytes one GPU sends for collective ``kind`` (NOTES §3.6) of full tensor ``size_bytes``
    over ``group`` GPUs: ``S`` for p2p, ``2S(g-1)/g`` for all_reduce, ``S(g-1)/g`` for the rest."""
    if kind == "p2p":
        return size_bytes
    if group <= 1:
        return 0.0
    share = size_bytes * (group - 1) / group
    return 2 * share if kind == "all_reduce" else share


def collective_time(kind: str, size_bytes: float, group: int, lane: str, profile: Profile,
                    per_node: int = 1, level: str | None = None) -> float:
    """Seconds for collective ``kind`` of ``size_bytes`` (S of NOTES §3.6) over ``group`` GPUs
    on ``lane`` (local or cross), by the profile's model for that collective. ``per_node``:
    ranks of the group on each node when it spans nodes (a ring's bandwidth, see
    :func:`ring_bandwidth`). ``level``: the topology level whose link a group partition's
    stage crosses (:data:`~dhelix.dsl.core.oplib.LINK`): the profile's link of that name
    where it has one, else the lane's."""
    link = profile.links.get(level, profile.links[lane]) if level else profile.links[lane]
    model = profile.collectives[kind]
    bandwidth = link.bw_gbps * 1e9 * model.efficiency_on(lane)
    alpha = link.latency_us * 1e-6
    if model.model == "p2p":
        return alpha + size_bytes / bandwidth
    if group <= 1:
        return 0.0
    if lane == "cross" and model.model in ("ring", "ring_allreduce", "rooted"):
        bandwidth = ring_bandwidth(bandwidth, per_node, profile.links["local"].bw_gbps * 1e9)
    steps = group - 1
    if model.model == "pairwise" and lane == "cross" and 1 < per_node < group:
        local = profile.links["local"].bw_gbps * 1e9 * model.efficiency_on("local")
        return alpha * steps + pairwise_split_seconds(size_bytes, group, per_node, bandwidth, local)
    if model.model == "rooted":  # a pipelined chain to or from the root: every byte crosses each hop
        return alpha * steps + size_bytes / bandwidth
    one = alpha * steps + size_bytes * steps / group / bandwidth
    return 2 * one if model.model == "ring_allreduce" else one


def pairwise_split_seconds(size_bytes: float, group: int, per_node: int, cross: float, local: float) -> float:
    """Wire seconds of a pairwise all-to-all over ``group`` GPUs, ``per_node`` of them on each
    node: a GPU sends ``S/g`` to every peer; the ``g - per_node`` peers on other nodes take
    theirs through its share of the node's NICs (``cross`` bytes/s), the ``per_node - 1`` on
    its own node through NVLink (``local``) at the same time, so the slower of the two sets the
    time. (A flat pairwise model prices every peer's bytes at the cross link: EP 16 over 2
    nodes, 15/16 of S over the NIC where 8/16 cross it.)"""
    remote = size_bytes * (group - per_node) / group / cross
    near = size_bytes * (per_node - 1) / group / local
    return max(remote, near)


def ring_bandwidth(per_gpu: float, per_node: int, local: float) -> float:
    """Bus bandwidth (bytes/s) of a ring collective over a group with ``per_node`` ranks on
    each of its nodes, the cross link giving ``per_gpu`` to each GPU. A ring leaves and
    enters a node once per pass, whatever the number of its ranks there; NCCL runs several
    rings (channels) through all the NICs of the node, which every GPU of the node shares
    with the same collective of the other groups (``gpus_per_node / per_node`` of them, each
    as busy): the group's rings get ``per_node`` GPUs' share of the node's cross-node
    bandwidth, at most the ring's node-local hops' (NOTES §3.6: "8 × 400 Gb/s per node").
    With one rank per node (a DP group under tp = gpus_per_node) this is ``per_gpu``; FSDP
    over 16 GPUs of 2 nodes gets the whole node's 8 shares; a flat ring there carries 15/16
    of S through each node's links each way, its group partition (8 inter-node gathers of
    S/8 over 2 ranks, one per GPU) S/2."""
    return min(per_gpu * per_node, local) if per_node > 1 else per_gpu


# ---------------------------------------------------------------- time

def achieved_class(op, profile: Profile) -> str:
    """The ``achieved`` class that prices the compute of ``op`` on ``profile``: its op class
    (``attention`` for attention and its backward), ``activation`` for a class the profile
    does not list (a streaming kernel)."""
    op_class = "attention" if _is_attention(op) else op.op_class
    return op_class if op_class in profile.achieved else "activation"


def _compute_seconds(op, profile: Profile, dtype: str, seq: int | None) -> float:
    flops, elements = _compute_cost(op, seq)
    moved = elements * dtype_bytes(dtype)
    op_class = achieved_class(op, profile)
    hbm = profile.hbm_gbps * 1e9
    achieved = profile.achieved[op_class]
    terms = profile.kernels
    if _is_attention(op) and terms.attention == "materialized":
        return _materialized_attention_seconds(op, profile, dtype, seq)
    if op_class in COMPUTE_BOUND:
        if base_kind(op.op) in SPLIT_OPS:
            if dtype == "fp8":
                achieved = profile.achieved.get("gemm_fp8", achieved)
            achieved *= terms.gemm_fill(*_gemm_output(op))
        seconds = max(flops / (profile.peak_flops(dtype) * achieved), moved / hbm)
    else:
        seconds = moved / (hbm * achieved)
    return seconds + terms.overhead()


def _gemm_output(op) -> tuple[float, float, int]:
    """(rows, columns, batch) of the output a GEMM-family op writes: ``[M, N]`` forward,
    ``[M, K]`` dgrad, ``[K, N]`` wgrad (per expert for a grouped GEMM, ``batch`` experts)."""
    m, k, n, experts = _gemm_dims(op)
    rows = m / experts
    if op.op.endswith("_dgrad"):
        return rows, k, experts
    if op.op.endswith("_wgrad"):
        return k, n, experts
    return rows, n, experts


def _materialized_attention_seconds(op, profile: Profile, dtype: str, seq: int | None) -> float:
    """Attention without a fused kernel (the profile's ``kernels.attention``): its two batched
    GEMMs (the backward's four) over the whole score matrix — a causal mask saves no FLOPs —
    and the score-sized passes of softmax, mask and dropout at the streaming fraction
    (:mod:`~dhelix.dsl.frontend.kernel_terms`), one kernel after the other. Each GEMM is its
    own roofline, as every other op here: the larger of its FLOPs at the GEMM fraction and
    the one score-sized pass it writes or reads (with a head dimension of 64-128 a score GEMM
    does about that many FLOPs per byte of scores, below the A100's and H100's balance point,
    so its HBM traffic is what it waits for and its FLOPs run under it)."""
    flops, elements, _ = _attention(op, seq)
    params = _params(op)
    if params.get("mask") == "causal":
        flops /= CAUSAL_FRACTION
    backward = op.op == "attention_bwd"
    if backward:  # four GEMMs of the forward's two sizes: twice, not FlashAttention's 2.5
        flops *= 2.0 / ATTENTION_BWD_FACTOR
    tokens, ring = op.shape[0], op.group_size
    context = params.get("seq") or seq or tokens * ring
    steps = ring + 1 if backward and ring > 1 else ring
    scores = params["heads"] * tokens * context / steps
    passes = SCORE_PASSES_BACKWARD if backward else SCORE_PASSES_FORWARD
    gemms = SCORE_GEMMS[backward]
    stream = profile.hbm_gbps * 1e9 * profile.achieved.get("activation", 1.0)
    pass_seconds = scores * dtype_bytes(dtype) / stream
    one_gemm = max(flops / gemms / (profile.peak_flops(dtype) * profile.achieved["gemm"]), pass_seconds)
    streams = (scores * (passes - gemms) + elements) * dtype_bytes(dtype) / stream
    kernels = ATTENTION_KERNELS[("materialized", backward)]
    return gemms * one_gemm + streams + profile.kernels.overhead(kernels)


def op_tasks(op, profile: Profile, dtype: str, *, seq: int | None = None) -> tuple[Task, ...]:
    """The lane work of ``op``: one task, or two for a carrying ring-attention step (its
    compute on the compute lane and its P2P on the ring's lane, running together)."""
    kind = _collective_kind(op)
    dtype = tensor_dtype(dtype, kind is None and base_kind(op.op) in SPLIT_OPS)
    tasks = []
    if kind is None or op.op_class == "ring_attention":
        keys = tuple(dict.fromkeys((op.name, op.op, op.op_class)))
        tasks.append(Task("compute", _compute_seconds(op, profile, dtype, seq), keys, "comp"))
    if kind is not None:
        seconds = collective_time(kind, _full_bytes(op, dtype), op.group_size, op.lane, profile, op.per_node,
                                  dict(op.params).get(LINK))
        tasks.append(Task(op.lane, seconds, (op.name, f"{kind}@{op.lane}"), _LANE_CLASS[op.lane]))
    return tuple(tasks)


def op_time(op, profile: Profile, dtype: str, *, seq: int | None = None) -> float:
    """Seconds ``op`` takes alone on one GPU: the profile's measured time for an op of that
    name if it has one for ``dtype``, else the model above. A ring step's compute and P2P
    overlap with the profile's same-strand slowdown σ: ``a + b - (1 - σ)·min(a, b)``."""
    measured = profile.measured
    if measured is not None and measured.dtype == dtype and op.name in measured.ops:
        return measured.ops[op.name] * 1e-6
    tasks = op_tasks(op, profile, dtype, seq=seq)
    if len(tasks) == 1:
        return tasks[0].seconds
    a, b = tasks[0].seconds, tasks[1].seconds
    return a + b - (1.0 - profile.slowdown) * min(a, b)


# ---------------------------------------------------------------- Megatron MFU accounting

#: AdamW bytes per parameter besides the gradient read and the weight write: read and write
#: the fp32 master weight and the two fp32 moments.
_ADAM_STATE_BYTES = 24


def optimizer_bytes_per_param(dtype: str) -> int:
    """Bytes one AdamW step streams per parameter of a model trained in ``dtype``."""
    size = dtype_bytes(dtype)
    # fp32: read the gradient (4) and the states; the weight is the master copy among them.
    return _ADAM_STATE_BYTES + (2 * size if dtype != "fp32" else size)


def optimizer_time(params: float, dtype: str, profile: Profile) -> float:
    """Seconds of an AdamW step over ``params`` local parameters (see the module docstring)."""
    rate = profile.optimizer_gbps if profile.optimizer_gbps is not None else (
        profile.hbm_gbps * profile.achieved.get("activation", 1.0))
    return params * optimizer_bytes_per_param(dtype) / (rate * 1e9)


@attrs.frozen
class OffloadTime:
    """Seconds of an offloaded optimizer step (``train { offload = optimizer }``), one part
    after another as the ranks run them: the averaged fp32 gradients device -> host, AdamW on
    the host, the updated weights (rounded to the model dtype on the host) host -> device."""

    to_host: float
    host: float
    to_device: float

    @property
    def seconds(self) -> float:
        return self.to_host + self.host + self.to_device


def host_optimizer_bytes_per_param(dtype: str) -> int:
    """Bytes a host AdamW step streams per parameter of a model trained in ``dtype``: the fp32
    gradient read, the fp32 master and moments read and written, and (but for fp32, whose
    master is what goes back) the weight rounded to ``dtype`` written."""
    return _ADAM_STATE_BYTES + dtype_bytes(MAIN_GRAD_DTYPE) + (dtype_bytes(dtype) if dtype != "fp32" else 0)


def offload_time(params: float, dtype: str, profile: Profile, span=None) -> OffloadTime:
    """An offloaded AdamW step over ``params`` local parameters on ``profile``'s host (its
    ``host`` section; a ProfileError located at ``span`` without one): the fp32 gradients
    and the ``dtype`` weights over the host link, the step at its host optimizer rate. The
    three run one after another (the ranks wait for the gradients' copy before the host
    step, and the weights' copy starts after it)."""
    host = profile.host_or_error(span)
    link = host.link_gbps * 1e9
    return OffloadTime(to_host=params * dtype_bytes(MAIN_GRAD_DTYPE) / link,
                       host=params * host_optimizer_bytes_per_param(dtype) / (host.optimizer_gbps * 1e9),
                       to_device=params * dtype_bytes(dtype) / link)


def step_optimizer_time(params: float, dtype: str, profile: Profile, offload: int = 0, span=None) -> float:
    """Seconds of the optimizer step over ``params`` local parameters with ``offload`` percent
    of them offloaded (``train { offload = optimizer  offload_percent }``; 0: all on the
    device, :func:`optimizer_time`): that share's :func:`offload_time`, the rest updated on the
    device while the host computes (the ranks launch it before they wait for the gradients'
    copy)."""
    share = offload / 100
    if not share:
        return optimizer_time(params, dtype, profile)
    host = offload_time(params * share, dtype, profile, span)
    return host.to_host + max(host.host, optimizer_time(params * (1 - share), dtype, profile)) + host.to_device


def megatron_flops_per_iteration(model, global_batch: int, *, swiglu: bool | None = None) -> float:
    """FLOPs of one training iteration as Megatron-LM counts them for TFLOPS and MFU (NOTES §3.8):
    ``12·B·s·L·h²·[(1 + g/a + s/h)·(a·d/h) + (f/h)·k·(3/2 if SwiGLU) + V/(2·L·h)]``.

    ``model`` is a :class:`~dhelix.dsl.core.program.Model` (layers, hidden, ffn, heads, kv_heads,
    seq, vocab, top_k for MoE); ``global_batch`` counts sequences. Causal attention is not
    halved. ``swiglu`` defaults to True unless the layer is a ``gpt*`` layer (GeLU MLP).
    """
    layers, hidden, heads, seq, vocab = (model.get(k) for k in ("layers", "hidden", "heads", "seq", "vocab"))
    if None in (layers, hidden, heads, seq, vocab):
        raise DhelixError(f"model {model.name} lacks a setting Megatron's FLOP count needs",
                           notes=["it needs layers, hidden, heads, seq and vocab"])
    kv_heads = model.get("kv_heads", heads)
    ffn = model.get("ffn", 4 * hidden)
    top_k = model.get("top_k", 1)
    head_dim = model.get("head_dim", hidden // heads)
    if swiglu is None:
        swiglu = not model.layer.startswith("gpt")
    gated = 1.5 if swiglu else 1.0
    attention = (1 + kv_heads / heads + seq / hidden) * (heads * head_dim / hidden)
    mlp = ffn / hidden * top_k * gated
    logits = vocab / (2 * layers * hidden)
    return 12.0 * global_batch * seq * layers * hidden ** 2 * (attention + mlp + logits)
