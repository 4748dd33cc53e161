"""The layer ops compiled into calls (interpreter/execute/layer_calls.py) against the runs' own
methods: the same loss and gradients bit for bit, the same memory-probe samples, and with the
probe off the same gradients again; and the calls, not the methods, run the ops."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from dhelix.interpreter.execute import layer_exec  # noqa: E402
from dhelix.interpreter.execute.executor import Executor  # noqa: E402
from dhelix.interpreter.execute.recording import Recorder  # noqa: E402
from dhelix.interpreter.ops.comm import SingleRankComm  # noqa: E402
from dhelix.interpreter.verify.reference import make_batch  # noqa: E402

from dhelix.dsl.passes.pipeline import check_text  # noqa: E402

#: A MoE layer (its routed ops' contexts made per run) in place of the Llama one.
MOE = "layer = moe  experts = 4  top_k = 2"


def _program(pipeline: str, fold: str, train: str = "", mesh: str = "tp = 1", gpus: int = 1,
             model: str = "layer = llama"):
    return check_text(f"""\
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m {{ layers = 4  hidden = 32  ffn = 64  heads = 4  kv_heads = 2  seq = 8  vocab = 64
  dtype = fp32  {model} }}
cluster {{ nodes = 1  gpus_per_node = {gpus}  profile = "a40" }}
mesh {{ {mesh} }}
train {{ micro_batch = 2  microbatches = 4  {train} }}
fold {fold}
pipeline {pipeline}
""", "t.dhx")


@contextlib.contextmanager
def _methods_only(counted: list):
    """Every LayerRun made inside runs its ops through its methods (not the compiled calls);
    ``counted`` gets one entry per method call, whichever way the run was made."""
    run = layer_exec.LayerRun
    init, forward_op, backward_op = run.__init__, run.forward_op, run.backward_op

    def slow(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fast = False

    def counting(method):
        def call(self, *args, **kwargs):
            counted.append(method.__name__)
            return method(self, *args, **kwargs)
        return call

    run.__init__, run.forward_op, run.backward_op = slow, counting(forward_op), counting(backward_op)
    try:
        yield
    finally:
        run.__init__, run.forward_op, run.backward_op = init, forward_op, backward_op


@contextlib.contextmanager
def _counting(counted: list):
    run = layer_exec.LayerRun
    forward_op, backward_op = run.forward_op, run.backward_op

    def counting(method):
        def call(self, *args, **kwargs):
            counted.append(method.__name__)
            return method(self, *args, **kwargs)
        return call

    run.forward_op, run.backward_op = counting(forward_op), counting(backward_op)
    try:
        yield
    finally:
        run.forward_op, run.backward_op = forward_op, backward_op


def _steps(executor: Executor, prog, steps: int = 2) -> tuple[list, dict, list]:
    """Two steps: their losses, the gradients after the last, and every probe sample."""
    samples: list[int] = []
    probe = executor.recorder.probe
    if probe is not None:
        def sampled() -> int:
            samples.append(probe())
            return samples[-1]
        executor.recorder.probe = sampled
    losses = [executor.step(make_batch(prog, step)) for step in range(steps)]
    return losses, executor.grads(), samples


def _same(a: tuple, b: tuple, probed: bool = True) -> None:
    assert [loss.item() for loss in a[0]] == [loss.item() for loss in b[0]]
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name
    if probed:
        assert a[2] == b[2] and len(a[2]) > 10


def _compare(prog, make_comm) -> None:
    methods: list = []
    with _methods_only(methods):
        by_methods = _steps(Executor(prog, make_comm(), seed=1, stand_in_weights=True), prog)
    called: list = []
    with _counting(called):
        compiled = _steps(Executor(prog, make_comm(), seed=1, stand_in_weights=True), prog)
        unprobed = _steps(Executor(prog, make_comm(), seed=1, stand_in_weights=True,
                                   recorder=Recorder(memory_probe=False)), prog)
    _same(by_methods, compiled)
    _same(by_methods, unprobed, probed=False)
    assert unprobed[2] == []
    # The calls ran the ops: every op of these layers (a Llama's, a MoE's routed ones
    # included) has one, and no method ran.
    assert len(methods) > 100 and called == []


@pytest.mark.parametrize("pipeline,fold,train", [("w_helix", "u", ""), ("w_helix", "u", "recompute = full"),
                                                 ("zb_h1", "none", "recompute = selective"),
                                                 ("one_f_one_b", "none", "")])
def test_the_calls_match_the_methods_on_one_rank(pipeline, fold, train):
    prog = _program(pipeline, fold, train)
    if train:  # a recomputing run's ops go to its methods (its policy keeps something back)
        methods: list = []
        with _methods_only(methods):
            by_methods = _steps(Executor(prog, SingleRankComm(), seed=1), prog)
        _same(by_methods, _steps(Executor(prog, SingleRankComm(), seed=1), prog))
        return
    _compare(prog, SingleRankComm)


@pytest.mark.parametrize("mesh,gpus,pipeline,fold,model", [("tp = 2", 2, "w_helix", "u", ""),
                                                           ("tp = 2  pp = 2", 4, "one_f_one_b", "none", ""),
                                                           ("tp = 2  dp = 2  ep = 2", 4, "w_helix", "u", MOE)])
def test_the_calls_match_the_methods_with_collectives(mesh, gpus, pipeline, fold, model):
    # Rank 0 of a stand-in world: every collective complete at its issue (left a Pending with
    # the probe on, its tensor without), the filler never waiting.
    import torch.distributed as dist

    from dhelix.dsl.frontend.profiles import load_profile
    from dhelix.interpreter.ops.standin import EmulatedComm, join_standin_world

    prog = _program(pipeline, fold, mesh=mesh, gpus=gpus, model=model or "layer = llama")
    join_standin_world(0, prog.mesh.world)
    try:
        _compare(prog, lambda: EmulatedComm(prog.mesh, "cpu", load_profile("a40"), "none"))
    finally:
        dist.destroy_process_group()
