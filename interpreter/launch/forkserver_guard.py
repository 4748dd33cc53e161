"""The first module the local ranks' forkserver imports (:data:`spawn.PRELOAD`): from then on
the forkserver dies with the launcher that started it, even one killed outright.

A forkserver notices its launcher is gone only between fork requests, so one still importing
torch (seconds, tens of seconds on a loaded machine) would outlive a launcher killed during
startup. Importing this module asks the kernel for SIGKILL at the launcher's death
(PR_SET_PDEATHSIG) before those imports start, and leaves at once if the launcher died even
earlier. The launcher names itself in :data:`LAUNCHER_PID` when its main thread is the one
that starts the server (the signal follows the thread that started a process); without the
name nothing is armed. Ranks forked later die through their own lifeline
(:func:`~dhelix.interpreter.launch.spawn.die_with_launcher`)."""

from __future__ import annotations

import os
import signal
import sys

#: The environment variable in which the launcher gives its pid to the forkserver it starts.
LAUNCHER_PID = "DHELIX_LAUNCHER_PID"
#: prctl(2)'s option (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def die_with_launcher() -> None:
    """Arm the parent-death signal of this process (the forkserver) when its launcher asked
    for it, and end it now if that launcher is already gone (Linux; a no-op elsewhere)."""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None or not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != int(launcher):
        os._exit(1)


die_with_launcher()
