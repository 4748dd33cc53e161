"""The simulator's memory model (dsl/simulator/memory.py) against the interpreter's own count.

The executor's probe counts the storages of activations, saved tensors and activation
gradients of the micro-batches in flight; :func:`~dhelix.interpreter.training.train.model_state_bytes`
counts the weights, gradients and optimizer moments a rank holds. The model must agree with
both (benchmarks/memory_vs_run.py does it for every tiny example on its full mesh).
"""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.dsl.simulator.events import simulate  # noqa: E402
from dhelix.dsl.simulator.memory import largest_gathered  # noqa: E402
from dhelix.interpreter.execute.executor import Executor  # noqa: E402
from dhelix.interpreter.ops.comm import SingleRankComm  # noqa: E402
from dhelix.interpreter.training.optim import for_executor  # noqa: E402
from dhelix.interpreter.training.train import model_state_bytes  # noqa: E402
from dhelix.interpreter.verify.reference import make_batch  # noqa: E402

#: The goal of issue 28: the predicted per-rank peak within 10 % of the measured one.
GOAL = 0.10


def program(mesh: str, pipeline: str, fold: str, train: str = "", layers: int = 4, microbatches: int = 4,
            gpus: int = 1, dtype: str = "fp32"):
    return check_text(f"""\
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m {{ layers = {layers}  hidden = 64  ffn = 128  heads = 4  kv_heads = 2  seq = 32  vocab = 256
  dtype = {dtype}  layer = llama }}
cluster {{ nodes = 1  gpus_per_node = {gpus}  profile = "a40" }}
mesh {{ {mesh} }}
train {{ micro_batch = 2  microbatches = {microbatches}  {train} }}
fold {fold}
pipeline {pipeline}
""", "t.dhx")


def measured(prog, comm, si: bool = True, zero1: bool = False) -> tuple[int, int]:
    """(activation peak, model-state bytes) of one step of ``prog`` on this rank."""
    executor = Executor(prog, comm, seed=1, si=si, optimizer=functools.partial(for_executor, zero1=zero1))
    optimizer = executor.optimizer
    executor.step(make_batch(prog, 2))
    optimizer.step(executor.grads(), 1e-3)
    optimizer.settle()
    return executor.recorder.peak_bytes, model_state_bytes(executor, optimizer)


@pytest.mark.parametrize("si", [True, False])
def test_si_blocks_peak_where_the_interpreter_does(si):
    # In an SI block the backward frees each op's tensors while the forward allocates its
    # own: the measured peak is one strand's (1F1B's), and so is the model's. Booking the
    # pair's forward layer before freeing its backward layer predicted a layer more (+21 %).
    prog = program("tp = 1", "w_helix", "u")
    acts, states = measured(prog, SingleRankComm(), si=si)
    rank = simulate(prog, si=si).ranks[0]
    assert rank.activations == pytest.approx(acts, rel=0.03)
    assert rank.states.total == states  # fp32 weights, gradients and two AdamW moments
    if si:
        one_strand = measured(program("tp = 1", "one_f_one_b", "none"), SingleRankComm())[0]
        assert acts == pytest.approx(one_strand, rel=0.01)


def test_bf16_gradients_are_fp32_main_gradients_in_the_optimizer_s_buffers():
    # Megatron-LM's main_grad: the backward adds every micro-batch's weight gradient into an
    # fp32 view of the optimizer's flat buffer, so the rank holds bf16 weights (2 bytes per
    # parameter), fp32 gradients (4) and fp32 masters and moments (12), and nothing beside
    # them: an fp32 copy of bf16 gradients took 20 bytes per parameter (+29 % at the peak
    # of llama8b_a40's rank 0 on an H100), 2 more than the model and Megatron-LM.
    from dhelix.interpreter.training.train import _storage_bytes

    prog = program("tp = 1", "w_helix", "u", dtype="bf16")
    executor = Executor(prog, SingleRankComm(), seed=1, optimizer=for_executor)
    optimizer = executor.optimizer
    executor.step(make_batch(prog, 2))
    buffers = {bucket.grads.untyped_storage().data_ptr() for bucket in optimizer.buckets}
    grads = executor.grads()
    assert grads and all(g.dtype == torch.float32 and g.untyped_storage().data_ptr() in buffers
                         for g in grads.values())
    optimizer.step(grads, 1e-3)
    states = simulate(prog).ranks[0].states
    params = sum(p.numel() for p in executor.params.values())
    assert (states.params, states.grads, states.optimizer) == (2 * params, 4 * params, 12 * params)
    assert model_state_bytes(executor, optimizer) == states.total
    assert _storage_bytes(optimizer.scratch_tensors()) == 0


def _zero3_rank(rank: int, world: int) -> dict:
    from dhelix.interpreter.ops.comm import DistComm

    prog = program("dp = 2", "w_helix", "u", "zero = 3", layers=2, microbatches=2, gpus=2)
    acts, states = measured(prog, DistComm(prog.mesh, timeout_s=60), zero1=True)
    return {"acts": acts, "states": states}


def test_zero3_counts_the_weights_one_gather_holds_while_a_layer_runs(tmp_path):
    # The interpreter gathers each weight on its own and drops it after its last reader: the
    # measured states are the shards exactly, and a gathered weight is live only while its
    # layer runs. Two whole gathered layers and a layer's full gradient added to the states
    # put the predicted peak 21-30 % over the measured one.
    from distributed import gloo_results

    prog = program("dp = 2", "w_helix", "u", "zero = 3", layers=2, microbatches=2, gpus=2)
    predicted = simulate(prog).ranks[0]
    for got in gloo_results(_zero3_rank, 2, tmp_path, timeout=240.0):
        peak = got["acts"] + got["states"]
        assert predicted.memory == pytest.approx(peak, rel=GOAL)
        assert predicted.states.total == got["states"]  # the shards the rank keeps
        # What the probe (sampled between ops) cannot see: at most one gathered weight per
        # strand and one full gradient over the activations.
        held = 4 * largest_gathered(prog.forward)
        assert got["acts"] < predicted.activations <= got["acts"] * 1.01 + 3 * held
