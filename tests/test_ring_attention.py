"""Ring attention over cp against full causal attention of the gathered sequence (fp32, max
abs diff <= 1e-5): the kernels alone (cp = 2 and cp = 4), the llama layer (cp = 2 with tp = 1
and tp = 2) and whole executor steps with the optimizer (cp × pp, tp × cp, cp × dp), all in
one world of 4 gloo ranks (spawning a world costs more than the checks)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


from dhelix.dsl.core.mesh import Mesh  # noqa: E402
from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.interpreter.ops.comm import AXES, DistComm, SingleRankComm  # noqa: E402
from dhelix.interpreter.execute.executor import Executor  # noqa: E402
from dhelix.interpreter.verify.harness import check_steps  # noqa: E402
from dhelix.interpreter.ops.kernels import KernelCtx  # noqa: E402
from dhelix.interpreter.execute.layer_exec import LayerPlan  # noqa: E402
from dhelix.interpreter.training.optim import DistributedAdamW, for_executor  # noqa: E402
from dhelix.interpreter.verify.reference import reference_layer  # noqa: E402
from dhelix.interpreter.ops.ring_attention import (  # noqa: E402
    KERNEL, STEP, local_positions, local_tokens)
from dhelix.dsl.planner.si_plan import op_by_op_plan  # noqa: E402
from dhelix.interpreter.ops.weights import WeightPlan, param_name  # noqa: E402

from distributed import TOL, assert_close, drive_layer, gloo_results  # noqa: E402
from commands import dhelix_here  # noqa: E402

SEED, DATA_SEED = 13, 4
MB, SEQ, HEADS, KV_HEADS, D = 2, 16, 4, 2, 8


def program(mesh: str, pipeline: str = "one_f_one_b", fold: str = "none", layer: str = "llama"):
    """A tiny Llama (hidden 64, seq 16: 2·cp·tp divides it) on ``mesh`` (4 ranks); the
    rotary settings are read by layer llama3_rope only."""
    return check_text(f"""
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m {{ layers = 4  hidden = 64  ffn = 128  heads = {HEADS}  kv_heads = {KV_HEADS}  seq = {SEQ}
  vocab = 64  dtype = fp32  layer = {layer}  rope_theta = 10000  rope_factor = 8  rope_low_freq = 1
  rope_high_freq = 4  rope_original = 8  norm_inv_eps = 1000000 }}
cluster {{ nodes = 2  gpus_per_node = 2  profile = "a40" }}
mesh {{ {mesh} }}
train {{ micro_batch = {MB}  microbatches = 4 }}
fold {fold}
pipeline {pipeline}
""", "t.dhx")


def local_rows(full: torch.Tensor, cp: int, index: int) -> torch.Tensor:
    """This cp rank's rows of ``[MB·SEQ, features]`` (the load-balanced layout)."""
    rows = full.reshape(MB, SEQ, -1)
    return local_tokens(rows.transpose(1, 2), cp, index).transpose(1, 2).reshape(-1, full.shape[1])


def attention_io():
    gen = torch.Generator().manual_seed(DATA_SEED)
    qkv = torch.randn(MB * SEQ, (HEADS + 2 * KV_HEADS) * D, generator=gen)
    return qkv, torch.randn(MB * SEQ, HEADS * D, generator=gen)


#: Rotary embeddings with Llama 3's scaling, as the attention op's parameters.
ROPE = {"rope": 10000, "rope_factor": 8, "rope_low_freq": 1, "rope_high_freq": 4, "rope_original": 8}


def full_attention(mask: str = "causal", rope: dict | None = None):
    """Output and qkv gradient of GQA attention over whole sequences (autograd)."""
    from dhelix.interpreter.verify.reference import _attention

    qkv, dout = attention_io()
    qkv.requires_grad_(True)
    out = _attention(qkv, {"heads": HEADS, "kv_heads": KV_HEADS, "mask": mask, **(rope or {})}, MB)
    out.backward(dout)
    return out.detach(), qkv.grad


def ring_kernels(comm, async_op: bool, mask: str = "causal", rope: dict | None = None):
    """Run the ring's forward and backward steps on this rank's rows."""
    cp, index = comm.size("cp"), comm.index("cp")
    qkv, dout = (local_rows(t, cp, index) for t in attention_io())

    def ctx(step):
        params = {"heads": HEADS, "kv_heads": KV_HEADS, "mask": mask, STEP: step, **(rope or {})}
        return KernelCtx(comm, "cp", MB, params, async_op=async_op)

    value = qkv
    for step in range(cp):
        value, saved = KERNEL.forward([value], None, ctx(step))
        value = value.wait() if hasattr(value, "wait") else value
    state = dout
    for step in range(cp + 1):
        state = KERNEL.backward(state, saved, ctx(step))
        state = state.wait() if hasattr(state, "wait") else state
    return value, state


