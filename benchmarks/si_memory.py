"""SI's own memory: each mode's measured peaks beside the simulator's, and the ratios between modes.

::

    .venv/bin/python benchmarks/si_memory.py --output benchmarks/results/cpu_si_memory.txt

For small programs built from ``examples/tiny_llama_cpu.dhx`` (as written, and with more layers,
micro-batches, pipeline ranks or a larger vocabulary; recompute none), three modes, each a
``dhelix run FILE --steps 3 --metrics OUT.json`` on local gloo ranks:

* ``W+SI``: the W schedule with SI (``fold u``, ``pipeline w_helix``, as written);
* ``W noSI``: the same schedule with ``--no-si`` (every SI block its forward, then its backward);
* ``1F1B``: ``fold none`` and ``pipeline one_f_one_b``, the rest as written.

Per pipeline rank: the peak of live activations the ranks counted (the executor's probe: the
largest over the ranks sharing that pipeline rank) beside the simulator's prediction, and the
model states (weights, gradients, optimizer states) likewise; then per program the ratios
between the modes of the busiest rank's peak (activations + model states, what ``dhelix
simulate --compare`` reports), measured beside predicted. Last, what the simulator predicts
for the DHelix paper's configurations (``examples/llama39b_a40.dhx``, ``phi31b_a40.dhx``):
the same ratios, and where W + SI's difference from 1F1B is.

Memory is counted, not timed: the figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from predict_vs_run import ROOT, dhelix, machine  # noqa: E402  (the same launcher and machine line)

MIB = 2**20
BASE = ROOT / "examples" / "tiny_llama_cpu.dhx"
#: name -> the settings changed from tiny_llama_cpu.dhx (model, mesh, cluster, train lines).
PROGRAMS = {
    "tiny_llama_cpu": {},
    "l8_pp2": {"layers": 8, "tp": 1, "nodes": 1},
    "l16_pp2_m16": {"layers": 16, "microbatches": 16, "tp": 1, "nodes": 1},
    "l8_pp4": {"layers": 8, "tp": 1, "pp": 4},
    "l8_pp2_vocab4096": {"layers": 8, "tp": 1, "nodes": 1, "vocab": 4096},
}
MODES = (("W+SI", ()), ("W noSI", ("--no-si",)), ("1F1B", ()))
PAPER = ("llama39b_a40", "phi31b_a40")


def with_settings(text: str, settings: dict) -> str:
    """``text`` with each ``name = value`` line of ``settings`` set to the new value; the
    data path made absolute (the variant is written elsewhere)."""
    for name, value in settings.items():
        text, count = re.subn(rf"(?m)^(\s*{name} = )\S+", rf"\g<1>{value}", text)
        if count != 1:
            raise SystemExit(f"{BASE.name} has {count} lines setting {name}; expected one")
    return text.replace('"../docs/', f'"{ROOT / "docs"}/')


def one_f_one_b(text: str) -> str:
    """``text`` as 1F1B without folding."""
    out = text.replace("\nfold u\n", "\nfold none\n").replace("\npipeline w_helix\n", "\npipeline one_f_one_b\n")
    if out.count("one_f_one_b") != 1 or "fold none" not in out:
        raise SystemExit(f"{BASE.name} no longer says 'fold u' and 'pipeline w_helix'")
    return out


def run(path: Path, flags: tuple[str, ...], work: Path, timeout: float) -> dict:
    """The metrics of a 3-step run of ``path``."""
    metrics = work / f"{path.stem}{'_'.join(flags)}.json"
    result = dhelix("run", str(path), "--steps", "3", *flags, "--metrics", str(metrics), timeout=timeout)
    if result.returncode != 0:
        raise SystemExit(f"dhelix run {path} {' '.join(flags)} failed:\n{result.stderr[-2000:]}")
    return json.loads(metrics.read_text())


def per_rank(data: dict) -> list[tuple[int, float, float, float, float]]:
    """(pp, predicted activations, measured, predicted states, measured) per pipeline rank,
    measured as the largest over the ranks of that pipeline rank."""
    out = []
    for predicted in data["predicted"]["pipeline_ranks"]:
        mine = [r for r in data["ranks"] if r["pp"] == predicted["pp"]]
        out.append((predicted["pp"], predicted["peak_activations_bytes"], max(r["peak_activations_bytes"] for r in mine),
                    predicted["model_states_bytes"], max(r["model_states_bytes"] for r in mine)))
    return out


def peaks(rows) -> tuple[float, float]:
    """(predicted, measured) peak of the busiest pipeline rank: activations + model states."""
    return max(a + s for _, a, _, s, _ in rows), max(a + s for _, _, a, _, s in rows)


def measured_table(work: Path, timeout: float, say) -> None:
    say("per pipeline rank, MiB: activations (peak of live bytes: pred = simulator, run = the ranks' count) "
        "and model states; ratio = pred / run")
    say(f"{'program':<18} {'mode':<7} {'pp':>2} {'act pred':>9} {'act run':>9} {'ratio':>6} "
        f"{'st pred':>8} {'st run':>8} {'ratio':>6}")
    summary, ratios = [], []
    for name, settings in PROGRAMS.items():
        text = with_settings(BASE.read_text(), settings)
        files = {"W+SI": work / f"{name}.dhx", "1F1B": work / f"{name}_1f1b.dhx"}
        files["W+SI"].write_text(text)
        files["1F1B"].write_text(one_f_one_b(text))
        files["W noSI"] = files["W+SI"]
        found = {}
        for mode, flags in MODES:
            rows = found[mode] = per_rank(run(files[mode], flags, work, timeout))
            for pp, acts_p, acts_m, states_p, states_m in rows:
                ratios.append(acts_p / acts_m)
                say(f"{name:<18} {mode:<7} {pp:>2} {acts_p / MIB:>9.3f} {acts_m / MIB:>9.3f} {acts_p / acts_m:>6.3f} "
                    f"{states_p / MIB:>8.3f} {states_m / MIB:>8.3f} {states_p / states_m:>6.3f}")
        base = peaks(found["W+SI"])
        summary.append((name, *(peaks(found[m])[i] / base[i] for m in ("1F1B", "W noSI") for i in (1, 0))))
    say(f"activations predicted / measured: {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} (program, mode, "
        "pipeline rank)")
    say("")
    say("ratios between modes, busiest rank's peak (activations + model states): measured, predicted")
    say(f"{'program':<18} {'W+SI / 1F1B':>12} {'pred':>7} {'noSI / W+SI':>12} {'pred':>7}")
    for name, one_m, one_p, nosi_m, nosi_p in summary:
        say(f"{name:<18} {1 / one_m:>12.3f} {1 / one_p:>7.3f} {nosi_m:>12.3f} {nosi_p:>7.3f}")


def paper_table(say) -> None:
    """The simulator's figures for the paper's configurations (no run: they need 64 GPUs)."""
    from dhelix.dsl.simulator.launch import priced_program
    from dhelix.dsl.simulator.memory import head_activations
    from dhelix.dsl.simulator.report import compare

    say("")
    say("predicted for the DHelix paper's configurations (dhelix simulate FILE --compare), busiest rank, GB")
    say(f"{'example':<14} {'mode':<7} {'rank':>4} {'states':>7} {'acts':>7} {'peak':>7} {'vs W+SI':>8}")
    for name in PAPER:
        path = ROOT / "examples" / f"{name}.dhx"
        program, _ = priced_program(path.read_text(), str(path))
        labels = {"as written": "W+SI", "without SI": "W noSI", "1F1B, fold none": "1F1B"}
        sims = {labels[sim.label]: sim for sim in compare(program) if sim.label in labels}
        base = max(r.memory for r in sims["W+SI"].ranks)
        for mode, sim in sims.items():
            busiest = max(sim.ranks, key=lambda r: r.memory)
            say(f"{name:<14} {mode:<7} {busiest.rank:>4} {busiest.states.total / 1e9:>7.2f} "
                f"{busiest.activations / 1e9:>7.2f} {busiest.memory / 1e9:>7.2f} {busiest.memory / base:>8.3f}")
        w, one = (max(sims[m].ranks, key=lambda r: r.memory) for m in ("W+SI", "1F1B"))
        say(f"{'':<14} W+SI - 1F1B: {(w.memory - one.memory) / 1e9:.2f} GB = states "
            f"{(w.states.total - one.states.total) / 1e9:+.2f} + activations {(w.activations - one.activations) / 1e9:+.2f}; "
            f"W+SI / 1F1B {w.memory / one.memory:.3f}; the LM head's activations per micro-batch "
            f"{head_activations(program, program.lowered.split).total / 1e9:.2f} GB")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run (default 600)")
    parser.add_argument("--output", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"# {shlex.join(['python', 'benchmarks/si_memory.py', *(argv if argv is not None else sys.argv[1:])])}")
    say(f"machine: {machine()}; {time.strftime('%Y-%m-%d %H:%M %Z')}")
    say(f"programs: {BASE.relative_to(ROOT)} with "
        + "; ".join(f"{name}: {', '.join(f'{k} {v}' for k, v in s.items()) or 'as written'}"
                    for name, s in PROGRAMS.items())
        + "; each run 3 steps on local gloo ranks")
    with tempfile.TemporaryDirectory(prefix="dhelix-si-memory-") as folder:
        measured_table(Path(folder), args.timeout, say)
    paper_table(say)
    if args.output is not None:
        args.output.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
