"""The issue order of SI segment pairs (dsl/planner/pair_order.py): every order runs each
pair's ops once, each after its producers; collectives go first, compute that unlocks one
next, waits last; and one executor step records exactly that order (recorded, not timed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")

from dhelix.dsl.passes.pipeline import check_text  # noqa: E402
from dhelix.interpreter.ops.comm import DistComm  # noqa: E402
from dhelix.interpreter.execute.executor import Executor  # noqa: E402
from dhelix.dsl.planner.pair_order import BlockOrder, plan_order  # noqa: E402
from dhelix.interpreter.execute.recording import Recorder  # noqa: E402
from dhelix.interpreter.verify.reference import make_batch  # noqa: E402
from dhelix.dsl.planner.si_plan import check_plan, op_by_op_plan, sequential_plan  # noqa: E402
from dhelix.dsl.simulator.events import planned_pairs  # noqa: E402

from distributed import gloo_results  # noqa: E402

PROPERTY = settings(max_examples=60, derandomize=True, deadline=None)


def program(layer: str = "llama", mesh: str = "tp = 2", extra: str = ""):
    """A tiny model with a layer pair to plan (fold u and w_helix: SI blocks even on one rank)."""
    return check_text(f"""
import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model m {{ layers = 2  hidden = 32  ffn = 64  heads = 4  kv_heads = 2  seq = 8  vocab = 64
  {extra} dtype = fp32  layer = {layer} }}
cluster {{ nodes = 1  gpus_per_node = {2 if "2" in mesh else 1}  profile = "a40" }}
mesh {{ {mesh} }}
train {{ micro_batch = 2  microbatches = 4 }}
fold u
pipeline w_helix
""", "t.dhx")


LLAMA = program()
MOE = program("moe", "dp = 2  ep = 2", "experts = 4  top_k = 2")


def outputs(prog) -> tuple[str, str]:
    """The ops producing a layer's output and its input gradient."""
    return prog.forward.output, prog.backward.output


def orders(prog, plan, barrier=False):
    """Each non-empty pair's issue order as names (``F.ln1``, ``B.rs2.bwd``)."""
    order = BlockOrder.build(plan, prog.forward.ops, prog.backward.ops, barrier, outputs(prog))
    return [[issue.name for issue in issues] for _, issues in order.both]


def assert_legal(prog, plan, barrier):
    """Every pair issues exactly its ops, each after its producers in the same strand."""
    fwd = {op.name: op for op in prog.forward.ops}
    bwd = {op.name: op for op in prog.backward.ops}
    pairs = dict(plan_order(plan, fwd, bwd, barrier))
    done = {"F": {prog.forward.input}, "B": {prog.backward.input}}
    for index, (fnames, bnames) in enumerate(plan):
        issues = pairs.get(index, ())
        assert sorted(i.name for i in issues) == sorted([f"F.{n}" for n in fnames] + [f"B.{n}" for n in bnames])
        for issue in issues:
            dag = fwd if issue.strand == "F" else bwd
            assert all(x in done[issue.strand] or x not in dag for x in issue.op.inputs), issue.name
            done[issue.strand].add(issue.op.name)


@st.composite
def segment_plans(draw, prog):
    """A random legal plan: each DAG's listed order cut into segments, paired in order,
    with some segments alone."""
    def cut(names):
        marks = draw(st.lists(st.booleans(), min_size=len(names), max_size=len(names)))
        segments, current = [], []
        for name, mark in zip(names, marks, strict=True):
            current.append(name)
            if mark:
                segments.append(tuple(current))
                current = []
        return segments + ([tuple(current)] if current else [])

    fwd, bwd = cut([op.name for op in prog.forward.ops]), cut([op.name for op in prog.backward.ops])
    plan = []
    while fwd or bwd:
        side = draw(st.sampled_from(["both", "fwd", "bwd"]))
        f = fwd.pop(0) if fwd and side != "bwd" else ()
        b = bwd.pop(0) if bwd and (side != "fwd" or not f) else ()
        plan.append((f, b))
    return tuple(plan)


@PROPERTY
@given(st.sampled_from([LLAMA, MOE]).flatmap(lambda p: st.tuples(st.just(p), segment_plans(p))), st.booleans())
def test_random_plans_issue_each_op_once_after_its_producers(case, barrier):
    prog, plan = case
    check_plan(plan, prog.forward, prog.backward)
    assert_legal(prog, plan, barrier)


