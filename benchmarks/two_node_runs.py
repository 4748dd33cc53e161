"""What the benchmarks over the emulated two-node link share: running one world of ranks
over the two network namespaces (:class:`World`), profiling the link with ``dhelix profile``,
the report printed and kept for ``--output``, the command-line options of the link and the
figures' formatting, and the scripts' entry point (:func:`run_main`, which prints their
failures). Used by ``two_nodes.py``, ``two_node_ranking.py`` and ``dp_overlap_two_nodes.py``;
everything else prints only through the :class:`Report` it is given.
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from two_node_link import TwoNodeLink

#: The first rendezvous port; each run takes the next (a socket may linger in TIME_WAIT).
FIRST_PORT = 29611


# -- the output --------------------------------------------------------------------------------

class Report:
    """Lines printed as they come and kept for ``--output``."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def write(self, path: str) -> None:
        Path(path).write_text("\n".join(self.lines) + "\n")


def command_line() -> str:
    """The command that started this script, as one shell line."""
    python = sys.executable
    if python.startswith(os.getcwd() + os.sep):
        python = os.path.relpath(python)
    return shlex.join([python, *sys.argv])


def machine() -> str:
    """Platform, CPUs, Python and torch versions, load average."""
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "not installed"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs; python "
            f"{platform.python_version()}, torch {torch}; load average {load}")


# -- launching one world over the two namespaces ------------------------------------------------

