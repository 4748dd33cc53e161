"""A communicator that times the collectives it passes on (`dhelix profile`'s layer pass).

The host's time between a layer's ops is what a pass of the whole layer takes beyond its ops
(:func:`dhelix.dsl.planner.calibrate._between_ops`). A pass over tp, cp or ep also holds its
collectives, and a collective timed alone is no measure of the same collective inside the
pass: on a link that lends credit after idling, or with a peer late by its own host work, the
two differ by more than the whole host time of the layer (on the emulated two-node link a
tp 2 layer's all-reduces, timed alone, outweighed the pass: no time between ops was left). So
the pass marks its own collectives, through :class:`ClockedComm`, and leaves them out.
"""

from __future__ import annotations

from typing import Any, Callable

from dhelix.interpreter.ops.comm import Communicator


class ClockedComm(Communicator):
    """``inner``'s collectives, each call's span marked with ``mark`` (the profile's clock:
    CUDA events on a GPU, where a run's :class:`~dhelix.interpreter.execute.recording.TimedComm`
    reads the host's clock, which a collective enqueued on a stream leaves at once):
    :attr:`spans` holds (start, stop) marks, turned into time by the caller once the pass is
    done (on CUDA a mark is an event, read after it completes). A collective issued
    asynchronously is marked to its issue only: the layer pass issues them synchronously.
    Its primitives are ``inner``'s, clocked (:func:`_clocked`, set below the class);
    anything else (process groups, names) is ``inner``'s."""

    def __init__(self, inner: Communicator, mark: Callable[[], Any]):
        self.inner, self._mark = inner, mark
        self.rank, self.mesh = inner.rank, inner.mesh
        self.names_ops = inner.names_ops
        self.completes_at_issue = inner.completes_at_issue
        self.spans: list[tuple[Any, Any]] = []

    def __getattr__(self, name: str) -> Any:  # only what this class and Communicator lack
        return getattr(self.inner, name)

    def _timed(self, primitive: Callable[..., Any], *args: Any) -> Any:
        start = self._mark()
        out = primitive(*args)
        self.spans.append((start, self._mark()))
        return out

    def post_p2p(self, transfers) -> list:
        return self.inner.post_p2p(transfers)


def _clocked(name: str) -> Callable[..., Any]:
    """The primitive ``name`` of the inner communicator, its span marked."""
    def primitive(self: ClockedComm, *args: Any) -> Any:
        return self._timed(getattr(self.inner, name), *args)

    primitive.__name__ = name
    return primitive


for _name in ("_all_gather", "_reduce_scatter", "_all_reduce", "_all_to_all", "_reduce", "_broadcast", "_send", "_recv"):
    setattr(ClockedComm, _name, _clocked(_name))