@pytest.mark.parametrize("prog", [LLAMA, MOE], ids=["llama", "moe"])
def test_fixed_and_planned_plans_are_legal(prog):
    for make in (op_by_op_plan, sequential_plan):
        for barrier in (False, True):
            assert_legal(prog, make(prog.forward, prog.backward), barrier)
    assert_legal(LLAMA, planned_pairs(LLAMA), False)


def test_a_ready_collective_is_issued_before_the_other_strands_compute():
    # op_by_op pairs forward op i with backward op i; where the backward op is a
    # collective whose input an earlier pair produced, it goes first.
    pairs = orders(LLAMA, op_by_op_plan(LLAMA.forward, LLAMA.backward))
    assert ["B.ag2.bwd", "F.ln2"] in pairs
    assert ["B.rs1.bwd", "F.act"] in pairs
    assert ["F.ag1", "B.rs2.bwd"] in pairs  # two collectives: alternation order


def test_compute_that_unlocks_a_collective_soonest_runs_first():
    fwd, bwd = LLAMA.forward.ops, LLAMA.backward.ops
    plan = ((("ln1", "ag1"), ()), (tuple(op.name for op in fwd[2:]), tuple(op.name for op in bwd)))
    first = orders(LLAMA, plan)[1][:6]
    # h2.bwd is one op from rs2.bwd, qkv three from rs1: the backward strand starts; rs2.bwd
    # is issued at once; fc2.dgrad would wait for it, so qkv … rs1 run beside it.
    assert first == ["B.h2.bwd", "B.rs2.bwd", "F.qkv", "F.att", "F.prj", "F.rs1"]


def test_a_fresh_collective_gets_filler_before_its_reader_waits():
    bwd = LLAMA.backward.ops
    plan = (((), tuple(op.name for op in bwd)), (tuple(op.name for op in LLAMA.forward.ops), ()))
    order = orders(LLAMA, plan)[0]
    # Each reduce-scatter / all-gather of the backward strand is followed by a wgrad (which
    # leads to no collective) before the op that reads it.
    for comm, reader in (("B.ag2.bwd", "B.ln2.bwd"), ("B.rs1.bwd", "B.prj.dgrad")):
        between = order[order.index(comm) + 1:order.index(reader)]
        assert between and all(name.endswith(".wgrad") for name in between), (comm, order)


def test_without_a_barrier_collectives_stay_in_flight_into_the_next_pair():
    plan = op_by_op_plan(LLAMA.forward, LLAMA.backward)
    # fc1 reads ag2, issued one pair earlier: without a barrier it waits, so the other
    # strand's op goes first; with one, ag2 is complete and the alternation order holds.
    assert ["B.h1.bwd", "F.fc1"] in orders(LLAMA, plan, barrier=False)
    assert ["F.fc1", "B.h1.bwd"] in orders(LLAMA, plan, barrier=True)


@pytest.mark.parametrize("barrier", [False, True])
def test_the_next_forward_layer_s_lead_is_issued_after_this_layer_pair_s_last_forward_op(barrier):
    plan = op_by_op_plan(LLAMA.forward, LLAMA.backward)
    order = BlockOrder.build(plan, LLAMA.forward.ops, LLAMA.backward.ops, barrier, outputs(LLAMA))
    assert [op.name for op in order.lead] == ["ln1", "ag1"]
    plain = [issue.name for _, issues in order.both for issue in issues]
    issues = [issue for _, pair in order.pairs(True, True, lead_next=True) for issue in pair]
    names = [issue.name for issue in issues]
    last_f = max(i for i, issue in enumerate(issues) if issue.strand == "F" and not issue.ahead)
    assert [(i.name, i.ahead) for i in issues[last_f + 1:last_f + 3]] == [("F.ln1", True), ("F.ag1", True)]
    assert [n for i, n in enumerate(names) if not issues[i].ahead] == plain
    # the next layer pair runs without them, everything else once, each after its producers
    led = [issue.name for _, pair in order.pairs(True, True, led=True) for issue in pair]
    assert sorted(led) == sorted(n for n in plain if n not in ("F.ln1", "F.ag1"))
    assert led.index("F.qkv") < led.index("F.prj")
    # a lone backward layer has no lead; the last layer pair issues none
    assert order.pairs(False, True, lead_next=True) == order.backward
    assert order.pairs(True, True) == order.both


