"""`dhelix run`: a real run on 4 local gloo ranks (summary and Chrome trace), a rank killed
mid-step (the job ends non-zero naming it, no hang), and the clean messages of bad runs."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest
from commands import dhelix_here
from conftest import tiny_example_text

pytest.importorskip("torch")
pytest.importorskip("tqdm")

from dhelix.cli import main  # noqa: E402
from dhelix.cli.run_options import write_trace  # noqa: E402
from dhelix.dsl.core.timeline import TraceEvent  # noqa: E402
from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.dsl.render.trace import LANES, trace_json  # noqa: E402
from dhelix.interpreter.training.summary import RankRecord, RunResult, format_summary, summarize  # noqa: E402
from dhelix.interpreter.training.train import FAULT_ENV  # noqa: E402

from test_trace import assert_nested  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "tiny_llama_cpu.dhx")


def dhelix(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``dhelix ARGS`` in this process (:func:`commands.dhelix_here`)."""
    return dhelix_here(*args, env=env)


@pytest.fixture(scope="module")
def example_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """One 2-step run of the example with a trace and metrics: (the process, trace, metrics),
    read by the summary and trace test and, as the plain run, by the recomputation tests."""
    folder = tmp_path_factory.mktemp("example_run")
    trace, metrics = folder / "trace.json", folder / "metrics.json"
    return dhelix("run", EXAMPLE, "--steps", "2", "--trace", str(trace), "--metrics", str(metrics)), trace, metrics


def test_run_prints_the_summary_and_writes_a_trace(example_run):
    result, trace, _ = example_run
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "w_helix, tp 2 × pp 2 on 4 gloo rank(s), SI on" in out
    assert f"devices: cpu on every rank ({socket.gethostname()})" in out  # never CPU without saying so
    # Issue 53, items 14 and 10: the first line at once; what data trains; how much of the
    # held-out data the evaluation covers.
    assert out.startswith(f"dhelix run: {EXAMPLE}: compiling, then checking that it fits this machine's memory "
                          "before any rank starts\n")
    docs = ROOT / "docs" / "*.md"
    assert (f"\n  data: {docs} (the train block's data; text as byte-level tokens, token files as stored; held out: "
            "the last 10% of its tokens)\n") in out
    metrics = json.loads(example_run[2].read_text())
    evaluated, total = metrics["held_out_windows"]["evaluated"], metrics["held_out_windows"]["of"]
    assert evaluated == 16 < total  # one global batch: micro_batch 2 × 8 micro-batches
    assert (f"after step 2, over 16 of the {total} held-out windows of seq + 1 tokens (one global batch: the first 16; "
            f"the other {total - 16} are not evaluated)") in out
    assert metrics["data"] in out
    # The fingerprint `dhelix report --run` compares: the program's sources as it ran.
    from dhelix.dsl.frontend.imports import sources_digest

    text = Path(EXAMPLE).read_text()
    assert metrics["program"] == {"sources_sha256": sources_digest(check_text(text, EXAMPLE).files, text)}
    for row in ("step time", "exposed comm", "peak act.", "simulator:"):
        assert row in out
    loaded = json.loads(trace.read_text())
    events = loaded["traceEvents"]
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {f"rank {r}" for r in range(4)}
    lanes = {e["cat"] for e in events if e["ph"] == "X"}
    assert lanes == {"compute", "local", "cross"}  # tp is node-local, pp crosses the 2 "nodes"
    assert any(e["name"].startswith("SI(") for e in events if e["ph"] == "X")
    # The simulator's writer (dsl/render/trace.py): lanes are threads with fixed ids, events
    # have what Perfetto needs, and the run is described in otherData.
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert all(threads[r, tid] == lane for r in range(4) for tid, lane in enumerate(LANES))
    assert all({"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) for e in events if e["ph"] == "X")
    assert loaded["otherData"]["program"] == "tiny_llama" and loaded["otherData"]["steps"] == 2
    assert f"trace: {trace} ({sum(e['ph'] == 'X' for e in events)} events" in out
    assert_nested(loaded)  # concurrent receives on the cross lane go to tracks of their own
    # A layer's collectives carry the program's op names, as the plan's rows do (those of the
    # embedding and the LM head, which are no ops of the layer, keep their kind and axis).
    local = {e["name"] for e in events if e["ph"] == "X" and e["cat"] == "local"}
    assert {"ag1", "rs1", "ag2", "rs2", "ag1.bwd", "rs1.bwd"} <= local, local


def test_a_killed_rank_ends_the_run_naming_it_as_the_one_cause(tmp_path):
    start = time.monotonic()
    result = dhelix("run", EXAMPLE, "--steps", "3", "--timeout", "20", env={FAULT_ENV: "1:1:3:kill"})
    assert result.returncode == 1
    err = result.stderr
    assert err.startswith("error: rank 1 was killed by signal 9 (SIGKILL); stopped the other 3 rank(s)\n"), err
    # Where it was: its last heartbeat's action (the fault kills it a moment into action 3 of step 1).
    assert "its last heartbeat," in err and "(action 3 of its list) of training step 1" in err, err
    # The peers' "connection reset by peer" follows from it: not shown, not as a schedule error.
    assert err.count("error:") == 1 and "Connection reset" not in err and "Traceback" not in err
    assert err.endswith("\n")
    assert time.monotonic() - start < 60


def test_mesh_size_must_match_the_torchrun_world(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["run", EXAMPLE]) == 1
    assert "the mesh has 4 ranks (tp 2 × pp 2) but torchrun started 2" in capsys.readouterr().err


def test_nproc_must_match_the_mesh(capsys):
    assert main(["run", EXAMPLE, "--nproc", "2"]) == 2
    assert "--nproc 2 does not match the mesh: it has 4 ranks (tp 2 × pp 2)" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "profile"])
