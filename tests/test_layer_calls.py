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


@contextlib.contextmanager
def _whole(ran: list):
    """Every segment pair and lone layer compiled inside (interpreter/execute/pair_calls.py)
    appends to ``ran`` what each of its runs did: "pair" or "alone" (compiled whole), "loop"
    (the loop over its issues ran it instead)."""
    from dhelix.interpreter.execute import pair_calls, si

    def counted(compile_whole, kind):
        def compile_counted(issues, calls):
            code = compile_whole(issues, calls)
            if code is None:
                return None

            def run(*args):
                done = code(*args)
                ran.append(kind if done else "loop")
                return done
            return run
        return compile_counted

    made = si.compile_pair, si.compile_alone
    si.compile_pair, si.compile_alone = counted(pair_calls.compile_pair, "pair"), counted(pair_calls.compile_alone, "alone")
    try:
        yield
    finally:
        si.compile_pair, si.compile_alone = made


def _compare(prog, make_comm, whole: bool = False) -> None:
    methods: list = []
    with _methods_only(methods):
        by_methods = _steps(Executor(prog, make_comm(), seed=1, stand_in_weights=True), prog)
    called: list = []
    ran: list = []
    with _counting(called), _whole(ran):
        compiled = _steps(Executor(prog, make_comm(), seed=1, stand_in_weights=True), prog)
        unprobed = _steps(Executor(prog, make_comm(), seed=1, stand_in_weights=True,
                                   recorder=Recorder(memory_probe=False)), prog)
    _same(by_methods, compiled)
    _same(by_methods, unprobed, probed=False)
    assert unprobed[2] == []
    # The calls ran the ops: every op of these layers (a Llama's, a MoE's routed ones
    # included) has one, and no method ran.
    assert len(methods) > 100 and called == []
    # Segment pairs and lone layers ran compiled whole where nothing can block (every
    # collective complete at its issue); a lone layer's ops always.
    assert ran.count("alone") >= 8 and "loop" not in ran
    assert not whole or ran.count("pair") > 10


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
        _compare(prog, lambda: EmulatedComm(prog.mesh, "cpu", load_profile("a40"), "none"),
                 whole=pipeline == "w_helix")
    finally:
        dist.destroy_process_group()


def test_an_error_inside_compiled_code_reads_as_the_methods_and_shows_its_line(monkeypatch):
    # A dgrad kernel that gives no gradient: the same ExecutionError (rank, action, cause) by the
    # runs' methods and by the generated code, whose traceback shows the generated line.
    import traceback

    from dhelix.interpreter.ops import handlers
    from dhelix.interpreter.ops.kernels import OPERATOR_KERNELS, Kernel

    swiglu = OPERATOR_KERNELS["swiglu"]
    broken = Kernel(swiglu.forward, lambda grad, saved, weight: (None,), swiglu.wgrad)
    for kind, (role, kernel) in list(handlers.HANDLERS.items()):
        if kernel is swiglu and role != handlers.FORWARD:
            monkeypatch.setitem(handlers.HANDLERS, kind, (role, broken))
    prog = _program("w_helix", "u")
    with _methods_only([]), pytest.raises(Exception) as by_methods:
        Executor(prog, SingleRankComm(), seed=1).step(make_batch(prog, 0))
    with pytest.raises(Exception) as compiled:
        Executor(prog, SingleRankComm(), seed=1).step(make_batch(prog, 0))
    message = str(compiled.value)
    assert message == str(by_methods.value)
    assert "rank 0 (pipeline rank 0) failed in" in message
    assert "the kernel gave no gradient for fc1, which autodiff says it produces" in message
    shown = "".join(traceback.format_exception(compiled.value.__cause__))
    assert '<dhelix layer calls' in shown and "raise ValueError('the kernel gave no gradient for fc1" in shown
    source = Executor(prog, SingleRankComm(), seed=1).calls.source
    assert "def F_qkv(run):" in source and "def alone(run):" in source and "    # F.qkv\n" in source
