"""``train { offload = optimizer }``: the optimizer's fp32 masters and AdamW moments live in
host memory; each step the averaged gradients go to the host, AdamW runs there and the
updated weights come back (interpreter/training/offload.py).

On 2 gloo ranks (2 micro-batches each), ZeRO 0, 1 (bf16, its gathers under the next
forward), 2 and 3 (37 % offloaded: ``offload_percent``), clipping on: two steps with the states
offloaded give the losses, weights and moments of the device optimizer bit for bit (one AdamW
kernel, the same elements in the same order; a share offloaded, to an fp32 rounding) — a
copy-back left out keeps the old weights and fails it. An offloaded run's checkpoint resumes
into a new offloaded run that takes the next step as the run that went on did. The simulator's
formulas: the device loses the optimizer states (its share), the host holds them and the staging
buffers (the interpreter's counts exactly), the step adds the two copies and the host's AdamW in
place of the device's; a profile without a host section refuses offload by name.
"""

from __future__ import annotations

import functools

import pytest

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.planner.costmodel import (host_optimizer_bytes_per_param, offload_time, optimizer_time,
                                         step_optimizer_time)
from dhelix.dsl.simulator.events import simulate

torch = pytest.importorskip("torch")

from test_training import EXAMPLE  # noqa: E402

#: name -> (mesh, ZeRO stage and what goes with it, model dtype, the offload written); 2 ranks.
LAYOUTS = {
    "dp2_zero0": ("dp = 2", "zero = 0", "fp32", "optimizer"),
    "dp2_zero1_bf16_gather_forward": ("dp = 2", "zero = 1  param_gather = forward", "bf16", "optimizer"),
    "dp2_zero2": ("dp = 2", "zero = 2", "fp32", "optimizer"),
    # A share offloaded: ZeRO-3's pieces, and the model's ends sliced over dp as ZeRO-1's buckets are.
    "dp2_zero3_37_percent": ("dp = 2", "zero = 3", "fp32", "optimizer  offload_percent = 37"),
}
STEPS = 2
#: One rounding of fp32 (a few units in the last place of the value).
ROUNDING = 4 * 2.0 ** -23


def _text(mesh: str, zero: str, dtype: str, offload: str, gpus: int = 2) -> str:
    text = EXAMPLE.replace("mesh {\n  tp = 2\n  pp = 2\n}", f"mesh {{ {mesh} }}").replace("nodes = 2", "nodes = 1")
    text = text.replace("gpus_per_node = 2", f"gpus_per_node = {gpus}").replace("dtype = fp32", f"dtype = {dtype}")
    text = text.replace("microbatches = 8", "microbatches = 2")
    return text.replace('data = "../docs/*.md"', f"{zero}  offload = {offload}")


def _executor(program):
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.ops.comm import DistComm
    from dhelix.interpreter.training.optim import AdamWConfig, for_executor

    comm = DistComm(program.mesh, timeout_s=60)
    config = AdamWConfig(lr=1e-2, clip=0.5)
    return Executor(program, comm, seed=5,
                    optimizer=functools.partial(for_executor, zero1=program.train.zero > 0, config=config))


def _step(executor, step: int) -> float:
    from dhelix.interpreter.training.data import DataSource
    from dhelix.interpreter.verify.harness import replica_batch

    program, comm = executor.program, executor.comm
    batch = DataSource(program, comm.size("dp"), 5, None).batch(step)
    loss = executor.step(replica_batch(batch, comm.index("dp"), program.train.microbatches)).item()
    executor.optimizer.step(executor.grads())
    return loss


def _trained(program, saves: str) -> dict:
    """Losses of :data:`STEPS` steps, then the fp32 weights and moments (ZeRO slices
    gathered); offloaded, the run saved there and the loss of one more step, continued and
    resumed from the save into a new offloaded run."""
    from dhelix.interpreter.training import checkpoint

    executor = _executor(program)
    optimizer = executor.optimizer
    losses = [_step(executor, step) for step in range(STEPS)]
    out = {"losses": losses, "masters": optimizer.masters(), "moments": optimizer.moments(),
           "params": {name: value.clone() for name, value in executor.params.items()},
           "host": len(optimizer.host_tensors()), "offloaded": [b.offloaded for b in optimizer.buckets],
           "tails": sum(b.tail is not None for b in optimizer.buckets)}
    if program.train.offloads and program.train.zero == 1:  # (a sliced layout: the save gathers the slices)
        sequences = program.mesh.size("dp") * program.train.micro_batch * program.train.microbatches
        checkpoint.save(saves, executor, optimizer, step=STEPS, seed=5, global_sequences=sequences)
        resumed = _executor(program)
        checkpoint.load(saves, resumed, resumed.optimizer, sequences)
        out["next"] = (_step(executor, STEPS), _step(resumed, STEPS))
    return out