@pytest.mark.parametrize("barrier", [False, True])
def test_the_next_backward_layer_s_lead_is_issued_right_after_this_one_s_input_gradient(barrier):
    plan = planned_pairs(LLAMA)
    order = BlockOrder.build(plan, LLAMA.forward.ops, LLAMA.backward.ops, barrier, outputs(LLAMA))
    assert [op.name for op in order.back_lead] == ["h2.bwd", "rs2.bwd"]
    plain = [issue.name for _, issues in order.both for issue in issues]
    issues = [i for _, pair in order.pairs(True, True, lead_next=True, back_lead_next=True) for i in pair]
    names = [issue.name for issue in issues]
    # right after the op that produces this backward layer's input gradient, before the
    # wgrads and forward ops the plan puts after it
    at = names.index(f"B.{LLAMA.backward.output}")
    assert [(i.name, i.ahead) for i in issues[at + 1:at + 3]] == [("B.h2.bwd", True), ("B.rs2.bwd", True)]
    assert at + 3 < len(names) - 2, "something of the layer pair runs beside the lead"
    assert [n for i, n in enumerate(names) if not issues[i].ahead] == plain
    # the next layer pair runs without either lead, everything else once, each after its producers
    led = [i for _, pair in order.pairs(True, True, led=True, back_led=True) for i in pair]
    assert sorted(i.name for i in led) == sorted(n for n in plain if n not in
                                                ("F.ln1", "F.ag1", "B.h2.bwd", "B.rs2.bwd"))
    done = {"F": {"ln1", "ag1", LLAMA.forward.input}, "B": {"h2.bwd", "rs2.bwd", LLAMA.backward.input}}
    dags = {"F": {op.name: op for op in LLAMA.forward.ops}, "B": {op.name: op for op in LLAMA.backward.ops}}
    for issue in led:
        assert all(dep in done[issue.strand] or dep not in dags[issue.strand] for dep in issue.op.deps), issue
        done[issue.strand].add(issue.op.name)
    # the backward strand's first op reads the lead's collective (in flight, or complete
    # under a barrier)
    first_b = next(i for i in led if i.strand == "B")
    assert "rs2.bwd" in first_b.op.deps
    # only where the backward strand has a layer
    assert order.pairs(True, False, back_lead_next=True, back_led=True) == order.forward


def test_a_layer_whose_output_is_a_collective_issues_no_lead():
    # Megatron TP without SP: the layer ends with its all_reduce, so the next layer's lead
    # would wait for it at once (and here the lead would be the whole layer).
    prog = check_text("""
import "stdlib/pipelines.dhx"
layer tail {
  in x [tokens, hidden]
  ln1 = rmsnorm(x)
  f = gemm(ln1, hidden, hidden)
  o = all_reduce(f, tp)
  out o
}
model m { layers = 6  hidden = 32  ffn = 64  heads = 4  seq = 8  vocab = 64  dtype = fp32  layer = tail }
cluster { nodes = 1  gpus_per_node = 2  profile = "a40" }
mesh { tp = 2 }
train { micro_batch = 2  microbatches = 4 }
fold u
pipeline w_helix
""", "t.dhx")
    plan = op_by_op_plan(prog.forward, prog.backward)
    order = BlockOrder.build(plan, prog.forward.ops, prog.backward.ops, False, outputs(prog))
    assert order.lead == ()
    assert order.pairs(True, True, led=True, lead_next=True) == order.both
    # its backward's input gradient comes from ln1's backward, not a collective: the backward
    # lead stays, up to its first collective
    assert order.back_lead[-1].name == "o.bwd" and order.back_lead[-1].kind == "comm"
    assert order.pairs(True, True, back_lead_next=True) != order.both


