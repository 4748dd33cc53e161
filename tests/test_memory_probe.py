"""The memory probe (Executor.live_bytes: each run, embedding and head remembers its storages
until it changes) against a walk of every live tensor at every sample."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.interpreter.execute.executor import Executor  # noqa: E402
from dhelix.interpreter.execute.layer_exec import count_storages  # noqa: E402
from dhelix.interpreter.ops.comm import SingleRankComm  # noqa: E402
from dhelix.interpreter.verify.reference import make_batch  # noqa: E402


def _program(pipeline: str, fold: str, train: str = "", mesh: str = "tp = 1", gpus: int = 1):
    return check_text(f"""\
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m {{ layers = 4  hidden = 32  ffn = 64  heads = 4  kv_heads = 2  seq = 8  vocab = 64
  dtype = fp32  layer = llama }}
cluster {{ nodes = 1  gpus_per_node = {gpus}  profile = "a40" }}
mesh {{ {mesh} }}
train {{ micro_batch = 2  microbatches = 4  {train} }}
fold {fold}
pipeline {pipeline}
""", "t.dhx")


def _walked(executor: Executor) -> int:
    # Every tensor in flight walked afresh (what the probe counted before runs and the model
    # ends remembered their counts).
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


def _checked_steps(executor: Executor, prog) -> None:
    """Two steps of ``executor`` with its probe checked against :func:`_walked` at every sample."""
    probe, samples = executor.recorder.probe, []

    def checked() -> int:
        counted = probe()
        samples.append((counted, _walked(executor)))
        return counted

    executor.recorder.probe = checked
    for step in range(2):
        executor.step(make_batch(prog, step))
    assert len(samples) > 20 and any(walked for _, walked in samples)
    assert [counted for counted, _ in samples] == [walked for _, walked in samples]
    assert executor.recorder.peak_bytes == max(walked for _, walked in samples)


@pytest.mark.parametrize("pipeline,fold,train", [("w_helix", "u", ""), ("w_helix", "u", "recompute = full"),
                                                 ("zb_h1", "none", "recompute = selective"),
                                                 ("one_f_one_b", "none", "")])
def test_the_probe_counts_what_a_walk_of_every_live_tensor_counts_at_every_sample(pipeline, fold, train):
    prog = _program(pipeline, fold, train)
    _checked_steps(Executor(prog, SingleRankComm(), seed=1), prog)


@pytest.mark.parametrize("mesh,gpus,pipeline,fold", [("tp = 2", 2, "w_helix", "u"),
                                                     ("tp = 2  pp = 2", 4, "one_f_one_b", "none")])
def test_the_probe_counts_collectives_results_as_they_land(mesh, gpus, pipeline, fold):
    # Rank 0 of a stand-in world (collectives and transfers written at once, left as Pendings
    # until read or settled): the layers' results land at a block's barrier, and a pipeline
    # rank's mailbox holds what it receives and sends.
    import torch.distributed as dist

    from dhelix.dsl.frontend.profiles import load_profile
    from dhelix.interpreter.ops.standin import EmulatedComm, join_standin_world

    prog = _program(pipeline, fold, mesh=mesh, gpus=gpus)
    join_standin_world(0, prog.mesh.world)
    try:
        comm = EmulatedComm(prog.mesh, "cpu", load_profile("a40"), "none")
        _checked_steps(Executor(prog, comm, seed=1, stand_in_weights=True), prog)
    finally:
        dist.destroy_process_group()
