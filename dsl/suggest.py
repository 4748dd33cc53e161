""""Did you mean" notes for misspelt names."""

from __future__ import annotations

import difflib
from typing import Iterable


def did_you_mean(word: str, candidates: Iterable[str]) -> list[str]:
    """A one-element list with a note naming the closest candidates, or [] when none is close."""
    # Short names differ by a larger fraction per typo ("tq" for "tp"), so be more lenient.
    cutoff = 0.5 if len(word) <= 3 else 0.6
    close = difflib.get_close_matches(word, sorted(set(candidates)), n=3, cutoff=cutoff)
    if not close:
        return []
    return ["did you mean " + " or ".join(f"'{c}'" for c in close) + "?"]
