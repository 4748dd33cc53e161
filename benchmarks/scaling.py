"""How each command's time and memory grow with the size of what it produces.

For each series the size is doubled twice (×1, ×2, ×4) and the command run in this process
through the CLI: time is the best of three runs (wall clock), peak memory the peak of Python
allocations during one run (tracemalloc). A linear command shows ratios near 2 and 4; the
limits in docs/language.md keep every series' largest size a few seconds away. Series:

- check, export --torch-csv, simulate: micro-batches (the lowered schedule's length);
- simulate: layers (per-layer records of the step);
- render --what placement: pipeline ranks;
- check of a file with one error per line: the errors (each echoes its source line).

    .venv/bin/python benchmarks/scaling.py
"""

from __future__ import annotations

import contextlib
import io
import tempfile
import time
import tracemalloc
from pathlib import Path

from dhelix.cli.main import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
TINY = (ROOT / "examples" / "tiny_llama_cpu.dhx").read_text()


def _program(microbatches: int = 64, layers: int = 4, pp: int = 2) -> str:
    nodes = pp  # 2 GPUs per node: tp 2 within a node, one node per pipeline rank
    return (TINY.replace("microbatches = 8", f"microbatches = {microbatches}")
            .replace("layers = 4\n", f"layers = {layers}\n").replace("pp = 2", f"pp = {pp}")
            .replace("nodes = 2 ", f"nodes = {nodes} "))


def _many_errors(count: int) -> str:
    """A model block with ``count`` settings that use an unknown name: one error each."""
    lines = [f"  s{n} = missing{n}" for n in range(count)]
    return TINY.replace("  layer = llama\n", "  layer = llama\n" + "\n".join(lines) + "\n")


def _run(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return cli_main(argv)


def measure(text: str, argv: list[str], folder: Path, expect: int) -> tuple[float, float]:
    """(seconds, peak MiB) of the command ``argv`` on ``text`` saved as prog.dhx in ``folder``;
    RuntimeError unless it exits with ``expect`` (a benchmark of a failing command measures nothing)."""
    (folder / "prog.dhx").write_text(text)
    argv = [a.replace("PROG", str(folder / "prog.dhx")).replace("OUT", str(folder / "out")) for a in argv]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        code = _run(argv)
        times.append(time.perf_counter() - start)
        if code != expect:
            raise RuntimeError(f"dhelix {' '.join(argv)} exited {code}, not {expect}")
    tracemalloc.start()
    _run(argv)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return min(times), peak


SERIES = (
    ("check            microbatches", lambda k: _program(microbatches=512 * k), ["check", "PROG"], 512),
    ("export           microbatches", lambda k: _program(microbatches=512 * k),
     ["export", "PROG", "--torch-csv", "OUT.csv"], 512),
    ("simulate         microbatches", lambda k: _program(microbatches=512 * k), ["simulate", "PROG"], 512),
    ("simulate         layers", lambda k: _program(layers=1024 * k), ["simulate", "PROG"], 1024),
    ("render placement pp", lambda k: _program(microbatches=8, layers=512 * k, pp=256 * k),
     ["render", "PROG", "--what", "placement", "-o", "OUT.dot"], 256),
    ("check (errors)   errors", lambda k: _many_errors(1000 * k), ["check", "PROG"], 1000),
)


def main() -> None:
    print(f"{'command          size':34} {'x1':>18} {'x2':>18} {'x4':>18}   time ratios   memory ratios")
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        for label, make, argv, base in SERIES:
            expect = 1 if "errors" in label else 0
            figures = [measure(make(k), argv, folder, expect) for k in (1, 2, 4)]
            cells = " ".join(f"{t:7.3f} s {m:6.1f} MiB" for t, m in figures)
            times = [t for t, _ in figures]
            peaks = [m for _, m in figures]
            ratios = f"{times[1] / times[0]:4.2f} {times[2] / times[1]:4.2f}"
            memory = f"{peaks[1] / peaks[0]:4.2f} {peaks[2] / peaks[1]:4.2f}"
            print(f"{label} {base:>5}  {cells}   {ratios}     {memory}")


if __name__ == "__main__":
    main()
