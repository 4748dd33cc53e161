"""benchmarks/schedule_table.py: its simulated section prices what `dhelix tune --keep …
--generated` prices and ranks it as tune does; the results file starts with its command."""

from __future__ import annotations

import json
import sys

from commands import dhelix_here
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import schedule_table as bench  # noqa: E402
from dhelix.dsl.search.pricer import Priced  # noqa: E402


def test_every_stdlib_and_generated_pipeline_is_priced_and_ranked_as_tune_ranks_it():
    result = bench.simulate_program("llama39b_a40", "examples/llama39b_a40.dhx")
    assert {c.pipeline for c in result.choices} == set(bench.stdlib_pipelines()) | set(bench.GENERATED)
    # Only the fold, the pipeline and SI vary.
    assert len({c.layout for c in result.choices}) == 1
    fits = sorted((r.seconds, c) for c, r in result.priced.items() if isinstance(r, Priced) and r.fits)
    places = {c: result.ranks[c] for _, c in fits}
    # Places go with the step; a choice tune lists with another takes that one's place.
    listed = [c for _, c in fits if isinstance(places[c], int)]
    assert [places[c] for c in listed] == list(range(1, len(listed) + 1))
    assert all(str(p).startswith("=#") for p in places.values() if not isinstance(p, int))
    # tune's own listing, through the command line, in the same order.
    keep = ",".join(bench.KEEP)
    out = dhelix_here("tune", "examples/llama39b_a40.dhx", "--keep", keep, "--generated", "--top", "30",
                      "--json", "-j", "1")
    assert out.returncode == 0, out.stderr
    top = [t["choice"] for t in json.loads(out.stdout)["top"]]
    assert [(t["fold"], t["pipeline"], t["si"]) for t in top] == [(c.fold, c.pipeline, c.si) for c in listed]


def test_the_results_file_starts_with_its_command_and_ends_with_a_reading():
    text = (ROOT / "benchmarks" / "results" / "cpu_schedule_table.txt").read_text()
    assert text.splitlines()[0] == "$ .venv/bin/python benchmarks/schedule_table.py"
    assert "## Where `dhelix tune` puts the new schedules" in text and "## Reading" in text
    assert "one_f_one_b_overlap" in text
