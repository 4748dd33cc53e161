"""Centauri's operation-level scheduling (ASPLOS'24 §3.2.1, Algorithm 1): the chunk count of
every ``chunk … by auto`` statement of a partition block, chosen with the cost model.

The partition pass leaves an auto chain whole until it is given a count
(``Program.chunk_counts``). Here each auto statement, in block order, tries every candidate
count — 1 and each count up to :data:`MAX_CHUNKS` the pass accepts (the chain's dimension
must divide) — with the counts chosen before it kept, and prices the layer's forward and
backward DAGs alone (:meth:`~.paircost.PairCost.solo`, in the order the interpreter issues
one strand: :func:`issue_order`): a chunk's collective overlaps the compute of the chunk before it, and every chunk pays its collective's latency and launch
gap, so the best count trades the two. The smallest total wins, ties to the fewer chunks.
Centauri's Algorithm 1 searches one collective's partitions the same way with its own cost
model; pricing the whole layer also counts what a chain does to the ops around it. A
candidate the passes refuse (a count that does not divide, a measured profile taken on
another program) is skipped with the reason, shown by ``dhelix plan``.

The choice needs the profile's costs, so it is made here, at the planner stage, and the
commands that price or run a program (plan, simulate, run) apply it through
:func:`priced_program`; ``dhelix check`` shows auto chains whole.
"""

from __future__ import annotations

import attrs

from dhelix.dsl.core.errors import DhelixError
from dhelix.dsl.core.program import Program
from dhelix.dsl.passes import pipeline as passes
from dhelix.dsl.passes.overrides import checked_program
from dhelix.dsl.passes.partition import chunk_statements, is_auto
from dhelix.dsl.planner.paircost import PairCost

#: The largest chunk count ``by auto`` tries (Centauri's MAX_CHUNKS).
MAX_CHUNKS = 8


@attrs.frozen
class Candidate:
    """One chunk count tried: the layer's forward + backward time alone with it (seconds),
    or None and why the passes refused it."""

    count: int
    seconds: float | None
    why: str = ""


@attrs.frozen
class ChunkChoice:
    """The count chosen for one ``by auto`` statement and every candidate tried."""

    ops: tuple[str, ...]
    chosen: int
    candidates: tuple[Candidate, ...]

    def describe(self) -> str:
        """``chunk ag2 + fc1 by auto: 4 (1: 12.3 ms, 2: 10.1 ms, 4: 9.8 ms, 8: 10.4 ms)``."""
        tried = ", ".join(f"{c.count}: {c.seconds * 1e3:.3f} ms" if c.seconds is not None
                          else f"{c.count}: refused ({c.why})" for c in self.candidates)
        return f"chunk {' + '.join(self.ops)} by auto: {self.chosen} ({tried}; forward + backward of a layer alone)"


def priced_program(text: str, path: str, profile: str | None = None,
                   gpus_per_node: int | None = None) -> tuple[Program, tuple[ChunkChoice, ...]]:
    """:func:`~dhelix.dsl.passes.overrides.checked_program` with the counts of its ``by auto``
    chunk statements chosen (:func:`choose_chunks`), and the choices."""
    return choose_chunks(checked_program(text, path, profile, gpus_per_node))


def choose_chunks(program: Program) -> tuple[Program, tuple[ChunkChoice, ...]]:
    """``program`` (checked, any stage from check on) with every ``by auto`` count chosen by
    the cost model, its later passes run again; unchanged with () when it has none."""
    statements = chunk_statements(program.partition)
    autos = [index for index, st in enumerate(statements) if is_auto(st)]
    if not autos or program.forward is None or program.profile is None:
        return program, ()
    counts = dict(program.chunk_counts)
    choices = []
    for index in autos:
        candidates = []
        for count in range(1, MAX_CHUNKS + 1):
            seconds, why = _price(program, {**counts, index: count})
            if count == 1 or seconds is not None or not why.startswith("the chain's"):
                candidates.append(Candidate(count, seconds, why))
        priced = [c for c in candidates if c.seconds is not None]
        best = min(priced, key=lambda c: (c.seconds, c.count)) if priced else Candidate(1, None)
        counts[index] = best.count
        choices.append(ChunkChoice(statements[index].ops, best.count,
                                   tuple(c for c in candidates if c.seconds is not None or c.count > 1)))
    chosen = attrs.evolve(program, chunk_counts=tuple(sorted(counts.items())))
    return passes.rerun(chosen, after="check"), tuple(choices)


def _price(program: Program, counts: dict[int, int]) -> tuple[float | None, str]:
    """(forward + backward seconds of the layer alone, "") with these counts, or (None, why)."""
    try:
        tried = passes.rerun(attrs.evolve(program, chunk_counts=tuple(sorted(counts.items()))),
                             after="check", stop="autodiff")
    except DhelixError as exc:
        message = exc.errors[0].message if hasattr(exc, "errors") else exc.message
        return None, _why(message)
    cost = PairCost(tried.profile, tried.model.dtype, seq=tried.model.get("seq"))
    return cost.solo(issue_order(tried.forward.ops)) + cost.solo(issue_order(tried.backward.ops)), ""


def issue_order(ops):
    """``ops`` (a DAG in a topological order) in the order the interpreter issues one strand:
    a collective as soon as its inputs exist, else the first ready compute op. Chunks come
    chunk-major from the partition pass; this lets chunk i + 1's collective go before chunk
    i's compute, as it runs."""
    names = {op.name for op in ops}
    done: set[str] = set()
    left, order = list(ops), []
    while left:
        ready = [op for op in left if all(name in done or name not in names for name in op.deps)]
        op = next((o for o in ready if o.kind == "comm"), ready[0])
        left.remove(op)
        done.add(op.name)
        order.append(op)
    return order


def _why(message: str) -> str:
    # A count the chain's dimension does not divide is expected for most candidates: keyed
    # so that those are left out of the report, anything else is shown.
    return "the chain's dimension does not divide" if "divid" in message else message
