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


def test_the_example_outputs_of_readme_and_docs_are_current():
    # README shows the compare block, docs/commands.md the plan block (issue 57, item 6).
    figures = _figures()
    for name in figures.BLOCKS:
        for page, text in figures.shown(name):
            assert text == figures.block(name), f"run python docs/figures.py ({name} in {page})"
    assert [page for page, _ in figures.shown("compare")] == ["README.md"]


def test_every_picture_shown_is_listed_with_the_command_that_draws_it():
    # README shows one picture beside its command; docs/diagrams.md shows them all with theirs.
    import re

    readme = (ROOT / "README.md").read_text()
    diagrams = (ROOT / "docs" / "diagrams.md").read_text()
    drawn = {}
    for command in _figures().PICTURES:
        output = command.split(" -o ")[1]
        assert (ROOT / output).is_file()
        assert command.replace(".png", ".$ext") in diagrams, command
        drawn[output] = command
    in_readme = re.findall(r'(?:\]\(|src=")(docs/[\w.]+\.png)', readme)
    assert in_readme and all(drawn[picture] in readme for picture in in_readme), in_readme
    in_diagrams = re.findall(r'(?:\]\(|src=")([\w.]+\.png)', diagrams)
    assert sorted(set(in_diagrams)) == sorted(output.removeprefix("docs/") for output in drawn)


def test_the_docs_promise_the_compare_columns_that_simulate_prints():
    # Issue 53: README promised a plain 1F1B baseline column that --compare never printed. Its
    # table keeps a one-line entry; the full one is docs/commands.md's (issue 57, item 6).
    import re

    from dhelix.dsl.passes.pipeline import check_text
    from dhelix.dsl.simulator.report import compare

    readme = (ROOT / "README.md").read_text()
    entry = next(line for line in readme.splitlines() if line.startswith("| `dhelix simulate FILE"))
    detail = re.search(r"## `dhelix simulate`\n(.*?)\n## ", (ROOT / "docs" / "commands.md").read_text(), re.DOTALL)
    assert detail
    path = ROOT / "examples" / "tiny_llama_centauri_cpu.dhx"
    labels = [sim.label for sim in compare(check_text(path.read_text(), str(path)))[1:]]
    for text in (entry, detail.group(1)):
        assert labels and all(f'"{label}"' in text for label in labels), labels
        assert "baseline" not in text


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


def test_the_schedule_file_shown_is_the_example_it_names():
    # README and docs/tour.md show examples/llama39b_a40.dhx compactly, the program whose
    # predicted step README's compare block prints: the same program, pass by pass.
    import re

    from dhelix.dsl.passes.pipeline import check_text

    path = ROOT / "examples" / "llama39b_a40.dhx"
    example = check_text(path.read_text(), str(path))
    for page in (ROOT / "README.md", ROOT / "docs" / "tour.md"):
        text = page.read_text()
        assert "`examples/llama39b_a40.dhx`" in text
        shown = re.search(r"```\n(import .*?)```", text, re.DOTALL).group(1)
        program = check_text(shown, str(path))  # the imports resolve beside the example
        fields = [name for name in program.__slots__ if not name.startswith("__") and name != "files"]
        assert [name for name in fields if getattr(program, name) != getattr(example, name)] == [], page
