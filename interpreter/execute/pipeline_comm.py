"""Point-to-point transfers of activations and gradients between pipeline ranks.

The lowered schedule puts SENDs right after the action producing the data and RECVs right
before the action consuming it (:mod:`dhelix.dsl.core.schedule`); on gloo the executor posts
each receive :data:`RECV_AHEAD` RECVs earlier. The executor queues the
transfers of a run of consecutive SEND/RECV actions here and :meth:`PipelineComm.flush` posts
them as one batch (the communicator's ``post_p2p``: ``batch_isend_irecv``), so a rank that both sends and receives never blocks on the
order of the two. Sends stay in flight (their tensors alive) until :meth:`PipelineComm.drain`;
a receive is a :class:`~.comm.Pending` that the consuming action waits for.

Matching: gloo takes a tag per message, so each transfer gets a tag derived from what it
carries (data, micro-batch, producing stage) and messages match whatever their order. NCCL
ignores tags inside a batch and matches messages between two ranks in the order they were
posted; :func:`~dhelix.dsl.passes.validate.check_fifo` verifies that every sender's order equals its receiver's, which
the executor requires before running a schedule on a backend without tags.
"""

from __future__ import annotations

import torch

from dhelix.dsl.core.schedule import Lowered, Transfer

from dhelix.interpreter.ops.comm import Communicator, Pending


#: How many RECVs ahead of its turn a rank posts a receive, on a backend with tags (the
#: executor's ``_post_receives``). A gloo message crosses only once its receive is posted
#: (measured on the emulated two-node link: a 1 MiB receive posted half a second after its
#: send still waited the 44 ms the link takes): posted at its RECV, right before the action
#: that reads it, the whole transfer stood in that action's way, and a pipeline with two
#: virtual stages per rank spent 60 % of its step waiting so. Two: the next receive from
#: each neighbour while the current one is read. A posted receive holds its buffer (one layer
#: input) from then on; the memory probe and the simulator count it from its RECV: up to
#: RECV_AHEAD layer inputs a rank holds that they do not.
RECV_AHEAD = 2


class _Slot:
    """The work of a receive, known only once its batch is posted; waited through Pending."""

    def __init__(self) -> None:
        self.work = None

    def wait(self) -> None:
        if self.work is None:
            raise RuntimeError("a receive was waited for before its batch was posted (flush first)")
        self.work.wait()


def transfer_tag(lowered: Lowered, key: tuple) -> int:
    """A tag unique within a step for a transfer's key (data, micro-batch, producing stage)."""
    data, microbatch, stage = key
    return (stage * lowered.microbatches + microbatch) * 2 + (data == "B")


class PipelineComm:
    """Queues the SEND/RECV actions of one rank and posts them in batches.

    ``comm`` gives the pipeline group (lowered peer p is global rank ``group_ranks('pp')[p]``);
    ``use_tags`` is True on gloo (see the module docstring); ``timed(pending, transfer)`` wraps
    a receive's Pending so that waiting for it counts as exposed communication (identity by default).
    """

    def __init__(self, comm: Communicator, lowered: Lowered, use_tags: bool, timed=None):
        self.comm, self.lowered, self.use_tags = comm, lowered, use_tags
        self.pp_ranks = comm.group_ranks("pp")
        self.timed = timed or (lambda pending, transfer: pending)
        self._ops: list = []
        self._slots: list[_Slot] = []
        self._in_flight: list = []  # (work, tensor) of posted sends

    def _tag(self, key: tuple) -> int:
        return transfer_tag(self.lowered, key) if self.use_tags else 0

    def send(self, tensor: torch.Tensor, transfer: Transfer, key: tuple) -> None:
        """Queue sending ``tensor`` for ``transfer`` (a SEND whose key is ``key``)."""
        peer = self.pp_ranks[transfer.peer]
        self._ops.append(("send", tensor.contiguous(), peer, self._tag(key)))
        self._slots.append(None)

    def recv(self, shape, dtype: torch.dtype, device, transfer: Transfer, key: tuple) -> Pending:
        """Queue receiving a ``shape`` tensor for ``transfer``; the Pending resolves to it
        once the batch is posted (:meth:`flush`) and the message has arrived."""
        buffer = torch.empty(tuple(shape), dtype=dtype, device=device)
        peer = self.pp_ranks[transfer.peer]
        slot = _Slot()
        self._ops.append(("recv", buffer, peer, self._tag(key)))
        self._slots.append(slot)
        return self.timed(Pending(slot, buffer), transfer)

    def flush(self) -> None:
        """Post the queued transfers as one batch (nothing to do when none are queued)."""
        if not self._ops:
            return
        works = self.comm.post_p2p(self._ops)
        for (_, tensor, _, _), slot, work in zip(self._ops, self._slots, works, strict=True):
            if slot is None:
                self._in_flight.append((work, tensor))
            else:
                slot.work = work if work is not None else _Done()
        self._ops, self._slots = [], []

    def drain(self) -> None:
        """Wait for every posted send (at the end of a step, so buffers can be reused)."""
        self.flush()
        for work, _ in self._in_flight:
            if work is not None:
                work.wait()
        self._in_flight = []


class _Done:
    def wait(self) -> None:
        return None
