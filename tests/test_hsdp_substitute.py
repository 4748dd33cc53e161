"""``substitute weights as reduce_scatter + all_gather`` under hybrid sharding (HSDP, ``zero =
3  shard = K``): the all-reduce of each weight piece's gradient across the replicas becomes a
reduce-scatter over ``dp.replicate``, an update of this replica's part of the piece and an
all-gather of it (Centauri's substitution of DP's all-reduce, applied to FSDP + DP).
Simulated and run exactly on 4 gloo ranks (dp = 4 in shard groups of 2)."""

from __future__ import annotations

import functools

import pytest

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.passes.fsdp import replicas_substituted
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.simulator.events import simulate

TEXT = """
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m {{ layers = 2  hidden = 32  ffn = 64  heads = 4  kv_heads = 4  seq = 8  vocab = 64  dtype = fp32
  layer = llama }}
cluster {{ nodes = 2  gpus_per_node = 2  profile = "a40" }}
mesh {{ dp = 4 }}
train {{ micro_batch = 2  microbatches = 2  {train} }}
fold none
pipeline one_f_one_b
{partition}
"""
SUBSTITUTE = "partition { substitute weights as reduce_scatter + all_gather }"


def program(train: str = "zero = 3  shard = 2", partition: str = SUBSTITUTE):
    return check_text(TEXT.format(train=train, partition=partition), "t.dhx")


def _dp_events(sim, kind: str) -> list:
    return [e for e in sim.events if e.rank == 0 and e.name.startswith(kind) and (e.args or {}).get("kind") == "DP"]


def test_the_replica_all_reduce_becomes_a_reduce_scatter_and_an_all_gather_after_the_update():
    plain, substituted = program(partition=""), program()
    assert not replicas_substituted(plain) and replicas_substituted(substituted)
    before, after = simulate(plain), simulate(substituted)
    layer_reductions = [e for e in _dp_events(before, "all_reduce") if "layer" in e.name]
    assert len(layer_reductions) == 2  # one per layer, across the 2 replicas
    assert not [e for e in _dp_events(after, "all_reduce") if "layer" in e.name]
    scattered = [e for e in _dp_events(after, "reduce_scatter") if "layer" in e.name]
    assert [e.args["bytes"] for e in scattered] == [e.args["bytes"] for e in layer_reductions]
    # The updated parts of the pieces come back by an all-gather over the replicas.
    assert len(_dp_events(after, "all_gather weights")) == len(_dp_events(before, "all_gather weights")) + 1


@pytest.mark.parametrize(("train", "words"), [("zero = 3", "there is no all-reduce"),
                                              ("zero = 1", "train { zero = 1 }")])
def test_without_hybrid_sharding_there_is_no_replica_all_reduce_to_substitute(train, words):
    with pytest.raises(DhelixError, match="substitutes the all-reduce of hybrid sharding") as caught:
        program(train)
    assert words in caught.value.render()


def _run(rank: int, world: int) -> tuple:
    from dhelix.interpreter.ops.comm import DistComm
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.verify.harness import check_steps
    from dhelix.interpreter.training.optim import for_executor

    prog = program()
    executor = Executor(prog, DistComm(prog.mesh, timeout_s=60), seed=7,
                        optimizer=functools.partial(for_executor, zero1=True))
    optimizer = executor.optimizer
    sliced = sorted(b.axis for b in optimizer.buckets if b.sliced)
    return check_steps(executor, optimizer, 2, 3), sliced


def test_substituted_replica_reduction_runs_exactly_on_4_gloo_ranks(tmp_path):
    pytest.importorskip("torch")
    from distributed import TOL, assert_steps_match, gloo_results

    checks, sliced = gloo_results(_run, 4, tmp_path)[0]
    assert_steps_match(checks, 2, TOL)
    assert "dp.replicate" in sliced  # the pieces' states are sliced across the replicas
