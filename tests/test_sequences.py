"""Legal operator sequences: the given order with moving ops free, checked against permutations."""

from __future__ import annotations


import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dhelix.dsl.core import syntax as s
from dhelix.dsl.passes.pipeline import check_text
from dhelix.dsl.core.program import LayerDag, Op, Strands
from dhelix.dsl.planner.sequences import (available, canonical, count_orders, is_legal, legal_orders, members,
                                  moving_ops, prefixes, strand_of, strand_within)

PROPERTY = settings(max_examples=120, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# Random ops: (op, kind, op_class, lane, axis). Comm ops carry an axis; ring steps are cp comm.
_KINDS = [
    ("gemm", "compute", "gemm", "compute", None),
    ("rmsnorm", "compute", "norm", "compute", None),
    ("attention", "compute", "attention", "compute", "cp"),
    ("all_gather", "comm", "all_gather", "local", "tp"),
    ("reduce_scatter", "comm", "reduce_scatter", "local", "tp"),
    ("attention", "comm", "ring_attention", "cross", "cp"),
    ("all_to_all", "comm", "all_to_all", "local", "ep"),
    ("all_to_all", "comm", "all_to_all", "cross", "ep"),
    # What the partition pass makes: the two halves of a group-partitioned collective and
    # the slices / concats of a chunk chain (so the exactness properties cover them too).
    ("all_gather", "comm", "all_gather", "local", "tp.intra"),
    ("reduce_scatter", "comm", "reduce_scatter", "cross", "tp.inter"),
    ("slice", "compute", "layout", "compute", None),
]


@st.composite
def dags(draw, direction: str = "forward", prefix: str = "f", max_ops: int = 6, max_moving: int = 6):
    """Random layer DAGs in a topological order: each op reads up to two earlier ops (or the
    layer input), has a random kind, lane and axis, and may be movable."""
    n = draw(st.integers(1, max_ops))
    ops: list[Op] = []
    moving = 0
    for i in range(n):
        earlier = [op.name for op in ops]
        inputs = draw(st.lists(st.sampled_from(earlier), max_size=2, unique=True)) if earlier else []
        name, kind, op_class, lane, axis = draw(st.sampled_from(_KINDS))
        movable = moving < max_moving and draw(st.integers(0, 2)) == 0
        moving += movable
        ops.append(Op(f"{prefix}{i}", name, kind, op_class, tuple(inputs) or ("x",), ((1, 1),), (1, 1),
                      axis=axis, lane=lane, movable=movable))
    return LayerDag("t", direction, "x", (1, 1), ops[-1].name, tuple(ops))


def legal_by_permutation(dag: LayerDag, moving: frozenset[str], window: int | None = None) -> list[tuple[str, ...]]:
    """Every permutation of the ops that keeps inputs first, the fixed ops in their given
    order and (with a window) each moving op within ``window`` fixed ops of its home."""
    names = [op.name for op in dag.ops]
    fixed = [n for n in names if n not in moving]
    home = {n: sum(1 for m in names[:i] if m not in moving) for i, n in enumerate(names)}
    inputs = {op.name: [i for i in op.inputs if i in home] for op in dag.ops}
    out = []

    def extend(perm: list[str], fixed_placed: int) -> None:
        # The permutations in lexicographic order of positions, a prefix dropped as soon as it
        # breaks a rule (the first two are broken for good by a prefix): the same set as
        # filtering itertools.permutations, without walking the 10! of a 10-op layer.
        if len(perm) == len(names):
            position = {n: i for i, n in enumerate(perm)}
            if window is None or all(abs(sum(1 for m in perm[:position[n]] if m not in moving) - home[n]) <= window
                                     for n in moving):
                out.append(tuple(perm))
            return
        for name in names:
            if name in perm or (name not in moving and name != fixed[fixed_placed]):
                continue
            if any(i not in perm for i in inputs[name]):
                continue
            extend(perm + [name], fixed_placed + (name not in moving))

    extend([], 0)
    return sorted(out, key=lambda perm: [names.index(n) for n in perm])


def _movable_names(dag: LayerDag, draw_mask: list[bool]) -> frozenset[str]:
    return frozenset(op.name for op, pick in zip(dag.ops, draw_mask, strict=True) if op.movable and pick)


@PROPERTY
@given(dags(), st.lists(st.booleans(), min_size=6, max_size=6), st.sampled_from([None, 0, 1, 2]))
def test_legal_orders_are_exactly_the_legal_permutations(dag, picks, window):
    moving = _movable_names(dag, picks[:len(dag.ops)])
    strand = strand_of(dag, moving, window)
    expected = legal_by_permutation(dag, moving, window)
    found = legal_orders(strand)
    assert list(found.orders) == expected  # same orders, lexicographic in given indices
    assert found.total == count_orders(strand) == len(expected)
    assert not found.truncated
    assert found.orders[0] == tuple(op.name for op in dag.ops)  # the given order is always legal
    assert all(is_legal(strand, order) for order in expected)


@PROPERTY
@given(dags(), st.lists(st.booleans(), min_size=6, max_size=6))
def test_every_prefix_difference_in_canonical_order_is_a_legal_piece(dag, picks):
    moving = _movable_names(dag, picks[:len(dag.ops)])
    strand = strand_of(dag, moving)
    table = prefixes(strand)
    assert table[0] == 0 and table[-1] == strand.full
    for low in table:
        for high in table:
            if low & high != low or low == high:
                continue
            order = canonical(strand, high ^ low)
            assert sorted(order) == list(members(high ^ low))
            done = low
            for i in order:  # each op is available when its turn comes
                assert i in available(strand, done)
                done |= 1 << i
            # a moving op runs before a fixed op of the segment only when that op reads it
            for a, b in zip(order, order[1:]):
                if strand.moving[a] and not strand.moving[b]:
                    assert strand.needs[b] >> a & 1


def test_cap_truncates_deterministically_and_keeps_the_exact_total(llama):
    fwd, bwd, strands = llama
    strand = strand_of(bwd, moving_ops(strands, fwd, bwd))
    first = legal_orders(strand, cap=7)
    assert first.truncated and len(first.orders) == 7 and first.total == 5824
    assert first == legal_orders(strand, cap=7)
    assert first.orders[0] == tuple(op.name for op in bwd.ops)
    assert legal_orders(strand, cap=100).orders[:7] == first.orders


LLAMA = """
import "stdlib/layers.dhx"
model m {{
  layers = 4  hidden = 1024  ffn = 4096  heads = 16  kv_heads = 8  seq = 4096  vocab = 32000
  experts = 8  top_k = 2  dtype = bf16  layer = {layer}
}}
cluster {{ nodes = 1  gpus_per_node = 8 }}
mesh {{ {mesh} }}
train {{ micro_batch = 1  microbatches = 8 }}
pipeline p
pipeline p {{ repeat m {{ F }} repeat m {{ B }} }}
strands {{ {strands} }}
"""


def checked(layer: str = "llama", mesh: str = "tp = 8", strands: str = "movable wgrad"):
    """(forward, backward, strands) of a small program with the given layer, mesh and block."""
    program = check_text(LLAMA.format(layer=layer, mesh=mesh, strands=strands), "t.dhx")
    return program.forward, program.backward, program.strands


@pytest.fixture
def llama():
    return checked()


def test_llama_wgrads_give_5824_backward_orders_and_one_forward_order(llama):
    fwd, bwd, strands = llama
    moving = moving_ops(strands, fwd, bwd)
    assert moving == {"fc2.wgrad", "fc1.wgrad", "prj.wgrad", "qkv.wgrad"}
    assert count_orders(strand_of(fwd, moving)) == 1
    assert count_orders(strand_of(bwd, moving)) == 5824
    assert len(prefixes(strand_of(bwd, moving))) == 106
    assert count_orders(strand_of(bwd, frozenset())) == 1  # without `movable` nothing moves


def test_a_wgrad_may_run_last_but_never_before_its_input(llama):
    fwd, bwd, strands = llama
    strand = strand_of(bwd, moving_ops(strands, fwd, bwd))
    names = [op.name for op in bwd.ops]
    last = [n for n in names if n != "qkv.wgrad"] + ["qkv.wgrad"]
    assert is_legal(strand, last)
    early = list(names)
    early.remove("fc2.wgrad")
    early.insert(early.index("rs2.bwd"), "fc2.wgrad")  # before the all-gather it reads
    assert not is_legal(strand, early)
    assert not is_legal(strand, names[:-1])  # every op exactly once


def test_only_ops_that_may_move_are_moved():
    fwd, bwd, strands = checked(strands="movable gemm")  # names dgrads too: they stay put
    assert moving_ops(strands, fwd, bwd) == {"fc2.wgrad", "fc1.wgrad", "prj.wgrad", "qkv.wgrad"}
    fwd, bwd, strands = checked("moe", "dp = 8  ep = 8", "movable router")
    assert moving_ops(strands, fwd, bwd) == {"rt", "rt.wgrad"}
    assert count_orders(strand_of(fwd, moving_ops(strands, fwd, bwd))) == 1  # pm reads rt at once


def test_window_narrows_until_the_prefixes_fit(llama):
    fwd, bwd, strands = llama
    moving = moving_ops(strands, fwd, bwd)
    assert strand_within(bwd, moving, 1000).window is None
    narrow = strand_within(bwd, moving, 40)
    assert narrow.window is not None and len(prefixes(narrow)) <= 40
    assert len(prefixes(attrs.evolve(narrow, window=narrow.window + 1))) > 40
    assert strand_within(bwd, moving, 1).window == 0  # nothing fits: moving ops stay home


def test_strands_default_moves_wgrads():
    assert Strands().movable == (s.Selector(("wgrad",)),)
