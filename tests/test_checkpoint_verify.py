"""Verified checkpoints: each save's manifest (size and SHA-256 of every file, written last),
a resume and ``dhelix checkpoint verify`` that name the damaged file, old saves without a
manifest that load with a warning; saves written by every rank outside the collectives'
timeout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from dhelix.cli import main  # noqa: E402
from dhelix.interpreter.training.checkpoint import SLOW_SAVE_ENV, save  # noqa: E402
from dhelix.interpreter.training.manifest import MANIFEST  # noqa: E402
from test_run_outputs import one_rank  # noqa: E402,F401 (a fixture)
from test_training import dhelix, program_text, write_program  # noqa: E402

#: The one_rank fixture's program.
ONE_RANK = program_text("one").replace("microbatches = 8", "microbatches = 1").replace("layers = 4", "layers = 2")


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def saved(one_rank, tmp_path):  # noqa: F811 (the fixture imported above)
    """A checkpoint folder with saves of steps 1 and 2, and the program that resumes it."""
    executor, optimizer = one_rank
    root = tmp_path / "ck"
    for step in (1, 2):
        save(str(root), executor, optimizer, step=step, seed=1, global_sequences=2, keep=2)
    program = tmp_path / "one.dhx"
    program.write_text(ONE_RANK)
    return root, str(program)


def test_the_manifest_lists_every_file_of_the_save_with_its_size_and_hash(saved):
    import hashlib

    root, _ = saved
    folder = root / "step-000002"
    listed = json.loads((folder / MANIFEST).read_text())["files"]
    on_disk = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    assert sorted(listed) == on_disk and "dhelix.json" in listed and any(n.endswith(".distcp") for n in listed)
    for name, entry in listed.items():
        data = (folder / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert not [p for p in folder.iterdir() if p.name.startswith(".manifest")]  # the temporary file is gone


def test_a_flipped_byte_is_named_by_resume_and_by_verify(saved, capsys):
    root, program = saved
    assert main(["checkpoint", "verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"{root / 'step-000002'}: intact (size and SHA-256 of each file checked)" in out
    assert f"{root / 'step-000001'}: intact" in out
    shard = next((root / "step-000002").glob("*.distcp"))
    _flip_middle_byte(shard)
    damaged = (f"error: the checkpoint '{root / 'step-000002'}' is damaged: its file '{shard.name}' differs from "
               "the manifest's SHA-256 (its bytes changed after the save)\n"
               f"  note: the earlier save '{root / 'step-000001'}' of this run is kept\n"
               f"  note: resume from it: --resume {root / 'step-000001'} (--resume auto skips damaged saves)\n")
    assert main(["run", program, "--steps", "4", "--resume", str(root)]) == 1
    assert capsys.readouterr().err == damaged + "  note: while running `dhelix run`\n"
    assert main(["checkpoint", "verify", str(root)]) == 1
    captured = capsys.readouterr()
    assert captured.err == damaged + "  note: while running `dhelix checkpoint`\n"
    assert f"{root / 'step-000001'}: intact" in captured.out and "step-000002" not in captured.out
    assert main(["checkpoint", "verify", str(root / "step-000001")]) == 0  # one save alone


def test_a_truncated_or_missing_file_and_a_broken_manifest_are_named(saved, capsys):
    root, _ = saved
    folder = root / "step-000002"
    shard = next(folder.glob("*.distcp"))
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    assert main(["checkpoint", "verify", str(folder)]) == 1
    assert f"its file '{shard.name}' has 100 bytes where the manifest says {size}" in capsys.readouterr().err
    shard.unlink()
    assert main(["checkpoint", "verify", str(folder)]) == 1
    assert f"its file '{shard.name}' is missing" in capsys.readouterr().err
    (folder / MANIFEST).write_text("{not json")
    assert main(["checkpoint", "verify", str(folder)]) == 1
    assert f"'{folder}' is damaged: its manifest '{MANIFEST}' cannot be read (JSONDecodeError)" in (
        capsys.readouterr().err)


def test_an_old_save_without_a_manifest_loads_with_a_warning(saved, capsys):
    from dhelix import api

    root, program = saved
    (root / "step-000002" / MANIFEST).unlink()
    warning = (f"warning: the checkpoint '{root / 'step-000002'}' has no manifest ({MANIFEST}; saved by an older "
               "dhelix): its files are not verified")
    assert main(["checkpoint", "verify", str(root)]) == 0
    captured = capsys.readouterr()
    assert warning in captured.err and f"{root / 'step-000002'}: not verified (no manifest)" in captured.out
    # The resume reads it (the warning, then the next refusal: it has no step left to run).
    assert main(["run", program, "--steps", "2", "--resume", str(root)]) == 2
    assert warning in capsys.readouterr().err
    model = api.reference_model(api.load_program(program), checkpoint=str(root))
    assert model is not None


def test_verify_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    assert main(["checkpoint", "verify", str(tmp_path / "none")]) == 2
    assert main(["checkpoint", "verify", str(tmp_path)]) == 1
    assert f"'{tmp_path}' is not a dhelix checkpoint: it holds no save (step-*)" in capsys.readouterr().err


def test_a_save_slower_than_the_timeout_completes_every_rank_writing_its_shards(tmp_path):
    # Rank 0 takes 9 s to start writing; the collectives time out after 6 s, which the save
    # does not wait under: the run finishes and the save is intact, each rank's shard in it.
    program = write_program(tmp_path, "dp2")
    saves = tmp_path / "ck"
    result = dhelix("run", program, "--steps", "2", "--save", str(saves), "--timeout", "6",
                    "--export-weights", str(tmp_path / "w.pt"), env={SLOW_SAVE_ENV: "9"})
    assert result.returncode == 0, result.stderr
    assert (saves / "latest").read_text() == "step-000002\n"
    assert sorted(p.name for p in (saves / "step-000002").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert main(["checkpoint", "verify", str(saves)]) == 0
    assert (tmp_path / "w.pt").is_file()


def test_keeping_counts_intact_saves_only(tmp_path):
    """--keep K keeps the K newest intact saves: a damaged save (a truncated file) is not
    counted, so an intact older one stays; what is older than the K-th intact one goes."""
    from dhelix.interpreter.training.manifest import beyond_kept, write_manifest

    for step in (2, 4, 6, 8):
        folder = tmp_path / f"step-{step:06d}"
        folder.mkdir()
        (folder / "shard.distcp").write_bytes(bytes(range(100)))
        write_manifest(folder)
    assert [p.name for p in beyond_kept(tmp_path, 2)] == ["step-000002", "step-000004"]
    (tmp_path / "step-000006" / "shard.distcp").write_bytes(b"cut")  # damaged after its save
    assert [p.name for p in beyond_kept(tmp_path, 2)] == ["step-000002"]
    assert beyond_kept(tmp_path, 5) == []


def test_keeping_reads_the_manifest_not_the_sizes(tmp_path):
    """A save whose bytes changed at the same size (a flipped byte, which --resume auto skips)
    is not counted either: the good save a run resumed from is never removed in its favour,
    and the run's own new save counts first."""
    from dhelix.interpreter.training.manifest import beyond_kept, write_manifest

    for step in (2, 4):
        folder = tmp_path / f"step-{step:06d}"
        folder.mkdir()
        (folder / "shard.distcp").write_bytes(bytes(range(100)))
        write_manifest(folder)
    _flip_middle_byte(tmp_path / "step-000004" / "shard.distcp")
    assert beyond_kept(tmp_path, 1) == []  # step 4 is damaged: step 2 is the one intact save
    (tmp_path / "step-000003").mkdir()  # the resumed run's save (from step 2, step 4 skipped)
    write_manifest(tmp_path / "step-000003")
    written, resumed = tmp_path / "step-000003", tmp_path / "step-000002"
    assert beyond_kept(tmp_path, 1, written=written, protected=[resumed]) == []
    assert [p.name for p in beyond_kept(tmp_path, 1, written=written)] == ["step-000002"]
