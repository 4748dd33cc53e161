"""P(seg_f, seg_b): the pair cost the planner's DP minimises over."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dhelix.dsl.planner.costmodel import op_time
from dhelix.dsl.planner.paircost import PairCost
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.frontend.profiles import LaunchGap, Measured, MeasuredPair, load_profile

SEQ = 8192


def program(mesh: str, nodes: int, seq: int = SEQ):
    return check_text(f"""
import "stdlib/layers.dhx"
pipeline seq1 {{ repeat m {{ F }} repeat m {{ B }} }}
model demo {{
  layers = 4  hidden = 8192  ffn = 28672  heads = 64  kv_heads = 8
  seq = {seq}  vocab = 32000  dtype = bf16  layer = llama
}}
cluster {{ nodes = {nodes}  gpus_per_node = 8  profile = "h100" }}
mesh {{ {mesh} }}
train {{ micro_batch = 1  microbatches = 8 }}
fold none
pipeline seq1
""", "demo.dhx")


TP8 = program("tp = 8", 1)
CP2 = program("tp = 8  cp = 2", 2, seq=16384)  # ring attention over cp: steps on the cross lane
H100 = load_profile("h100")


def ops(prog, *names):
    table = {op.name: op for dag in (prog.forward, prog.backward) for op in dag.ops}
    return [table[name] for name in names]


def cost(profile=H100, prog=TP8):
    return PairCost(profile, "bf16", seq=prog.model.get("seq"))


def test_for_program_takes_the_profile_dtype_and_seq():
    pc = PairCost.for_program(TP8)
    assert (pc.profile.name, pc.dtype, pc.seq) == ("h100", "bf16", SEQ)


def test_solo_of_a_chain_is_the_sum_of_its_ops():
    chain = TP8.forward.ops  # the forward layer is a chain: nothing overlaps inside it
    total = sum(op_time(op, H100, "bf16", seq=SEQ) for op in chain)
    assert cost().solo(chain) == pytest.approx(total)
    assert cost().pair(chain, []) == cost().solo(chain) and cost().pair([], []) == 0


def test_dual_colour_wgrad_overlaps_the_reduce_scatter_within_a_strand():
    dgrad, wgrad, rs = ops(TP8, "fc1.dgrad", "fc1.wgrad", "ag2.bwd")
    t_d, t_w, t_rs = (op_time(op, H100, "bf16") for op in (dgrad, wgrad, rs))
    # fc1.wgrad and the reduce_scatter both wait for fc1.dgrad only, then run together with σ.
    expected = t_d + t_w + t_rs - (1 - H100.slowdown) * min(t_w, t_rs)
    assert cost().solo([dgrad, wgrad, rs]) == pytest.approx(expected)


def test_compute_with_compute_is_the_sum_plus_the_launch_gap():
    fwd, bwd = ops(TP8, "qkv", "att"), ops(TP8, "fc2.dgrad", "act.bwd")
    pc = cost()
    assert pc.pair(fwd, bwd) == pytest.approx(pc.solo(fwd) + pc.solo(bwd) + 20e-6)  # fixed gap, no comm
    no_gap = cost(attrs.evolve(H100, launch_gap=LaunchGap(0, 0)))
    assert no_gap.pair(fwd, bwd) == pytest.approx(no_gap.solo(fwd) + no_gap.solo(bwd))


@pytest.mark.parametrize("fwd_name, bwd_name, oef", [
    ("ag1", "act.bwd", 0.8),  # no override for all_gather@local x swiglu_bwd: the comp_intra class
    ("qkv", "ag2.bwd", 0.73),  # heatmap override: gemm_attn_c x intra_rs
    ("fc2", "rs1.bwd", 0.65),  # heatmap: gemm_mlp_l x intra_ag
])
def test_single_op_pair_is_the_papers_oef_formula(fwd_name, bwd_name, oef):
    (f,), (b,) = ops(TP8, fwd_name), ops(TP8, bwd_name)
    t_f, t_b = op_time(f, H100, "bf16", seq=SEQ), op_time(b, H100, "bf16", seq=SEQ)
    pc = cost()
    expected = t_f + t_b - oef * min(t_f, t_b) + pc.gap([f], [b])
    assert pc.pair([f], [b]) == pytest.approx(expected)
    t_comm = t_f if f.kind == "comm" else t_b
    assert pc.gap([f], [b]) == pytest.approx(max(20e-6, 0.1 * t_comm))


def test_comm_with_the_same_comm_lane_does_not_overlap():
    (f,), (b,) = ops(TP8, "ag1"), ops(TP8, "ag2.bwd")
    pc = cost()
    assert pc.pair([f], [b]) == pytest.approx(pc.solo([f]) + pc.solo([b]) + pc.gap([f], [b]))


def test_local_with_cross_comm_overlaps_by_intra_inter():
    (f,), (b,) = ops(CP2, "ag1"), ops(CP2, "att.bwd.step0")
    pc = cost(prog=CP2)
    assert pc.pair([f], [b]) < pc.solo([f]) + pc.solo([b])


def test_measured_pairs_and_solos_win_over_the_model():
    fwd, bwd = ops(TP8, "ln1", "ag1"), ops(TP8, "h2.bwd")
    measured = Measured("bf16", pairs=(MeasuredPair(("ln1", "ag1"), ("h2.bwd",), 612.0),
                                       MeasuredPair((), ("h2.bwd",), 95.0)))
    pc = cost(attrs.evolve(H100, measured=measured))
    assert pc.pair(fwd, bwd) == pytest.approx(612e-6)
    assert pc.solo(bwd) == pytest.approx(95e-6)
    assert pc.pair(fwd, bwd[:0]) == cost().solo(fwd)
    other = PairCost(attrs.evolve(H100, measured=measured), "fp16", seq=SEQ)  # another dtype: modelled
    assert other.pair(fwd, bwd) != pytest.approx(612e-6)


def test_schedule_keeps_lanes_exclusive_and_dependencies():
    fwd = ops(TP8, "ln1", "ag1", "qkv", "att")
    bwd = ops(TP8, "fc1.dgrad", "fc1.wgrad", "ag2.bwd")
    pc = cost()
    span, slots = pc.schedule(fwd, bwd)
    assert span == pc.pair(fwd, bwd)  # the launch gap included
    assert {s.op for s in slots} == {op.name for op in fwd + bwd}
    for lane in ("compute", "local"):
        on_lane = sorted((s.start, s.end) for s in slots if s.lane == lane)
        assert all(a[1] <= b[0] + 1e-15 for a, b in zip(on_lane, on_lane[1:]))
    end = {s.op: s.end for s in slots}
    start = {s.op: s.start for s in slots}
    for op in fwd + bwd:
        assert all(start[op.name] >= end[i] - 1e-15 for i in op.inputs if i in end)
    assert start["ag1"] < end["fc1.dgrad"]  # the forward's gather hides under the backward GEMM


def test_results_are_cached_and_deterministic():
    fwd, bwd = TP8.forward.ops[:5], TP8.backward.ops[3:9]
    first = cost().pair(fwd, bwd)
    pc = cost()
    assert pc.pair(fwd, bwd) == first == pc.pair(fwd, bwd)


def test_segment_out_of_order_is_a_programming_error():
    with pytest.raises(ValueError, match="not topological"):
        cost().solo(ops(TP8, "qkv", "ag1"))


# ------------------------------------------------------------------ properties

OEF = st.floats(0.0, 1.0)


@st.composite
def profiles(draw):
    """Random profiles with OEFs in [0, 1] (the clamp keeps overrides there too)."""
    classes = {name: draw(OEF) for name in H100.oef_classes}
    gap = LaunchGap(draw(st.floats(0, 100)), draw(st.floats(0, 0.3)))
    pairs = draw(st.booleans())
    slowdown = draw(st.floats(0, 1))
    return (tuple(classes.items()), pairs, slowdown, gap)


def build(drawn):
    classes, pairs, slowdown, gap = drawn
    return attrs.evolve(H100, oef_classes=dict(classes), oef_pairs=H100.oef_pairs if pairs else {},
                        slowdown=slowdown, launch_gap=gap)


PROGRAMS = {"tp8": TP8, "tp8_cp2": CP2}


@st.composite
def segment_pairs(draw):
    """(program name, forward op names, backward op names): contiguous segments of the DAGs."""
    name = draw(st.sampled_from(sorted(PROGRAMS)))
    fwd, bwd = PROGRAMS[name].forward.ops, PROGRAMS[name].backward.ops
    i = draw(st.integers(0, len(fwd) - 1))
    j = draw(st.integers(i + 1, min(len(fwd), i + 6)))
    k = draw(st.integers(0, len(bwd) - 1))
    m = draw(st.integers(k + 1, min(len(bwd), k + 6)))
    return name, tuple(op.name for op in fwd[i:j]), tuple(op.name for op in bwd[k:m])


def resolve(case):
    name, fwd, bwd = case
    return PROGRAMS[name], ops(PROGRAMS[name], *fwd), ops(PROGRAMS[name], *bwd)


@settings(max_examples=150, deadline=None)
@given(segment_pairs(), profiles())
def test_pair_is_bounded_by_its_solos(case, drawn):
    prog, fwd, bwd = resolve(case)
    pc = cost(build(drawn), prog)
    solo_f, solo_b, pair = pc.solo(fwd), pc.solo(bwd), pc.pair(fwd, bwd)
    eps = 1e-9 * (solo_f + solo_b)
    assert pair <= solo_f + solo_b + pc.gap(fwd, bwd) + eps
    assert pair >= max(solo_f, solo_b) - eps


@settings(max_examples=100, deadline=None)
@given(segment_pairs(), profiles())
def test_swapping_the_strands_changes_nothing_without_overrides(case, drawn):
    prog, fwd, bwd = resolve(case)
    profile = attrs.evolve(build(drawn), oef_pairs={})  # class OEFs are symmetric
    pc = cost(profile, prog)
    assert pc.pair(fwd, bwd) == pytest.approx(pc.pair(bwd, fwd), rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(segment_pairs())
def test_perfect_overlap_costs_the_busiest_lane_at_least(case):
    prog, fwd, bwd = resolve(case)
    ideal = attrs.evolve(H100, oef_classes={k: 1.0 for k in H100.oef_classes}, oef_pairs={}, slowdown=0.0,
                         launch_gap=LaunchGap(0, 0))
    pc = cost(ideal, prog)
    busiest = max(sum(t.seconds for op in fwd + bwd for t in pc_tasks(pc, op) if t.lane == lane)
                  for lane in ("compute", "local", "cross"))
    assert pc.pair(fwd, bwd) >= busiest * (1 - 1e-9)


def pc_tasks(pc, op):
    from dhelix.dsl.planner.costmodel import op_tasks

    return op_tasks(op, pc.profile, pc.dtype, seq=pc.seq)


@settings(max_examples=150, deadline=None)
@given(segment_pairs(), profiles())
def test_segment_bounds_never_exceed_the_times_they_bound(case, drawn):
    prog, fwd, bwd = resolve(case)
    pc = cost(build(drawn), prog)
    bf, bb = pc.segment_bound(fwd), pc.segment_bound(bwd)
    eps = 1e-9 * (pc.solo(fwd) + pc.solo(bwd))
    assert pc.solo(fwd) >= bf.solo() - eps and pc.solo(bwd) >= bb.solo() - eps
    assert pc.pair(fwd, bwd) >= bf.pair(bb) - eps
    assert bf.lanes == pc.lane_work(fwd) and bf.comm + bb.comm == pytest.approx(
        sum(bf.lanes[1:]) + sum(bb.lanes[1:]))


@settings(max_examples=150, deadline=None)
@given(segment_pairs(), profiles(), st.data())
def test_segment_bounds_never_grow_when_ops_leave_or_oef_classes_join(case, drawn, data):
    """What the exact search's rest bound (dsl.planner.restbound) rests on: dropping ops from
    either segment, while keeping the dropped ops' OEF classes, never raises a bound."""
    prog, fwd, bwd = resolve(case)
    pc = cost(build(drawn), prog)
    keep_f = [op for op in fwd if data.draw(st.booleans())]
    keep_b = [op for op in bwd if data.draw(st.booleans())] or bwd[:1]
    bf, bb = pc.segment_bound(fwd), pc.segment_bound(bwd)
    sf = attrs.evolve(pc.segment_bound(keep_f), kinds=bf.kinds)
    sb = attrs.evolve(pc.segment_bound(keep_b), kinds=bb.kinds)
    eps = 1e-12 * (bf.solo() + bb.solo())
    assert sb.solo() <= bb.solo() + eps
    if keep_f:
        assert sf.solo() <= bf.solo() + eps and sf.pair(sb) <= bf.pair(bb) + eps


