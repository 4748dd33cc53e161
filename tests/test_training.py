"""Training on data: a layout-independent batch order, the learning-rate schedule against
torch's schedulers, clipping against the reference (``--check``), checkpoints that resume
the same trajectory on other layouts, the weights export and the per-step log, and the
messages of bad data and bad checkpoints."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tqdm")

from dhelix.cli import main  # noqa: E402
from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.interpreter.training.data import DataSource, DataSpec, load_corpus  # noqa: E402
from dhelix.interpreter.verify.harness import replica_batch  # noqa: E402
from dhelix.interpreter.training.schedule import MIN_LR_RATIO, LRSchedule  # noqa: E402
from dhelix.interpreter.training.train import FAULT_ENV  # noqa: E402

from commands import dhelix_here  # noqa: E402
from conftest import docs_corpus, tiny_example_text  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = (ROOT / "examples" / "tiny_llama_cpu.dhx").read_text()
#: The docs as they were when the session began: every run of a test trains on the same text.
DOCS = docs_corpus()
#: Layouts of the tiny example with the same global batch (16 sequences a step).
LAYOUTS = {
    "tp2_pp2": ("mesh {\n  tp = 2\n  pp = 2\n}", 8, 4),
    "one": ("mesh {\n}", 8, 1),
    "dp2": ("mesh {\n  dp = 2\n}", 4, 2),
    "dp2_tp2": ("mesh {\n  tp = 2\n  dp = 2\n}", 4, 4),
    # Uneven stages: 1 layer on the embedding's pipeline rank, 3 on the LM head's.
    "pp2_uneven": ("mesh {\n  pp = 2\n}", 8, 2),
}
#: What a layout changes besides the mesh (text → text).
UNEVEN = {"fold u": "fold none", "pipeline w_helix": "pipeline one_f_one_b",
          "  seed = 1234": "  seed = 1234\n  first_stage_layers = 1"}


def program_text(layout: str, data: str = DOCS) -> str:
    mesh, microbatches, gpus = LAYOUTS[layout]
    text = EXAMPLE.replace("mesh {\n  tp = 2\n  pp = 2\n}", mesh).replace("nodes = 2", "nodes = 1")
    text = text.replace("gpus_per_node = 2", f"gpus_per_node = {gpus}")
    text = text.replace("microbatches = 8", f"microbatches = {microbatches}")
    for old, new in (UNEVEN.items() if layout == "pp2_uneven" else ()):
        text = text.replace(old, new)
    return text.replace('"../docs/*.md"', f'"{data}"')


def write_program(tmp_path: Path, layout: str, data: str = DOCS) -> str:
    path = tmp_path / f"{layout}.dhx"
    path.write_text(program_text(layout, data))
    return str(path)


def dhelix(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``dhelix ARGS`` in this process (:func:`commands.dhelix_here`)."""
    return dhelix_here(*args, env=env)


# --- data ---------------------------------------------------------------------------------------

def test_the_tests_train_on_a_frozen_copy_of_the_docs():
    # A resume test compares separate runs, each reading the corpus afresh: on the live docs
    # a merge landing mid-suite made them train on different text (a loss off by 0.1).
    frozen = Path(DOCS).parent
    assert not frozen.is_relative_to(ROOT) and f'data = "{DOCS}"' in tiny_example_text()
    assert docs_corpus() == DOCS and any(frozen.glob("*.md"))  # one copy a session, of the docs


@pytest.mark.parametrize("with_data", [True, False])
def test_a_step_s_global_batch_does_not_depend_on_the_layout(with_data):
    batches = {}
    for layout in LAYOUTS:
        program = check_text(program_text(layout), f"{layout}.dhx")
        corpus = load_corpus(DataSpec(DOCS), 256, program.model.get("seq")) if with_data else None
        dp = program.mesh.size("dp")
        source = DataSource(program, dp, 7, corpus)
        # Steps far enough apart to cross an epoch of the corpus.
        steps = (0, 1, 5, 80) if with_data else (0, 1, 5)
        batches[layout] = [source.batch(k) for k in steps]
        for batch in batches[layout]:
            replicas = [replica_batch(batch, d, program.train.microbatches) for d in range(dp)]
            assert torch.equal(torch.cat([r.inputs for r in replicas]), batch.inputs)
    first = batches.pop("tp2_pp2")
    for layout, others in batches.items():
        for a, b in zip(first, others, strict=True):
            assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets), layout
    assert not torch.equal(first[0].inputs, first[1].inputs)


