"""The SI plans of a search's layer pairs, each computed once per distinct pair: the plan of
a layer pair depends on the two layer DAGs, the strands block and the profile only."""

from __future__ import annotations

import attrs

from dhelix.dsl.core.plan import Plan
from dhelix.dsl.core.program import LayerDag, Program
from dhelix.dsl.planner.pairing import plan_layers
from dhelix.dsl.planner.paircost import PairCost
from dhelix.dsl.simulator.costs import si_backward


class PlanCache:
    """SI plans by what determines them: the forward DAG, the backward DAG an SI block runs,
    the strands block and the pricing (one PairCost per search). Interns DAGs too: equal
    DAGs of different variants become one object, so the PairCost's caches (by op identity)
    serve every variant."""

    def __init__(self, cost: PairCost):
        self.cost = cost
        self._plans: dict[tuple, Plan] = {}
        self._dags: dict[LayerDag, LayerDag] = {}

    def intern(self, program: Program) -> Program:
        """``program`` with its layer DAGs replaced by equal ones seen before."""
        if program.forward is None or program.backward is None:
            return program
        forward = self._dags.setdefault(program.forward, program.forward)
        backward = self._dags.setdefault(program.backward, program.backward)
        return attrs.evolve(program, forward=forward, backward=backward)

    def plan(self, program: Program) -> Plan:
        """The plan :func:`~dhelix.dsl.simulator.events.schedule_plan` would compute."""
        key = self._key(program)
        if key not in self._plans:
            assert program.forward is not None, "a checked model"
            self._plans[key] = plan_layers(program.forward, key[1], program.strands, self.cost)
        return self._plans[key]

    @staticmethod
    def _key(program: Program) -> tuple:
        return program.forward, si_backward(program), program.strands

    def has(self, program: Program) -> bool:
        """Whether the plan of ``program``'s layer pair is computed already."""
        return self._key(program) in self._plans

    def since(self, count: int) -> list[tuple[tuple, Plan]]:
        """(key, plan) of the plans computed or merged after the first ``count`` (to hand to
        another process: :mod:`~dhelix.dsl.search.workers`)."""
        return list(self._plans.items())[count:]

    def merge(self, plans: list[tuple[tuple, Plan]]) -> None:
        """Take ``plans`` (:meth:`since` of another process's cache) as computed here."""
        for key, plan in plans:
            self._plans.setdefault(key, plan)

    def __len__(self) -> int:
        return len(self._plans)