def _recorded_pairs(rank: int, world: int) -> dict:
    # One step of the tiny Llama at tp = 2 with the op_by_op plan, tracing: the trace
    # records each op of a pair when it is issued, in order, before the pair's own span.
    prog = program()
    recorder = Recorder(trace=True)
    executor = Executor(prog, DistComm(prog.mesh, timeout_s=60), seed=1, plan_for=op_by_op_plan,
                        recorder=recorder)
    executor.step(make_batch(prog, 2))
    pairs, current = [], []
    # Held wgrads may run after a block's last pair (the filler's flush): count every one.
    wgrads = [name for name, lane, _, _ in recorder.events if lane == "compute" and name.endswith(".wgrad")]
    for name, lane, _, _ in recorder.events:
        if name.startswith(("F.", "B.")) and lane == "compute":
            current.append(name)
        elif ".pair" in name:
            pairs.append(current)
            current = []
    blocks = sum(1 for action in prog.lowered.actions[0] if str(action).startswith("SI("))
    return {"pairs": pairs, "blocks": blocks, "layers": len(prog.placement.stages[0].layers), "wgrads": wgrads,
            "planned": [[issue.name for issue in issues] for _, issues in executor.si_order.both]}


def _without_wgrads(pairs):
    # The backward's wgrads run where the thread would wait (si.Filler): when depends on
    # timing; everything else keeps the planned order.
    return [[name for name in issued if not name.endswith(".wgrad")] for issued in pairs]


def test_an_si_step_issues_a_ready_collective_before_the_other_strands_compute(tmp_path):
    ranks = gloo_results(_recorded_pairs, 2, tmp_path)
    got = ranks[0]
    assert _without_wgrads(ranks[1]["pairs"]) == _without_wgrads(got["pairs"]), \
        "the two tp ranks issued in different orders"
    planned = got["planned"]
    assert got["blocks"] and len(got["pairs"]) == got["blocks"] * got["layers"] * len(planned)
    assert _without_wgrads(got["pairs"][:len(planned)]) == _without_wgrads(planned)
    wgrads = [name for issued in planned for name in issued if name.endswith(".wgrad")]
    assert wgrads and sorted(got["wgrads"]) == sorted(wgrads * got["blocks"] * got["layers"])
    # op_by_op pairs ln2 (forward op 7) with ag2.bwd (backward op 7), a reduce-scatter of
    # fc1.dgrad, which the pair before produced: it is issued first.
    paired = [issued for issued in got["pairs"] if "F.ln2" in issued and "B.ag2.bwd" in issued]
    assert len(paired) == got["blocks"] * got["layers"]
    assert all(issued == ["B.ag2.bwd", "F.ln2"] for issued in paired), paired


class _Flying:
    """A stand-in collective in flight: done once ``arrive()`` is called."""

    def __init__(self):
        self.arrived = False

    def is_completed(self):
        return self.arrived


class _Strand:
    """A stand-in LayerRun for the filler: records what runs; a collective leaves a Pending
    whose work ``flying`` controls; a wgrad that runs lets it arrive (time passing)."""

    backward_started = True

    def __init__(self, log, strand, flying):
        self.log, self.strand, self.flying = log, strand, flying
        self.acts, self.bgrads, self.version = {}, {}, 0

    def forward_op(self, op, async_op=False):
        from dhelix.interpreter.ops.comm import Pending

        self.log.append(f"{self.strand}.{op.name}")
        value = Pending(self.flying[op.name], None) if op.kind == "comm" else object()
        if self.strand == "F":
            self.acts[op.name] = value
        else:
            self.bgrads[op.name] = {"out": value}
        if op.name.endswith(".wgrad"):
            for work in self.flying.values():
                work.arrived = True

    backward_op = forward_op


