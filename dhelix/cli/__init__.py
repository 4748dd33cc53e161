"""The ``dhelix`` command: the compiler's commands (:mod:`dhelix.dsl`, no torch) and ``run``
(:mod:`dhelix.interpreter`, which imports torch only when a run starts).

It lives here, above both packages, because ``dsl/`` never imports ``interpreter/``.
"""

from __future__ import annotations

from dhelix.cli import main as cli
from dhelix.interpreter import launch


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    return cli.main(argv, extra=(launch.register,))
