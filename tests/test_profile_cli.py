"""`dhelix profile`: a real profile of the tiny example on 4 local gloo ranks that `check`, `plan`
and `simulate` accept, and the command-line mistakes refused before any rank starts."""

from __future__ import annotations

import os

import subprocess
from pathlib import Path

import pytest
from commands import dhelix_here
from conftest import tiny_example_text

torch = pytest.importorskip("torch")
pytest.importorskip("tqdm")

from dhelix.cli import main  # noqa: E402
from dhelix.dsl.core.oplib import END_OPS  # noqa: E402
from dhelix.dsl.frontend.profiles import parse_profile  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny_llama_cpu.dhx"


def dhelix(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``dhelix ARGS`` in this process (:func:`commands.dhelix_here`)."""
    return dhelix_here(*args, timeout=timeout)


def test_a_profile_of_the_tiny_example_is_accepted_by_check_plan_simulate_and_run(tmp_path, capsys):
    # The program names a stale measured profile (another layer's): re-measuring is the cure, so
    # `dhelix profile` must not refuse it, and its other values fill in what cannot be measured.
    (tmp_path / "stale.yaml").write_text((ROOT / "tests" / "errors" / "stale_profile.measured.yaml").read_text())
    stale = tmp_path / "stale.dhx"
    stale.write_text(tiny_example_text().replace('profile = "a40"', 'profile = "stale.yaml"'))  # a copy elsewhere
    assert main(["check", str(stale)]) == 1 and "measured on another program" in capsys.readouterr().err
    out = tmp_path / "measured.yaml"
    result = dhelix("profile", str(stale), "-o", str(out), "--repeats", "2")
    assert result.returncode == 0, result.stderr
    assert "on 4 gloo rank(s) (tp 2 × pp 2), 2 timed repeat(s) after 1 warm-up" in result.stdout
    assert ("timed 32 layer ops alone, 1 pass of the whole layer, 4 embedding and LM-head passes, 1 optimizer step, "
            "112 op pairs, 8 link sizes, 12 other collectives") in result.stdout
    assert 'use it: cluster { profile = "' in result.stdout
    assert "profiling" not in result.stderr  # the progress bar is for terminals: logs stay readable
    profile = parse_profile(out.read_text(), str(out))
    measured = profile.measured
    assert measured.dtype == "fp32" and measured.repeats == 2 and measured.mesh == {"tp": 2, "pp": 2}
    assert set(measured.stamp) == {"machine", "torch", "backend", "date", "command"}
    assert measured.stamp["backend"] == "gloo" and measured.stamp["command"].startswith("dhelix profile ")
    assert len(measured.ops) == 14 + 18 + 4 and len(measured.pairs) == 112
    assert set(END_OPS) <= set(measured.ops) and measured.shapes["lm_head"] == "tokens 64, hidden 64, vocab 256 over tp 2"
    assert all(us > 0 for us in measured.ops.values())
    assert set(profile.peak_tflops) == {"fp32"}
    # The optimizer step was timed over one layer's weights (18,560 on this rank): its rate.
    assert profile.optimizer_gbps > 0 and "one AdamW step over a layer's 18,560 parameters (fp32)" in out.read_text()
    assert "[measured]" in out.read_text() and "[from lab]" in out.read_text()  # cross pairs: not in this layer
    # The host's time between ops: the pass of the whole layer outside its 8 collectives, less
    # its 14 + 18 - 8 compute ops alone, over them.
    assert "a pass of the layer outside its collectives" in out.read_text()
    assert "less its 24 compute ops alone" in out.read_text()
    # Measured on CPU ranks: the host's cores and the ranks that shared them, with the CPU
    # share of a collective's time (the simulator's bound of shared cores).
    assert profile.cores.usable == len(os.sched_getaffinity(0)) and profile.cores.ranks == 4
    assert 0 < profile.cores.comm_busy <= 1

    program = tmp_path / "tiny.dhx"
    program.write_text(EXAMPLE.read_text().replace('profile = "a40"', 'profile = "measured.yaml"'))
    capsys.readouterr()
    for command in ("check", "plan", "simulate"):
        assert main([command, str(program)]) == 0, capsys.readouterr().err
    assert f"profile {profile.name}" in capsys.readouterr().out

    # --profile prices the stale program with the new profile instead, in the ranks too.
    assert main(["plan", str(stale), "--profile", str(out)]) == 0, capsys.readouterr().err
    result = dhelix("run", str(stale), "--steps", "2", "--profile", str(out))
    assert result.returncode == 0, result.stderr
    assert f"simulator: predicted with the profile {out} measured on this machine" in result.stdout


def test_the_output_may_not_overwrite_an_input(tmp_path, capsys):
    program = tmp_path / "tiny.dhx"
    program.write_text(EXAMPLE.read_text().replace('profile = "a40"', 'profile = "lab.yaml"'))
    (tmp_path / "lab.yaml").write_text((ROOT / "stdlib_schedules" / "a40.yaml").read_text())
    for target in (program, tmp_path / "lab.yaml"):
        assert main(["profile", str(program), "-o", str(target)]) == 2
        assert "that is an input of this command" in capsys.readouterr().err
    assert program.read_text().count("lab.yaml") == 1  # untouched


@pytest.mark.parametrize("args, message", [
    (["-o", "out.txt"], "-o out.txt: a profile is a .yaml file"),
    (["-o", "missing/out.yaml"], "-o missing/out.yaml: the folder 'missing' does not exist"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--nproc", "2"], "--nproc 2 does not match the mesh: it has 4 ranks (tp 2 × pp 2)"),
])
def test_command_line_mistakes_exit_2_before_any_rank_starts(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["profile", str(EXAMPLE), *args]) == 2
    assert message in capsys.readouterr().err


def test_a_library_file_has_nothing_to_profile(capsys):
    assert main(["profile", str(ROOT / "stdlib_schedules" / "layers.dhx")]) == 2
    assert "is a library file (no model block)" in capsys.readouterr().err


def test_the_default_output_is_named_after_the_program_and_the_host(tmp_path, monkeypatch):
    import argparse

    from dhelix.cli.profile import _output
    from dhelix.dsl.passes.pipeline import check_text

    program_file = tmp_path / "tiny.dhx"
    program_file.write_text(EXAMPLE.read_text())
    program = check_text(program_file.read_text(), str(program_file))
    args = argparse.Namespace(file=str(program_file), output=None)
    assert _output(args, program, "lab1") == tmp_path / "tiny-lab1.yaml"
    assert not (tmp_path / "tiny-lab1.yaml").exists()  # checked, not written


def test_check_says_how_to_re_measure_a_stale_profile(tmp_path, capsys):
    for name in ("stale_profile.dhx", "stale_profile.measured.yaml"):
        (tmp_path / name).write_text((ROOT / "tests" / "errors" / name).read_text())
    assert main(["check", str(tmp_path / "stale_profile.dhx")]) == 1
    err = capsys.readouterr().err
    assert "was measured on another program" in err
    assert err.rstrip().endswith(f"note: to re-measure it: dhelix profile {tmp_path / 'stale_profile.dhx'}")


class _Counting:
    """A stand-in for the profiler's layer bench and communicator (rank ``index`` of a group of
    2): records what runs."""

    def __init__(self, index: int = 0):
        self.calls, self._index = [], index

    def index(self, axis):
        return self._index

    def size(self, axis):
        return 2

    def peer(self, axis, offset):
        return (self._index + offset) % 2

    def post_p2p(self, transfers):
        self.calls += [(kind, peer) for kind, _, peer, _ in transfers]
        return [None] * len(transfers)

    def all_reduce(self, x, axis):
        self.calls.append(("all_reduce", axis))

    def issue(self, op, async_op):
        self.calls.append(("issue", op.name, async_op))

    def wait(self, op):
        self.calls.append(("wait", op.name))

    def all_gather(self, x, axis):
        self.calls.append(("all_gather", axis))


class _Ticks:
    """A clock whose marks are the number of calls the bench saw so far."""

    def __init__(self, bench, cuda: bool = True):
        self.bench, self.cuda = bench, cuda

    def mark(self):
        return len(self.bench.calls)

    def us(self, start, stop):
        return float(stop - start)


def test_every_timed_collective_follows_an_untimed_run_of_itself():
    """The profile times collectives on a busy link (a link lending credit after idling, as
    tc tbf's burst, would otherwise price them faster than an SI block sees them): each timed
    collective, alone, issued, in a pair and in the sweep, comes right after an untimed run.
    A compute op alone runs warm, back to back, as a layer's ops run one after the other."""
    from types import SimpleNamespace

    from dhelix.interpreter.measure import profiler

    comm, compute = SimpleNamespace(name="ag1", kind="comm"), SimpleNamespace(name="qkv", kind="compute")
    for async_op in (False, True):
        bench = _Counting()
        out = profiler._solo(bench, _Ticks(bench), comm, async_op)()
        assert bench.calls[:2] == [("issue", "ag1", False), ("wait", "ag1")]  # the untimed run
        assert bench.calls[2:] == [("issue", "ag1", async_op), ("wait", "ag1")] and out["us"] == 2.0
    # On CPU ranks a synchronous collective then runs back to back, for its share of CPU time:
    # after its timed run, so that the time is not changed.
    bench = _Counting()
    out = profiler._solo(bench, _Ticks(bench, cuda=False), comm, False)()
    assert bench.calls[4:] == [("issue", "ag1", False), ("wait", "ag1")] * profiler.CPU_BURST
    assert out["us"] == 2.0 and out["cpu"] >= 0.0
    bench = _Counting()
    out = profiler._solo(bench, _Ticks(bench), compute, False)()
    # Compute: an untimed run (its inputs in the caches), then back to back, the mean of those.
    assert bench.calls == [("issue", "qkv", False)] * (1 + profiler.BACK_TO_BACK) and out["us"] == 1.0
    bench = _Counting()
    out = profiler._pair(bench, _Ticks(bench), compute, comm)()
    assert bench.calls[:2] == [("issue", "ag1", False), ("wait", "ag1")]
    assert out["us"] == 4.0  # the timed pair: the collective issued, the compute op, both waited
    bench = _Counting()
    out = profiler._gather(bench, _Ticks(bench), None, "tp")()
    assert bench.calls == [("all_gather", "tp")] * 2 and out["us"] == 1.0
    bench = _Counting()
    out = profiler._collective(bench, _Ticks(bench), "x", "tp", "all_reduce")()
    assert bench.calls == [("all_reduce", "tp")] * 2 and out["us"] == 1.0
    # The send timed one way, in pairs of the group: index 0 sends to 1, 1 receives from 0.
    for index, kind, peer in ((0, "send", 1), (1, "recv", 0)):
        bench = _Counting(index)
        out = profiler._collective(bench, _Ticks(bench), torch.zeros(2), "pp", "p2p")()
        assert [call[:2] for call in bench.calls] == [(kind, peer)] * 2 and out["us"] == 1.0


def test_the_layer_pass_leaves_out_its_collectives_as_they_took_in_it():
    """The layer pass's time is without its collectives, marked by the profile's clock around
    each one as the pass issues it (a collective timed alone can differ from the same one in the
    pass by more than the layer's host time): a stand-in whose all-reduce takes 5 ticks."""
    from types import SimpleNamespace

    from dhelix.interpreter.measure.clocked_comm import ClockedComm
    from dhelix.interpreter.ops.comm import Communicator

    ticks = [0]

    class Slow(Communicator):
        rank, mesh = 0, SimpleNamespace(size=lambda axis: 2)  # a tp 2 group

        def _all_reduce(self, x, axis, op, async_op):
            ticks[0] += 5
            return x

    def mark():
        ticks[0] += 1
        return ticks[0]

    clocked = ClockedComm(Slow(), mark)
    assert clocked.all_reduce("x", "tp") == "x" and clocked.issuer("all_reduce", "tp", False)("y") == "y"
    assert [stop - start for start, stop in clocked.spans] == [6, 6]  # the 5 ticks and the stop mark's own
    assert clocked.rank == 0 and clocked.names_ops is False
