"""The ``dhelix`` command line: one module per command (:mod:`.check`, :mod:`.fmt`,
:mod:`.render`, :mod:`.export`, :mod:`.plan`, :mod:`.simulate`, :mod:`.run`), the output-path
check they share (:mod:`.paths`) and :mod:`.main`, which assembles the parser and turns what a
command raises into an exit code.

It lives here, above :mod:`dhelix.dsl` and :mod:`dhelix.interpreter`, because those never
print, parse arguments or exit: they raise typed errors and return values.
"""

from __future__ import annotations

from dhelix.cli.main import main

__all__ = ["main"]
