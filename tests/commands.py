"""How the tests run the ``dhelix`` command: as its own process (what a user runs), or in the
test's process (the same ``main``, its torch and its ranks' forkserver already loaded).

A run in its own process pays Python's start, torch's import and a forkserver that imports
torch again before its ranks fork (4-5 s of this 2-core machine's CPU); in the test's process
a tiny run takes under a third of the time. Tests of what only a process shows (its exit on
a signal, a launcher killed, torchrun, the interpreter's clean-up) keep :func:`dhelix_process`.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import HANG_S, ROOT

#: What a torchrun rank sets: left out of every command's environment (a test may run under one).
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def dhelix_process(*args: str, env: dict | None = None, cwd: Path | None = ROOT,
                   timeout: float = HANG_S) -> subprocess.CompletedProcess:
    """``python -m dhelix ARGS`` in a fresh process, its output captured (``cwd`` None: this
    process's working folder)."""
    full_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in _RANK_VARIABLES}
    return subprocess.run([sys.executable, "-m", "dhelix", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=cwd)


class _Hung(Exception):
    pass


def _hung(signum, frame):
    raise _Hung


def dhelix_here(*args: str, env: dict | None = None, cwd: Path | None = ROOT,
                timeout: float = HANG_S) -> subprocess.CompletedProcess:
    """``dhelix ARGS`` run by :func:`dhelix.cli.main.main` in this process, as
    :func:`dhelix_process` would run it: ``env`` added to the environment (which `dhelix run`
    hands its ranks), ``cwd`` the working folder (None: this one), standard output and error
    captured, the exit code returned; all restored afterwards. A run still going after
    ``timeout`` seconds is stopped (its ranks with it) and raises subprocess.TimeoutExpired.
    Only from the main thread (the launcher's signal handling and the timeout need it)."""
    from dhelix.cli.main import main

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        os.environ.update(env or {})
        for name in _RANK_VARIABLES:
            os.environ.pop(name, None)
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 1
    except _Hung:
        raise subprocess.TimeoutExpired(["dhelix", *args], timeout, out.getvalue(), err.getvalue()) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["dhelix", *args], code, out.getvalue(), err.getvalue())
