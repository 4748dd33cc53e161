"""``train { grad_reduce_dtype = bf16 | fp16 }``: data parallelism reduces the fp32 gradients in
a 16-bit dtype (Megatron-LM's ``--grad-reduce-in-bf16`` and its fp16 default, FSDP's
``reduce_dtype``). The simulator sends half the bytes; the ranks cast each bucket before its
all-reduce or reduce-scatter and back after. On 4 gloo ranks, for ZeRO 0, 1 and 2 and with an
fp32 and a bf16 model: the first step's loss is the fp32 reduction's (nothing reduced has been
used yet), the averaged gradients differ from the fp32 reduction's (the cast happened) by a
16-bit rounding's share of the tensor's largest gradient (a summand lost or doubled would move
an element by about that gradient), and every dp replica holds the same average.
"""

from __future__ import annotations

import functools

import pytest

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.simulator.costs import step_costs
from dhelix.dsl.simulator.events import simulate

torch = pytest.importorskip("torch")

from test_training import EXAMPLE  # noqa: E402

#: name -> (mesh, micro-batches a replica, ZeRO stage, model dtype); 4 ranks, 16 sequences a step.
LAYOUTS = {
    "dp2_tp2": ("tp = 2  dp = 2", 4, 0, "fp32"),
    "dp4_zero1": ("dp = 4", 2, 1, "fp32"),
    "dp2_pp2_zero2_bf16": ("dp = 2  pp = 2", 4, 2, "bf16"),
}
DTYPES = ("fp32", "bf16", "fp16")
#: The largest difference from the fp32 reduction, relative to the tensor's largest averaged
#: gradient: a few roundings of the summands and partial sums (bf16 keeps 8 significant bits,
#: fp16 11; gloo's bf16 sum measured 2^-7 of the summands' magnitude on random data).
ROUNDING = {"bf16": 2.0 ** -5, "fp16": 2.0 ** -8}


def _text(mesh: str, microbatches: int, zero: int, dtype: str, reduce_dtype: str) -> str:
    text = EXAMPLE.replace("mesh {\n  tp = 2\n  pp = 2\n}", f"mesh {{ {mesh} }}").replace("nodes = 2", "nodes = 1")
    text = text.replace("gpus_per_node = 2", "gpus_per_node = 4").replace("dtype = fp32", f"dtype = {dtype}")
    text = text.replace("microbatches = 8", f"microbatches = {microbatches}")
    return text.replace('data = "../docs/*.md"', f"zero = {zero}  grad_reduce_dtype = {reduce_dtype}")


def _averaged(program, zero: int, reduce_dtype: str, rank: int) -> dict:
    """One step's loss and averaged gradients (every parameter, ZeRO slices gathered)."""
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.ops.comm import DistComm
    from dhelix.interpreter.training.data import DataSource
    from dhelix.interpreter.training.optim import AdamWConfig, for_executor
    from dhelix.interpreter.verify.harness import replica_batch

    comm = DistComm(program.mesh, timeout_s=60)
    config = AdamWConfig(lr=1e-2, grad_reduce_dtype=reduce_dtype)
    executor = Executor(program, comm, seed=5, optimizer=functools.partial(for_executor, zero1=zero > 0, config=config))
    source = DataSource(program, comm.size("dp"), 5, None)
    loss = executor.step(replica_batch(source.batch(0), comm.index("dp"), program.train.microbatches))
    averaged = executor.optimizer.averaged_grads(executor.grads())
    return {"loss": loss.item(), "averaged": averaged, "place": tuple(comm.index(axis) for axis in ("tp", "pp"))}


def _runs(rank: int, world: int) -> dict:
    results = {}
    for name, (mesh, microbatches, zero, dtype) in LAYOUTS.items():
        for reduce_dtype in DTYPES:
            program = check_text(_text(mesh, microbatches, zero, dtype, reduce_dtype), f"{name}.dhx")
            results[name, reduce_dtype] = _averaged(program, zero, reduce_dtype, rank)
    return results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from distributed import gloo_results

    return gloo_results(_runs, 4, tmp_path_factory.mktemp("grad_reduce_dtype"), timeout=600.0)


@pytest.mark.parametrize("reduce_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_16_bit_reduction_rounds_the_summands_and_nothing_else(world, layout, reduce_dtype):
    changed = 0
    for results in world:
        wide, narrow = results[layout, "fp32"], results[layout, reduce_dtype]
        assert narrow["loss"] == wide["loss"]  # the forward of step 1 used no reduced gradient
        for name, exact in wide["averaged"].items():
            got = narrow["averaged"][name]
            assert got.dtype == exact.dtype == torch.float32
            bound = ROUNDING[reduce_dtype] * exact.abs().max()
            assert (got - exact).abs().max() <= bound, name
            changed += int(not torch.equal(got, exact))
    assert changed > 0, "the 16-bit reduction gave the fp32 one's numbers: no cast happened"


@pytest.mark.parametrize("reduce_dtype", DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_dp_replica_holds_the_same_average(world, layout, reduce_dtype):
    by_place: dict = {}
    for results in world:
        result = results[layout, reduce_dtype]
        by_place.setdefault(result["place"], []).append(result["averaged"])
    for replicas in by_place.values():
        for other in replicas[1:]:
            assert all(torch.equal(other[name], replicas[0][name]) for name in replicas[0])


def test_the_simulator_sends_the_reduce_dtype_s_bytes():
    text = _text("tp = 2  dp = 2", 4, 1, "bf16", "fp32")
    wide = check_text(text, "wide.dhx")
    narrow = check_text(text.replace("grad_reduce_dtype = fp32", "grad_reduce_dtype = bf16"), "narrow.dhx")
    assert step_costs(wide, None).grad_bytes == 4 and step_costs(narrow, None).grad_bytes == 2
    dp_wide = max(r.dp_comm for r in simulate(wide).ranks)
    dp_narrow = max(r.dp_comm for r in simulate(narrow).ranks)
    assert 0 < dp_narrow < dp_wide
    # The gradients are accumulated in fp32 either way: the model states do not change.
    assert simulate(narrow).ranks[0].states == simulate(wide).ranks[0].states


@pytest.mark.parametrize("setting, message", [
    ("zero = 3  grad_reduce_dtype = bf16", "grad_reduce_dtype = bf16 with zero = 3"),
    ("grad_reduce_dtype = fp8", "unknown grad_reduce_dtype 'fp8' (fp32, bf16 or fp16)"),
])
def test_a_reduce_dtype_it_cannot_run_is_a_located_error(setting, message):
    text = EXAMPLE.replace('data = "../docs/*.md"', setting)
    with pytest.raises(DhelixError) as info:
        check_text(text, "bad.dhx")
    rendered = info.value.render()
    assert message in rendered and "bad.dhx:" in rendered

