"""Weighted blends of data sources (``--data 0.7:a/ 0.3:b.uint16``): the realised share of
each source over many batches, each source's windows in its own seeded order, one source
unchanged, the blend's position restored from a checkpoint (a resumed run's losses equal an
uninterrupted run's), and the usage errors of bad weights.

Each source's token ids lie in a range of their own, so every window says where it came from."""

from __future__ import annotations

import array
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tqdm")

from dhelix.cli import main  # noqa: E402
from dhelix.dsl.core.errors import UsageError  # noqa: E402
from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.interpreter.training.blend import parse_items  # noqa: E402
from dhelix.interpreter.training.data import (Blend, BlendedCorpus, DataSource, DataSpec, data_spec,  # noqa: E402
                                              load_corpus)

from test_training import dhelix, program_text, write_program  # noqa: E402

SEQ = 32
#: Source i's ids: [RANGES[i], RANGES[i] + 60).
RANGES = (0, 64, 128)


def write_source(path: Path, index: int, tokens: int) -> str:
    """A raw .uint16 token file whose ids all lie in source ``index``'s range."""
    ids = array.array("H", [RANGES[index] + (7 * i + index) % 60 for i in range(tokens)])
    path.write_bytes(ids.tobytes())
    return str(path)


def origin(window: torch.Tensor) -> int:
    """The source a window came from, by its ids' range."""
    return max(i for i, low in enumerate(RANGES) if int(window[0]) >= low)


def blend_source(tmp_path: Path, weights, sizes=(4000, 2500, 3000), seed: int = 5) -> DataSource:
    tmp_path.mkdir(exist_ok=True)
    program = check_text(program_text("one"), "one.dhx")
    specs = tuple(DataSpec(write_source(tmp_path / f"s{i}.uint16", i, size))
                  for i, size in enumerate(sizes[:len(weights or sizes)]))
    corpus = load_corpus(Blend(specs, weights), 256, SEQ)
    return DataSource(program, 1, seed, corpus)


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.2, 0.3), (1.0, 0.0, 3.0)])
def test_each_source_s_share_of_many_batches_is_its_weight(weights, tmp_path):
    source = blend_source(tmp_path, weights)
    seen = [origin(row) for step in range(60) for row in source.batch(step).inputs.reshape(-1, SEQ)]
    total = sum(weights)
    for index, weight in enumerate(weights):
        # Megatron's rule keeps every prefix near its share: here within one sample.
        assert abs(seen.count(index) - weight / total * len(seen)) <= 1, (index, seen.count(index), len(seen))
    assert source.sources_of(3) == [origin(row) for row in source.batch(3).inputs.reshape(-1, SEQ)]


def test_without_weights_the_sources_weigh_their_sizes(tmp_path):
    source = blend_source(tmp_path, None, sizes=(6000, 2000))
    parts = source.corpus.parts
    sizes = [part.train.shape[0] for part in parts]
    assert source.corpus.weights == pytest.approx([s / sum(sizes) for s in sizes])


def test_each_source_gives_all_its_windows_once_an_epoch_in_a_seeded_order(tmp_path):
    source = blend_source(tmp_path, (0.5, 0.5), sizes=(1400, 1400))
    windows = source.corpus.parts[0].train
    n = windows.shape[0]
    rows = [row for step in range(8) for row in torch.cat([source.batch(step).inputs, source.batch(step).targets[..., -1:]],
                                                          dim=-1).reshape(-1, SEQ + 1)]
    from_first = [row for row in rows if origin(row) == 0][:n]
    assert len(from_first) == n
    as_lists = sorted(row.tolist() for row in from_first)
    assert as_lists == sorted(windows.long().tolist())  # every window once in the first epoch
    assert [row.tolist() for row in from_first] != windows.long().tolist()  # shuffled
    again = blend_source(tmp_path / "again", (0.5, 0.5), sizes=(1400, 1400))
    other_seed = blend_source(tmp_path / "other", (0.5, 0.5), sizes=(1400, 1400), seed=6)
    assert torch.equal(again.batch(5).inputs, source.batch(5).inputs)
    assert not torch.equal(other_seed.batch(5).inputs, source.batch(5).inputs)


def test_a_restored_position_continues_the_blend(tmp_path):
    running = blend_source(tmp_path, (0.7, 0.3))
    for step in range(3):
        running.batch(step)
    position = running.position()
    assert position["sample"] == 3 * running.global_sequences and sum(position["counts"]) == position["sample"]
    resumed = blend_source(tmp_path, (0.7, 0.3))
    assert resumed.restore(position)
    for step in range(3, 6):
        assert torch.equal(resumed.batch(step).inputs, running.batch(step).inputs)
    # The stored position is what a resumed blend follows (not a replay): another one moves it.
    moved = blend_source(tmp_path, (0.7, 0.3))
    moved.restore({"sample": position["sample"], "counts": [position["counts"][0] + 1, position["counts"][1] - 1]})
    assert not torch.equal(moved.batch(3).inputs, running.batch(3).inputs)


