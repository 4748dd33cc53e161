"""The ``dhelix`` command line: the parser of every command and the exit-code policy.

Each command is a module of this package with ``register(subparsers)``, which adds its
sub-parser and sets ``func`` to the function that runs it and returns the exit code; adding a
command is adding its module's name to :data:`COMMANDS` (one line). The policy for what a command raises:

- :class:`UsageError` (a wrong command line): ``dhelix: message`` on standard error, exit 2;
- any other :class:`DhelixError` (a wrong program, a failed run): rendered with its location,
  source line, caret and notes, exit 1; outside ``check`` and ``fmt``, whose errors are their
  whole output, a last note says which command was running, because library messages do not;
- ``KeyboardInterrupt``: ``dhelix: interrupted``, exit 130; SIGTERM or SIGHUP to a launcher
  (``spawn.LauncherStopped``, its ranks stopped): ``dhelix: stopped by SIGTERM``, exit 128 + the
  signal.

Nothing surfaces as a traceback. Commands that need torch (run) import it only when invoked.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from dhelix import __version__
from dhelix.dsl.core.errors import DhelixError, ErrorGroup, UsageError

#: The command modules of this package, in the order ``dhelix --help`` lists them.
COMMANDS = (
    "new",
    "check",
    "fmt",
    "render",
    "export",
    "plan",
    "simulate",
    "report",
    "tune",
    "run",
    "profile",
    "calibrate",
    "generate",
    "checkpoint",
)
#: Commands whose errors are their report, so they get no "while running" note.
REPORTING = ("check", "fmt")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-command per module of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(prog="dhelix", description=(
        "Declare, check, plan, draw, simulate and run DHelix strand-interleaved training schedules."),
        epilog="`dhelix COMMAND --help` lists a command's options; docs/commands.md describes each command in full.")
    parser.add_argument("--version", action="version", version=f"dhelix {__version__}",
                        help="print dhelix's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"dhelix.cli.{name}").register(sub)
    return parser


#: The options that fix a run-time error, by the error's class name (library messages name no
#: option; a rank's error reaches the command as a RankFailure naming its ``cause``).
RUN_REMEDIES = {
    "NonFiniteError": "lower --lr, clip the gradients (--clip 1.0), or skip such steps with --skip-nonfinite",
    "PlacementError": "or run with --topology measured: the nodes the ranks run on then decide which groups "
                      "are node-local",
}


def _add_remedies(exc: DhelixError) -> None:
    """Add the command or option that fixes an error, where there is one (library messages
    name none): a stale measured profile is re-measured with `dhelix profile`; a damaged
    checkpoint's earlier save is resumed with --resume; a run's non-finite step or wrong
    placement gets the options of :data:`RUN_REMEDIES`."""
    from dhelix.dsl.frontend.profilecheck import StaleProfileError

    for error in exc.errors if isinstance(exc, ErrorGroup) else (exc,):
        if isinstance(error, StaleProfileError) and error.program:
            error.add_note(f"to re-measure it: dhelix profile {error.program}")
        # (by name: the command line imports the interpreter only for the commands that run it)
        earlier = getattr(error, "earlier", None) if type(error).__name__ == "CheckpointDamaged" else None
        if earlier is not None:
            error.add_note(f"resume from it: --resume {earlier} (--resume auto skips damaged saves)")
        remedy = RUN_REMEDIES.get(getattr(error, "cause", "") or type(error).__name__)
        if remedy is not None:
            error.add_note(remedy)


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: the process's arguments); returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (`dhelix simulate --json | head`): stop quietly, exit 1, as
        # Python's documentation advises; stdout goes to /dev/null so nothing fails at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except UsageError as exc:
        print(f"dhelix: {exc.message}", file=sys.stderr)
        return 2
    except DhelixError as exc:
        _end_progress_line()
        _add_remedies(exc)
        if args.command not in REPORTING:
            exc.add_note(f"while running `dhelix {args.command}`")
        print(exc.render(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        _end_progress_line()
        print("dhelix: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        stopped = _launcher_signal(exc)
        if stopped is None:
            raise
        _end_progress_line()
        print(f"dhelix: stopped by {stopped.name}; stopped every rank", file=sys.stderr)
        return 128 + stopped.value


def leave(code: int) -> NoReturn:
    """End this process with ``code`` (``python -m dhelix``). A rank of a torchrun world
    (``RANK`` and ``WORLD_SIZE`` set, torch.distributed loaded) leaves without the interpreter's
    clean-up, as a local rank does (interpreter/launch/spawn.py): torch's C++ destructors at exit
    sometimes abort ("terminate called without an active exception", SIGABRT) on a thread still
    running, and torchrun takes the finished rank for a failed one: its node's agent stops the
    node, and the other node's agent waits out torchrun's exit barrier (300 s) for it."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "torch.distributed" in sys.modules:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more can be said
                pass
        os._exit(code)
    raise SystemExit(code)


def _launcher_signal(exc: Exception):
    """The signal that stopped a launcher (``spawn.LauncherStopped``), else None; the
    interpreter is imported only if it was running."""
    spawn = sys.modules.get("dhelix.interpreter.launch.spawn")
    if spawn is None or not isinstance(exc, spawn.LauncherStopped):
        return None
    import signal

    return signal.Signals(exc.signum)


def _end_progress_line() -> None:
    """On a terminal, end the line a rank's progress bar may have left open, so that the
    message starts on a line of its own (redirected, there is no bar)."""
    if sys.stderr.isatty():
        print(file=sys.stderr)
