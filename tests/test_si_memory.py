"""SI's own memory: the simulator's per-mode activation peaks against the interpreter's count.

The same tiny model on 2 pipeline ranks run three ways — the W schedule with SI (fold u,
``w_helix``), the same schedule without SI (each SI block its forward, then its backward)
and 1F1B without folding — each rank's measured peak beside the simulator's; and the
ratios between the modes, which is what ``dhelix simulate --compare`` reports
(benchmarks/si_memory.py does it on larger programs and prints the table).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from test_memory_model import measured, program  # noqa: E402

from dhelix.dsl.simulator.events import simulate  # noqa: E402

#: (pipeline, fold, SI) of each mode.
MODES = {"W + SI": ("w_helix", "u", True), "W without SI": ("w_helix", "u", False),
         "1F1B": ("one_f_one_b", "none", True)}
#: Predicted within this fraction of the measured activation peak (bytes are deterministic
#: on CPU; here the model is 0.4-4.4 % under). What it leaves out, at this size: per-row
#: statistics (norm and attention: 0.7 % of a layer) and the values an action sends, which
#: wait in the mailbox for their SEND (an SI block's two: 3.7 % of rank 1's peak here, 0.1 %
#: of llama39b_a40's).
TOLERANCE = 0.05


def _mode_program(mode: str):
    pipeline, fold, _ = MODES[mode]
    return program("pp = 2", pipeline, fold, layers=4, microbatches=4, gpus=2)


def _modes_rank(rank: int, world: int) -> dict:
    from dhelix.interpreter.ops.comm import DistComm

    comm, out = None, {}
    for mode, (_, _, si) in MODES.items():
        prog = _mode_program(mode)
        comm = comm or DistComm(prog.mesh, timeout_s=60)
        out[mode] = measured(prog, comm, si=si)
    return out


def test_each_mode_s_peak_and_the_ratios_between_modes_are_measured_ones(tmp_path):
    # Measured (2 gloo ranks, one step each): W + SI holds what 1F1B's first rank holds on
    # every rank, plus the LM head's on rank 0 (fold u puts the last stage there); without SI
    # each block's forward allocates a whole chunk before its backward frees one (+1 chunk).
    # A chain's last layer kept its output while its micro-batch was in flight (the model
    # never counted it; 8.4 % over it where a chunk is one layer) until the executor let go
    # of it once handed on.
    from distributed import gloo_results

    got = gloo_results(_modes_rank, 2, tmp_path, timeout=240.0)
    peaks = {}
    for mode, (_, _, si) in MODES.items():
        sim = simulate(_mode_program(mode), si=si)
        for rank in range(2):
            acts, states = got[rank][mode]
            assert sim.ranks[rank].activations == pytest.approx(acts, rel=TOLERANCE), (mode, rank)
            assert sim.ranks[rank].states.total == states, (mode, rank)
        peaks[mode] = (max(r.memory for r in sim.ranks), max(sum(got[rank][mode]) for rank in range(2)))
    for mode in ("W without SI", "1F1B"):
        predicted = peaks[mode][0] / peaks["W + SI"][0]
        assert predicted == pytest.approx(peaks[mode][1] / peaks["W + SI"][1], rel=0.02), mode
