"""No orphan at startup: a launcher killed outright (SIGKILL) at any moment of its ranks'
start leaves no rank alive 5 s later, on a machine kept busy by CPU burners.

The ranks are found by a marker in their environment (they inherit the launcher's), so
processes of other runs on the machine are never counted, and any rank the launcher had
started by the moment it died is seen, whether the test saw it appear or not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks in Linux's /proc")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "tiny_llama_cpu.dhx")
MARK = "DHELIX_TEST_STARTUP_MARK"


def _marked(mark: str) -> list[int]:
    """The live (not zombie) processes whose environment holds ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def _ranks(launcher: int, mark: str) -> list[int]:
    return [pid for pid in _marked(mark) if pid != launcher]


def _described(pids) -> list[str]:
    """Each process as ``pid name state: command line`` (what a failure shows of a survivor)."""
    out = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
            out.append(f"{pid} {name} {state}: {cmd}")
        except (OSError, ValueError):
            out.append(f"{pid} (gone)")
    return out


def _named_ranks(pids) -> int:
    count = 0
    for pid in pids:
        try:
            count += Path(f"/proc/{pid}/comm").read_text().startswith("dhelix-rank")
        except OSError:
            continue
    return count


#: When the launcher is killed: as its first rank process appears, once all four exist (still
#: importing torch, joining the world), and once every rank runs its work.
MOMENTS = {
    "first rank appears": lambda ranks, since: len(ranks) >= 1,
    "all four exist": lambda ranks, since: len(ranks) >= 4,
    "ranks at work": lambda ranks, since: _named_ranks(ranks) >= 4,
}


@pytest.fixture
def cpu_load():
    """Two busy-loop processes for the test's duration."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait(10)


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_launcher_killed_during_startup_leaves_no_rank(moment, cpu_load, tmp_path):
    mark = uuid.uuid4().hex
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}, MARK: mark}
    launcher = subprocess.Popen([sys.executable, "-m", "dhelix", "run", EXAMPLE, "--steps", "100000"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    try:
        reached, first_seen = MOMENTS[moment], None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ranks = _ranks(launcher.pid, mark)
            if ranks and first_seen is None:
                first_seen = time.monotonic()
            if reached(ranks, lambda since=first_seen: time.monotonic() - since):
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"the launcher did not reach '{moment}' in 120 s")
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        time.sleep(5.0)
        survivors = _described(_ranks(launcher.pid, mark))
        assert survivors == [], f"ranks alive 5 s after the launcher was killed ({moment})"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        for pid in _ranks(launcher.pid, mark):
            os.kill(pid, signal.SIGKILL)


LAUNCHER = """
import os, signal
from multiprocessing import forkserver
from dhelix.interpreter.launch import spawn
spawn.PRELOAD = [spawn.PRELOAD[0], "slow_import"]  # the guard, then an import of 60 s
spawn.rank_context()
print(forkserver._forkserver._forkserver_pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_forkserver_dies_with_its_launcher_in_the_middle_of_its_imports(tmp_path):
    # A forkserver reads its launcher's pipe only between fork requests: without the guard it
    # would import on for the full minute after the launcher's death.
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # the server's path (it is not given the launcher's)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    server = int(launcher.stdout.readline())  # not read to the end: the server holds the pipe too
    launcher.wait(60)
    launcher.stdout.close()
    deadline = time.monotonic() + 20
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(server)
    if alive:
        os.kill(server, signal.SIGKILL)
    assert not alive, "the forkserver outlived its launcher"
