"""How messages and reports word things: word lists, "did you mean" notes, fixed-width tables."""

from __future__ import annotations

from dhelix.dsl.core.table import format_table
from dhelix.dsl.core.wording import did_you_mean, join_words


def test_join_words_lists_like_a_sentence():
    assert join_words([]) == ""
    assert join_words(["a"]) == "a"
    assert join_words(["a", "b"]) == "a and b"
    assert join_words(["a", "b", "c"]) == "a, b and c"
    assert join_words([1, 2, 3], "or") == "1, 2 or 3"
    assert join_words(x for x in "ab") == "a and b"


def test_did_you_mean_quotes_the_closest_candidates():
    assert did_you_mean("tq", ["tp", "cp", "dp"]) == ["did you mean 'tp'?"]
    assert did_you_mean("microbatch", ["micro_batch", "microbatches", "seed"]) == [
        "did you mean 'micro_batch' or 'microbatches'?"]
    assert did_you_mean("zzz", ["tp"]) == []


def test_table_columns_are_as_wide_as_their_widest_cell():
    lines = format_table(["name", "time"], [["a", "1.0"], ["longer", "12.25"]], right={1})
    assert lines == ["name     time",
                     "a         1.0",
                     "longer  12.25"]
    # Left-aligned last columns leave no trailing spaces.
    assert format_table(["#", "ops"], [["1", "a, b"], ["2", "-"]], right={0}) == ["#  ops", "1  a, b", "2  -"]