# -- the world ---------------------------------------------------------------------------

def layer_io(plan):
    gen = torch.Generator().manual_seed(DATA_SEED)
    hidden = plan.program.model.get("hidden")
    return torch.randn(MB * SEQ, hidden, generator=gen), 0.1 * torch.randn(MB * SEQ, hidden, generator=gen)


def ring_layer(mesh: str):
    """The llama layer's output, input gradient and weight gradients on this rank."""
    prog = program(mesh)
    comm = DistComm(prog.mesh, timeout_s=60)
    plan = WeightPlan(prog, SEED)
    index = {axis: comm.index(axis) for axis in AXES}
    layer_plan = LayerPlan.build(prog.forward, prog.backward, MB)
    x, dout = (local_rows(t, comm.size("cp"), index["cp"]).chunk(comm.size("tp"))[index["tp"]]
               for t in layer_io(plan))
    results = []
    for async_comm in (False, True):
        out, _, _, run = drive_layer(layer_plan, plan.layer_weights(0, index), comm, x, dout, async_comm)
        assert not run.saved  # the ring released everything it kept for the backward
        results.append(dict(out=out, dx=run.input_grad(), grads=run.grads, index=index))
    return results


STEPS = {"cp2_pp2_w_helix": ("cp = 2  pp = 2", "w_helix", "u"),
         "tp2_cp2_1f1b": ("tp = 2  cp = 2", "one_f_one_b", "none"),
         "cp2_dp2_1f1b": ("cp = 2  dp = 2", "one_f_one_b", "none"),
         "tp2_cp2_1f1b_llama3_rope": ("tp = 2  cp = 2", "one_f_one_b", "none", "llama3_rope")}
#: With the optimizer `dhelix run` builds: each layer's gradients, partial over cp, handed to it
#: under the backward, reduced over dp, then summed over cp by the optimizer.
EARLY = {"cp2_dp2_1f1b_reduced_under_backward": ("cp = 2  dp = 2", "one_f_one_b", "none")}


def executor_step(name: str):
    prog = program(*(STEPS.get(name) or EARLY[name]))
    comm = DistComm(prog.mesh, timeout_s=60)
    early = functools.partial(for_executor, norms=False) if name in EARLY else None
    executor = Executor(prog, comm, seed=SEED, plan_for=op_by_op_plan, optimizer=early)
    optimizer = executor.optimizer or DistributedAdamW(executor.params, comm)
    assert optimizer.early == (name in EARLY)
    checks = check_steps(executor, optimizer, 1, DATA_SEED)
    return checks, {k: g.clone() for k, g in executor.grads().items()}


def _results(rank: int, world: int) -> dict:
    results = {}
    for name, sizes in (("cp2", (2, 2)), ("cp4", (4, 1))):
        comm = DistComm(Mesh(("cp", "dp"), sizes, 1, 4), timeout_s=60)
        results[name] = [ring_kernels(comm, async_op) for async_op in (False, True)]
    results["cp2_full"] = [ring_kernels(DistComm(Mesh(("cp", "dp"), (2, 2), 1, 4)), False, "full")]
    results["cp4_rope"] = [ring_kernels(DistComm(Mesh(("cp", "dp"), (4, 1), 1, 4)), async_op, rope=ROPE)
                           for async_op in (False, True)]
    results["layer_cp2"] = ring_layer("cp = 2  dp = 2")
    results["layer_tp2_cp2"] = ring_layer("tp = 2  cp = 2")
    results.update({name: executor_step(name) for name in list(STEPS) + list(EARLY)})
    return results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return gloo_results(_results, 4, tmp_path_factory.mktemp("ring"))


# -- checks ------------------------------------------------------------------------------

def test_layout_gives_rank_i_chunks_i_and_its_mirror():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([local_positions(16, 4, i) for i in range(4)])
    assert sorted(every.tolist()) == list(range(16))


