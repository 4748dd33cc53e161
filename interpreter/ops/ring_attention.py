"""Ring attention over the context-parallel axis (cp): the kernels of the compiler's ring steps.

**Token layout** (Megatron's load-balanced causal layout, NOTES §3.3). Every sequence is cut
into ``2·cp`` equal chunks; cp rank ``i`` holds chunks ``i`` and ``2·cp−1−i``, in that order
(:func:`local_positions`). A micro-batch's rows on a cp rank are its sequences' local tokens
in (batch, local position) order, so every op but attention — all per-token, none
position-dependent — runs unchanged on them (rotary embeddings, the one thing that depends on
a token's position, are applied to q and k here, at the positions :func:`local_positions`
gives, before the ring passes the keys on, and turned back on dQ and dK at the end); the data
loader picks the tokens with :func:`local_tokens`, the reference model keeps whole
sequences in natural order, and the sum of the per-token losses is the same.

**Blocks.** Rank ``r`` attends its local queries to the K/V block of rank ``j``. Under the
causal mask that block is, with ``h`` the first (chunk ``j`` / ``r``) half of a block:

* ``j == r``: causal over the ``2c`` local tokens (local order is global order);
* ``j < r``: every query against the first half of the keys only, unmasked;
* ``j > r``: the second half of the queries against every key, unmasked.

Each is thus an unmasked sub-block or one causal square block (``mask = full``: every
block is unmasked). Attention is computed here explicitly in fp32 — scores, log-sum-exp,
probabilities — on any device: correctness first; the flash kernels' output would need the
same merge and masks.

**Forward** (``att.step0 … att.step{cp−2}``, comm ops, then ``att``): step ``i`` posts the
send of the K/V block it holds to the next rank of the ring and the receive of the next
block from the previous one, computes its queries against the block that started on rank
``(r−i) mod cp`` and merges the partial output with the running one by log-sum-exp, then
waits for the transfer (or, when the executor runs comm ops asynchronously, returns a
:class:`~.comm.Pending` that the next step waits for). ``att`` computes the last block and
returns the merged output; it saves q, k, v, the output and the log-sum-exp.

**Backward** (``att.bwd.step0 … att.bwd.step{cp−1}``, comm ops, then ``att.bwd``): K/V
travel the ring again (Megatron recirculates rather than keeping every block), each step
recomputes its block's probabilities from the saved log-sum-exp (``P = exp(S − lse)``,
``dS = P ⊙ (dP − rowsum(dO ⊙ O))``), adds into dQ and produces a partial dK/dV of the block
it holds. The dK/dV accumulator of a block travels with it: step ``i`` sends on the
accumulator of the block it computed at step ``i−1`` (together with the K/V it forwards),
receives the one of its current block and adds its partial. After step ``cp−1`` the
accumulator of block ``r+1`` is complete and goes back to its owner: the last step posts
that hand-back, ``att.bwd`` waits for it and assembles ``[dQ | dK | dV]`` in the qkv layout.
P2P per backward: ``cp−1`` K/V transfers and ``cp`` dK/dV transfers per rank.

Every exchange posts its sends before its receives on even ring positions and after them on
odd ones, so a backend that runs point-to-point operations in order (NCCL) cannot deadlock;
both sides post in the same order, so untagged messages match.
"""

from __future__ import annotations

import attrs
import torch

from dhelix.dsl.core.program import Op

from .comm import Pending
from .rope import rope_of, rope_tables, rotate

#: The role of a ring op in :class:`~.layer_exec.LayerRun`, and the key of its step index.
RING, STEP = "ring", "ring_step"


# -- token layout --------------------------------------------------------------------------

def local_positions(seq: int, cp: int, index: int) -> torch.Tensor:
    """Global positions of cp rank ``index``'s tokens of a ``seq``-token sequence."""
    if seq % (2 * cp):
        raise ValueError(f"seq {seq} does not split in 2·cp = {2 * cp} chunks")
    chunk = seq // (2 * cp)
    starts = (index * chunk, (2 * cp - 1 - index) * chunk)
    return torch.cat([torch.arange(s, s + chunk) for s in starts])


def local_tokens(tokens: torch.Tensor, cp: int, index: int) -> torch.Tensor:
    """The columns of ``tokens`` ``[..., seq]`` that cp rank ``index`` holds (all of them
    for cp = 1)."""
    if cp == 1:
        return tokens
    return tokens[..., local_positions(tokens.shape[-1], cp, index)].contiguous()


