"""Centauri's partition space for `dhelix tune`: the partition block a layout's layer admits.

Centauri (§3.1) builds a partition tree per collective — primitive substitution, group
partition, workload partition — prunes it, and leaves the rest to its three-tier scheduler.
:func:`generated_partition` writes that tree as statements of the language for one layer DAG
(the forward before the partition pass), and the planner's own choices stand in for the
scheduler: ``by auto`` chunk counts (1 to 8 and ``stages``, settled by the whole step among
the layer's best three), ``substitute … as auto`` and the backward priority (wgrad or dgrad
first), each priced as `plan` and `simulate` price them. The search then sets the layout's
partition to this block or to the file's own (none when it has none), and keeps the faster
whole step.

Pruned as the paper prunes (and what keeps the search's bounds valid):

* substitutions: only the scalable one (an ``all_reduce`` as ``reduce_scatter +
  all_gather``, Table 2); the rooted forms put a collective's traffic on one root and lose
  alone, so Centauri drops them, and an all_gather or reduce_scatter is kept whole;
* workload chains: one per collective, the longest the language accepts, from an
  ``all_gather`` along its sole readers to the reduce_scatter that ends the block, or from
  a GEMM into the reduce_scatter (or all_reduce) it feeds; along tokens, the default;
* group partitions: every collective whose groups span nodes, in the order that carries the
  fewest bytes across nodes (:func:`~dhelix.dsl.passes.partition.fewest_cross_bytes`,
  written as ``first``, so the layout's layer DAGs — and its bounds — are those it runs);
  over a cluster's declared levels every collective whose groups span two levels or more, its
  default order's first level written as ``first``
  (:func:`~dhelix.dsl.passes.group_levels.default_order`);
  under ZeRO-3, ``group weights`` when the data-parallel groups span nodes.

Chains are searched with SI on and off. Settling a candidate's chunk counts simulates its
whole step for several counts (and under SI plans several SI layer pairs: one
Llama-70B-shaped SI pair with three chains plans in 2-3 s,
benchmarks/results/cpu_planner_speed.txt, ``--chunked``), so the search first bounds every
such candidate by its step with every chain whole and every layer pass at a lower bound of
it in any pieces (:func:`~dhelix.dsl.search.bound.pass_bound`: its lanes' work and OEFs,
and its longest path with the chains run in pieces), and settles its counts only when that
bound can still enter the top, best bound first
(:meth:`~dhelix.dsl.search.pricer.Pricer.price`, ``defer``).

Chunks, substitutions and the priority never lessen a lane's work (chunk GEMMs read their
weight once per chunk, collectives pay their latency per chunk, a substituted all_reduce
moves the same bytes), so the layout's bounds, computed with every chain whole, stay lower
bounds of whatever the planner then chooses (tests/test_tune.py holds them to every priced
step).
"""

from __future__ import annotations

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import ErrorCollector
from dhelix.dsl.core.program import AUTO, LayerDag, Op, Program
from dhelix.dsl.passes.group_levels import default_order, stages_of
from dhelix.dsl.passes.fsdp import shard_axis
from dhelix.dsl.passes.partition import WEIGHTS, fewest_cross_bytes, unsplittable
from dhelix.dsl.passes.workload import checked_chain

#: Why a layout's generated partition is refused when its layer has nothing to partition:
#: the layout is then the same as its twin with the file's partition (the search counts it so).
NOTHING_TO_PARTITION = "partition auto: nothing to partition (no collective over a mesh axis larger than 1)"

#: The collectives a chain may end at (the block's reduction).
_ENDS = ("reduce_scatter", "all_reduce")


def generated_partition(program: Program) -> s.PartitionDef | None:
    """The partition block of the layer of ``program`` (checked up to shapes: its forward
    before any partition), or None when no statement applies (no collective over an axis of
    size above 1)."""
    fwd, mesh = program.forward, program.mesh
    assert fwd is not None and mesh is not None and program.train is not None, "a checked model"
    substituted = [op.name for op in fwd.ops if op.op == "all_reduce" and op.group_size > 1]
    body: list[s.XStmt] = [s.Substitute(name, (AUTO,)) for name in substituted]
    claimed: dict = {}
    for op in fwd.ops:
        if op.kind == "comm" and op.group_size > 1 and op.name not in claimed and op.name not in substituted:
            chain = _chain(fwd, op, dict(program.env), claimed, substituted)
            if chain is not None:
                body.append(chain)
    grouped = [op for op in fwd.ops if op.kind == "comm" and op.group_size > 1 and op.axis
               and op.name not in substituted and op.op in ("all_gather", "reduce_scatter", "all_reduce")]
    for op in grouped:
        if mesh.levels:  # over declared levels: the default order's first level
            stages = stages_of(op.name, str(op.axis), mesh, None)
            if isinstance(stages, tuple):
                body.append(s.Group((op.name,), default_order(op.op, stages)[0]))
        elif unsplittable(op.name, str(op.axis), mesh, None) is None:
            body.append(s.Group((op.name,), fewest_cross_bytes(op.op)))
    if program.train.zero == 3 and unsplittable(WEIGHTS, shard_axis(program), mesh, None) is None:
        body.append(s.Group((WEIGHTS,), None))
    return s.PartitionDef(tuple(body)) if body else None


def _chain(fwd: LayerDag, op: Op, env, claimed: dict, substituted: list[str]) -> s.Chunk | None:
    """The longest ``chunk … by auto`` chain around collective ``op`` the partition pass
    accepts: from an all_gather along sole readers up to the collective that ends the
    block; into a reduction, from the GEMM that feeds it. None when none is accepted."""
    if op.op == "all_gather":
        names = [op.name]
        current = op
        while True:
            readers = [o for o in fwd.ops if current.name in o.inputs]
            if len(readers) != 1 or readers[0].name in substituted or current.name == fwd.output:
                break
            current = readers[0]
            names.append(current.name)
            if current.kind == "comm":
                if current.op not in _ENDS:
                    names.pop()
                break
    elif op.op in _ENDS and len(op.inputs) == 1 and op.inputs[0] in {o.name for o in fwd.ops}:
        names = [op.inputs[0], op.name]
    else:
        return None
    while len(names) >= 2:
        statement = s.Chunk(tuple(names), s.Name(AUTO))
        trial = dict(claimed)
        if checked_chain(fwd, statement, env, trial, ErrorCollector(), parts=1) is not None:
            claimed.update(trial)
            return statement
        names.pop()
    return None


def writes_si(pipeline: s.PipelineDef) -> bool:
    """Whether ``pipeline`` writes an SI block (anywhere, repeats included)."""
    def any_si(body) -> bool:
        return any(isinstance(st, s.SIBlock) or (isinstance(st, s.Repeat) and any_si(st.body)) for st in body)
    return any_si(pipeline.body)
