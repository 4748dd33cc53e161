"""`dhelix render`: draw a schedule file as a Graphviz diagram.

Four diagrams (``--what``):

- ``pipeline`` (default): ranks × unit time, F/B/W/SI blocks (:mod:`dsl.render.pipeline`);
- ``placement``: which layers each rank and chunk holds, with the stage order drawn as arrows
  (:mod:`dsl.render.placement`);
- ``dag``: the layer's forward DAG and its derived backward DAG (:mod:`dsl.render.dag`);
- ``pairing``: the SI plan of a layer pair as a ladder of segment pairs (:mod:`dsl.render.ladder`,
  the paper's Figs. 9–10); it needs the cluster's hardware profile.

Output (``-o``) by extension: ``.dot`` is the DOT text, ``.svg`` and ``.png`` are rendered by
the Graphviz ``dot`` program; without ``-o`` the DOT text goes to standard output. The DOT text
is deterministic, byte for byte. When ``dot`` is not installed, the ``.dot`` file is written next
to the requested path, a message says how to install Graphviz, and the exit code is 1 (the
requested picture was not made, so scripts notice). Command-line mistakes (unknown diagram, bad
extension, unwritable path) exit 2; mistakes in the file exit 1 with the usual located message.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from dhelix.cli.paths import output_path, program_inputs, refuse_inputs, write_output
from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.core.outputfile import write_atomically
from dhelix.cli.overrides import add_override_arguments, overrides_from_args
from dhelix.dsl.passes.overrides import load_file
from dhelix.dsl.render.diagrams import DIAGRAMS, diagram_source
from dhelix.dsl.render.dot import run_dot
from dhelix.dsl.core.wording import did_you_mean

FORMATS = (".dot", ".svg", ".png")

INSTALL_HINT = ("install Graphviz to make SVG/PNG pictures: `apt-get install graphviz` (Debian, "
                "Ubuntu) or `brew install graphviz` (macOS)")


def register(subparsers) -> None:
    """Add the ``render`` command to the CLI's sub-command parsers."""
    render = subparsers.add_parser(
        "render", help="draw the pipeline, the layer placement, the layer DAG or the SI pairing",
        description="Draw FILE's pipeline schedule (ranks x unit time), its layer placement or "
                    "its layer DAG as a Graphviz diagram. Exit code 1 when the file has an error "
                    "or when Graphviz `dot` is missing for .svg/.png (the .dot is still written).")
    render.add_argument("file", metavar="FILE")
    render.add_argument("--what", default="pipeline", metavar="DIAGRAM",
                        help=f"which diagram: {', '.join(DIAGRAMS)} (default pipeline)")
    render.add_argument("-o", "--output", metavar="OUT",
                        help="output file, .svg, .png or .dot (default: DOT text on standard output)")
    add_override_arguments(render)
    render.set_defaults(func=cmd_render)


def cmd_render(args) -> int:
    """`dhelix render FILE [--what DIAGRAM] [-o OUT] [overrides]`; returns the exit code."""
    if args.what not in DIAGRAMS:
        notes = did_you_mean(args.what, DIAGRAMS)
        raise UsageError(f"--what: unknown diagram '{args.what}'"
                         + (f" ({notes[0]})" if notes else "") + f"; diagrams: {', '.join(DIAGRAMS)}")
    output = picture_path(args.output, args.file) if args.output else None
    overrides = overrides_from_args(args)
    program = load_file(args.file, overrides, DIAGRAMS[args.what])
    if output is not None:
        # The .dot written instead of a picture when Graphviz is missing must not overwrite
        # an input either.
        for written in {output, output.with_suffix(".dot")}:
            refuse_inputs(written, "-o", program_inputs(program))
    source = diagram_source(program, args.what, overrides.describe())
    if output is None:
        sys.stdout.write(source)
        return 0
    return write_diagram(source, output)


def picture_path(path: str, program_file: str) -> Path:
    """``path`` as a Path after checking its extension and :func:`paths.output_path`'s rules
    (not the program file, not a folder, writable). Raises UsageError; creates nothing."""
    suffix = Path(path).suffix
    if suffix.lower() not in FORMATS:
        raise UsageError(f"-o {path}: unknown picture format '{suffix or '(none)'}'; "
                         f"write {', '.join(FORMATS)}")
    return output_path(path, "-o", inputs=(program_file,))


def write_diagram(source: str, output: Path) -> int:
    """Write ``source`` to ``output`` (.dot as text, .svg/.png through Graphviz ``dot``).

    Returns 0, or 1 when ``dot`` is missing: then the DOT text is written to ``output`` with
    the suffix .dot and a message on standard error says how to install Graphviz.
    """
    if output.suffix.lower() == ".dot":
        write_output(output, source)
        return 0
    dot = shutil.which("dot")
    if dot is None:
        fallback = output.with_suffix(".dot")
        write_output(fallback, source)
        print(f"dhelix: Graphviz `dot` was not found, so {output} was not made; wrote the "
              f"diagram source to {fallback} instead.\n  {INSTALL_HINT};\n  then run "
              f"`dot -T{output.suffix[1:].lower()} {fallback} -o {output}`", file=sys.stderr)
        return 1
    picture = run_dot(dot, source, output.suffix[1:].lower(), str(output))
    write_atomically(output, lambda target: target.write_bytes(picture))
    return 0