def _runs(rank: int, world: int, folder: str) -> dict:
    results = {}
    for name, (mesh, zero, dtype, offload) in LAYOUTS.items():
        for written in ("none", offload):
            program = check_text(_text(mesh, zero, dtype, written), f"{name}.dhx")
            results[name, written != "none"] = _trained(program, f"{folder}/{name}")
    return results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from distributed import gloo_results

    folder = tmp_path_factory.mktemp("offload")
    return gloo_results(functools.partial(_runs, folder=str(folder / "saves")), 2, folder, timeout=300.0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_offloaded_steps_equal_the_device_optimizer_s(world, layout):
    # Offloading everything runs AdamW's kernel over the same elements in the same order: bit
    # for bit. A share (offload_percent) splits each part at an element that the device's
    # vectorised kernel then starts at: one rounding of fp32 apart at most.
    partial = "offload_percent" in LAYOUTS[layout][3]
    for results in world:
        device, host = results[layout, False], results[layout, True]
        assert device["host"] == 0 and not any(device["offloaded"])
        assert host["host"] > 0 and all(host["offloaded"])
        assert (host["tails"] > 0) == partial  # a share stays on the device
        assert host["losses"] == pytest.approx(device["losses"], rel=1e-6 if partial else 0)
        pairs = [(host[kind][name], value, (kind, name)) for kind in ("masters", "params")
                 for name, value in device[kind].items()]
        pairs += [(host["moments"][name][slot], moment[slot], ("moments", name)) for name, moment in
                  device["moments"].items() for slot in (0, 1)]
        for got, value, what in pairs:
            if partial:
                assert ((got - value).abs() <= ROUNDING * value.abs() + 1e-30).all(), what
            else:
                assert torch.equal(got, value), what


def test_an_offloaded_run_resumes_from_its_checkpoint(world):
    # The save holds the host's masters and moments (ZeRO-1 slices gathered); a new offloaded
    # run loads them into its host copies and takes the next step as the run that went on did.
    for results in world:
        went_on, resumed = results["dp2_zero1_bf16_gather_forward", True]["next"]
        assert resumed == went_on


def _single(dtype: str, offload: str):
    return check_text(_text("tp = 1", "zero = 0", dtype, offload, gpus=1), "one.dhx")


@pytest.mark.parametrize("dtype, percent", [("fp32", 100), ("bf16", 100), ("bf16", 50)])
def test_the_memory_model_counts_what_the_rank_keeps_on_the_device_and_the_host(dtype, percent):
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.ops.comm import SingleRankComm
    from dhelix.interpreter.training.optim import for_executor
    from dhelix.interpreter.training.train import _storage_bytes, model_state_bytes
    from dhelix.interpreter.verify.reference import make_batch

    program = _single(dtype, f"optimizer  offload_percent = {percent}")
    executor = Executor(program, SingleRankComm(), seed=1, optimizer=for_executor)
    executor.step(make_batch(program, 3))
    executor.optimizer.step(executor.grads())
    states = simulate(program).ranks[0].states
    device = simulate(_single(dtype, "none")).ranks[0].states
    params = sum(p.numel() for p in executor.params.values())
    size = 4 if dtype == "fp32" else 2
    assert states.params == device.params and states.grads == device.grads
    # fp32 masters and moments, the fp32 gradients' landing buffer, the rounded weights' (16-bit only)
    share = percent / 100
    assert states.host == params * share * (12 + 4 + (size if dtype != "fp32" else 0))
    assert states.optimizer == params * (1 - share) * 12  # the device's share keeps fp32 masters too
    # Each bucket part splits at a whole element: the model's share is within an element a bucket.
    slack = 30 * len(executor.optimizer.buckets) if percent < 100 else 0
    assert abs(model_state_bytes(executor, executor.optimizer) - states.total) <= slack
    assert abs(_storage_bytes(executor.optimizer.host_tensors()) - states.host) <= slack


def test_the_step_adds_the_copies_and_the_host_s_adamw():
    program, device = _single("bf16", "optimizer"), _single("bf16", "none")
    h100 = check_text(_text("tp = 1", "zero = 0", "bf16", "optimizer", gpus=1).replace('"a40"', '"h100"'),
                      "h.dhx").profile
    part = offload_time(1e9, "bf16", h100)
    # 4 GB of fp32 gradients and 2 GB of bf16 weights over 64 GB/s; 30 bytes a parameter at 30 GB/s
    assert host_optimizer_bytes_per_param("bf16") == 30 and host_optimizer_bytes_per_param("fp32") == 28
    assert part.to_host == pytest.approx(4e9 / 64e9) and part.to_device == pytest.approx(2e9 / 64e9)
    assert part.host == pytest.approx(30e9 / 30e9) and part.seconds == pytest.approx(part.to_host + 1 + part.to_device)
    rank, base = simulate(program).ranks[0], simulate(device).ranks[0]
    held = base.states.grads / 4  # fp32 main gradients: one per parameter this rank holds
    added = offload_time(held, "bf16", program.profile).seconds - optimizer_time(held, "bf16", program.profile)
    assert rank.end - base.end == pytest.approx(added, rel=1e-9)
    assert simulate(program).step_time > simulate(device).step_time
    # offload_percent = P: the host's share copied and stepped there, the rest on the device meanwhile.
    half = offload_time(held / 2, "bf16", program.profile)
    assert step_optimizer_time(held, "bf16", program.profile, 50) == pytest.approx(
        half.to_host + max(half.host, optimizer_time(held / 2, "bf16", program.profile)) + half.to_device)
    partial = simulate(_single("bf16", "optimizer  offload_percent = 50")).ranks[0]
    assert partial.end - base.end == pytest.approx(
        step_optimizer_time(held, "bf16", program.profile, 50) - optimizer_time(held, "bf16", program.profile), rel=1e-9)


def test_a_profile_without_a_host_link_refuses_offload_by_its_field(tmp_path):
    text = _shipped("a40")
    cut = text[:text.index("\nhost:")] + "\n"
    (tmp_path / "nohost.yaml").write_text(cut)
    program = _text("tp = 1", "zero = 0", "fp32", "optimizer", gpus=1).replace('"a40"', '"nohost.yaml"')
    (tmp_path / "p.dhx").write_text(program)
    with pytest.raises(DhelixError) as info:
        check_text(program, str(tmp_path / "p.dhx"))
    rendered = info.value.render()
    assert "offload = optimizer needs the host link's bandwidth, and profile 'a40' has no host.link_gbps" in rendered
    assert "offload = optimizer" in rendered.splitlines()[1]  # located at the setting
    check_text(program.replace("offload = optimizer", "offload = none"), str(tmp_path / "p.dhx"))


@pytest.mark.parametrize("offload, message", [
    ("optimiser", "unknown offload 'optimiser' (none or optimizer)"),
    ("none  offload_percent = 50", "offload_percent = 50 needs offload = optimizer"),
    ("optimizer  offload_percent = 101", "offload_percent"),
])
def test_an_offload_it_cannot_run_is_a_located_error(offload, message):
    with pytest.raises(DhelixError) as info:
        check_text(_text("tp = 1", "zero = 0", "fp32", offload, gpus=1), "bad.dhx")
    rendered = info.value.render()
    assert message in rendered and "bad.dhx:" in rendered


def _shipped(name: str) -> str:
    from importlib import resources

    return (resources.files("dhelix.stdlib_schedules") / f"{name}.yaml").read_text()


def test_a_node_s_host_memory_refuses_what_it_cannot_hold(tmp_path):
    # host.memory_gb is a node's: the offloaded states of its GPUs add up. Two GPUs of dp 2 on
    # one node each hold half the states; a host just below their sum refuses the program in
    # check, simulate and run's simulation, naming the node, the GPUs' bytes and the figure;
    # half as many offloaded (offload_percent = 50) fit.
    from commands import dhelix_here

    from dhelix.dsl.frontend.profiles import parse_profile
    from dhelix.dsl.simulator.host_memory import busiest_node

    program = check_text(_text("dp = 2", "zero = 1", "fp32", "optimizer"), "p.dhx")
    per_gpu = max(r.states.host for r in simulate(program, trace=False).ranks)
    assert busiest_node(program.mesh, [per_gpu]).total == 2 * per_gpu
    assert parse_profile(_shipped("a40"), "a40.yaml").host.memory_gb == 512
    text = _shipped("a40")
    cut = text.replace("memory_gb: 512 ", f"memory_gb: {1.5 * per_gpu / 1e9!r} ", 1)
    (tmp_path / "small.yaml").write_text(cut)
    source = _text("dp = 2", "zero = 1", "fp32", "optimizer").replace('"a40"', '"small.yaml"')
    (tmp_path / "p.dhx").write_text(source)
    gb = per_gpu / 1e9
    for command in ("check", "simulate"):
        done = dhelix_here(command, str(tmp_path / "p.dhx"))
        assert done.returncode == 1, done
        assert f"the offloaded optimizer states take {2 * gb:.4g} GB of host memory on node 0" in done.stderr
        assert f"node 0: 2 GPUs x {gb:.4g} GB (pipeline rank 0)" in done.stderr
        assert "host.memory_gb" in done.stderr and "p.dhx:" in done.stderr
    half = source.replace("offload = optimizer", "offload = optimizer  offload_percent = 50")
    (tmp_path / "half.dhx").write_text(half)
    assert dhelix_here("check", str(tmp_path / "half.dhx")).returncode == 0
