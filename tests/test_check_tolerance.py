"""`dhelix run --check`'s verdict: a difference is held to a tolerance derived from the dtype
and the size of the reduction that computed it (a correct run at hidden 1024 passes), and a
real bug (a gradient or the clipping norm off) still fails."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dhelix.dsl.core.errors import DhelixError  # noqa: E402
from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.interpreter.verify.harness import StepCheck, tolerances  # noqa: E402

from distributed import gloo_results  # noqa: E402

TINY = """
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m { layers = 2  hidden = 32  ffn = 64  heads = 4  kv_heads = 2  seq = 8  vocab = 64
  dtype = fp32  layer = llama }
cluster { nodes = 1  gpus_per_node = 1  profile = "a40" }
mesh { tp = 1 }
train { micro_batch = 2  microbatches = 2 }
pipeline one_f_one_b
"""


def _verdict(checks) -> tuple[int, str]:
    """What `dhelix run --check` prints and whether it fails, for ``checks``."""
    import contextlib
    import io
    from types import SimpleNamespace

    from dhelix.cli.run import report

    program = check_text(TINY, "t.dhx")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = report(program, SimpleNamespace(check=True), SimpleNamespace(checks=tuple(checks)), None)
        except DhelixError:
            code = 1
    return code, out.getvalue().splitlines()[-1]


def _issue_53_step(norm_diff: float) -> StepCheck:
    # The run of issue 53 (hidden 1024, ~21 M parameters, fp32): every gradient element agrees
    # to 6e-8, the global norm of 0.99 to 3.15e-5 (one fp32 sum of 21 M squares against
    # another order's).
    allowed = tolerances("fp32", loss=6.1, tokens=512, vocab=256, grad_scale=0.05, weight_scale=0.1,
                         norm=0.99, elements=21_000_000)
    return StepCheck(0, 6.099257, 6.099257, 4.47e-8, "lm_head", 27, update_diff=7.45e-9, norm_diff=norm_diff,
                     grad_scale=0.05, allowed=allowed)


def test_a_correct_run_at_hidden_1024_passes():
    code, verdict = _verdict([_issue_53_step(3.15e-5)])
    assert code == 0 and verdict.startswith("check: passed: 1 step(s)"), verdict
    assert "grad norm of step 1, 3.15e-05 <=" in verdict


def test_a_norm_off_by_a_thousandth_fails_at_that_size():
    code, verdict = _verdict([_issue_53_step(1e-3)])
    assert code == 1 and verdict.startswith("check: FAILED: 1 step(s), worst difference: grad norm of step 1")


def test_the_tolerance_grows_with_the_reduction_and_the_magnitude_only():
    small = tolerances("fp32", loss=1.0, tokens=64, vocab=64, grad_scale=0.0, weight_scale=0.0, norm=0.0,
                       elements=10)
    assert small.grad == small.update == small.norm == 1e-5  # the fp32 floor: nothing to round
    big = tolerances("fp32", loss=1.0, tokens=64, vocab=64, grad_scale=1.0, weight_scale=1.0, norm=1.0,
                     elements=21_000_000)
    assert 1e-5 < big.grad < 2e-5 and 3e-4 < big.norm < 1e-3
    # A bf16 model's norm is summed over fp32 main gradients: fp32's epsilon, bf16's floor.
    assert tolerances("bf16", loss=1.0, tokens=64, vocab=64, grad_scale=1.0, weight_scale=1.0, norm=1.0,
                      elements=21_000_000).norm < 5e-2 + 1e-3


def _checked_steps(rank: int, world: int, sabotage: str) -> list:
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.ops.comm import DistComm
    from dhelix.interpreter.training.optim import for_executor
    from dhelix.interpreter.verify.harness import check_steps

    program = check_text(TINY, "t.dhx")
    executor = Executor(program, DistComm(program.mesh, timeout_s=60), seed=7)
    optimizer = for_executor(executor, zero1=False)
    if sabotage == "gradient":  # one weight's gradient off by 1e-4, as a lost reduction would leave it
        grads = executor.grads
        executor.grads = lambda: {name: g + 1e-4 if name == "lm_head" else g for name, g in grads().items()}
    elif sabotage == "norm":  # the clipping norm off by a thousandth, as a weight counted twice would
        norm = optimizer.global_norm
        optimizer.global_norm = lambda averaged: norm(averaged) * 1.001
    return check_steps(executor, optimizer, 2, 3)


def _checked(rank: int, world: int) -> dict:
    return {sabotage: _checked_steps(rank, world, sabotage) for sabotage in ("none", "gradient", "norm")}


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    return gloo_results(_checked, 1, tmp_path_factory.mktemp("check"))[0]


def test_a_correct_run_passes_on_one_rank(checked):
    code, verdict = _verdict(checked["none"])
    assert code == 0, verdict


@pytest.mark.parametrize("sabotage, quantity", [("gradient", "gradient"), ("norm", "grad norm")])
def test_a_real_bug_still_fails(checked, sabotage, quantity):
    code, verdict = _verdict(checked[sabotage])
    assert code == 1 and f"worst difference: {quantity} of step" in verdict, verdict
