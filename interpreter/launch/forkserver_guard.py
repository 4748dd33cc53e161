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
import sys

from dhelix.dsl.core.lifetime import die_with_parent

#: The environment variable in which the launcher gives its pid to the forkserver it starts.
LAUNCHER_PID = "DHELIX_LAUNCHER_PID"


def _preloading() -> bool:
    """Whether this import runs inside multiprocessing's forkserver ``main`` (its preload), the
    one place the guard acts: anywhere else (the launcher reading :data:`LAUNCHER_PID`, a rank)
    importing this module does nothing."""
    frame = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and code.co_filename.endswith(os.path.join("multiprocessing", "forkserver.py")):
            return True
        frame = frame.f_back
    return False


def die_with_launcher() -> None:
    """In the forkserver's preload, arm its parent-death signal when its launcher asked for it
    (and drop the request from the environment its ranks inherit), and end it now if that
    launcher is already gone (Linux; a no-op elsewhere, where a watching thread would run
    beside the forks)."""
    launcher = os.environ.pop(LAUNCHER_PID, None)
    if launcher is not None and launcher.isdigit() and sys.platform.startswith("linux"):
        die_with_parent(int(launcher))


if _preloading():
    die_with_launcher()