def test_text_is_packed_into_byte_windows_each_used_once_an_epoch(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(128)) * 16)  # every ASCII byte (valid UTF-8), control characters too
    corpus = load_corpus(DataSpec(str(text)), 256, 32)
    assert corpus.train.shape[1] == 33 and corpus.held_out.shape[0] >= 1
    assert corpus.train[0].tolist() == list(range(33))  # the file's bytes, in order
    program = check_text(program_text("one", str(text)), "one.dhx")
    source = DataSource(program, 1, 3, corpus)
    n = corpus.train.shape[0]
    seen = torch.cat([source.batch(k).inputs.reshape(-1, 32) for k in range(math.ceil(n / 16))])[:n]
    assert len({tuple(row.tolist()) for row in seen}) == len({tuple(r[:-1].tolist()) for r in corpus.train})


def test_raw_token_files_are_read_as_unsigned_ids(tmp_path):
    tokens = torch.arange(0, 2000, dtype=torch.int32) % 300 + 40000
    path = tmp_path / "ids.uint16"
    path.write_bytes(b"".join(int(t).to_bytes(2, "little") for t in tokens.tolist()))
    corpus = load_corpus(DataSpec(str(path)), 50000, 32)
    assert corpus.train[0, 0].item() == 40000 and int(corpus.train.long().max()) == 40299


def _bad_data(tmp_path, name: str) -> tuple[str, str]:
    """A program whose data is bad in way ``name``; (program path, data path)."""
    data = tmp_path / "data.txt"
    if name == "empty":
        data.write_text("")
    elif name == "short":
        data.write_text("too short for one window")
    elif name == "odd":
        data = tmp_path / "ids.uint16"
        data.write_bytes(b"\x01\x02\x03")
    return write_program(tmp_path, "one", str(data)), str(data)


@pytest.mark.parametrize("name, message", [
    ("missing", "no data file or folder '{data}'"),
    ("empty", "the data '{data}' is empty"),
    ("short", "the data '{data}' has 24 tokens: too short for sequences of 32"),
    ("odd", "'{data}' is 3 bytes, not a whole number of 16-bit token ids"),
])
def test_bad_data_is_a_located_error_before_any_rank_starts(name, message, tmp_path, capsys):
    program, data = _bad_data(tmp_path, name)
    assert main(["run", program]) == 1
    err = capsys.readouterr().err
    line = next(i for i, text in enumerate(Path(program).read_text().splitlines(), 1) if "data =" in text)
    assert f"{program}:{line}:10: " + message.format(data=data) in err
    assert "Traceback" not in err


def test_text_data_needs_a_byte_vocabulary(tmp_path, capsys):
    program = tmp_path / "small.dhx"
    program.write_text(program_text("one").replace("vocab = 256", "vocab = 128"))
    assert main(["run", str(program)]) == 1
    err = capsys.readouterr().err
    assert "is text, tokenized byte-level (256 tokens), but the model's vocab is 128" in err
    assert f"{program}:" in err and "note: set vocab = 256 or more in the model block" in err


def test_data_on_the_command_line_names_the_flag(tmp_path, capsys):
    assert main(["run", write_program(tmp_path, "one"), "--data", str(tmp_path / "nothing")]) == 1
    assert f"error: no data file or folder '{tmp_path / 'nothing'}' (given by --data)" in capsys.readouterr().err


# --- the learning rate ----------------------------------------------------------------------

