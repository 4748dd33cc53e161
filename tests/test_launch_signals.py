"""`dhelix run`'s launcher and its ranks live and die together, and a hung rank is named.

Real runs of the tiny example on 4 local gloo ranks (Linux: the ranks are found in /proc as
the launcher's children): SIGTERM to the launcher stops every rank and exits 128 + 15; a
launcher killed outright (SIGKILL) leaves no rank behind; a rank stopped with SIGSTOP ends
the run with exit 1 naming it and the action it was in, within the timeout and a few seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.interpreter.training.train import FAULT_ENV  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks in Linux's /proc")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "tiny_llama_cpu.dhx")


def _launch(tmp_path, *args: str, env: dict | None = None) -> subprocess.Popen:
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}, **(env or {})}
    err = open(tmp_path / "stderr.txt", "w")
    return subprocess.Popen([sys.executable, "-m", "dhelix", "run", EXAMPLE, "--steps", "100000", *args],
                            stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT)


def _ranks_of(launcher: int, count: int = 4, within: float = 60.0) -> list[int]:
    """The pids of the launcher's ``count`` rank processes: named ``dhelix-rankN``, children of
    the launcher (spawned) or of its forkserver (forked)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                parent = _parent(int(entry.name))
                named = (entry / "comm").read_text().startswith("dhelix-rank")
                if named and launcher in (parent, _parent(parent)):
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
        if len(found) == count:
            return sorted(found)
        time.sleep(0.2)
    raise AssertionError(f"the launcher did not start {count} ranks in {within} s")


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie is dead, waiting for its new parent to reap it


def _gone_within(pids, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(map(_running, pids)):
        time.sleep(0.1)
    return [pid for pid in pids if _running(pid)]


def _kill_all(proc, pids) -> None:
    for pid in [proc.pid, *pids]:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait(10)


def test_sigterm_to_the_launcher_stops_every_rank(tmp_path):
    launcher = _launch(tmp_path)
    ranks = _ranks_of(launcher.pid)
    try:
        time.sleep(1.0)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(10) == 128 + signal.SIGTERM
        assert _gone_within(ranks, 5.0) == []
        err = (tmp_path / "stderr.txt").read_text()
        assert "dhelix: stopped by SIGTERM" in err and "Traceback" not in err
    finally:
        _kill_all(launcher, ranks)


def test_ranks_die_with_a_launcher_killed_outright(tmp_path):
    launcher = _launch(tmp_path)
    ranks = _ranks_of(launcher.pid)
    try:
        time.sleep(1.0)
        launcher.kill()
        launcher.wait(10)
        assert _gone_within(ranks, 5.0) == []
    finally:
        _kill_all(launcher, ranks)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _named(pids, name: str, within: float = 60.0) -> int:
    """The pid among ``pids`` that calls itself ``name`` (a rank names itself as it starts)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for pid in pids:
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no rank named {name}")


def test_a_stopped_rank_is_named_with_its_action(tmp_path):
    timeout = 5
    program = check_text(Path(EXAMPLE).read_text(), EXAMPLE)
    action = program.lowered.actions[program.mesh.coords(2)["pp"]][5]
    launcher = _launch(tmp_path, "--timeout", str(timeout), env={FAULT_ENV: "2:1:5:stop"})
    ranks = _ranks_of(launcher.pid)
    try:
        rank2 = _named(ranks, "dhelix-rank2")
        while _state(rank2) != "T":  # it stops itself before action 5 of training step 1
            assert launcher.poll() is None, (tmp_path / "stderr.txt").read_text()
            time.sleep(0.05)
        stopped = time.monotonic()
        assert launcher.wait(timeout + 30) == 1
        took = time.monotonic() - stopped
        err = (tmp_path / "stderr.txt").read_text()
        assert (f"error: rank 2 stopped making progress in {action} (action 5 of its list) of training step 1: "
                "no heartbeat for ") in err, err
        assert "the others waited for it until their collective timeout of 5 s; stopped the other 3 rank(s)" in err
        assert "Traceback" not in err and "Connection reset" not in err
        assert took < timeout + 5, f"the run ended {took:.1f} s after the rank stopped"
        assert _gone_within(ranks, 5.0) == []
    finally:
        for pid in ranks:
            if _running(pid):
                os.kill(pid, signal.SIGCONT)
        _kill_all(launcher, ranks)