def test_one_source_is_read_as_before_with_or_without_a_weight(tmp_path):
    path = write_source(tmp_path / "one.uint16", 0, 3000)
    program = check_text(program_text("one"), "one.dhx")
    plain = data_spec(program, "one.dhx", path, "--data")
    assert plain == data_spec(program, "one.dhx", [path], "--data") == data_spec(program, "one.dhx", [f"2:{path}"],
                                                                                   "--data")
    assert isinstance(plain, DataSpec)
    blend = data_spec(program, "one.dhx", [f"0.7:{path}", f"0.3:{path}"], "--data")
    assert isinstance(blend, Blend) and blend.weights == (0.7, 0.3)
    assert isinstance(load_corpus(blend, 256, SEQ), BlendedCorpus)


@pytest.mark.parametrize(("items", "message"), [
    (["-0.3:a", "1:b"], "--data -0.3:a: the weight -0.3 is negative; a weight is a finite number, 0 or more"),
    (["0:a", "0:b"], "--data 0:a 0:b: the weights sum to zero; at least one source needs a positive weight"),
    (["0.7x:a", "0.3:b"], "--data 0.7x:a: '0.7x' is not a weight"),
    (["0.7:", "0.3:b"], "--data 0.7:: the weight 0.7 has no path after its colon"),
    (["0.7:a", "b"], "--data b: give every source of a blend a weight (WEIGHT:PATH), or none"),
    (["1e999:a"], "--data 1e999:a: the weight 1e999 is not finite; a weight is a finite number, 0 or more"),
])
def test_bad_weights_are_usage_errors_naming_the_item(items, message, tmp_path, capsys):
    with pytest.raises(UsageError) as caught:
        parse_items(items, "--data")
    assert caught.value.message == message
    # argparse reads an item starting with "-" as an option: "--data=-0.3:a" passes it.
    argv = [f"--data={items[0]}"] if items[0].startswith("-") else ["--data", *items]
    assert main(["run", write_program(tmp_path, "one"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_path_that_does_not_start_like_a_number_keeps_its_colon():
    assert [item.path for item in parse_items(["data:v2/", "./0.5:x"], "--data")] == ["data:v2/", "./0.5:x"]
    assert [item.weight for item in parse_items(["3:a", ".5:b"], "--data")] == [3.0, 0.5]


def _resume_point(saves: Path, step: int, to: Path, move: int = 0) -> str:
    """A checkpoint folder holding only save ``step`` of ``saves`` (its blend position moved
    by ``move`` samples from the first source to the second)."""
    import shutil

    from dhelix.interpreter.training.manifest import write_manifest

    name = f"step-{step:06d}"
    shutil.copytree(saves / name, to / name)
    (to / "latest").write_text(name + "\n")
    meta = json.loads((to / name / "dhelix.json").read_text())
    meta["data"]["position"]["counts"][0] += move
    meta["data"]["position"]["counts"][1] -= move
    (to / name / "dhelix.json").write_text(json.dumps(meta))
    write_manifest(to / name)  # the edited save, verified as the run would have written it
    return str(to)


def test_a_resumed_blend_trains_on_the_batches_of_an_uninterrupted_run(tmp_path):
    blend = [f"0.6:{write_source(tmp_path / 'a.uint16', 0, 3000)}",
             f"0.4:{write_source(tmp_path / 'b.uint16', 1, 2000)}"]
    program = write_program(tmp_path, "one")
    run = ("run", program, "--lr-decay", "constant", "--data", *blend)
    whole = dhelix(*run, "--steps", "3", "--save", str(tmp_path / "ck"), "--save-every", "1", "--keep", "3",
                   "--log", str(tmp_path / "whole.jsonl"))
    assert whole.returncode == 0, whole.stderr
    meta = json.loads((tmp_path / "ck" / "step-000001" / "dhelix.json").read_text())
    assert meta["data"]["position"]["sample"] == 16 and sum(meta["data"]["position"]["counts"]) == 16
    resumed = dhelix(*run, "--steps", "3", "--resume", _resume_point(tmp_path / "ck", 1, tmp_path / "r"),
                     "--log", str(tmp_path / "resumed.jsonl"))
    assert resumed.returncode == 0, resumed.stderr
    # The resume follows the stored position: moved by one sample, the batches differ.
    moved = dhelix(*run, "--steps", "2", "--resume", _resume_point(tmp_path / "ck", 1, tmp_path / "m", move=1),
                   "--log", str(tmp_path / "moved.jsonl"))
    assert moved.returncode == 0, moved.stderr

    def losses(name):
        lines = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        return [line["loss"] for line in lines if "loss" in line]

    assert len(losses("whole.jsonl")) == 3 and len(losses("resumed.jsonl")) == 2
    assert losses("resumed.jsonl") == pytest.approx(losses("whole.jsonl")[1:], abs=1e-6)
    assert losses("moved.jsonl") != pytest.approx(losses("whole.jsonl")[1:2], abs=1e-6)