def formula_lr(step: int, peak: float, warmup: int, total: int | None) -> float:
    """The schedule written out here, apart from schedule.py:
    linear warm-up, then cosine decay reaching the floor AT the last update (issue 31)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if total is None or total <= warmup:
        return peak
    span = total - 1 - warmup
    progress = 1.0 if span <= 0 else min(step - warmup, span) / span
    low = MIN_LR_RATIO * peak
    return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("warmup, total", [(3, 11), (0, 11), (1, 2), (4, 5), (3, 3), (2, None), (0, None),
                                           (0, 1), (5, 400)])
def test_the_schedule_is_a_linear_warm_up_then_cosine(warmup, total):
    peak = 0.01
    rates = LRSchedule(peak, warmup, total).rates(total or 8)
    for step, rate in enumerate(rates):
        assert rate == pytest.approx(formula_lr(step, peak, warmup, total), rel=1e-12), step
    if total is not None and total > warmup:
        # The floor is the last update's rate, not the one after it (issue 31).
        assert rates[-1] == pytest.approx(MIN_LR_RATIO * peak, rel=1e-12)
        assert total - 2 < warmup or rates[-2] > MIN_LR_RATIO * peak * (1 + 1e-9)
    # A resumed run's schedule continues the uninterrupted one, to the bit.
    for start in range(len(rates)):
        assert LRSchedule.at(start, peak, warmup, total).lr == rates[start], start


def _no_replay(self):
    raise AssertionError("a resumed schedule stepped through the past updates")


def test_a_resume_at_a_large_step_is_positioned_at_once_and_continues_the_schedule(monkeypatch):
    peak, warmup, total = 3e-4, 2_000, 1_000_000
    with monkeypatch.context() as patched:
        patched.setattr(LRSchedule, "advance", _no_replay)  # positioning never steps (a replay took 82 s)
        last = LRSchedule.at(total - 1, peak, warmup, total)
        early = LRSchedule.at(total - 1_000, peak, warmup, total)
    assert last.step == total - 1 and last.lr == pytest.approx(MIN_LR_RATIO * peak, rel=1e-12)
    assert early.lr == pytest.approx(formula_lr(total - 1_000, peak, warmup, total), rel=1e-12)
    # Stepped on from there, the schedule meets every later resume point to the bit.
    rates = early.rates(1_000)
    assert rates == [LRSchedule.at(step, peak, warmup, total).lr for step in range(total - 1_000, total)]
    assert rates[-1] == last.lr and early.lr == last.lr  # the floor is held past the last update


# --- the loop against the reference, checkpoints, export, log (ranks) ---------------------

def test_clipping_decay_and_schedule_match_the_reference_under_dp_tp_and_zero1(tmp_path):
    result = dhelix("run", write_program(tmp_path, "dp2_tp2"), "--check", "--steps", "3", "--clip", "0.3",
                    "--warmup", "2", "--weight-decay", "0.1", "--zero1")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all("grad norm diff" in line for line in lines)


def _log(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


def _died_after_a_save(program: str, saves: Path) -> None:
    """Run ``program`` for 4 steps saving every 2, rank 0 dying before step 3: the save of
    step 2 survives."""
    died = dhelix("run", program, "--steps", "4", "--save", str(saves), "--save-every", "2",
                  env={FAULT_ENV: "0:2:0"})
    assert died.returncode == 1 and (saves / "latest").read_text().strip() == "step-000002"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, dict]:
    """The log of 4 uninterrupted steps on one rank, by step: what every resumed run continues."""
    folder = tmp_path_factory.mktemp("whole")
    whole = folder / "whole.jsonl"
    assert dhelix("run", write_program(folder, "one"), "--steps", "4", "--log", str(whole)).returncode == 0
    return _log(whole)


@pytest.fixture(scope="module")
def saved_on_tp2_pp2(tmp_path_factory) -> Path:
    """A checkpoint folder saved at step 2 on tp 2 x pp 2 by a run whose rank 0 then died.
    Tests that damage it take a copy (:func:`_copy`)."""
    folder = tmp_path_factory.mktemp("tp2_pp2_saves")
    saves = folder / "ck"
    _died_after_a_save(write_program(folder, "tp2_pp2"), saves)
    return saves


def _copy(saves: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(saves, to)
    return to


def test_a_resumed_run_continues_the_uninterrupted_one_on_any_layout(tmp_path, capsys, uninterrupted,
                                                                      saved_on_tp2_pp2):
    programs = {layout: write_program(tmp_path, layout) for layout in ("tp2_pp2", "one", "dp2", "pp2_uneven")}
    # Saved every 2 steps on tp 2 x pp 2, then rank 0 died before step 3: the save of step 2 survived.
    saves = _copy(saved_on_tp2_pp2, tmp_path / "ck")
    expected = uninterrupted
    for layout, extra in (("tp2_pp2", ()), ("one", ()), ("dp2", ("--export-weights", str(tmp_path / "w.pt"))),
                          ("pp2_uneven", ())):
        log = tmp_path / f"{layout}.jsonl"
        result = dhelix("run", programs[layout], "--steps", "4", "--resume", str(saves), "--log", str(log), *extra)
        assert result.returncode == 0, result.stderr
        resumed = _log(log)
        assert sorted(resumed) == [3, 4]
        for step in (3, 4):
            assert resumed[step]["loss"] == pytest.approx(expected[step]["loss"], abs=2e-5), (layout, step)
            assert resumed[step]["lr"] == pytest.approx(expected[step]["lr"], rel=1e-12)
            assert resumed[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=1e-4)
    _check_export(tmp_path / "w.pt", programs["one"])
    log = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    # eval_every = 10 in the program: the held-out loss comes at the last step too.
    assert set(log[-1]) == {"step", "eval_loss", "eval_ppl"} and log[-1]["step"] == 4
    assert set(log[-2]) == {"step", "loss", "lr", "grad_norm", "step_s", "tokens_per_s", "exposed_comm_s",
                            "peak_bytes"}
    _check_refusals(tmp_path, saves, capsys)


def _check_refusals(tmp_path: Path, saves: Path, capsys) -> None:
    """A checkpoint that does not fit the model or the batch, and one with truncated files
    (named from the save's manifest)."""
    wider = tmp_path / "wider.dhx"
    wider.write_text(program_text("one").replace("hidden = 64", "hidden = 32"))
    assert main(["run", str(wider), "--steps", "4", "--resume", str(saves)]) == 1
    assert ("does not fit this model (27 parameters differ: embedding: checkpoint [256, 64], model [256, 32]"
            in capsys.readouterr().err)
    fewer = tmp_path / "fewer.dhx"
    fewer.write_text(program_text("one").replace("microbatches = 8", "microbatches = 4"))
    assert main(["run", str(fewer), "--steps", "4", "--resume", str(saves)]) == 1
    assert "was trained with 16 sequences a step, this run has 8" in capsys.readouterr().err
    for data in (saves / "step-000002").glob("*.distcp"):
        data.write_bytes(data.read_bytes()[:100])
    # Found before any rank starts: the command reports it (in this process).
    assert main(["run", str(tmp_path / "one.dhx"), "--steps", "4", "--resume", str(saves)]) == 1
    err = capsys.readouterr().err
    assert f"the checkpoint '{saves / 'step-000002'}' is damaged: its file '__0_0.distcp' has 100 bytes" in err
    assert "Traceback" not in err


def _check_export(path: Path, program_path: str):
    from dhelix.interpreter.verify.reference import ReferenceModel

    program = check_text(Path(program_path).read_text(), program_path)
    model = ReferenceModel(program, seed=program.train.seed)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(torch.load(path))  # strict: every key, every shape
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- bad checkpoints (no rank starts) ---------------------------------------------------------

def test_a_zero_3_run_with_weight_chunks_resumes_on_another_layout_and_back(tmp_path, uninterrupted,
                                                                           saved_on_tp2_pp2):
    # The ZeRO-3 pieces of a gemm chunked along its outputs are cut per block of columns, here
    # over cp (ZeRO-3 shards over dp x cp: cp = 2 beside ring attention, dp = 1); a checkpoint
    # holds the full weights, so either layout resumes the other's save.
    chunked = tmp_path / "chunked.dhx"
    chunked.write_text(program_text("dp2").replace("dp = 2", "cp = 2").replace("microbatches = 4", "microbatches = 8")
                       .replace("seed = 1234", "seed = 1234\n  zero = 3")
                       + "\npartition {\n  chunk qkv along outputs by 2\n  chunk fc2 along outputs by 4\n}\n")
    plain = write_program(tmp_path, "one")
    expected = uninterrupted
    # The other layout's save: tp 2 x pp 2's (the fixture's, as in the test above); the chunked
    # run's own save, resumed on one rank.
    own = tmp_path / "ck-chunked"
    _died_after_a_save(str(chunked), own)
    for saves, resumed_by in ((own, plain), (saved_on_tp2_pp2, str(chunked))):
        log = tmp_path / f"from-{saves.name}.jsonl"
        saved_by = saves.name
        result = dhelix("run", resumed_by, "--steps", "4", "--resume", str(saves), "--log", str(log))
        assert result.returncode == 0, result.stderr
        resumed = _log(log)
        for step in (3, 4):
            assert resumed[step]["loss"] == pytest.approx(expected[step]["loss"], abs=2e-5), (saved_by, step)


def test_bad_checkpoints_are_clear_errors(tmp_path, capsys):
    program = write_program(tmp_path, "one")
    assert main(["run", program, "--resume", str(tmp_path)]) == 1
    assert f"'{tmp_path}' is not a dhelix checkpoint: it has no 'latest' file" in capsys.readouterr().err
    save = tmp_path / "step-000002"
    save.mkdir()
    (tmp_path / "latest").write_text("step-000002\n")
    (save / "dhelix.json").write_text("{broken")
    assert main(["run", program, "--resume", str(tmp_path)]) == 1
    assert f"the checkpoint '{save}' is corrupt: " in capsys.readouterr().err


# --- mixed precision (one rank, in process) -------------------------------------------------

def _losses(dtype: str, master: bool, steps: int = 2) -> list[float]:
    from dhelix.interpreter.ops.comm import SingleRankComm
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.training.optim import AdamWConfig, DistributedAdamW, norm_weights

    text = program_text("one").replace("dtype = fp32", f"dtype = {dtype}")
    text = text.replace("microbatches = 8", "microbatches = 2").replace("micro_batch = 2", "micro_batch = 1")
    program = check_text(text, "one.dhx")
    comm = SingleRankComm()
    executor = Executor(program, comm, seed=1)
    optimizer = DistributedAdamW(executor.params, comm, config=AdamWConfig(lr=3e-3, clip=1.0, master=master),
                                 weights=norm_weights(executor.weights, comm, executor.params))
    source = DataSource(program, 1, 1, load_corpus(DataSpec(DOCS), 256, 32))
    losses = []
    for _ in range(steps):
        # One batch again and again: its loss must fall whatever text the docs (the corpus) hold.
        losses.append(executor.step(source.batch(0)).item())
        optimizer.step(executor.grads())
        if master and dtype != "fp32":
            masters = optimizer.masters()
            assert all(t.dtype == torch.float32 for t in masters.values())
            assert all(p.dtype == torch.bfloat16 for p in executor.params.values())
            # The bf16 parameters are the masters rounded, not a separate trajectory.
            assert all(torch.equal(executor.params[n], m.to(torch.bfloat16)) for n, m in masters.items())
    return losses


def test_bf16_with_fp32_masters_stays_within_0_05_of_fp32():
    fp32, bf16 = _losses("fp32", True), _losses("bf16", True)
    assert fp32[-1] < fp32[0]
    assert max(abs(a - b) for a, b in zip(fp32, bf16, strict=True)) < 0.05
