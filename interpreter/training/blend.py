"""Weighted blends of several data sources: ``--data 0.7:web/ 0.3:code.npy``.

Each item of ``--data`` is ``PATH`` or ``WEIGHT:PATH`` (a non-negative number, a colon, the
path; a path whose text before its first colon could be a number is written ``./2024:x``).
Either every item has a weight or none has: without weights each source weighs its number of
training sequences (as if the sources were one). The weights are normalised to sum to 1.

Which source sample ``j`` of the blend (counted over the whole run, as the batches are)
comes from is Megatron's blended-dataset rule: the source ``i`` furthest behind its share,
``argmax_i (w_i · (j + 1) − c_i)`` with ``c_i`` the samples source ``i`` gave so far (ties to
the first). Every prefix of the blend then keeps each source's count near ``w_i · j`` (the
tests find it within one sample), whatever the seed; the seed orders each source's own windows
(:class:`~.data.DataSource`). The position of the blend is ``(j, c)``: a checkpoint stores it
and a resumed run continues from it (:func:`advance` replays from any position, for a run
that has none).

Nothing here imports torch: the command line parses ``--data`` before any rank starts.
"""

from __future__ import annotations

import math
import re

import attrs

from dhelix.dsl.core.errors import UsageError

#: ``WEIGHT:PATH``: what stands before the first colon is read as a weight when it starts like
#: a number and holds no path separator.
_WEIGHTED = re.compile(r"^([-+.0-9][^:/\\]*):(.*)$", re.DOTALL)


@attrs.frozen
class DataItem:
    """One ``--data`` item: its ``path`` and its ``weight`` (None: none written)."""

    path: str
    weight: float | None = None


def parse_items(items, flag: str) -> list[DataItem]:
    """The items of ``flag``'s values ``items`` (strings); UsageError naming the item for a
    weight that is not a finite non-negative number, an empty path, weights given to some
    items only, or weights that sum to zero."""
    parsed = [_item(text, flag) for text in items]
    weighted = [item.weight is not None for item in parsed]
    if any(weighted) and not all(weighted):
        bare = next(text for text, has in zip(items, weighted, strict=True) if not has)
        raise UsageError(f"{flag} {bare}: give every source of a blend a weight (WEIGHT:PATH), or none",
                         notes=[f"for instance {flag} 0.7:corpus/ 0.3:code.npy"])
    if all(weighted) and parsed and sum(item.weight for item in parsed) <= 0:
        raise UsageError(f"{flag} {' '.join(items)}: the weights sum to zero; at least one source needs a "
                         "positive weight")
    return parsed


def _item(text: str, flag: str) -> DataItem:
    match = _WEIGHTED.match(text)
    if match is None:
        return DataItem(text)
    number, path = match.groups()
    try:
        weight = float(number)
    except ValueError:
        raise UsageError(f"{flag} {text}: '{number}' is not a weight", notes=[
            "a blend's item is WEIGHT:PATH with a number before the colon (0.7:corpus/); write a path "
            f"that starts like that as ./{text}"]) from None
    if not math.isfinite(weight) or weight < 0:
        raise UsageError(f"{flag} {text}: the weight {number} is {'negative' if weight < 0 else 'not finite'}; "
                         "a weight is a finite number, 0 or more")
    if not path:
        raise UsageError(f"{flag} {text}: the weight {number} has no path after its colon",
                         notes=["write WEIGHT:PATH, as in 0.7:corpus/"])
    return DataItem(path, weight)


def normalised(weights) -> tuple[float, ...]:
    """``weights`` scaled to sum to 1 (they are non-negative with a positive sum)."""
    total = math.fsum(weights)
    return tuple(w / total for w in weights)


def pick(weights: tuple[float, ...], sample: int, counts) -> int:
    """The source of blend sample ``sample`` given ``counts`` (what each source gave before
    it): the one furthest behind its share ``weights[i] · (sample + 1)``, the first on ties."""
    best, behind = 0, -math.inf
    for index, weight in enumerate(weights):
        gap = weight * (sample + 1) - counts[index]
        if gap > behind:
            best, behind = index, gap
    return best


def advance(weights: tuple[float, ...], sample: int, counts, stop: int) -> list[int]:
    """The counts after blend samples ``sample … stop - 1`` drawn from position
    (``sample``, ``counts``)."""
    counts = list(counts)
    for at in range(sample, stop):
        counts[pick(weights, at, counts)] += 1
    return counts