@pytest.mark.parametrize("name,cp", [("cp2", 2), ("cp4", 4), ("cp2_full", 2), ("cp4_rope", 4)])
def test_ring_kernels_match_full_attention(world, name, cp):
    want_out, want_dqkv = full_attention("full" if name.endswith("full") else "causal",
                                         ROPE if name.endswith("rope") else None)
    for rank, results in enumerate(world):
        index = rank % cp  # cp is the innermost axis of these meshes
        for out, dqkv in results[name]:  # synchronous, then asynchronous steps
            assert_close(out, local_rows(want_out, cp, index), f"rank {rank} output")
            assert_close(dqkv, local_rows(want_dqkv, cp, index), f"rank {rank} dq/dk/dv")


def reference_layer_grads(plan):
    x, dout = layer_io(plan)
    weights = {op: plan.full(param_name(0, op)).requires_grad_(True) for op in plan.layer_specs}
    x.requires_grad_(True)
    out = reference_layer(plan.full_forward, weights, x, MB)
    out.backward(dout)
    return out.detach(), x.grad, {op: w.grad for op, w in weights.items()}


@pytest.mark.parametrize("name,mesh", [("layer_cp2", "cp = 2  dp = 2"), ("layer_tp2_cp2", "tp = 2  cp = 2")])
def test_ring_layer_matches_reference(world, name, mesh):
    plan = WeightPlan(program(mesh), SEED)
    tp, cp = plan.program.mesh.size("tp"), plan.program.mesh.size("cp")
    want_out, want_dx, want_grads = reference_layer_grads(plan)
    for k in range(2):  # synchronous, then asynchronous comm ops
        runs = {(r[name][k]["index"]["cp"], r[name][k]["index"]["tp"]): r[name][k]
                for r in world if r[name][k]["index"]["dp"] == 0}
        assert len(runs) == cp * tp
        for (c, t), run in runs.items():
            for got, want, what in ((run["out"], want_out, "output"), (run["dx"], want_dx, "input grad")):
                assert_close(got, local_rows(want, cp, c).chunk(tp)[t], f"{name} cp {c} tp {t} {what}")
        for op in plan.layer_specs:
            spec, total = plan.spec(param_name(0, op)), 0
            for c in range(cp):  # complete over tp, then summed over cp
                pieces = [runs[c, t]["grads"][op] for t in range(tp)]
                total = total + (plan.join(param_name(0, op), pieces) if spec.axis == "tp"
                                 else sum(pieces) if "tp" in spec.grad_sum else pieces[0])
            assert "cp" in spec.grad_sum
            assert_close(total, want_grads[op], f"{name}: gradient of {op} summed over cp")


@pytest.mark.parametrize("name", list(STEPS) + list(EARLY))
def test_executor_step_with_cp_matches_reference(world, name):
    (checks, _) = world[0][name]
    assert len(checks) == 1
    for check in checks:
        assert check.loss_diff <= TOL, str(check)
        assert check.grad_diff <= TOL, str(check)
        assert check.update_diff <= TOL, str(check)


def test_cp_ranks_hold_the_summed_gradient(world):
    # Every weight is replicated over cp: after the step its gradient is complete (summed
    # over the cp group) and equal on both ranks of a cp group, before the optimizer runs.
    for name in STEPS:
        mesh = program(STEPS[name][0]).mesh
        for group in mesh.groups("cp"):
            grads = [world[rank][name][1] for rank in group]
            assert set(grads[0]) == set(grads[1])
            for param in grads[0]:
                assert grads[0][param].equal(grads[1][param]), (name, group, param)


def test_without_cp_there_is_no_ring():
    prog = program("tp = 2  dp = 2")
    plan = LayerPlan.build(prog.forward, prog.backward, MB)
    assert all(step.role != "ring" for step in plan.steps.values())
    assert local_tokens(torch.arange(SEQ), 1, 0).equal(torch.arange(SEQ))
    assert SingleRankComm().size("cp") == 1


def test_dhelix_run_checks_a_cp_run_against_the_reference(tmp_path):
    """`dhelix run --check` on cp 2 × pp 2 (planned SI pairs, w_helix): the preflight lets
    cp through and every step matches the reference."""
    root = Path(__file__).resolve().parent.parent
    text = (root / "examples" / "tiny_llama_cpu.dhx").read_text().replace("tp = 2", "cp = 2")
    text = text.replace('"../docs/*.md"', f'"{root / "docs" / "*.md"}"')  # the copy lives elsewhere
    path = tmp_path / "cp.dhx"
    path.write_text(text)
    result = dhelix_here("run", str(path), "--steps", "1", "--check", cwd=root)
    assert result.returncode == 0, result.stderr
    assert "step 1: loss" in result.stdout
