""""Did you mean" notes for misspelt names."""

from __future__ import annotations

import difflib
from typing import Iterable


def did_you_mean(word: str, candidates: Iterable[str]) -> list[str]:
    """A one-element list with a note naming the closest candidates, or [] when none is close."""
    close = difflib.get_close_matches(word, sorted(set(candidates)), n=3, cutoff=0.6)
    if not close:
        return []
    return ["did you mean " + " or ".join(f"'{c}'" for c in close) + "?"]
