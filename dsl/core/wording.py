""""Did you mean" notes for misspelt names."""

from __future__ import annotations

import difflib
from typing import Iterable


def did_you_mean(word: str, candidates: Iterable[str]) -> list[str]:
    """A one-element list with a note naming the closest candidates, or [] when none is close."""
    close = close_matches(word, candidates)
    if not close:
        return []
    quoted = [f"'{c}'" for c in close]
    listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return [f"did you mean {listed}?"]


def close_matches(word: str, candidates: Iterable[str]) -> list[str]:
    """Up to three candidates close to ``word``, closest first."""
    # Short names differ by a larger fraction per typo ("tq" for "tp"), so be more lenient.
    cutoff = 0.5 if len(word) <= 3 else 0.6
    close = difflib.get_close_matches(word, sorted(set(candidates)), n=3, cutoff=cutoff)
    if len(word) <= 2 and len(close) > 1:
        # "xp" is one letter from tp, pp and ep alike: only a shared first letter is a hint.
        close = [c for c in close if c[:1] == word[:1]]
    return close
