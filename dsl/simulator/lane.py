"""One communication lane of one simulated rank: the intervals it is busy, pipeline traffic
booked in program order and gradient buckets fitted into its idle gaps.

The simulator books every pipeline transfer before any bucket (buckets after the rank's
actions), and a rank's buckets one after another (each ready no earlier than the previous
one's end). A bucket then only has to look among the in-order traffic after its ready time,
and a fit (first gap long enough) is found without scanning every interval: the intervals
are kept sorted, those ending by the ready time are skipped by bisection, and runs of
intervals whose gaps are all too short are skipped by the largest gap of each block. The
answer is always the plain scan's (:meth:`Lane.scan`), to the last bit: a block is skipped
only when no gap in it comes within a margin far above rounding of the bucket's length,
and every candidate gap is then tested with the scan's own expression.
"""

from __future__ import annotations

import bisect
import itertools

#: Intervals per block of the largest-gap index.
BLOCK = 32


class Lane:
    """Busy intervals of one lane: :meth:`in_order` bookings (pipeline traffic, in program
    order) and :meth:`fit` bookings (gradient buckets, in the first idle gap)."""

    def __init__(self) -> None:
        #: The busy intervals (begin, end), sorted once :meth:`fit` needs them so.
        self.busy: list[tuple[float, float]] = []
        self.fifo = 0.0
        self._sorted = False
        #: The ends of ``busy`` in its order while it is sorted and its intervals do not
        #: overlap (then the ends are sorted too); None otherwise.
        self._ends: list[float] | None = None
        #: The intervals as sorted last (when apart), their ends, the gap before each and
        #: the largest gap of each BLOCK of them; the latest end of a fit booked since.
        self._static: list[tuple[float, float]] | None = None
        self._static_ends: list[float] = []
        self._gaps: list[float] = []
        self._blocks: list[float] = []
        self._fitted_end = float("-inf")

    def in_order(self, ready: float, seconds: float) -> float:
        """Book ``seconds`` after ``ready`` and after the previous in-order booking; the start."""
        start = max(ready, self.fifo)
        self.fifo = start + seconds
        self.busy.append((start, self.fifo))
        self._sorted = False
        return start

    def fit(self, ready: float, seconds: float) -> float:
        """Book ``seconds`` in the first idle gap at or after ``ready``; the start (what
        :meth:`scan` finds)."""
        if not self._sorted:
            self._sort()
        busy, ends = self.busy, self._ends
        if self._static is not None and ready >= self._fitted_end:
            # Every fit so far ends by ``ready``: the scan skips them, and only the
            # intervals of the last sort remain to look through.
            start = self._static_fit(ready, seconds)
        else:
            start = self.scan(busy, ready, seconds, bisect.bisect_right(ends, ready) if ends is not None else 0)
        booked = (start, start + seconds)
        at = bisect.bisect_right(busy, booked)
        busy.insert(at, booked)
        self._fitted_end = max(self._fitted_end, booked[1])
        if ends is not None:
            # A booking in a gap keeps the intervals apart (and the ends sorted).
            if (at and busy[at - 1][1] > booked[0]) or (at + 1 < len(busy) and busy[at + 1][0] < booked[1]):
                self._ends = None
            else:
                ends.insert(at, booked[1])
        return start

    @staticmethod
    def scan(busy: list[tuple[float, float]], ready: float, seconds: float, first: int = 0) -> float:
        """The start of the first gap of ``seconds`` at or after ``ready`` among the sorted
        intervals ``busy``, looking from index ``first`` (those before end by ``ready``)."""
        start = ready
        for begin, end in itertools.islice(busy, first, None):
            if end <= start:
                continue
            if begin >= start + seconds:
                break
            start = max(start, end)
        return start

    def _static_fit(self, ready: float, seconds: float) -> float:
        """:meth:`scan` over the intervals of the last sort (apart, so their ends are
        sorted: past the first one ending after ``ready``, the scan's start is the previous
        interval's end), skipping the blocks whose largest gap is clearly too short."""
        static, ends, gaps, blocks = self._static, self._static_ends, self._gaps, self._blocks
        assert static is not None, "called after a sort found the intervals apart"
        n = len(static)
        first = bisect.bisect_right(ends, ready)
        if first == n or static[first][0] >= ready + seconds:
            return ready
        # A gap the scan accepts (begin >= end + seconds) measures at least ``seconds`` less
        # a few roundings of the times; ``short`` is far below that.
        short = seconds - 1e-12 * (ends[-1] + seconds)
        i = first + 1
        while i < n:
            if i % BLOCK == 0 and blocks[i // BLOCK] < short:
                i += BLOCK
                continue
            if gaps[i] >= short and static[i][0] >= static[i - 1][1] + seconds:
                return static[i - 1][1]
            i += 1
        return ends[-1]

    def _sort(self) -> None:
        """Sort ``busy``; when no two intervals overlap, keep its ends and index its gaps."""
        self.busy.sort()
        self._sorted = True
        busy = self.busy
        apart = all(begin <= end for begin, end in busy) and all(
            busy[i][1] <= busy[i + 1][0] for i in range(len(busy) - 1))
        self._ends = [end for _, end in busy] if apart else None
        self._static, self._fitted_end = None, float("-inf")
        if apart and busy:
            self._static, self._static_ends = list(busy), [end for _, end in busy]
            self._gaps = [float("-inf")] + [busy[i][0] - busy[i - 1][1] for i in range(1, len(busy))]
            self._blocks = [max(self._gaps[k:k + BLOCK]) for k in range(0, len(busy), BLOCK)]
