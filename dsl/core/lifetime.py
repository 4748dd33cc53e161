"""A helper process's lifetime tied to its parent's: it ends when the parent dies, even one
killed outright, so nothing keeps computing — or holding the parent's output pipes open —
after the command is gone. Used by `tune --jobs`'s search processes, the local ranks'
forkserver and ranks started by torchrun's agent."""

from __future__ import annotations

import os
import signal
import sys
import time

#: prctl(2)'s option (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, *, prctl: bool = True) -> None:
    """Make this process end when ``parent`` (a pid) is gone, even killed outright: with
    ``prctl`` on Linux the kernel sends SIGKILL at its death (PR_SET_PDEATHSIG; only safe
    when the parent's main thread started this process: the signal follows the thread),
    else a daemon thread checks every half second whether the parent changed. Ends now if
    the parent is already gone."""
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