def test_the_filler_runs_held_wgrads_only_while_an_op_would_wait_for_a_collective():
    from dhelix.dsl.planner.pair_order import Issue
    from dhelix.interpreter.execute.si import Filler, run_pair

    ops = {op.name: op for op in LLAMA.backward.ops}
    fops = {op.name: op for op in LLAMA.forward.ops}
    flying = {"rs2.bwd": _Flying(), "ag1": _Flying()}
    log = []
    fwd, bwd = _Strand(log, "F", flying), _Strand(log, "B", flying)
    # layer pair 0 ends with a wgrad the plan puts last; layer pair 1 opens with both strands'
    # first collectives and their readers
    filler = Filler(Recorder())
    run_pair(None, bwd, [Issue("B", ops["qkv.wgrad"])], Recorder(), "l0", False, filler, 0)
    assert log == [] and len(filler.held) == 1
    filler.flush(before_layer=0)
    assert len(filler.held) == 1  # its own layer pair's: kept into the next one
    nxt = _Strand(log, "B", flying)
    issues = [Issue("B", ops["h2.bwd"]), Issue("B", ops["rs2.bwd"]), Issue("F", fops["ln1"]),
              Issue("F", fops["ag1"]), Issue("F", fops["qkv"]), Issue("B", ops["fc2.dgrad"])]
    run_pair(fwd, nxt, issues, Recorder(), "l1", False, filler, 1)
    # qkv would wait for ag1: the held wgrad runs first (and the collectives arrive meanwhile)
    assert log == ["B.h2.bwd", "B.rs2.bwd", "F.ln1", "F.ag1", "B.qkv.wgrad", "F.qkv", "B.fc2.dgrad"]
    assert filler.held == []
    # with nothing in flight a held wgrad stays held until its layer pair is flushed
    log.clear()
    run_pair(None, nxt, [Issue("B", ops["fc2.wgrad"]), Issue("B", ops["act.bwd"])], Recorder(), "l1",
             False, filler, 1)
    assert log == ["B.act.bwd"]
    filler.flush(before_layer=2)
    assert log == ["B.act.bwd", "B.fc2.wgrad"] and filler.held == []
    # an op that reads a held wgrad (a ZeRO-3 gradient scatter) runs it first, with the ones
    # held before it on that run, in their order
    log.clear()
    import attrs

    reader = attrs.evolve(ops["act.bwd"], inputs=("fc1.wgrad",), waits=())
    run_pair(None, nxt, [Issue("B", ops["fc2.wgrad"]), Issue("B", ops["fc1.wgrad"]),
                         Issue("B", ops["prj.wgrad"]), Issue("B", reader)], Recorder(), "l2", False, filler, 2)
    assert log == ["B.fc2.wgrad", "B.fc1.wgrad", "B.act.bwd"]
    assert [h[2].op.name for h in filler.held] == ["prj.wgrad"]


def test_a_block_s_last_held_wgrads_run_in_the_next_block_s_opening_wait():
    from dhelix.dsl.planner.pair_order import Issue
    from dhelix.interpreter.execute.si import Filler, run_pair

    ops = {op.name: op for op in LLAMA.backward.ops}
    fops = {op.name: op for op in LLAMA.forward.ops}
    flying = {"ag1": _Flying()}
    log = []
    filler = Filler(Recorder())
    # the last layer pair (1) of a block holds a wgrad; the block ends: carried, not run
    last = _Strand(log, "B", flying)
    run_pair(None, last, [Issue("B", ops["qkv.wgrad"])], Recorder(), "b0.l1", False, filler, 1)
    filler.carry(lambda: log.append("layer done"))
    assert log == [] and [h[0] for h in filler.held] == [-1]
    # the next block's first layer pair: its forward waits for ag1 (the embedding's reduction
    # stands for it here) — the carried wgrad runs there
    fwd, bwd = _Strand(log, "F", flying), _Strand(log, "B", flying)
    run_pair(fwd, bwd, [Issue("F", fops["ag1"]), Issue("F", fops["qkv"])], Recorder(), "b1.l0", False, filler, 0)
    assert log == ["F.ag1", "B.qkv.wgrad", "F.qkv"] and filler.held == []
    # the layer is reported done at the static point, the flush after that first pair, not
    # when its wgrad happened to run (a moment that differs between ranks)
    filler.flush(before_layer=0)
    assert log[-1] == "layer done"
    # with no wait in the opening it runs at the latest after that first layer pair
    log.clear()
    run_pair(None, last, [Issue("B", ops["fc2.wgrad"])], Recorder(), "b1.l1", False, filler, 1)
    filler.carry(lambda: log.append("layer done"))
    run_pair(fwd, None, [Issue("F", fops["h1"])], Recorder(), "b2.l0", False, filler, 0)
    assert log == ["F.h1"]
    filler.flush(before_layer=0)
    assert log == ["F.h1", "B.fc2.wgrad", "layer done"] and filler.held == []
    filler.flush()
    assert log.count("layer done") == 1


class _Recording:
    """A stand-in LayerRun that records the ops a runner issues (name, asynchronously?)."""

    def __init__(self):
        self.issued, self.version, self.acts, self.bgrads = [], 0, {}, {}

    def forward_op(self, op, async_op=False):
        self.issued.append((op.name, async_op))

    backward_op = forward_op


