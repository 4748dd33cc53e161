"""The block scheduler (dsl/planner/blockorder.py): every op of an SI block once, after its
producers, the strands drifting apart across layers; its make-span is what an independent
replay of its order on the same model gives; the simulator prices SI blocks with it; and an
executor step issues exactly its order (recorded, not timed), on one rank and on two tp ranks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from dhelix.dsl.core.program import Op
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.planner.blockorder import LAG, BlockScheduler, block_nodes, schedule_block
from dhelix.dsl.simulator.costs import cost_of
from dhelix.dsl.simulator.events import block_orders, block_scheduler, simulate

PROPERTY = settings(max_examples=40, derandomize=True, deadline=None)


def program(layers: int = 4, mesh: str = "tp = 2", pipeline: str = "w_helix", recompute: str = "none",
            fold: str = "u"):
    """A tiny Llama, fold u: two layers per chunk at four layers (SI blocks even on one rank)."""
    return check_text(f"""
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m {{ layers = {layers}  hidden = 32  ffn = 64  heads = 4  kv_heads = 2  seq = 8  vocab = 64
  dtype = fp32  layer = llama }}
cluster {{ nodes = {1 if mesh == "tp = 1" else 2}  gpus_per_node = 1  profile = "a40" }}
mesh {{ {mesh} }}
train {{ micro_batch = 2  microbatches = 4  recompute = {recompute} }}
fold {fold}
pipeline {pipeline}
""", "t.dhx")


LLAMA = program()


def _op(name, kind="compute", deps=(), lane="compute"):
    return Op(name=name, op="gemm" if kind == "compute" else "all_gather", kind=kind,
              op_class="gemm" if kind == "compute" else "all_gather", inputs=tuple(deps), in_shapes=(),
              shape=(1,), lane=lane)


def replay(schedule, fwd, bwd, outputs, seconds):
    """An independent replay of ``schedule.order`` on the module's model (no slowdown): one
    thread issuing in order (a collective reading a collective waits for it there), each
    comm lane running its collectives in issue order; the make-span."""
    ops = {("F", op.name): op for op in fwd} | {("B", op.name): op for op in bwd}
    nodes = block_nodes(fwd, bwd, outputs, schedule.layers)
    done, lanes, thread = {}, {}, 0.0
    for node in schedule.order:
        op = ops[(node[0], node[2])]
        ready = max([0.0] + [done[dep] for dep in nodes[node]])
        if op.kind == "comm":
            thread = max([thread] + [done[d] for d in nodes[node] if ops[(d[0], d[2])].kind == "comm"])
            done[node] = lanes[op.lane] = max(ready, thread, lanes.get(op.lane, 0.0)) + seconds(op)
        else:
            done[node] = thread = max(thread, ready) + seconds(op)
    return max(done.values(), default=0.0)


def _check_order(schedule, nodes):
    assert sorted(schedule.order) == sorted(nodes), "every op of the block once"
    seen = set()
    for node in schedule.order:
        assert all(dep in seen for dep in nodes[node]), f"{node} before a producer"
        seen.add(node)


def test_a_llama_block_order_is_legal_and_its_makespan_replays():
    cost = cost_of(LLAMA)
    fwd, bwd = LLAMA.forward.ops, LLAMA.backward.ops
    outputs = (LLAMA.forward.output, LLAMA.backward.output)
    seconds = lambda op: cost.solo((op,))  # noqa: E731
    for layers in ((1, 1), (2, 2), (3, 1), (0, 2)):
        schedule = schedule_block(fwd, bwd, outputs, layers, seconds)
        _check_order(schedule, block_nodes(fwd, bwd, outputs, layers))
        assert schedule.makespan == pytest.approx(replay(schedule, fwd, bwd, outputs, seconds))
        compute = sum(seconds(op) for op in fwd if op.kind != "comm") * layers[0] \
            + sum(seconds(op) for op in bwd if op.kind != "comm") * layers[1]
        assert schedule.compute == pytest.approx(compute)
        # bounded by the busiest lane and by running everything one after the other
        assert max(schedule.compute, schedule.comm / 2) <= schedule.makespan + 1e-12
        assert schedule.makespan <= schedule.compute + schedule.comm + 1e-12
        assert schedule.makespan >= schedule.compute + schedule.waits - 1e-12


def test_wgrads_wait_at_most_two_layers_and_the_forward_runs_at_most_two_ahead():
    # A compute-bound block (the tiny model on the a40 profile): the wgrads, which nothing
    # waits for, would otherwise go to the block's end with every layer's saved tensors.
    cost = cost_of(LLAMA)
    schedule = schedule_block(LLAMA.forward.ops, LLAMA.backward.ops, (LLAMA.forward.output, LLAMA.backward.output),
                              (6, 6), lambda op: cost.solo((op,)))
    position = {node: i for i, node in enumerate(schedule.order)}
    for layer in range(6):
        last_b = max(i for (s, l, _), i in position.items() if s == "B" and l == layer)
        for strand in ("F", "B"):
            if layer + LAG < 6:
                first = min(i for (s, l, _), i in position.items() if s == strand and l == layer + LAG)
                assert last_b < first, (strand, layer)


def test_the_strands_drift_apart_across_layers():
    # F: a -> ag (1 s on the link) -> b -> (next layer); B: c (3 s). One layer pair at a time
    # would leave the thread waiting for ag; the block order runs B's compute meanwhile and
    # lets F's second layer start before B's first has ended.
    fwd = (_op("a"), _op("ag", "comm", ("a",), "cross"), _op("b", deps=("ag",)))
    bwd = (_op("c"), _op("d", deps=("c",)))
    times = {"a": 0.1, "ag": 1.0, "b": 0.1, "c": 1.5, "d": 1.5}
    schedule = schedule_block(fwd, bwd, ("b", "d"), (2, 2), lambda op: times[op.name])
    order = list(schedule.order)
    assert order.index(("F", 0, "ag")) < order.index(("B", 0, "c")) < order.index(("F", 0, "b"))
    assert order.index(("F", 1, "a")) < order.index(("B", 0, "d")) or \
        order.index(("F", 1, "ag")) < order.index(("B", 1, "c"))
    assert schedule.waits == pytest.approx(0.0)
    assert schedule.makespan == pytest.approx(schedule.compute)


@PROPERTY
@given(st.data())
def test_random_chains_give_legal_orders_that_replay(data):
    def chain(prefix):
        count = data.draw(st.integers(1, 6))
        ops = []
        for i in range(count):
            comm = data.draw(st.booleans())
            deps = data.draw(st.lists(st.sampled_from([op.name for op in ops]), max_size=2, unique=True)) if ops else []
            ops.append(_op(f"{prefix}{i}", "comm" if comm else "compute", deps,
                           data.draw(st.sampled_from(["local", "cross"])) if comm else "compute"))
        return tuple(ops)

    fwd, bwd = chain("f"), chain("b")
    outputs = (fwd[-1].name, bwd[-1].name)
    times = {op.name: data.draw(st.floats(0.01, 2.0)) for op in fwd + bwd}
    layers = (data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3)))
    seconds = lambda op: times[op.name]  # noqa: E731
    schedule = schedule_block(fwd, bwd, outputs, layers, seconds)
    _check_order(schedule, block_nodes(fwd, bwd, outputs, layers))
    assert schedule.makespan == pytest.approx(replay(schedule, fwd, bwd, outputs, seconds))
    assert schedule_block(fwd, bwd, outputs, layers, seconds) == schedule  # deterministic


def test_an_executor_refuses_orders_made_for_another_program():
    pytest.importorskip("torch")
    from dhelix.interpreter.ops.comm import SingleRankComm
    from dhelix.interpreter.execute.executor import Executor

    prog = program(mesh="tp = 1")
    orders = block_orders(prog)
    with pytest.raises(ValueError, match="no block order for 2 forward and 2 backward layers"):
        Executor(prog, SingleRankComm(), block_orders={(1, 1): orders[(2, 2)]})
    with pytest.raises(ValueError, match="does not run each of their ops once"):
        Executor(prog, SingleRankComm(), block_orders={(2, 2): orders[(2, 2)][:-1]})


def test_the_scheduler_caches_by_layer_counts_and_orders_cover_every_stage():
    scheduler = block_scheduler(LLAMA)
    assert isinstance(scheduler, BlockScheduler) and scheduler(2, 2) is scheduler(2, 2)
    orders = block_orders(LLAMA)
    assert set(orders) == {(2, 2)} and orders[(2, 2)] == scheduler(2, 2).order


def test_the_simulator_prices_si_blocks_with_the_block_scheduler():
    planned, scheduled, off = (simulate(LLAMA), simulate(LLAMA, scheduled=True), simulate(LLAMA, si=False))
    assert scheduled.step_time != planned.step_time
    assert scheduled.step_time < off.step_time
    # off, or without SI blocks, the option changes nothing
    assert simulate(LLAMA, si=False, scheduled=True).step_time == off.step_time
    one_f_one_b = program(pipeline="one_f_one_b", fold="none")
    assert simulate(one_f_one_b, scheduled=True).step_time == simulate(one_f_one_b).step_time


def test_a_split_backward_is_scheduled_without_its_wgrads():
    prog = program(pipeline="dualpipe_v")
    order = block_scheduler(prog)(2, 2).order
    assert prog.lowered.split and order and not any(name.endswith(".wgrad") for _, _, name in order)


# -- the interpreter follows the order ---------------------------------------------------------

def _recorded(rank: int, world: int) -> dict:
    from dhelix.interpreter.ops.comm import DistComm, SingleRankComm
    from dhelix.interpreter.execute.executor import Executor
    from dhelix.interpreter.verify.harness import broadcast_from_first
    from dhelix.interpreter.execute.recording import Recorder
    from dhelix.interpreter.verify.reference import make_batch

    prog = program(mesh="tp = 2" if world == 2 else "tp = 1")
    comm = DistComm(prog.mesh, timeout_s=60) if world == 2 else SingleRankComm()
    recorder = Recorder(trace=True)
    orders = broadcast_from_first(block_orders(prog)) if world == 2 else block_orders(prog)
    executor = Executor(prog, comm, seed=1, recorder=recorder, block_orders=orders)
    executor.step(make_batch(prog, 2))
    blocks, current = [], None
    for name, lane, _, _ in recorder.events:  # an op is recorded when it runs, its block's span after
        if lane != "compute":
            continue
        if name.startswith(("F.", "B.")):
            current = current if current is not None else []
            current.append(name)
        elif name.endswith(".block"):
            blocks.append(current or [])
            current = None
        elif not name.startswith("SI("):
            current = None  # ops of an action outside SI blocks
    expected = [f"{strand}.{name}" for strand, _, name in orders[(2, 2)]]
    si = sum(1 for action in prog.lowered.actions[0] if str(action).startswith("SI("))
    return {"blocks": blocks, "expected": expected, "si": si}


def test_one_rank_issues_the_block_order():
    pytest.importorskip("torch")
    got = _recorded(0, 1)
    assert got["si"] and len(got["blocks"]) == got["si"]
    assert all(block == got["expected"] for block in got["blocks"])


def test_two_tp_ranks_issue_the_same_block_order(tmp_path):
    pytest.importorskip("torch")
    from distributed import gloo_results

    ranks = gloo_results(_recorded, 2, tmp_path)
    for got in ranks:
        assert got["si"] and len(got["blocks"]) == got["si"]
        assert all(block == got["expected"] for block in got["blocks"])
    # and the strands interleave inside each layer (not a forward layer, then a backward one)
    order = block_orders(program())[(2, 2)]
    for layer in range(2):
        strands = [s for s, at, _ in order if at == layer]
        assert sum(a != b for a, b in zip(strands, strands[1:])) > 4, strands


def test_simulate_cli_prices_si_blocks_with_the_block_scheduler(capsys):
    import json

    from conftest import ROOT
    from dhelix.cli import main

    example = str(ROOT / "examples" / "tiny_llama_cpu.dhx")
    steps = {}
    for plan in ("planned", "scheduled"):
        assert main(["simulate", example, "--json", "--si-plan", plan]) == 0
        steps[plan] = json.loads(capsys.readouterr().out)["step_s"]
    assert steps["scheduled"] != steps["planned"]
    assert main(["simulate", example, "--compare", "--json", "--si-plan", "scheduled"]) == 0
    written, off, _ = json.loads(capsys.readouterr().out)
    assert written["step_s"] == steps["scheduled"] and off["step_s"] != written["step_s"]
    assert main(["simulate", example, "--si-plan", "scheduled"]) == 0
    assert "SI blocks priced whole by the block scheduler" in capsys.readouterr().out