class World:
    """Runs a command as every rank of a ``world``-rank job, ``per_node`` consecutive ranks in
    each namespace, in the environment torchrun would give them."""

    def __init__(self, link: TwoNodeLink, world: int, per_node: int, workdir: Path, timeout: float,
                 priority: tuple[str, ...] = ()):
        self.link, self.world, self.per_node = link, world, per_node
        #: What each rank's command runs under (:func:`priority_prefix`): nothing, ``nice`` or ``chrt``.
        self.priority = priority
        self.workdir, self.timeout = workdir, timeout
        self.port = FIRST_PORT
        self.runs = 0

    def environment(self, rank: int) -> dict:
        """RANK and the rest for ``rank``: rank 0's veth address is the rendezvous."""
        node = self.link.node(rank // self.per_node)
        # GROUP_RANK, the node's number, as torchrun sets it: dhelix checks it against the cluster block.
        return {"RANK": rank, "WORLD_SIZE": self.world, "LOCAL_RANK": rank % self.per_node,
                "GROUP_RANK": rank // self.per_node,
                # join.run_rank divides the CPUs by LOCAL_WORLD_SIZE: both "nodes" share this machine's.
                "LOCAL_WORLD_SIZE": self.world, "MASTER_ADDR": self.link.node(0)["address"],
                "MASTER_PORT": self.port, "GLOO_SOCKET_IFNAME": node["device"]}

    def run(self, args: list[str], label: str) -> tuple[bool, str]:
        """Run ``python ARGS`` on every rank; (success, where its output is or what failed)."""
        self.runs += 1
        self.port += 1  # a fresh port: the last run's socket may linger in TIME_WAIT
        logs = self.workdir / f"{self.runs:03d}-{label.replace(' ', '_')}"
        logs.mkdir()
        procs = []
        try:
            for rank in range(self.world):
                env = [f"{name}={value}" for name, value in self.environment(rank).items()]
                command = ["ip", "netns", "exec", self.link.node(rank // self.per_node)["namespace"],
                           "env", *env, sys.executable, *args]
                command = [*self.priority, *command]
                with open(logs / f"rank{rank}.out", "w") as out, open(logs / f"rank{rank}.err", "w") as err:
                    procs.append(subprocess.Popen(command, stdout=out, stderr=err, cwd=self.workdir))
            return self._watch(procs, logs)
        finally:
            stop_processes(procs)

    def _watch(self, procs, logs: Path) -> tuple[bool, str]:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                return False, f"rank {rank} exited with code {code}:\n{tail(logs / f'rank{rank}.err')}"
            if all(code == 0 for code in codes):
                return True, str(logs)
            time.sleep(0.2)
        return False, f"still running after {self.timeout:.0f} s (--run-timeout); rank 0:\n{tail(logs / 'rank0.err')}"


def stop_processes(procs, grace: float = 5.0) -> None:
    """Terminate the processes of a run that are still alive (ours, by their handles)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of the file ``path``, indented."""
    text = path.read_text(errors="replace").replace("\r", "\n")
    return "\n".join(f"    {line}" for line in text.strip().split("\n")[-lines:])


# -- profiling the link and the figures ---------------------------------------------------------

class BenchError(Exception):
    """The benchmark cannot go on (a run failed, a program that does not fit)."""


def has_profile_command() -> bool:
    """Whether this dhelix has ``dhelix profile`` (an older checkout may lack it)."""
    result = subprocess.run([sys.executable, "-m", "dhelix", "profile", "--help"], capture_output=True)
    return result.returncode == 0


def profile_link(world: World, program: Path, args, report: Report, name: str = "link.yaml") -> str | None:
    """Run ``dhelix profile`` on the two nodes; the name of the profile written beside the
    program (``name``), or None when this dhelix has no profile command."""
    if not has_profile_command():
        report("profile: skipped: this dhelix has no `dhelix profile` command")
        return None
    out = program.parent / name
    command = ["-m", "dhelix", "profile", str(program), "-o", str(out), "--repeats", str(args.profile_repeats)]
    start = time.monotonic()
    ok, where = world.run(command, "profile")
    if not ok:
        raise BenchError(f"dhelix profile failed: {where}")
    report(f"profile: `dhelix profile {program.name} -o {name} --repeats {args.profile_repeats}` over the link "
           f"({time.monotonic() - start:.0f} s); {program.name}'s cluster profile is now {name}")
    return out.name


def priority_prefix(priority: str | None) -> tuple[str, ...]:
    """The command a rank runs under for ``--priority``: none (``None``), ``nice -n N`` (an
    integer; negative puts the ranks ahead of the machine's other work) or ``chrt -f 10``
    (``rt``: first-in first-out real-time scheduling, so that a rank with work takes a core from
    any ordinary process; the kernel's real-time throttling still leaves 5 % of each second to
    the rest). Root only for a negative nice and for rt."""
    if priority is None:
        return ()
    if priority == "rt":
        return ("chrt", "-f", "10")
    try:
        return ("nice", "-n", str(int(priority)))
    except ValueError:
        raise BenchError(f"--priority {priority!r}: give an integer (nice) or rt") from None


def add_link_arguments(parser, rate: str, burst: str = "256kb") -> None:
    """The options every benchmark over the two-node link takes: the link's shaping (``rate``
    and ``burst`` by default), the rounds of alternated modes and the steps of each run."""
    parser.add_argument("--rate", default=rate, help="tbf rate of each direction of the link")
    parser.add_argument("--burst", default=burst, help="tbf burst (bytes sent at the line's own speed after the "
                        "link idled: a message up to this size crosses without paying the rate)")
    parser.add_argument("--latency", default="50ms", help="tbf latency (queue limit)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every mode, alternated")
    parser.add_argument("--steps", type=int, default=4, help="training steps per run (the first is left out)")


def median(values):
    """The median of ``values``, None when there are none."""
    return statistics.median(values) if values else None


def seconds_text(value) -> str:
    """``1.234 s``, or a dash for None."""
    return "—" if value is None else f"{value:.3f} s"


def ratio_text(value) -> str:
    """``0.812``, or a dash for None."""
    return "—" if value is None else f"{value:.3f}"


def percent_text(value) -> str:
    """``81 %``, or a dash for None."""
    return "—" if value is None else f"{100 * value:.0f} %"


# -- the scripts' entry point --------------------------------------------------------------------

def run_main(script: str, args, bench, prefix: str, errors: tuple = ()) -> int:
    """What each two-node script's ``main`` does around its ``bench(args, report, workdir)``:
    check that the link can be made (``--cleanup``, where the script has it, removes the
    namespaces a killed run left behind instead), run it in a fresh working folder, write the
    report to ``--output`` only after a complete run, turn every failure (``errors`` adds the
    script's own) into one line naming the script, and always remove what it made (the
    folder kept with ``--keep-files``). Returns the exit code."""
    import shutil
    import tempfile

    from two_node_link import LinkError, check_can_run, remove_namespaces

    from dhelix.dsl.core.errors import DhelixError

    try:
        check_can_run()
        if getattr(args, "cleanup", False):
            removed = remove_namespaces()
            print(f"removed: {', '.join(removed)}" if removed else "nothing to remove")
            return 0
    except LinkError as exc:
        print(f"{script}: {exc}", file=sys.stderr)
        return 2
    report, workdir = Report(), Path(tempfile.mkdtemp(prefix=prefix))
    try:
        code = bench(args, report, workdir)
        if args.output:  # only a complete run replaces the results file
            report.write(args.output)
        return code
    except DhelixError as exc:
        print(exc.render(), file=sys.stderr)
    except (LinkError, BenchError, OSError, *errors) as exc:
        print(f"{script}: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{script}: interrupted; the namespaces are removed", file=sys.stderr)
    finally:
        if getattr(args, "keep_files", False):
            print(f"files kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1
