"""The first code a spawned rank runs: it is bound to its launcher's life before it imports
anything else.

A spawned rank starts a new Python, which unpickles its target and arguments (importing the
target's module) and only then calls it. This module is that target's: it imports nothing
beyond the standard library, and :func:`start_rank` asks the kernel to kill the rank with its
launcher (PR_SET_PDEATHSIG) — or kills it at once if the launcher is already gone — before
the rank imports the rest of dhelix, torch and what its work needs (seconds on a loaded
machine, during which a launcher killed outright would otherwise leave an orphan).
"""

from __future__ import annotations

import os
import signal
import sys
import time

#: prctl(2) options (linux/prctl.h).
PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15


def start_rank(payload: bytes, rank: int, world: int, address: tuple[str, int], launcher: int, results) -> None:
    """A spawned rank's entry point: die with ``launcher`` (its pid), then run the rank
    (:func:`.spawn.rank_process` with the other arguments)."""
    die_with_parent(launcher, prctl=True)
    from .spawn import rank_process

    rank_process(payload, rank, world, address, results)


def die_with_parent(parent: int, *, prctl: bool) -> None:
    """Make this process end when ``parent`` (the launcher) is gone, even killed outright:
    with ``prctl`` on Linux the kernel sends SIGKILL at its death (PR_SET_PDEATHSIG; only
    safe when the parent's main thread started this process), else a daemon thread checks
    every half second whether the parent changed."""
    if prctl and sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    else:
        import threading

        def orphaned() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=orphaned, name="dhelix-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # it died before we asked
        os.kill(os.getpid(), signal.SIGKILL)


def name_process(name: str) -> None:
    """Show this process as ``name`` (15 bytes at most) in ps, top and /proc/PID/comm, on
    Linux; a no-op elsewhere."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
