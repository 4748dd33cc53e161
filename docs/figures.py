"""Regenerate the example outputs of README.md and docs/ and the pictures in docs/ from their commands.

    python docs/figures.py            # rewrite the pages' example blocks and the docs/ pictures
    python docs/figures.py --check    # exit 1 if a block is not what its command prints now

An example block sits in one of :data:`PAGES`, between ``<!-- figures: NAME -->`` and
``<!-- /figures -->``; its text is the command's output cut to the lines :data:`BLOCKS` keeps
(the pages show excerpts). The pictures are drawn by the ``dhelix render`` commands of
:data:`PICTURES`: README.md lists the one it shows, docs/diagrams.md all of them (Graphviz's
``dot`` is needed for them). ``tests/test_docs.py`` holds the pages' blocks to this script's
output, so figures cannot go stale silently.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: The pages that may hold example blocks: a block may sit in any of them, or in several.
PAGES = (README, ROOT / "docs" / "commands.md")


def _plan_lines(lines: list[str]) -> list[str]:
    table = [k for k, line in enumerate(lines) if line.lstrip().startswith("#  fwd")][0]
    keep = [line for line in lines if line.startswith("plan ")]
    return keep + lines[table:table + 3] + [" …"] + [line for line in lines
                                                      if line.startswith(("predicted ", "communication "))]


def _compare_lines(lines: list[str]) -> list[str]:
    rows = ("step time s ", "MFU ", "layer comm exposed s ", "peak memory GB (rank) ")
    header = [line for line in lines if line.lstrip().startswith("as written")]
    return header + [line for line in lines if line.startswith(rows)]


#: Block name → (the command line, what of its output the block shows).
BLOCKS = {
    "plan": ("dhelix plan examples/llama39b_a40.dhx", _plan_lines),
    "compare": ("dhelix simulate examples/llama39b_a40.dhx --compare", _compare_lines),
}

#: The pictures of docs/ and README.md, each as the command that draws it (.png and .svg).
PICTURES = (
    "dhelix render examples/llama8b_a40.dhx --ranks 4 --microbatches 12 -o docs/pipeline_w_helix_p4_m12.png",
    "dhelix render examples/llama8b_a40.dhx --ranks 4 --microbatches 12 --pipeline one_f_one_b "
    "-o docs/pipeline_1f1b_p4_m12.png",
    "dhelix render examples/llama8b_a40.dhx --what placement --ranks 4 --layers 8 -o docs/placement_u_8layers_p4.png",
    "dhelix render examples/llama39b_cp2_a40.dhx --what dag -o docs/dag_llama.png",
    "dhelix render examples/llama39b_a40.dhx --what pairing -o docs/pairing_llama39b_a40.png",
)


def run(command: str) -> str:
    """What ``command`` (a ``dhelix …`` line) prints on standard output, run in-process from
    the repository's root; RuntimeError if it fails."""
    from dhelix.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), _in_root():
        code = main(shlex.split(command)[1:])
    if code != 0:
        raise RuntimeError(f"`{command}` exited {code}")
    return out.getvalue()


@contextlib.contextmanager
def _in_root():
    import os

    before = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(before)


def block(name: str) -> str:
    """The block ``name`` as the command prints it now: ``$ command`` and the lines kept."""
    command, keep = BLOCKS[name]
    return "\n".join([f"$ {command}", *keep(run(command).splitlines())]) + "\n"


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- figures: {name} -->\n```\n)(.*?)(```\n<!-- /figures -->)", re.DOTALL)


def shown(name: str) -> list[tuple[str, str]]:
    """Each copy of the block ``name`` the pages hold now, as (the page, relative to the root,
    its text); ValueError when no page holds it."""
    found = [(str(page.relative_to(ROOT)), match.group(2)) for page in PAGES
             for match in _pattern(name).finditer(page.read_text())]
    if not found:
        pages = ", ".join(str(page.relative_to(ROOT)) for page in PAGES)
        raise ValueError(f"none of {pages} holds <!-- figures: {name} -->")
    return found


def update_pages() -> None:
    """Rewrite every page's blocks with what their commands print now."""
    for name in BLOCKS:
        shown(name)  # each block must be somewhere
    for page in PAGES:
        text = page.read_text()
        for name in BLOCKS:
            text = _pattern(name).sub(lambda m, name=name: m.group(1) + block(name) + m.group(3), text)
        page.write_text(text)


def draw_pictures() -> None:
    """Draw every picture of :data:`PICTURES`, as .png and as .svg."""
    for command in PICTURES:
        run(command)
        run(command.replace(".png", ".svg"))


def main(argv: list[str]) -> int:
    """``--check``: 1 when a page's block is stale; otherwise regenerate everything."""
    if "--check" in argv:
        stale = [(page, name) for name in BLOCKS for page, text in shown(name) if text != block(name)]
        for page, name in stale:
            print(f"{page}'s block '{name}' is stale: run python docs/figures.py", file=sys.stderr)
        return 1 if stale else 0
    update_pages()
    draw_pictures()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