def local_micro(batch, m: int, cp: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``m`` of ``batch`` (a :class:`~.reference.Batch`) as cp rank
    ``index`` holds it: ids and targets of its local tokens, ``[micro_batch · seq / cp]``
    rows in (batch, local position) order."""
    return tuple(local_tokens(t[m], cp, index).reshape(-1) for t in (batch.inputs, batch.targets))


def check_ring(fwd_ops) -> None:
    """Raise NotImplementedError for a ring attention this module cannot run."""
    for op in fwd_ops:
        if op.op_class != "attention" or op.group_size == 1:
            continue
        if op.axis != "cp":
            raise NotImplementedError(f"ring attention {op.name} runs over {op.axis}; only a ring over "
                                      "cp is executed (the data loader splits sequences over cp)")
        params = dict(op.params)
        if params.get("seq", 0) % (2 * op.group_size):
            raise NotImplementedError(f"ring attention {op.name}: seq {params.get('seq')} must divide "
                                      f"into 2·cp = {2 * op.group_size} chunks (load-balanced layout)")


def ring_step(op: Op) -> int | None:
    """The position of ``op`` in its ring (None: not a ring op): forward steps 0 … cp−1
    (the last is ``att``), backward steps 0 … cp (the last is ``att.bwd``)."""
    if op.op_class == "ring_attention":
        return int(op.name.rsplit(".step", 1)[1])
    if op.op_class == "attention" and op.group_size > 1:
        return op.group_size - (op.op == "attention")
    return None


# -- blocks ----------------------------------------------------------------------------------

def _heads(qkv: torch.Tensor, heads: int, kv_heads: int, micro_batch: int):
    """q ``[b, h, L, d]`` and k, v ``[b, kv, L, d]`` from ``[tokens, (h + 2kv)·d]`` rows."""
    tokens, width = qkv.shape
    d = width // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    return tuple(t.reshape(micro_batch, tokens // micro_batch, n, d).transpose(1, 2)
                 for t, n in ((q, heads), (k, kv_heads), (v, kv_heads)))


def _tokens(t: torch.Tensor) -> torch.Tensor:
    b, n, seq, d = t.shape
    return t.transpose(1, 2).reshape(b * seq, n * d)


def _slices(rank: int, source: int, causal: bool, length: int):
    """(query rows, key columns, causal) of rank ``rank``'s block against ``source``'s K/V
    (module docstring)."""
    half = length // 2
    if not causal:
        return slice(None), slice(None), False
    if source == rank:
        return slice(None), slice(None), True
    if source < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _scores(q, k, causal: bool):
    """fp32 scores ``[b, kv, g, Lq, Lk]``: query head ``kv·g + i`` reads kv head ``kv`` (GQA)."""
    b, h, lq, d = q.shape
    kv = k.shape[1]
    qg = q.float().reshape(b, kv, h // kv, lq, d)
    s = torch.einsum("bkgqd,bkjd->bkgqj", qg, k.float()) * d ** -0.5
    if causal:
        mask = torch.ones(lq, k.shape[2], dtype=torch.bool, device=q.device).triu_(1)
        s = s.masked_fill(mask, float("-inf"))
    return s, qg


def block_forward(q, k, v, causal: bool):
    """Attention of ``q`` over one K/V block: fp32 output ``[b, h, Lq, d]`` and
    log-sum-exp ``[b, h, Lq]``."""
    s, _ = _scores(q, k, causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bkgqj,bkjd->bkgqd", torch.exp(s - lse[..., None]), v.float())
    return out.flatten(1, 2), lse.flatten(1, 2)


def block_backward(q, k, v, lse, delta, dout, causal: bool):
    """fp32 (dq, dk, dv) of one block given the *final* log-sum-exp and
    ``delta = rowsum(dO ⊙ O)`` of the merged output (the flash-attention backward)."""
    s, qg = _scores(q, k, causal)
    b, kv, g, lq, d = qg.shape
    p = torch.exp(s - lse.reshape(b, kv, g, lq, 1))
    do = dout.reshape(b, kv, g, lq, d)
    dv = torch.einsum("bkgqj,bkgqd->bkjd", p, do)
    ds = p * (torch.einsum("bkgqd,bkjd->bkgqj", do, v.float()) - delta.reshape(b, kv, g, lq, 1))
    scale = d ** -0.5
    dq = torch.einsum("bkgqj,bkjd->bkgqd", ds, k.float()) * scale
    dk = torch.einsum("bkgqj,bkgqd->bkjd", ds, qg) * scale
    return dq.flatten(1, 2), dk, dv


# -- the ring ------------------------------------------------------------------------------

def _exchange(ctx, sends: list[torch.Tensor], recvs: list[tuple]) -> tuple[list, list]:
    """Post ``sends`` to the next rank of the ring and receives shaped ``recvs`` (shape,
    dtype) from the previous one, all asynchronous; returns (send, receive) Pendings."""
    comm, axis = ctx.comm, ctx.axis
    nxt, prv = comm.peer(axis, 1), comm.peer(axis, -1)

    def post_sends():
        return [comm.send(t, nxt, async_op=True) for t in sends]

    def post_recvs():
        return [comm.recv(shape, dtype, prv, async_op=True) for shape, dtype in recvs]

    if comm.index(axis) % 2 == 0:
        sent = post_sends()
        return sent, post_recvs()
    got = post_recvs()
    return post_sends(), got


def _finish(ctx, state, sent: list, got: list, then):
    """Wait for the step's transfers and run ``then(received)``; asynchronously, a
    Pending that does so when the next step needs the state."""
    def complete(_):
        received = [p.wait() for p in got]
        for p in sent:
            p.wait()  # the send buffers may be reused only now
        then(received)
        return state

    pending = Pending(None, state, complete)
    return pending if ctx.async_op else pending.wait()


@attrs.define(eq=False)
class _Forward:
    """The running forward ring of one attention op for one micro-batch."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv: torch.Tensor  # the K/V block held now, k and v stacked
    meta: tuple  # (heads, kv_heads, causal, micro_batch, dtype, rope tables or None)
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None

    def attend(self, rank: int, source: int) -> None:
        """Attend to the held block (started on ``source``) and merge by log-sum-exp."""
        rows, cols, causal = _slices(rank, source, self.meta[2], self.q.shape[2])
        k, v = self.kv[0][:, :, cols], self.kv[1][:, :, cols]
        out, lse = block_forward(self.q[:, :, rows], k, v, causal)
        if self.out is None:  # step 0: the diagonal block, where every row sees a key
            self.out, self.lse = out, lse
            return
        old_out, old_lse = self.out[:, :, rows], self.lse[:, :, rows]
        new_lse = torch.logaddexp(old_lse, lse)
        self.out[:, :, rows] = (old_out * torch.exp(old_lse - new_lse)[..., None]
                                + out * torch.exp(lse - new_lse)[..., None])
        self.lse[:, :, rows] = new_lse


def _rope_tables(params, q: torch.Tensor, cp: int, rank: int):
    """The cos and sin ``[local tokens, d]`` of this cp rank's positions (its two chunks of
    the sequence), or None without rotary embeddings."""
    rope = rope_of(params)
    if rope is None:
        return None
    length, d = q.shape[2], q.shape[3]
    cos, sin = rope_tables(length * cp, d, rope, q.device, q.dtype)
    positions = local_positions(length * cp, cp, rank).to(q.device)
    return cos[positions], sin[positions]


def ring_forward(inputs, weight, ctx):
    """A forward ring step (the Kernel ``forward`` signature): step 0 reads qkv, later
    steps the previous step's state; carrying steps return the state (or its Pending), the
    last step the merged output ``[tokens, heads·d]`` and what the backward saves."""
    step, cp = int(ctx.params[STEP]), ctx.comm.size(ctx.axis)
    rank = ctx.comm.index(ctx.axis)
    if step == 0:
        (qkv,) = inputs
        heads, kv_heads = int(ctx.params["heads"]), int(ctx.params["kv_heads"])
        q, k, v = _heads(qkv, heads, kv_heads, ctx.micro_batch)
        tables = _rope_tables(ctx.params, q, cp, rank)
        if tables is not None:  # rotated once here: the ring passes rotated keys around
            q, k = rotate(q, *tables), rotate(k, *tables)
        meta = (heads, kv_heads, ctx.params.get("mask") == "causal", ctx.micro_batch, qkv.dtype, tables)
        state = _Forward(q, k, v, torch.stack((k, v)), meta)
    else:
        (state,) = inputs
    source = (rank - step) % cp
    if step == cp - 1:  # the last step: compute and merge, nothing left to pass on
        state.attend(rank, source)
        out = _tokens(state.out).to(state.meta[4])
        return out, (state.q, state.k, state.v, state.out, state.lse, state.meta)
    sent, got = _exchange(ctx, [state.kv], [(state.kv.shape, state.kv.dtype)])
    state.attend(rank, source)

    def receive(received):
        state.kv = received[0]

    return _finish(ctx, state, sent, got, receive), None


@attrs.define(eq=False)
class _Backward:
    """The running backward ring of one attention op for one micro-batch."""

    saved: tuple
    dout: torch.Tensor  # fp32 [b, h, L, d]
    delta: torch.Tensor  # rowsum(dO ⊙ O) [b, h, L]
    dq: torch.Tensor
    kv: torch.Tensor | None
    dkv: torch.Tensor | None = None  # fp32 accumulator of the block computed last
    partial: torch.Tensor | None = None
    home: list = attrs.field(factory=list)  # the hand-back of this rank's own dK/dV

    def attend(self, rank: int, source: int) -> None:
        """This step's block: add into dQ, keep the block's partial dK/dV."""
        q, _, _, _, lse, meta = self.saved
        rows, cols, causal = _slices(rank, source, meta[2], q.shape[2])
        k, v = self.kv[0][:, :, cols], self.kv[1][:, :, cols]
        dq, dk, dv = block_backward(q[:, :, rows], k, v, lse[:, :, rows], self.delta[:, :, rows],
                                    self.dout[:, :, rows], causal)
        self.dq[:, :, rows] += dq
        self.partial = torch.zeros(self.kv.shape, dtype=torch.float32, device=dq.device)
        self.partial[0][:, :, cols] = dk
        self.partial[1][:, :, cols] = dv


def ring_backward(grad, saved, ctx):
    """A backward ring step: step 0 reads the output gradient ``[tokens, heads·d]``, later
    steps the previous step's state; carrying steps return the state (or its Pending), the
    last (``att.bwd``) the qkv gradient ``[tokens, (heads + 2·kv_heads)·d]``."""
    step, cp = int(ctx.params[STEP]), ctx.comm.size(ctx.axis)
    rank = ctx.comm.index(ctx.axis)
    if step == cp:
        return _assemble(grad)
    state = _start_backward(grad, saved) if step == 0 else grad
    sends = ([state.kv] if step < cp - 1 else []) + ([state.dkv] if step > 0 else [])
    shapes = ([(state.kv.shape, state.kv.dtype)] if step < cp - 1 else []) \
        + ([(state.kv.shape, torch.float32)] if step > 0 else [])
    sent, got = _exchange(ctx, sends, shapes)
    state.attend(rank, (rank - step) % cp)

    def receive(received):
        if step < cp - 1:
            state.kv = received.pop(0)
        # The received accumulator is that of the block this step just computed.
        state.dkv = state.partial + received[0] if step > 0 else state.partial
        state.partial = None
        if step == cp - 1:  # block r+1 is complete: hand it back, collect our own
            state.kv = None
            state.home = list(_exchange(ctx, [state.dkv], [(state.dkv.shape, torch.float32)]))

    return _finish(ctx, state, sent, got, receive)


def _start_backward(grad: torch.Tensor, saved: tuple) -> _Backward:
    q, k, v, out, _, meta = saved
    b, h, length, d = q.shape
    dout = grad.float().reshape(b, length, h, d).transpose(1, 2)
    delta = (dout * out).sum(-1)
    return _Backward(saved, dout, delta, torch.zeros_like(dout), torch.stack((k, v)))


def _assemble(state: _Backward) -> torch.Tensor:
    sent, got = state.home
    (dkv,) = [p.wait() for p in got]
    for p in sent:
        p.wait()
    dtype, tables = state.saved[5][4], state.saved[5][5]
    dq, dk = state.dq, dkv[0]
    if tables is not None:  # gradients of the rotated q and k, turned back
        cos, sin = tables
        dq, dk = rotate(dq, cos, -sin), rotate(dk, cos, -sin)
    return torch.cat([_tokens(dq), _tokens(dk), _tokens(dkv[1])], dim=1).to(dtype)


@attrs.frozen
class RingKernel:
    """The ring ops' kernel: ``forward(inputs, weight, ctx)`` as every forward kernel,
    ``backward(grad_or_state, saved, ctx)`` for the backward steps (they communicate)."""

    forward: object = ring_forward
    backward: object = ring_backward
    wgrad: object = None


KERNEL = RingKernel()
