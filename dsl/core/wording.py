"""How messages word things: lists of words and "did you mean" notes for misspelt names."""

from __future__ import annotations

import difflib
from typing import Iterable


def join_words(words: Iterable[object], last: str = "and") -> str:
    """``words`` as a sentence lists them: 'a', 'a and b', 'a, b and c' (with ``last`` "or":
    'a, b or c'); "" for no words. Each word is written with ``str``."""
    texts = [str(word) for word in words]
    if len(texts) <= 1:
        return "".join(texts)
    return ", ".join(texts[:-1]) + f" {last} " + texts[-1]


def did_you_mean(word: str, candidates: Iterable[str]) -> list[str]:
    """A one-element list with a note naming the closest candidates, or [] when none is close."""
    close = close_matches(word, candidates)
    if not close:
        return []
    quoted = [f"'{c}'" for c in close]
    return [f"did you mean {join_words(quoted, 'or')}?"]


def close_matches(word: str, candidates: Iterable[str]) -> list[str]:
    """Up to three candidates close to ``word``, closest first."""
    # Short names differ by a larger fraction per typo ("tq" for "tp"), so be more lenient.
    cutoff = 0.5 if len(word) <= 3 else 0.6
    close = difflib.get_close_matches(word, sorted(set(candidates)), n=3, cutoff=cutoff)
    if len(word) <= 2 and len(close) > 1:
        # "xp" is one letter from tp, pp and ep alike: only a shared first letter is a hint.
        close = [c for c in close if c[:1] == word[:1]]
    return close