def test_a_lone_strand_issues_its_collectives_asynchronously_with_its_wgrads_beside_them():
    from dhelix.interpreter.execute.si import LayerChain, run_alone

    for forward, ops in ((False, LLAMA.backward.ops), (True, LLAMA.forward.ops)):
        run = _Recording()
        chain = LayerChain([run], ops, begin=lambda: None, end=lambda value: None, forward=forward)
        chain.start = chain.result = lambda *args: None
        run_alone(chain, Recorder(), "B0")
        names = [name for name, _ in run.issued]
        assert sorted(names) == sorted(op.name for op in ops)
        assert all(is_async == (LLAMA_KINDS[name] == "comm") for name, is_async in run.issued)
        if forward:  # a forward layer is one chain: nothing can run beside its collectives
            assert names == [op.name for op in ops]
            continue
        # ag2.bwd (reduce-scatter of fc1.dgrad) has fc2.wgrad beside it before ln2.bwd reads it;
        # ag1.bwd has the attention wgrads beside it.
        for comm, reader in (("ag2.bwd", "ln2.bwd"), ("rs1.bwd", "prj.dgrad"), ("ag1.bwd", "ln1.bwd")):
            between = names[names.index(comm) + 1:names.index(reader)]
            assert between and all(name.endswith(".wgrad") for name in between), (comm, names)


LLAMA_KINDS = {op.name: op.kind for op in LLAMA.forward.ops + LLAMA.backward.ops}


def test_a_block_s_end_sends_the_model_ends_collectives_off_the_next_block_s_opening(monkeypatch):
    # One rank (every group of size 1: the same calls, nothing on a wire), w_helix over fold u:
    # consecutive SI blocks. Recorded: in which action each model-end call happens.
    from dhelix.interpreter.execute import model_ends
    from dhelix.interpreter.ops.comm import SingleRankComm

    prog = program(mesh="tp = 1")
    log: list = []
    executor = Executor(prog, SingleRankComm(), seed=1, plan_for=op_by_op_plan, pair_barrier=False,
                        on_action=lambda step, index: log.append(("action", index)))

    def spy(cls, name, label):
        method = getattr(cls, name)

        def record(self, *args, **kwargs):
            log.append((label, id(self)))
            return method(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, record)

    spy(model_ends.EmbedRun, "forward", "embed")
    spy(model_ends.EmbedRun, "backward", "embed.bwd")
    spy(model_ends.HeadRun, "forward", "head")
    spy(model_ends.HeadRun, "backward", "head.bwd")
    executor.step(make_batch(prog, 2))
    actions, stages = executor.actions, executor.stages
    where, index = [], None
    for entry in log:
        if entry[0] == "action":
            index = entry[1]
        else:
            where.append((entry[0], index))

    def parts(action):  # (forward, backward) Compute actions of an action, None where absent
        if str(action).startswith("SI("):
            return action.fwd, action.bwd
        return (action, None) if str(action).startswith("F") else (None, action)

    # the head's backward runs right after its forward, in the same action
    heads = [entry for entry in where if entry[0].startswith("head")]
    assert heads and heads[::2] == [("head", at) for _, at in heads[1::2]]
    assert all(label == "head.bwd" for label, _ in heads[1::2])
    # an SI block followed by an action whose forward embeds issues that embedding itself
    # (after its first layer pair): that action does not
    embeds = [at for label, at in where if label == "embed"]
    ahead = [i for i, action in enumerate(actions[:-1]) if str(action).startswith("SI(")
             and parts(actions[i + 1])[0] is not None and stages[parts(actions[i + 1])[0].chunk].first]
    assert ahead and all(i in embeds and i + 1 not in embeds for i in ahead)
    # the gather of an embedding backward is issued in a later action than the one whose
    # backward chain reached the embedding (or at the step's end, after the last action)
    reached = [i for i, action in enumerate(actions) if parts(action)[1] is not None
               and stages[parts(action)[1].chunk].first]
    gathers = [at for label, at in where if label == "embed.bwd"]
    assert len(gathers) == len(reached) == prog.train.microbatches
    assert all(at > i for i, at in zip(reached[:-1], gathers[:-1], strict=True))
    assert gathers[-1] == reached[-1] == len(actions) - 1