def test_a_measured_profile_offers_no_bounds():
    measured = Measured("bf16", pairs=(MeasuredPair(("ln1",), ("h2.bwd",), 1.0),))
    assert cost(attrs.evolve(H100, measured=measured)).segment_bound(ops(TP8, "ln1")) is None
    assert cost().segment_bound(ops(TP8, "ln1")) is not None


# ------------------------------------------------------------------ results shared by shape

_GROUP = """
  pm{k} = permute(ln, rt, top_k)
  dsp{k} = all_to_all(pm{k}, ep)
  fc1{k} = grouped_gemm(dsp{k}, hidden, 2 * ffn, experts / ep)
  act{k} = swiglu(fc1{k})
  fc2{k} = grouped_gemm(act{k}, ffn, hidden, experts / ep)
  cmb{k} = all_to_all(fc2{k}, ep)
  up{k} = unpermute(cmb{k}, rt, top_k)"""
MOE = check_text("""
pipeline seq1 { repeat m { F } repeat m { B } }
layer moe2 {
  in x [tokens, hidden]
  ln = rmsnorm(x)
  rt = router(ln, experts)""" + "".join(_GROUP.format(k=k) for k in range(2)) + """
  m1 = add(up0, up1)
  h = add(m1, x)
  out h
}
model demo { layers = 2  hidden = 4096  ffn = 2048  heads = 32  kv_heads = 8  seq = 4096  vocab = 32000
  experts = 8  top_k = 2  dtype = bf16  layer = moe2 }
cluster { nodes = 2  gpus_per_node = 8  profile = "h100" }
mesh { ep = 4  dp = 16 }
train { micro_batch = 1  microbatches = 8 }
fold none
pipeline seq1
""", "moe2.dhx")


