"""What a layer keeps between its forward and its backward: the recomputation policies of a
:class:`~.layer_exec.LayerRun`, chosen once when the run is made (:func:`keeping`).

* :class:`KeepAll` (``recompute = none``): every saved tensor stays until its backward reader.
* :class:`FullRecompute` (``recompute = full``): only the layer input is kept; the forward
  runs again (collectives included) before the first backward op. Every rank of a group
  replays at the same point of its op order.
* :class:`SelectiveRecompute` (``recompute = selective``): the outputs of the named forward
  ops are dropped when the forward ends (their places in the saved tensors marked) and
  computed again, from the inputs kept for them, when the backward starts.

The run tells its policy when the forward starts, after each forward kernel, when the
forward ends and before each backward op; the policy says what it holds (for the memory
probe) and whether the backward's preparation is done.
"""

from __future__ import annotations

from typing import Collection

import attrs
import torch


class KeepAll:
    """No recomputation: the forward's saved tensors stay until their backward readers."""

    prepared = True

    def started(self, run, x) -> None:
        """The forward starts on ``x``: nothing to keep."""

    def forwarded(self, run, op, out, args) -> None:
        """A forward kernel of ``op`` made ``out`` from ``args``: nothing to note."""

    def forward_ended(self, run) -> None:
        """The forward's last op has run: nothing to drop."""

    def before_backward(self, run, op=None) -> None:
        """Backward op ``op`` is about to run: nothing to rebuild."""

    def arrived(self, pending, value) -> None:
        """A collective's result landed: nothing kept refers to it."""

    def held(self) -> None:
        """What the policy itself holds: nothing."""
        return None


class FullRecompute(KeepAll):
    """Keep only the layer input; replay the forward before the first backward op."""

    def __init__(self):
        self.input = None
        self.replaying = False

    @property
    def prepared(self) -> bool:
        """Whether the replay has run (or there is nothing to replay)."""
        return self.input is None

    def started(self, run, x) -> None:
        """Keep the layer input (not the replay's own start)."""
        if not self.replaying:
            self.input = x

    def forward_ended(self, run) -> None:
        """Drop the saved tensors: the backward rebuilds them from the kept input."""
        if not self.replaying:
            run.saved.clear()

    def before_backward(self, run, op=None) -> None:
        """Run the forward again from the kept input, synchronously, to rebuild the saved
        tensors the backward reads; the layer output stays as it was."""
        if self.input is None:
            return
        output = run.plan.fwd.output
        kept = {output: run.acts[output]} if output in run.acts else {}
        self.replaying = True
        run.restart_forward()
        run.start(self.input)
        for op in run.plan.fwd.ops:
            run.forward_op(op)
        run.output()  # nothing of the replay left in flight
        run.acts = kept
        self.input, self.replaying = None, False
        run.version += 1

    def arrived(self, pending, value) -> None:
        """The input kept for recomputation arrived: keep the tensor."""
        if self.input is pending:
            self.input = value

    def held(self):
        """The kept input."""
        return self.input


class SelectiveRecompute(KeepAll):
    """Drop the outputs of the ``selective`` forward ops at the forward's end; compute them
    again from the inputs kept for them before the first backward op."""

    def __init__(self, selective: Collection[str]):
        self.selective = frozenset(selective)
        self.recipes: dict[str, tuple] = {}
        self.dropped: dict[str, torch.Tensor] = {}

    @property
    def prepared(self) -> bool:
        """Whether the dropped outputs have been rebuilt (or none were dropped)."""
        return not self.recipes

    def forwarded(self, run, op, out, args) -> None:
        """Note how to make ``out`` again when ``op`` is one whose output is dropped: its
        inputs, kept tensors or dropped ones by name."""
        if op.name in self.selective:
            self.recipes[op.name] = (op, [n if n in self.selective else a for n, a in zip(op.inputs, args)])
            self.dropped[op.name] = out

    def forward_ended(self, run) -> None:
        """Every saved tensor that is a dropped op's output becomes a :class:`Dropped` mark,
        and the output is let go."""
        if not self.dropped:
            return
        names = {id(tensor): name for name, tensor in self.dropped.items()}
        for key, saved in run.saved.items():
            if isinstance(saved, tuple) and any(id(t) in names for t in saved):
                run.saved[key] = tuple(Dropped(names[id(t)]) if id(t) in names else t for t in saved)
        for name in self.dropped:
            if name != run.plan.fwd.output:
                run.acts.pop(name, None)
        self.dropped.clear()
        run.version += 1

    def before_backward(self, run, op=None) -> None:
        """Run the dropped ops' forward kernels again (in forward order, from the kept
        inputs) and put their outputs back where they were saved: before the first backward
        op, or, under ZeRO-3 where the norms' weights are gathered again for the backward,
        before the first op that waits for those gathers (``run.plan.rebuild_readers``)."""
        if not self.recipes or (op is not None and run.plan.rebuild_readers
                                and op.name not in run.plan.rebuild_readers):
            return
        made: dict[str, torch.Tensor] = {}
        for name, (op, inputs) in self.recipes.items():
            made[name] = run.remake(op, [made[x] if isinstance(x, str) else x for x in inputs])
        for key, saved in run.saved.items():
            if isinstance(saved, tuple) and any(isinstance(t, Dropped) for t in saved):
                run.saved[key] = tuple(made[t.name] if isinstance(t, Dropped) else t for t in saved)
        self.recipes.clear()
        run.version += 1

    def held(self):
        """The inputs kept to make the dropped outputs again."""
        return [inputs for _, inputs in self.recipes.values()]


@attrs.frozen
class Dropped:
    """Where a saved tensor was that selective recomputation dropped: the op that makes it."""

    name: str


def keeping(recompute: bool, selective: Collection[str]) -> KeepAll:
    """The policy of a run: full recomputation when ``recompute``, selective when it names
    ops to drop, else none (both at once is refused: a program chooses one)."""
    if recompute and selective:
        raise ValueError("a layer recomputes fully or selectively, not both")
    if recompute:
        return FullRecompute()
    return SelectiveRecompute(selective) if selective else KeepAll()