@pytest.mark.parametrize("args, message", [
    (["--timeout", "0"], "--timeout must be a finite number of seconds, positive, at most 604800; got 0"),
    (["--timeout", "-5"], "--timeout must be a finite number of seconds, positive, at most 604800; got -5"),
    (["--nproc", "0"], "--nproc must be at least 1, got 0"),
    (["--nproc", "-2"], "--nproc must be at least 1, got -2"),
    (["--backend", "nccl"], "--backend nccl needs CUDA GPUs, and this torch sees none"),
])
def test_launch_mistakes_exit_2_before_any_rank_starts(command, args, message, tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU machine
    monkeypatch.chdir(tmp_path)
    assert main([command, EXAMPLE, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written


def test_without_a_backend_gpus_mean_nccl_and_too_few_mean_gloo(monkeypatch):
    import torch

    from dhelix.cli.launch import choose_backend
    from dhelix.dsl.core.errors import UsageError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert choose_backend(None, 4) == "nccl" and choose_backend(None, 8) == "gloo"
    assert choose_backend("gloo", 4) == "gloo"
    with pytest.raises(UsageError, match="one GPU per local rank: 8 rank"):
        choose_backend("nccl", 8)


def test_a_schedule_that_does_not_fit_is_reported_before_any_rank_starts(tmp_path, capsys):
    bad = tmp_path / "bad.dhx"
    bad.write_text(Path(EXAMPLE).read_text().replace("microbatches = 8", "microbatches = 1"))
    assert main(["run", str(bad)]) == 1
    assert "pipeline w_helix needs m >= p (m = 1, p = 2)" in capsys.readouterr().err


# --- what rank 0 brings back, printed and written by the command line (no ranks started) ---------

def _result() -> RunResult:
    """A made-up run of 3 steps on 2 ranks (seconds and bytes)."""
    ranks = (RankRecord(rank=0, step=(0.9, 0.2, 0.4), collective=(0.5, 0.05, 0.07), p2p=(0.1, 0.01, 0.03),
                        peak_activations=3 * 2**20, events=(TraceEvent(0, "compute", "F0.0", 0.0, 0.001),
                                                            TraceEvent(0, "local", "all_gather", 0.0005, 0.002))),
             RankRecord(rank=1, step=(1.0, 0.3, 0.1), collective=(0.4, 0.02, 0.04), p2p=(0.2, 0.1, 0.3),
                        peak_activations=2**20, events=(TraceEvent(1, "cross", "SEND_F0.0>0", 0.001, 0.003),)))
    return RunResult(losses=(6.0, 5.5, 5.25), ranks=ranks)


def _options(program_path: str, plan: str = "planned", **changes):
    from dhelix.dsl.simulator.runplan import build_run_plan
    from dhelix.interpreter.training.train import RunOptions

    compiled = build_run_plan(Path(program_path).read_text(), program_path, mode=plan)
    return RunOptions(path=program_path, compiled=compiled, steps=3, **changes)


def test_the_summary_is_medians_without_the_first_step_beside_the_simulator():
    program = check_text(Path(EXAMPLE).read_text(), EXAMPLE)
    summary = summarize(program, _options(EXAMPLE, plan="planned"), _result())
    assert [(r.rank, r.step_time, r.p2p_wait) for r in summary.ranks] == [(0, pytest.approx(0.3), pytest.approx(0.02)),
                                                                          (1, pytest.approx(0.2), pytest.approx(0.2))]
    assert summary.measured.step_time == pytest.approx(0.35)  # median of max(0.2, 0.3), max(0.4, 0.1)
    assert summary.measured.exposed_comm == pytest.approx(0.06)
    assert summary.predicted.step_time > 0 and "a40 profile" in summary.note
    text = format_summary(summary)
    assert text.splitlines()[0] == f"{EXAMPLE}: w_helix, tp 2 × pp 2 on 2 gloo rank(s), SI on (planned plan)"
    assert "loss 6.0000 -> 5.2500 over 3 step(s)" in text
    assert "     step time     350.00ms" in text and "     peak act.     3.000MiB" in text


def test_the_header_says_what_data_trains_and_random_tokens_when_none_is_given():
    from dhelix.interpreter.training.data import Blend, DataSpec
    from dhelix.interpreter.training.summary import describe_data, held_out_extent

    assert describe_data(None) == "seeded random tokens (no data given)"
    assert describe_data(DataSpec("/d/a.npy", flag="--data"), DataSpec("/d/e.txt", flag="--eval-data")) == (
        "/d/a.npy (given by --data; text as byte-level tokens, token files as stored; held out: /d/e.txt (--eval-data))")
    blend = Blend((DataSpec("/w", flag="--data", tokenizer="/t.json"), DataSpec("/c", flag="--data")), (0.7, 0.3))
    assert describe_data(blend) == ("a blend of /w (0.7), /c (0.3) (given by --data; text through the tokenizer "
                                    "/t.json, token files as stored; held out: the last 10% of its tokens (of each "
                                    "source))")
    assert held_out_extent((12, 12)) == "all 12 held-out window(s) of seq + 1 tokens"
    assert held_out_extent(None) == "one global batch of seeded random tokens"


def test_the_held_out_coverage_counts_the_distinct_windows_one_evaluation_reads():
    import torch

    from dhelix.interpreter.training.data import BlendedCorpus, Corpus, DataSource

    program = check_text(Path(EXAMPLE).read_text(), EXAMPLE)  # a global batch of 16 sequences
    windows = lambda n: torch.zeros(n, 33, dtype=torch.long)  # noqa: E731
    assert DataSource(program, 1, 0, Corpus(windows(40), windows(57))).held_out_coverage() == (16, 57)
    assert DataSource(program, 1, 0, Corpus(windows(40), windows(5))).held_out_coverage() == (5, 5)  # repeated
    blend = BlendedCorpus((Corpus(windows(40), windows(3)), Corpus(windows(40), windows(50))), (0.5, 0.5))
    assert DataSource(program, 1, 0, blend).held_out_coverage() == (3 + 8, 53)
    assert DataSource(program, 1, 0, None).held_out_coverage() is None


def test_the_summary_says_plainly_when_ranks_share_fewer_cores():
    from dhelix.interpreter.training.summary import shared_cores

    ranks = [RankRecord(rank=r, step=(0.1,), collective=(0.0,), p2p=(0.0,), peak_activations=0, host="a")
             for r in range(4)]
    note = shared_cores(ranks, cores=2, host="a", core_wait=0.0125, counted=True)
    assert note.startswith("4 ranks share 2 CPU cores here") and "at the same moment" in note
    assert "a rank waited 12.50ms per step for a core" in note
    # A profile without its host's cores (a GPU's): the prediction gave each rank a core.
    assert "gives each rank a core of its own" in shared_cores(ranks, cores=2, host="a")
    assert shared_cores(ranks, cores=4, host="a") == ""  # a core each
    assert shared_cores(ranks, cores=2, host="b") == ""  # ranks on another host


def test_the_header_names_every_mesh_axis_expert_parallelism_too():
    from dhelix.dsl.core.mesh import Mesh
    from dhelix.interpreter.training.summary import describe_mesh
    assert describe_mesh(Mesh(("tp", "dp", "pp"), (2, 4, 1), ep=2)) == "tp 2 × dp 4 (ep 2)"
    assert describe_mesh(Mesh(("tp", "dp"), (1, 1))) == "1 rank"


def test_the_summary_says_which_device_each_rank_used():
    from dhelix.interpreter.training.summary import describe_devices

    ranks = [RankRecord(rank=r, step=(0.1,), collective=(0.0,), p2p=(0.0,), peak_activations=0,
                        device=f"cuda:{r % 2}", host=f"node{r // 2}") for r in range(4)]
    assert describe_devices(ranks) == "node0: rank 0 cuda:0, rank 1 cuda:1; node1: rank 2 cuda:0, rank 3 cuda:1"


def test_the_run_trace_is_the_simulators_format(tmp_path):
    program = check_text(Path(EXAMPLE).read_text(), EXAMPLE)
    result, path = _result(), tmp_path / "run.json"
    write_trace(path, program, _options(EXAMPLE), result)
    text = path.read_text()
    assert text == trace_json(result.events, metadata=json.loads(text)["otherData"])  # the one writer
    trace = json.loads(text)
    complete = sorted((e["pid"], e["tid"], e["name"], e["ts"], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X")
    assert complete == [(0, 0, "F0.0", 0.0, 1000.0), (0, 1, "all_gather", 500.0, 2000.0),
                        (1, 2, "SEND_F0.0>0", 1000.0, 3000.0)]
    assert trace["otherData"]["schedule"] == "w_helix" and trace["otherData"]["backend"] == "gloo"


def _peaks(metrics: Path) -> tuple[float, float]:
    data = json.loads(metrics.read_text())
    return data["peak_activations_bytes"], data["predicted"]["peak_activations_bytes"]


def _peak_activations(tmp_path, example_run, **programs) -> dict[str, tuple[float, float]]:
    """Per named program: (measured, predicted) peak activation bytes of a 2-step run; "plain"
    is the example's (the ``example_run`` fixture's)."""
    result, _, metrics = example_run
    assert result.returncode == 0, result.stderr
    peaks = {"plain": _peaks(metrics)}
    for name, path in programs.items():
        metrics = tmp_path / f"{name}.json"
        result = dhelix("run", str(path), "--steps", "2", "--metrics", str(metrics))
        assert result.returncode == 0, result.stderr
        peaks[name] = _peaks(metrics)
    return peaks


def test_full_recomputation_runs_exactly_and_keeps_fewer_activations(tmp_path, example_run):
    program = tmp_path / "recompute.dhx"
    text = tiny_example_text()  # a copy elsewhere
    program.write_text(text.replace("  seed = 1234", "  seed = 1234\n  recompute = full"))
    checked = dhelix("run", str(program), "--steps", "2", "--check")
    assert checked.returncode == 0, checked.stderr  # loss and every gradient equal to the reference
    # Steps counted from 1, as the summary and the log count them; a verdict at the end.
    lines = checked.stdout.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert steps[0].startswith("step 1: loss") and steps[1].startswith("step 2: loss")
    assert lines[-1].startswith("check: passed: 2 step(s) match the single-process reference")
    peaks = _peak_activations(tmp_path, example_run, recompute=program)
    assert peaks["recompute"][0] < 0.5 * peaks["plain"][0]  # measured
    assert peaks["recompute"][1] < 0.5 * peaks["plain"][1]  # simulated


def test_selective_recomputation_runs_exactly_and_drops_what_the_model_says(tmp_path, example_run):
    # The tiny example's layer (sequence parallel) drops the SwiGLU output between its forward
    # and its backward; the run's measured peak and the simulator's fall by the same bytes.
    program = tmp_path / "selective.dhx"
    program.write_text(tiny_example_text().replace("  seed = 1234", "  seed = 1234\n  recompute = selective"))
    checked = dhelix("run", str(program), "--steps", "2", "--check")
    assert checked.returncode == 0, checked.stderr
    peaks = _peak_activations(tmp_path, example_run, selective=program)
    measured, simulated = (peaks["plain"][i] - peaks["selective"][i] for i in (0, 1))
    assert measured > 0 and simulated > 0
    assert measured == pytest.approx(simulated, rel=0.25)


def test_recomputing_the_first_layers_of_each_chunk_runs_exactly_between_none_and_full(tmp_path):
    # 8 layers on fold u over 2 ranks: 4 chunks of 2; recompute_layers = 1 recomputes the
    # first of each. The run matches the reference, and its measured peak (and the
    # simulator's) lies between keeping every activation and full recomputation, near the
    # simulator's prediction.
    text = tiny_example_text().replace("layers = 4", "layers = 8")
    peaks = {}
    for name, train in (("none", ""), ("partial", "recompute = full  recompute_layers = 1"), ("full", "recompute = full")):
        program = tmp_path / f"{name}.dhx"
        program.write_text(text.replace("  seed = 1234", f"  seed = 1234\n  {train}"))
        if name == "partial":
            checked = dhelix("run", str(program), "--steps", "2", "--check")
            assert checked.returncode == 0, checked.stderr
            assert checked.stdout.splitlines()[-1].startswith("check: passed: 2 step(s) match")
        metrics = tmp_path / f"{name}.json"
        result = dhelix("run", str(program), "--steps", "2", "--metrics", str(metrics))
        assert result.returncode == 0, result.stderr
        peaks[name] = _peaks(metrics)
    for side in (0, 1):  # measured, simulated
        assert peaks["full"][side] < peaks["partial"][side] < peaks["none"][side]
    assert peaks["partial"][0] == pytest.approx(peaks["partial"][1], rel=0.1)


def test_uneven_stages_run_exactly_and_alone_as_one_rank(tmp_path):
    # 10 layers on fold u over 2 ranks: 2 in the embedding's chunk and in the LM head's (both
    # on rank 0), 3 in rank 1's two; its SI blocks pair chunks of unequal layers. The run
    # matches the reference; rank 1 runs alone (--as-rank) with the layers it owns.
    program = tmp_path / "uneven.dhx"
    program.write_text(tiny_example_text().replace("layers = 4", "layers = 10").replace(
        "  seed = 1234", "  seed = 1234\n  first_stage_layers = 2  last_stage_layers = 2"))
    checked = dhelix("run", str(program), "--steps", "2", "--check")
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.splitlines()[-1].startswith("check: passed: 2 step(s) match")
    alone = dhelix("run", str(program), "--steps", "2", "--as-rank", "1")
    assert alone.returncode == 0, alone.stderr
    assert "rank 1 of 4 alone" in alone.stdout


def test_the_command_modules_import_no_circle_and_no_private_names():
    # run.py and as_rank.py imported each other, as_rank.py took run.py's private helpers
    # (issue 57): what both use is dhelix/cli/run_options.py's, public.
    import ast

    from test_layering import ROOT as TREE, imported_modules

    folder = TREE / "dhelix" / "cli"
    graph = {path.stem: {module.rpartition(".")[2] for _, module in imported_modules(path)
                         if module.startswith("dhelix.cli.")} for path in folder.glob("*.py")}
    private = [f"{path.name}: {node.module}.{alias.name}" for path in folder.glob("*.py")
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
               and (node.module or "").startswith("dhelix.cli.") for alias in node.names if alias.name.startswith("_")]
    assert private == []

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen))
                   for nxt in graph.get(start, ()))

    assert [name for name in sorted(graph) if reaches(name, name, set())] == []