def _other_group(names: tuple[str, ...]) -> tuple[str, ...]:
    """The same ops of the other expert group (``fc10.dgrad`` <-> ``fc11.dgrad``)."""
    out = []
    for name in names:
        base, dot, rest = name.partition(".")
        if base != "m1" and base[-1] in "01":
            base = base[:-1] + "10"[int(base[-1])]
        out.append(base + dot + rest)
    return tuple(out)


def test_the_expert_groups_have_one_shape():
    pc = PairCost.for_program(MOE)
    group = [op for op in MOE.backward.ops if op.name.endswith(("0.bwd", "0.dgrad", "0.wgrad")) and op.name[0] != "m"]
    other = [op for op in MOE.backward.ops if op.name.endswith(("1.bwd", "1.dgrad", "1.wgrad")) and op.name[0] != "m"]
    assert len(group) == len(other) > 5 and pc.shape(group) == pc.shape(other)
    # (that the key holds all a pair's price depends on, its name order included, is the
    # property test below: a shared price equals a fresh simulation)


@st.composite
def moe_segment_pairs(draw):
    fwd, bwd = MOE.forward.ops, MOE.backward.ops
    i = draw(st.integers(0, len(fwd) - 1))
    j = draw(st.integers(i + 1, min(len(fwd), i + 7)))
    k = draw(st.integers(0, len(bwd) - 1))
    m = draw(st.integers(k + 1, min(len(bwd), k + 7)))
    return tuple(op.name for op in fwd[i:j]), tuple(op.name for op in bwd[k:m])


@settings(max_examples=120, deadline=None)
@given(moe_segment_pairs(), profiles())
def test_a_result_shared_by_shape_is_the_one_simulated_alone(case, drawn):
    """A PairCost that has priced the other expert group's pair (same shape or not) returns
    exactly what a fresh one simulates for this pair, solo and paired."""
    fwd, bwd = case
    profile = build(drawn)
    shared = PairCost(profile, "bf16", seq=4096)
    swapped_f, swapped_b = _other_group(fwd), _other_group(bwd)
    known = {op.name for dag in (MOE.forward, MOE.backward) for op in dag.ops}
    if set(swapped_f) <= known and set(swapped_b) <= known:
        shared.pair(ops(MOE, *swapped_f), ops(MOE, *swapped_b))
        shared.solo(ops(MOE, *swapped_f))
    f, b = ops(MOE, *fwd), ops(MOE, *bwd)
    assert shared.pair(f, b) == PairCost(profile, "bf16", seq=4096).pair(f, b)
    assert shared.solo(f) == PairCost(profile, "bf16", seq=4096).solo(f)
