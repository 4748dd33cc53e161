"""The memory probe's running tally (interpreter/execute/live_memory.py) against the sum it
replaces: the bytes of the distinct storages of every holder, summed afresh."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.interpreter.execute.executor import Executor  # noqa: E402
from dhelix.interpreter.execute.layer_exec import count_storages  # noqa: E402
from dhelix.interpreter.execute.live_memory import LiveTally  # noqa: E402
from dhelix.interpreter.ops.comm import SingleRankComm  # noqa: E402
from dhelix.interpreter.verify.reference import make_batch  # noqa: E402


def _summed(holders: dict) -> int:
    seen: dict[int, int] = {}
    for storages in holders.values():
        seen.update(storages)
    return sum(seen.values())


def test_the_tally_is_the_sum_of_the_distinct_storages_as_holders_change():
    # Holders come and go, change (a new mapping) or stay (the same one); storages are
    # shared between holders, and a data pointer given up by one holder comes back with
    # another size in another's (freed and reused between two samples).
    rng = random.Random(7)
    tally, holders = LiveTally(), {}
    for _ in range(2000):
        key = rng.randrange(8)
        if rng.random() < 0.2:
            holders.pop(key, None)
        elif rng.random() < 0.8:
            holders[key] = {rng.randrange(12): rng.choice((0, 16, 64, 256)) for _ in range(rng.randrange(5))}
        # Live storages never share a pointer with different sizes: each pointer's size is
        # the one its newest holder gave (the others' are stale: made consistent here).
        sizes = {}
        for storages in holders.values():
            sizes.update(storages)
        for k in list(holders):
            if any(holders[k][p] != sizes[p] for p in holders[k]):
                holders[k] = {p: sizes[p] for p in holders[k]}
        assert tally.update(holders) == _summed(holders)


def test_a_pointer_reused_by_another_holder_with_another_size_is_recounted():
    tally = LiveTally()
    assert tally.update({"a": {1: 100}, "b": {2: 8}}) == 108
    # a gave up storage 1; b's new storage landed at the same address, smaller.
    assert tally.update({"a": {}, "b": {2: 8, 1: 40}}) == 48
    assert tally.update({"b": {1: 40}}) == 40
    assert tally.update({}) == 0


def _program(pipeline: str, fold: str, train: str = ""):
    return check_text(f"""\
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m {{ layers = 4  hidden = 32  ffn = 64  heads = 4  kv_heads = 2  seq = 8  vocab = 64
  dtype = fp32  layer = llama }}
cluster {{ nodes = 1  gpus_per_node = 1  profile = "a40" }}
mesh {{ tp = 1 }}
train {{ micro_batch = 2  microbatches = 4  {train} }}
fold {fold}
pipeline {pipeline}
""", "t.dhx")


def _walked(executor: Executor) -> int:
    # What the probe summed afresh at every sample before the tally.
    seen: dict[int, int] = {}
    values: list = list(executor.mailbox.values())
    for stage in executor.stages.values():
        for runs in stage.runs.values():
            for run in runs:
                count_storages((run.acts, run.saved, run.bgrads, run.keeping.held()), seen)
        values += [e.saved for e in stage.embeds.values()]
        values += [(h._norm_saved, h._head_saved) for h in stage.heads.values()]
    count_storages(values, seen)
    return sum(seen.values())


@pytest.mark.parametrize("pipeline,fold,train", [("w_helix", "u", ""), ("w_helix", "u", "recompute = full"),
                                                 ("zb_h1", "none", "recompute = selective"),
                                                 ("one_f_one_b", "none", "")])
def test_the_probe_counts_what_a_walk_of_every_live_tensor_counts_at_every_sample(pipeline, fold, train):
    prog = _program(pipeline, fold, train)
    executor = Executor(prog, SingleRankComm(), seed=1)
    probe, samples = executor.recorder.probe, []

    def checked() -> int:
        counted = probe()
        samples.append((counted, _walked(executor)))
        return counted

    executor.recorder.probe = checked
    for step in range(2):  # the second step starts from the first one's tally
        executor.step(make_batch(prog, step))
    assert len(samples) > 20 and any(walked for _, walked in samples)
    assert [counted for counted, _ in samples] == [walked for _, walked in samples]
    assert executor.recorder.peak_bytes == max(walked for _, walked in samples)
