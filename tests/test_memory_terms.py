"""Memory terms held to published runs (issue 52): fp8's 16-bit storage and the loss's copies
of the logits (dsl/simulator/memory.py, the profile's ``kernels.loss``)."""

from __future__ import annotations

import attrs
import pytest

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.fidelity.predict import run_profile
from dhelix.dsl.fidelity.runs import load_runs
from dhelix.dsl.frontend.kernel_terms import LOSS_COPIES
from dhelix.dsl.frontend.profiles import load_profile
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.simulator.events import simulate
from dhelix.dsl.simulator.memory import head_transients, stored_bytes

VOCAB, SEQ, MICRO = 4096, 256, 2


def program(dtype: str = "bf16", mesh: str = "tp = 2", pipeline: str = "one_f_one_b"):
    return check_text(f"""\
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m {{ layers = 2  hidden = 256  ffn = 512  heads = 4  seq = {SEQ}  vocab = {VOCAB}
  dtype = {dtype}  layer = llama }}
cluster {{ nodes = 1  gpus_per_node = 2  profile = "h100" }}
mesh {{ {mesh} }}
train {{ micro_batch = {MICRO}  microbatches = 2 }}
pipeline {pipeline}
""", "t.dhx")


def with_loss(prog, loss: str):
    return attrs.evolve(prog, profile=attrs.evolve(prog.profile, kernels=attrs.evolve(prog.profile.kernels, loss=loss)))


def peak(prog) -> float:
    return max(rank.memory for rank in simulate(prog, trace=False).ranks)


def test_fp8_keeps_weights_gradients_and_activations_in_bf16():
    assert stored_bytes("fp8") == stored_bytes("bf16") == 2 and stored_bytes("fp32") == 4
    fp8, bf16 = simulate(program("fp8"), trace=False).ranks[0], simulate(program("bf16"), trace=False).ranks[0]
    assert fp8.states == bf16.states and fp8.activations == bf16.activations
    # ... while its GEMMs run in fp8: the step is shorter
    assert simulate(program("fp8"), trace=False).step_time < simulate(program("bf16"), trace=False).step_time


def test_an_upcast_loss_holds_two_more_fp32_copies_of_the_local_logits_in_its_backward():
    base = program()
    logits = MICRO * SEQ * VOCAB / 2 * 4.0  # [T, V/tp] in fp32, tp 2
    assert LOSS_COPIES["upcast"] == (1.0, 1.5, 2.0)
    assert head_transients(base) == (0.0, 0.0)
    assert head_transients(with_loss(base, "upcast")) == (1.5 * logits, 2.0 * logits)
    # one stage: every layer's activations are live when the head's backward starts
    assert peak(with_loss(base, "upcast")) - peak(base) == pytest.approx(2.0 * logits)
    # they are the last stage's alone: with a pipeline the first stage, which has no head,
    # keeps its peak
    piped = program(mesh="pp = 2")
    first = [simulate(p, trace=False).ranks[0].memory for p in (piped, with_loss(piped, "upcast"))]
    last = [simulate(p, trace=False).ranks[1].memory for p in (piped, with_loss(piped, "upcast"))]
    assert first[0] == first[1] and last[1] - last[0] == pytest.approx(2.0 * MICRO * SEQ * VOCAB * 4.0)


def test_a_fused_loss_keeps_the_16_bit_logits_and_holds_their_16_bit_gradient():
    base, fused = program(), with_loss(program(), "fused")
    logits = MICRO * SEQ * VOCAB / 2 * 4.0
    assert head_transients(fused) == (0.0, 0.5 * logits)
    # half the fp32 softmax kept, half a copy held in the backward: the same peak at the
    # head's backward, but each micro-batch in flight keeps half as much
    assert peak(fused) == pytest.approx(peak(base))
    # GPipe: both micro-batches in flight at the last stage's first backward, 2 fp32 copies
    # kept against 2 halves kept and a half held
    piped = program(mesh="pp = 2", pipeline="gpipe")
    copy = MICRO * SEQ * VOCAB * 4.0  # tp 1
    last = [simulate(p, trace=False).ranks[1].memory for p in (piped, with_loss(piped, "fused"))]
    assert last[0] - last[1] == pytest.approx(2 * copy - (2 * 0.5 + 0.5) * copy)


def test_a_source_s_loss_reaches_its_runs_profile_and_a_wrong_one_is_refused(tmp_path):
    runs = load_runs("benchmarks/published_runs.yaml")
    titan = next(run for run in runs if run.source.key == "torchtitan_bench_2412")
    nemo = next(run for run in runs if run.source.key == "nemo_perf_2407")
    h100 = load_profile("h100")
    assert run_profile(titan, h100).kernels.loss == "upcast"
    compiled = next(run for run in runs if run.source.key == "torchtitan_bench_h200_2506")
    assert run_profile(compiled, load_profile("h200")).kernels.loss == "fused"
    assert run_profile(nemo, h100).kernels.loss == "vocab_parallel"
    bad = tmp_path / "runs.yaml"
    bad.write_text("sources:\n  s:\n    cite: somebody\n    loss: chunked\nruns: []\n")
    with pytest.raises(DhelixError, match="loss must be one of vocab_parallel, upcast, fused"):
        load_runs(bad)
    # a misspelt key is an error at its source, not a fact silently left out
    bad.write_text("sources:\n  s:\n    cite: somebody\n    los: upcast\nruns: []\n")
    with pytest.raises(DhelixError) as info:
        load_runs(bad)
    assert "runs.yaml:3:1" in str(info.value) and "source 's': unknown key(s) los" in str(info.value)
