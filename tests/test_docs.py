"""The language reference names every operator of the library with its real signature."""

from __future__ import annotations

from conftest import ROOT
from dhelix.dsl.core.oplib import OPS


def test_language_reference_lists_every_operator_with_its_usage():
    text = (ROOT / "docs" / "language.md").read_text()
    missing = [op.usage() for op in OPS.values() if f"`{op.usage()}`" not in text]
    assert not missing


def test_the_architecture_tour_names_every_module():
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = [path for folder in ("dsl", "interpreter", "dhelix") for path in (ROOT / folder).rglob("*.py")
               if path.name != "__init__.py"]
    missing = sorted(str(p.relative_to(ROOT)) for p in modules if not re.search(rf"\b{p.stem}\b", text))
    assert missing == [], f"docs/architecture.md does not name {missing}"


def test_the_readmes_error_example_is_what_check_prints(capsys, monkeypatch):
    import re

    from dhelix.cli import main

    text = (ROOT / "README.md").read_text()
    block = re.search(r"Errors look like this.*?```\n\$ dhelix check (\S+)\n(.*?)```", text, re.DOTALL)
    assert block, "README.md's error example is missing"
    monkeypatch.chdir(ROOT)
    assert main(["check", block.group(1)]) == 1
    assert capsys.readouterr().err == block.group(2)


def _figures():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "docs" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readmes_example_outputs_are_current():
    figures = _figures()
    for name in figures.BLOCKS:
        assert figures.readme_block(name) == figures.block(name), f"run python docs/figures.py ({name})"


def test_the_readme_lists_the_commands_that_draw_its_pictures():
    text = (ROOT / "README.md").read_text()
    for command in _figures().PICTURES:
        assert command in text
        assert (ROOT / command.split(" -o ")[1]).is_file()


def test_the_readme_promises_the_compare_columns_that_simulate_prints():
    # Issue 53: it promised a plain 1F1B baseline column that --compare never printed.
    from dhelix.dsl.passes.pipeline import check_text
    from dhelix.dsl.simulator.report import compare

    text = (ROOT / "README.md").read_text()
    entry = next(line for line in text.splitlines() if line.startswith("| `dhelix simulate FILE"))
    path = ROOT / "examples" / "tiny_llama_centauri_cpu.dhx"
    labels = [sim.label for sim in compare(check_text(path.read_text(), str(path)))[1:]]
    assert labels and all(f'"{label}"' in entry for label in labels), labels
    assert "baseline" not in entry


def test_the_readmes_demo_figures_are_the_results_file_s():
    # Issue 53, item 14: README quoted a demo run of long ago (5.89 -> 2.87, held-out 2.90);
    # its sentence is now written with benchmarks/results/cpu_demo.txt from `make demo`'s outputs.
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_demo_figures",
                                                  ROOT / "benchmarks" / "readme_demo_figures.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    results = (ROOT / "benchmarks" / "results" / "cpu_demo.txt").read_text()
    assert results.splitlines()[0] == demo.COMMAND
    found = demo.read_results(results)
    assert set(found) == set(demo.KEYS) and "unknown" not in found.values()
    readme = (ROOT / "README.md").read_text()
    start, end = demo.marked(readme)
    assert readme[start:end] == demo.sentence(found)
    assert "5.89" not in readme and "297 ms" not in readme  # the stale figures
