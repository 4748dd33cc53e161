"""`dhelix report`: one self-contained HTML page per schedule.

The plain tests read the page as text (every section, no address, no script, a run's figures
beside the prediction, bad --run files); the Chromium tests open it in a real headless
browser (Debian's ``chromium``, skipped when it is absent) and check the rendered DOM and that
no script error is logged.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import HANG_S, ROOT
from dhelix.cli import main
from dhelix.dsl.render.report import SECTIONS

EXAMPLE = ROOT / "examples" / "tiny_llama_cpu.dhx"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")

#: A run's metrics as `dhelix run --metrics` writes them (the fields the page reads).
METRICS = {"file": "examples/tiny_llama_cpu.dhx", "backend": "gloo", "si": True, "steps": 2,
           "losses": [5.61, 5.43], "step_s": 0.0123, "exposed_comm_s": 0.0021, "peak_activations_bytes": 1048576,
           "predicted": {"step_s": 0.0011, "exposed_comm_s": 0.0009, "peak_activations_bytes": 524288,
                         "note": "predicted for the a40 profile",
                         "pipeline_ranks": [{"pp": 0, "peak_activations_bytes": 524288,
                                             "model_states_bytes": 3 * 2**20}]},
           "ranks": [{"rank": 0, "pp": 0, "device": "cpu", "step_s": [0.5, 0.0123, 0.0125],
                      "peak_activations_bytes": 1048576, "model_states_bytes": 3 * 2**20}]}


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    """The tiny example's report with a run's metrics, written once for the module."""
    folder = tmp_path_factory.mktemp("report")
    metrics = folder / "m.json"
    metrics.write_text(json.dumps(METRICS))
    out = folder / "r.html"
    assert main(["report", str(EXAMPLE), "-o", str(out), "--run", str(metrics)]) == 0
    return out


def test_the_page_has_every_section_and_names_no_address(page):
    text = page.read_text()
    for key in SECTIONS:
        assert f'<section id="{key}">' in text, key
    assert not re.search(r"https?://", text)
    assert "<script" not in text and "<link" not in text and "src=" not in text
    # The timeline shows the SI blocks' segment pairs and each action's hidden/exposed layer comm.
    timeline = text[text.index('<section id="timeline">'):text.index('<section id="memory">')]
    assert "SI pair 1" in timeline and "layer_comm_exposed_s" in timeline
    assert "pipeline rank 1" in timeline


def test_the_page_shows_measured_beside_predicted_and_the_commands(page):
    text = page.read_text()
    measured = text[text.index('<section id="measured">'):]
    assert "12.3 ms" in measured and "1.10 ms" in measured  # the run's step, the run's prediction
    assert "5.6100 → 5.4300" in measured
    # Per rank: the median step without the first, memory beside its pipeline rank's prediction.
    assert re.search(r"<td>0</td><td>0</td><td>cpu</td><td>12.4 ms</td><td>1.000 MiB</td><td>0.500 MiB</td>"
                     r"<td>3.000 MiB</td><td>3.000 MiB</td>", measured)
    commands = text[text.index('<section id="commands">'):text.index('<section id="pipeline">')]
    assert f"dhelix report {EXAMPLE}" in commands and "--run" in commands


def test_without_graphviz_the_diagrams_are_text(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    out = tmp_path / "r.html"
    assert main(["report", str(EXAMPLE), "-o", str(out)]) == 0
    assert "Graphviz `dot` is not installed" in capsys.readouterr().out
    text = out.read_text()
    assert "<svg" in text  # the timeline and memory are drawn here, not by Graphviz
    pipeline = text[text.index('<section id="pipeline">'):text.index('<section id="placement">')]
    assert "r0:" in pipeline and "<svg" not in pipeline
    assert "No run given" in text and "--run run.json" in text


@pytest.mark.parametrize("content, message", [
    ("not json", "not JSON"),
    ('{"losses": [1]}', "not the metrics of a run"),
    ('{"step_s": "fast"}', "'step_s' is 'fast', not a number"),
])
def test_a_bad_run_file_is_a_clear_error(content, message, tmp_path, capsys):
    metrics = tmp_path / "m.json"
    metrics.write_text(content)
    assert main(["report", str(EXAMPLE), "-o", str(tmp_path / "r.html"), "--run", str(metrics)]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "r.html").exists()


def test_the_output_must_be_html_and_not_the_run_file(tmp_path, capsys):
    metrics = tmp_path / "m.json"
    metrics.write_text(json.dumps(METRICS))
    assert main(["report", str(EXAMPLE), "-o", str(tmp_path / "r.txt")]) == 2
    assert "the report is an .html file" in capsys.readouterr().err
    assert main(["report", str(EXAMPLE), "-o", str(metrics), "--run", str(metrics)]) == 2
    assert "that is an input of this command" in capsys.readouterr().err
    assert json.loads(metrics.read_text()) == METRICS


def test_the_metrics_of_another_program_are_refused_and_unfingerprinted_ones_warned(tmp_path, capsys):
    # Issue 53, item 14: another program's metrics.json was taken silently.
    from dhelix.cli.report import same_program
    from dhelix.dsl.frontend.imports import sources_digest
    from dhelix.dsl.passes.pipeline import check_text

    text = EXAMPLE.read_text()
    digest = sources_digest(check_text(text, str(EXAMPLE)).files, text)
    metrics = tmp_path / "m.json"
    metrics.write_text(json.dumps({**METRICS, "program": {"sources_sha256": "0123456789abcdef"}}))
    assert main(["report", str(EXAMPLE), "-o", str(tmp_path / "r.html"), "--run", str(metrics)]) == 2
    assert capsys.readouterr().err == (
        f"dhelix: --run {metrics}: those are the metrics of a run of another program ('examples/tiny_llama_cpu.dhx', "
        f"sources 0123456789abcdef), not of {EXAMPLE} as it is now (sources {digest}); give the metrics "
        f"`dhelix run {EXAMPLE} --metrics OUT.json` writes\n")
    assert not (tmp_path / "r.html").exists()
    same_program({**METRICS, "program": {"sources_sha256": digest}}, "m.json", "t.dhx", digest)
    assert capsys.readouterr().err == ""  # its own program's: nothing said
    same_program(METRICS, "m.json", "t.dhx", digest)  # an older dhelix's, without the fingerprint
    assert capsys.readouterr().err.startswith("warning: --run m.json: these metrics name no fingerprint of their "
                                              "program (an older dhelix wrote them): nothing tells they are a run "
                                              "of t.dhx")
    assert sources_digest(check_text(text, str(EXAMPLE)).files, text + "# edited\n") != digest


def _chromium(page: Path, tmp_path: Path) -> tuple[str, str]:
    """The DOM Chromium renders from ``page`` and what it logged (console messages included)."""
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--enable-logging=stderr",
         "--v=0", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=HANG_S, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, result.stderr


def _script_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if "CONSOLE" in line or "Uncaught" in line]


@needs_chromium
def test_chromium_renders_every_section_without_a_script_error(page, tmp_path):
    dom, log = _chromium(page, tmp_path)
    for key in SECTIONS:
        assert re.search(rf'<section id="{key}">\s*<h2>', dom), key
    assert dom.count("<svg") >= 6  # four diagrams, the ladder included, the timeline and memory
    assert _script_errors(log) == []


@needs_chromium
def test_chromium_script_errors_are_seen(tmp_path):
    # The check above would see an error: a page whose script fails logs it.
    broken = tmp_path / "broken.html"
    broken.write_text("<!DOCTYPE html><html><body><script>no_such_function();</script></body></html>")
    _, log = _chromium(broken, tmp_path)
    assert any("no_such_function" in line for line in _script_errors(log))
