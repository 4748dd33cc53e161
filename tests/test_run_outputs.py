"""`dhelix run`'s outputs on a bad day (issue 33): every destination probed before a rank
starts, the training data never overwritten, options out of range refused, a full disk under
an output reported once by its cause with nothing partial left, and checkpoint folders that
keep the newest saves, drop what interrupted saves left and refuse another run's saves.

/dev/full (every write: "No space left on device") stands in for a full disk; a path whose
folder is a file, or a monkeypatched probe, for a read-only place (no root needed)."""

from __future__ import annotations

import errno
import json
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tqdm")

from dhelix.cli import main  # noqa: E402
from commands import dhelix_here  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "tiny_llama_cpu.dhx")
FULL = Path("/dev/full")
OUTPUTS = ("--save", "--log", "--metrics", "--trace", "--export-weights")


def dhelix(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``dhelix ARGS`` in this process (:func:`commands.dhelix_here`)."""
    return dhelix_here(*args, cwd=cwd)


# --- before any rank starts (in process: nothing is spawned) --------------------------------

@pytest.mark.parametrize("flag", OUTPUTS)
def test_a_destination_under_a_file_is_refused_before_training(flag, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["run", EXAMPLE, flag, str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dhelix: {flag} {blocker / 'out'}: ") and "is not a folder" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag", OUTPUTS)
def test_an_unwritable_destination_is_refused_before_training(flag, tmp_path, monkeypatch, capsys):
    import tempfile

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refused)  # what a read-only folder answers
    assert main(["run", EXAMPLE, flag, str(tmp_path / "out")]) == 2
    assert f"{flag} {tmp_path / 'out'}: cannot write there (Permission denied)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ("--log", "--metrics", "--trace", "--export-weights"))
def test_an_output_never_overwrites_the_training_data(flag, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to train on\n" * 100)
    assert main(["run", EXAMPLE, "--data", str(corpus), flag, str(corpus)]) == 2
    assert f"{flag} {corpus}: that is an input of this command" in capsys.readouterr().err
    assert corpus.read_text() == "some text to train on\n" * 100


def test_a_checkpoint_folder_holding_the_data_is_refused(tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text("some text to train on\n" * 100)
    assert main(["run", EXAMPLE, "--data", str(tmp_path), "--save", str(tmp_path)]) == 2
    assert "the folder holds the training data" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--seed", "18446744073709551616"], "--seed must be between 0 and 9223372036854775807"),
    (["--seed", "-1"], "--seed must be between 0"),
    (["--timeout", "inf"], "--timeout must be a finite number of seconds, positive, at most 604800; got inf"),
    (["--timeout", "nan"], "--timeout must be a finite number of seconds, positive, at most 604800; got nan"),
    (["--lr", "nan"], "--lr must be a finite number, positive; got nan"),
    (["--lr", "inf"], "--lr must be a finite number, positive; got inf"),
    (["--lr", "-1"], "--lr must be a finite number, positive; got -1"),
    (["--lr", "0"], "--lr must be a finite number, positive; got 0"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number, at least 0; got nan"),
    (["--weight-decay", "-5"], "--weight-decay must be a finite number, at least 0; got -5"),
    (["--clip", "nan"], "--clip must be a finite number, positive; got nan"),
    (["--clip", "inf"], "--clip must be a finite number, positive; got inf"),
    (["--steps", "0"], "--steps must be between 1 and 1000000, got 0"),
    (["--keep", "0", "--save", "ck"], "--keep must be between 1"),
    (["--keep", "2"], "--keep needs --save DIR"),
])
def test_options_out_of_range_are_usage_errors(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", EXAMPLE, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_a_fresh_run_does_not_save_over_another_runs_checkpoint(tmp_path, capsys):
    saves = tmp_path / "ck"
    (saves / "step-000004").mkdir(parents=True)
    (saves / "latest").write_text("step-000004\n")
    assert main(["run", EXAMPLE, "--save", str(saves)]) == 2
    err = capsys.readouterr().err
    assert f"--save {saves}: the folder holds a checkpoint of another run (step-000004)" in err
    assert f"continue that run with --resume {saves}" in err
    assert (saves / "step-000004").is_dir()


# --- a full disk while training (4 ranks) ---------------------------------------------------

@pytest.mark.parametrize(("flag", "message"), [
    ("--export-weights", "error: cannot write the weights to '/dev/full': No space left on device"),
    ("--log", "error: cannot write the log '/dev/full': No space left on device"),
])
def test_a_full_disk_under_an_output_is_reported_once_by_its_cause(flag, message, tmp_path):
    if not FULL.exists():
        pytest.skip("no /dev/full here")
    result = dhelix("run", EXAMPLE, "--steps", "1", flag, str(FULL), cwd=tmp_path)
    assert result.returncode == 1
    err = result.stderr
    # Rank 0 meets it; the other ranks' lost connections follow and are not what is reported.
    assert err.startswith(message), err
    assert err.count("error:") == 1 and "Connection" not in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_under_the_metrics_keeps_the_summary_and_exits_1(tmp_path):
    if not FULL.exists():
        pytest.skip("no /dev/full here")
    result = dhelix("run", EXAMPLE, "--steps", "1", "--metrics", str(FULL), cwd=tmp_path)
    assert result.returncode == 1  # 2 is for a wrong command line only
    assert "dhelix run: " in result.stdout
    assert result.stderr.startswith("error: cannot write '/dev/full': No space left on device")
    assert "the training finished" in result.stderr


def test_a_written_output_leaves_no_partial_file_when_the_disk_fills(tmp_path, monkeypatch):
    from dhelix.cli.paths import write_output
    from dhelix.dsl.core.errors import OutputError

    target = tmp_path / "m.json"
    target.write_text("the previous metrics")

    def full(self, text, *args, **kwargs):
        Path.write_bytes(self, b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OutputError) as info:
        write_output(target, "{}")
    assert info.value.message == f"cannot write '{target}': No space left on device"
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"] and target.read_bytes() == b"the previous metrics"


# --- the launcher: the cause, not a victim ---------------------------------------------------

class _Store:
    def __init__(self, values: dict):
        self.values = {k: v.encode() for k, v in values.items()}

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key]


class _Proc:
    def __init__(self, exitcode):
        self.exitcode = exitcode


def test_the_launcher_reports_a_ranks_own_error_over_the_peers_it_cut_off():
    from dhelix.interpreter.launch.failure import CAUSE_PREFIX, FAILURE_PREFIX, failure_cause

    # Rank 2 exited first, with gloo's "Connection closed by peer"; rank 0's own error came later.
    store = _Store({f"{FAILURE_PREFIX}2": "error: rank 2: Connection closed by peer", f"{CAUSE_PREFIX}2": "peer 1.0",
                    f"{FAILURE_PREFIX}0": "error: cannot write the log", f"{CAUSE_PREFIX}0": "own 2.0"})
    failure = failure_cause([_Proc(1), _Proc(0), _Proc(1), _Proc(0)], (2, 1), store, timeout=60)
    assert failure.rank == 0 and failure.render().startswith("error: cannot write the log")


def test_gloos_lost_connections_are_a_peers_failure():
    from dhelix.interpreter.launch.failure import lost_a_peer

    try:
        try:
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")
        except RuntimeError as exc:
            raise ValueError("in F0.0") from exc
    except ValueError as outer:
        assert lost_a_peer(outer)
    assert not lost_a_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


# --- checkpoint folders (one rank in process) -------------------------------------------------

@pytest.fixture
def one_rank(tmp_path):
    """An executor and optimizer of a 2-layer model in a one-rank gloo world."""
    import torch.distributed as dist

    from dhelix.dsl.passes.pipeline import check_text
    from dhelix.interpreter.ops.comm import SingleRankComm
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.training.optim import for_executor
    from test_training import program_text

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        text = program_text("one").replace("microbatches = 8", "microbatches = 1").replace("layers = 4", "layers = 2")
        executor = Executor(check_text(text, "one.dhx"), SingleRankComm(), seed=1, optimizer=for_executor)
        yield executor, executor.optimizer
    finally:
        dist.destroy_process_group()


def test_saves_keep_the_newest_k_and_drop_what_interrupted_saves_left(one_rank, tmp_path):
    from dhelix.interpreter.training.checkpoint import save

    executor, optimizer = one_rank
    root = tmp_path / "ck"
    stale = root / ".partial-step-000001-999999999"  # its writer (no such process) is gone
    stale.mkdir(parents=True)
    (stale / "x.distcp").write_bytes(b"half a save")
    for step in (1, 2, 3):
        save(str(root), executor, optimizer, step=step, seed=1, global_sequences=2, keep=2,
             schedule={"lr": 0.001})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002", "step-000003"]
    meta = json.loads((root / "step-000003" / "dhelix.json").read_text())
    assert meta["seed"] == 1 and meta["schedule"] == {"lr": 0.001}


def test_a_full_disk_during_a_save_removes_it_and_names_the_save_kept(one_rank, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from dhelix.dsl.core.errors import OutputError
    from dhelix.interpreter.training.checkpoint import save

    executor, optimizer = one_rank
    root = tmp_path / "ck"
    save(str(root), executor, optimizer, step=2, seed=1, global_sequences=2)

    def full(state, checkpoint_id, **kwargs):
        Path(checkpoint_id).mkdir()
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(OutputError) as info:
        save(str(root), executor, optimizer, step=4, seed=1, global_sequences=2)
    assert info.value.message == f"cannot save the checkpoint of step 4 to '{root}': No space left on device (rank 0)"
    assert info.value.notes == ("the partial save was removed", "the last good save, step-000002, is kept")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002"]


@pytest.mark.parametrize(("free", "reason"), [
    (0, "No space left on device (ranks 1 and 2); Permission denied (rank 3)"),
    (10 << 30, "a write failed (torch: unexpected pos 64 vs 0) (ranks 1 and 2); Permission denied (rank 3)"),
])
def test_every_rank_that_failed_to_save_is_named_with_its_cause(one_rank, tmp_path, monkeypatch, free, reason):
    # torch.save on a full disk raises RuntimeError "unexpected pos" (no OSError); DCP hands
    # every rank each rank's failure: all of them are named, a full disk by its free space.
    import collections
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dhelix.dsl.core.errors import OutputError
    from dhelix.interpreter.training.checkpoint import save, verify

    executor, optimizer = one_rank
    root = tmp_path / "ck"
    save(str(root), executor, optimizer, step=2, seed=1, global_sequences=2)
    torn = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    def full(state, checkpoint_id, **kwargs):
        Path(checkpoint_id).mkdir()
        (Path(checkpoint_id) / "__1_0.distcp").write_bytes(b"x" * 100)
        raise CheckpointException("write", {1: (torn, None), 2: (torn, None),
                                             3: (OSError(errno.EACCES, "Permission denied"), None)})

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(dcp, "save", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, (1 << 40) - free, free))
    with pytest.raises(OutputError) as info:
        save(str(root), executor, optimizer, step=4, seed=1, global_sequences=2)
    assert info.value.message == f"cannot save the checkpoint of step 4 to '{root}': {reason}"
    assert info.value.notes == ("the partial save was removed", "the last good save, step-000002, is kept")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002"]
    assert verify(root / "step-000002") == []


def test_a_save_that_fails_on_some_ranks_is_one_clean_error_naming_them(tmp_path):
    from dhelix.interpreter.training.checkpoint import FULL_DISK_ENV
    from test_training import write_program

    saves = tmp_path / "ck"
    result = dhelix_here("run", write_program(tmp_path, "dp2"), "--steps", "2", "--save", str(saves),
                         "--save-every", "1", env={FULL_DISK_ENV: "1"}, cwd=tmp_path)
    err = result.stderr
    assert result.returncode == 1, err
    assert err.startswith(f"error: cannot save the checkpoint of step 1 to '{saves}': a write failed (torch: "
                          "unexpected pos 64 vs 0) (rank 1)\n"), err
    assert err.count("error:") == 1 and "Traceback" not in err and "exited with code" not in err
    assert "  note: the partial save was removed\n" in err
    assert [p.name for p in saves.iterdir() if p.name.startswith(".partial")] == []


def test_older_saves_are_removed_off_the_critical_path(one_rank, tmp_path, monkeypatch):
    # Rank 0 removes what --keep drops in a thread of its own: the save returns (and the
    # ranks go on to the next step's collectives) while a slow removal still runs.
    import shutil
    import threading

    from dhelix.interpreter.training import checkpoint

    executor, optimizer = one_rank
    root = tmp_path / "ck"
    for step in (1, 2):
        checkpoint.save(str(root), executor, optimizer, step=step, seed=1, global_sequences=2, keep=2)
    removing, done, where = threading.Event(), threading.Event(), []
    real = shutil.rmtree

    def slow(path, *args, **kwargs):
        if Path(path).name.startswith("step-"):
            where.append(threading.current_thread() is threading.main_thread())
            removing.set()
            done.wait(10)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", slow)
    rotation = checkpoint.Rotation()
    checkpoint.save(str(root), executor, optimizer, step=3, seed=1, global_sequences=2, keep=1, rotation=rotation)
    assert removing.wait(10) and (root / "step-000001").is_dir()  # the save returned mid-removal
    done.set()
    rotation.join()
    assert where == [False, False]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["latest", "step-000003"]


def test_a_branch_resume_with_keep_1_keeps_what_it_wrote_and_resumed_from(one_rank, tmp_path):
    # A run resumed from step-000001 of a folder that also holds steps 2 and 3 (another
    # branch) writes step 2 again: neither that save nor step 1 goes, and latest names it.
    from dhelix.interpreter.training import checkpoint

    executor, optimizer = one_rank
    root = tmp_path / "ck"
    for step in (1, 2, 3):
        checkpoint.save(str(root), executor, optimizer, step=step, seed=1, global_sequences=2, keep=3)
    rotation = checkpoint.Rotation(checkpoint.resolve(str(root / "step-000001")), background=False)
    checkpoint.save(str(root), executor, optimizer, step=2, seed=1, global_sequences=2, keep=1, rotation=rotation)
    assert [p.name for p in checkpoint.saves_in(root)] == ["step-000001", "step-000002", "step-000003"]
    assert checkpoint.resolve(str(root)) == root / "step-000002" and checkpoint.verify(root / "step-000002") == []


def test_two_runs_on_one_save_folder_the_second_is_refused(tmp_path, capsys):
    from dhelix.interpreter.training.manifest import FolderLock

    saves = tmp_path / "ck"
    with FolderLock(saves):  # the first run, still saving
        assert main(["run", EXAMPLE, "--save", str(saves)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {saves}: another run is saving to this folder (process ") and (
            f"holds its lock '{saves / '.lock'}')" in err), err
    # A run lets the lock go when it ends, however it ends (here: data that is not there).
    assert main(["run", EXAMPLE, "--save", str(saves), "--data", str(tmp_path / "none")]) != 0
    capsys.readouterr()
    FolderLock(saves).acquire().release()


def test_a_latest_pointer_holding_garbage_is_a_clean_error(one_rank, tmp_path):
    from dhelix.interpreter.training.checkpoint import CheckpointError, latest, resolve, save

    executor, optimizer = one_rank
    root = tmp_path / "ck"
    save(str(root), executor, optimizer, step=1, seed=1, global_sequences=2)
    for garbage, shown in ((b"x" * 5000, repr("x" * 40) + "…"), (b"\xff\xfe", "<unreadable: UnicodeDecodeError>"),
                           (b"step-000009\n", "step-000009")):
        (root / "latest").write_bytes(garbage)
        for read in (resolve, latest):
            with pytest.raises(CheckpointError) as info:
                read(str(root))
            assert info.value.message == (f"the checkpoint '{root}' is damaged: its 'latest' file names no save of "
                                          f"it ({shown})")
            assert info.value.notes == (f"resume from one of its saves, such as {root / 'step-000001'}, or from "
                                        "the newest intact one",)


# --- the step log: never an earlier run's, never in a checkpoint -----------------------------

def test_an_earlier_runs_log_is_refused_not_truncated(tmp_path, capsys):
    log = tmp_path / "train.jsonl"
    log.write_text('{"step": 1, "loss": 5.0}\n')
    assert main(["run", EXAMPLE, "--steps", "1", "--log", str(log)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dhelix: --log {log}: the file holds an earlier run's log (25 bytes), which this run "
                          "would replace; it is refused, not overwritten nor appended to"), err
    assert log.read_text() == '{"step": 1, "loss": 5.0}\n'


@pytest.mark.parametrize("inside", ["latest", "step-000001/x.jsonl", "new.jsonl"])
def test_an_output_inside_a_checkpoint_folder_is_refused(inside, tmp_path, capsys):
    saves = tmp_path / "ck"
    (saves / "step-000001").mkdir(parents=True)
    (saves / "step-000001" / "dhelix.json").write_text("{}")
    (saves / "latest").write_text("step-000001\n")
    flag = "--log" if inside != "new.jsonl" else "--metrics"
    assert main(["run", EXAMPLE, "--resume", str(saves), "--save", str(saves), flag, str(saves / inside)]) == 2
    folder = saves / "step-000001" if inside.startswith("step-") else saves
    assert (f"dhelix: {flag} {saves / inside}: that is inside the checkpoint folder '{folder}', whose files are "
            "the checkpoint's; give a path outside it") in capsys.readouterr().err
    assert (saves / "latest").read_text() == "step-000001\n"


def test_the_step_log_has_a_name_torchrun_does_not_claim():
    from torch.distributed.run import get_args_parser

    from dhelix.cli.main import build_parser

    torchrun = get_args_parser().parse_args(["--standalone", "--nproc-per-node", "2", "-m", "dhelix", "run",
                                             "p.dhx", "--step-log", "out.jsonl"])
    assert torchrun.training_script_args == ["run", "p.dhx", "--step-log", "out.jsonl"]
    for flag in ("--step-log", "--log"):  # --log: the same option outside torchrun
        assert build_parser().parse_args(["run", "p.dhx", flag, "out.jsonl"]).log == "out.jsonl"


# --- non-finite steps and the strict log ------------------------------------------------------

def _strict_lines(path: Path) -> list[dict]:
    def refuse(constant):
        raise ValueError(f"bare {constant} in the log")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_the_log_is_strict_json_with_what_was_not_finite(tmp_path):
    from dhelix.interpreter.training.steplog import StepLog

    path = tmp_path / "log.jsonl"
    times = {"step": [0.5], "collective": [0.1], "p2p": [0.0]}
    with StepLog(str(path), tokens=64) as log:
        log.step(0, float("nan"), 1e-3, float("inf"), times, 10, skipped=True)
        log.evaluation(0, float("inf"))
    rows = [row for row in _strict_lines(path) if "step" in row]
    assert rows[0]["loss"] is None and rows[0]["grad_norm"] is None and rows[0]["skipped"] is True
    assert rows[0]["nonfinite"] == {"loss": "nan", "grad_norm": "inf"}
    assert rows[1]["eval_loss"] is None and rows[1]["nonfinite"]["eval_loss"] == "inf"


def test_a_diverging_run_stops_at_the_first_non_finite_step_naming_it(tmp_path):
    from test_training import write_program

    log = tmp_path / "log.jsonl"
    result = dhelix("run", write_program(tmp_path, "dp2"), "--steps", "3", "--lr", "1e30", "--log", str(log))
    assert result.returncode == 1
    err = result.stderr
    assert err.startswith("error: rank 0: training step 2 is not finite (loss nan, gradient norm nan); the run "
                          "stopped\n"), err
    assert "first non-finite gradients: rank 0: " in err and "; rank 1: " in err
    assert "skip such steps with --skip-nonfinite" in err and err.count("error:") == 1
    steps = [row for row in _strict_lines(log) if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2] and steps[1]["loss"] is None


def test_skip_nonfinite_trains_on_past_such_steps(tmp_path):
    from test_training import write_program

    log = tmp_path / "log.jsonl"
    result = dhelix("run", write_program(tmp_path, "one"), "--steps", "2", "--lr", "1e30", "--log", str(log),
                    "--skip-nonfinite")
    assert result.returncode == 0, result.stderr
    assert "skipped: 1 step(s) whose loss or gradient norm was not finite (2)" in result.stdout
    assert [row.get("skipped", False) for row in _strict_lines(log) if "loss" in row] == [False, True]


def test_a_resume_with_another_seed_or_schedule_is_warned():
    from dhelix.cli.run_options import resume_differences
    from dhelix.interpreter.training.train import RunOptions

    options = RunOptions(path="p.dhx", compiled=None, steps=8, seed=2, lr=3e-3, warmup=2, resume="ck")
    saved = {"seed": 1, "schedule": {**options.schedule(), "lr": 1e-3, "steps": 4}}
    first, second = resume_differences(saved, options)
    assert first.render() == ("warning: --resume ck: the run was saved with seed 1, this one has 2; the data order "
                              "changes from here\n  note: give --seed 1 to continue the same run")
    assert second.message == ("--resume ck: the learning-rate schedule differs from the saved run's "
                              "(lr 0.001 → 0.003; steps 4 → 8)")
    same = {"seed": 2, "schedule": options.schedule()}
    assert resume_differences(same, options) == []
    mark = {"windows": 40, "sha256": "0123456789abcdef"}
    with_data = {**same, "data": {"fingerprint": mark}}
    assert resume_differences(with_data, options, dict(mark)) == []
    [changed] = resume_differences(with_data, options, {"windows": 41, "sha256": "fedcba9876543210"})
    assert changed.message == ("--resume ck: the training data differs from the saved run's (40 windows, "
                               "fingerprint 0123456789abcdef; now 41 windows, fingerprint fedcba9876543210)")
    [gone] = resume_differences(with_data, options, None)
    assert "now seeded random tokens" in gone.message


def test_the_data_fingerprint_reads_the_windows_not_their_type():
    import torch

    from dhelix.interpreter.training.data import Corpus, fingerprint

    windows = torch.arange(600).reshape(100, 6)
    wide, narrow = Corpus(windows, windows[:2]), Corpus(windows.to(torch.int32), windows[:2])
    assert fingerprint(wide) == fingerprint(narrow) and fingerprint(wide)["windows"] == 100
    changed = windows.clone()
    changed[0, 0] = 7
    assert fingerprint(Corpus(changed, windows[:2])) != fingerprint(wide)
    assert fingerprint(None) is None


def test_the_data_fingerprint_reads_every_window():
    # A change in a window that none of the 64 evenly spaced ones of the older fingerprint
    # reads (row 1 of 1000) is seen; a resume says what it compared.
    import torch

    from dhelix.cli.run_options import resume_differences
    from dhelix.interpreter.training.data import Corpus, fingerprint
    from dhelix.interpreter.training.train import RunOptions

    windows = torch.arange(9000).reshape(1000, 9)
    changed = windows.clone()
    changed[1, 3] = 7
    before, after = fingerprint(Corpus(windows, windows[:2])), fingerprint(Corpus(changed, windows[:2]))
    assert before["hashed"] == "all" and before != after
    assert fingerprint(Corpus(windows, windows[:2]), sampled=True)["sha256"] == (
        fingerprint(Corpus(changed, windows[:2]), sampled=True)["sha256"])
    options = RunOptions(path="p.dhx", compiled=None, steps=8, seed=2, resume="ck")
    same = {"seed": 2, "schedule": options.schedule()}
    [warning] = resume_differences({**same, "data": {"fingerprint": before}}, options, after)
    assert warning.notes[0] == "compared: the window count and a SHA-256 of every training token"
    old = {k: v for k, v in before.items() if k != "hashed"}  # an older dhelix's save
    [warning] = resume_differences({**same, "data": {"fingerprint": old}}, options, after)
    assert warning.notes[0] == ("compared: the window count and a SHA-256 of 64 sampled windows (the saved run's "
                                "dhelix fingerprinted no more)")


def test_a_resumed_log_continues_rather_than_repeats(tmp_path):
    # Saved at step 3, stopped at step 5: the resumed run writes steps 4 and 5 again.
    from dhelix.interpreter.training.steplog import StepLog

    path = tmp_path / "log.jsonl"
    path.write_text('{"note": "x"}\n' + "".join(f'{{"step": {k}, "loss": 1.0}}\n' for k in range(1, 6))
                    + '{"step": 4, "eval_loss": 1.0, "eval_ppl": 2.7}\n')
    times = {"step": [0.5], "collective": [0.1], "p2p": [0.0]}
    with StepLog(str(path), tokens=64, resumed=3) as log:
        log.step(3, 0.5, 1e-3, 1.0, times, 10)
    assert [row.get("step") for row in _strict_lines(path)] == [None, 1, 2, 3, 4]
    assert list(tmp_path.iterdir()) == [path]


def test_the_log_holds_steps_and_evaluations_only(tmp_path):
    # No metadata row (a `note` column and NaN steps in a table reader).
    from dhelix.interpreter.training.steplog import StepLog

    path = tmp_path / "log.jsonl"
    times = {"step": [0.5], "collective": [0.1], "p2p": [0.0]}
    with StepLog(str(path), tokens=64) as log:
        log.step(0, 0.5, 1e-3, 1.0, times, 10)
        log.evaluation(0, 0.7)
    rows = _strict_lines(path)
    assert [row["step"] for row in rows] == [1, 1] and "eval_loss" in rows[1]
