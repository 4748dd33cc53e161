"""Runs dhelix commands on fuzzed files under a time and memory limit (for test_fuzz_inputs.py).

Usage: ``python fuzz_worker.py CASES.json RESULTS.json``. CASES is a list of
``{"files": {name: text}, "commands": [[arg, …], …]}``; each case's files are written into a
fresh folder, and each command runs there in this process through ``dhelix.cli.main.main``
with :data:`SECONDS` of CPU time (a virtual timer: CPU time, not wall time, so a loaded
machine does not fail it) and the whole process under :data:`MEMORY_BYTES`
of address space. RESULTS gets, per command, ``{"code", "stderr"}`` or ``{"crash": text}``
for anything other than a return: a traceback, a timeout, running out of memory.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import signal
import sys
import tempfile
import traceback

SECONDS = 10
MEMORY_BYTES = 4 * 2**30


class TimeLimit(Exception):
    """The command ran past SECONDS."""


def _alarm(signum, frame):
    raise TimeLimit(f"ran past {SECONDS} s")


def run_case(case: dict, cli_main) -> list[dict]:
    """The results of the case's commands, run in a new folder holding its files."""
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for name, text in case["files"].items():
            with open(os.path.join(folder, name), "wb") as file:
                file.write(text.encode("utf-8", "surrogateescape"))
        os.chdir(folder)
        for argv in case["commands"]:
            err = io.StringIO()
            signal.setitimer(signal.ITIMER_VIRTUAL, SECONDS)
            try:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                    code = cli_main(argv)
                results.append({"code": code, "stderr": err.getvalue()})
            except BaseException:  # noqa: BLE001 - whatever escapes is the finding
                results.append({"crash": traceback.format_exc(limit=-8)})
            finally:
                signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        os.chdir("/")
    return results


def main() -> None:
    cases_path, results_path = sys.argv[1:3]
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    signal.signal(signal.SIGVTALRM, _alarm)
    from dhelix.cli.main import main as cli_main

    with open(cases_path) as file:
        cases = json.load(file)
    results = [run_case(case, cli_main) for case in cases]
    with open(results_path, "w") as file:
        json.dump(results, file)


if __name__ == "__main__":
    main()
