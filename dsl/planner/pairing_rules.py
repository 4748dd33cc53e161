"""The pairing rules of the SI planner: which segments of the two strands may run side by
side (:mod:`dsl.planner.pairing` searches within them).

Constraints (a restricted pair may still run each segment alone, one after the other):

* ``overlap K…``: communication over an axis not listed cannot be hidden — a segment holding
  such a comm op never pairs with a non-empty segment of the other strand. So the paper's
  Fig. 15 ablation reads ``overlap tp`` → ``overlap tp, cp`` → ``comm_with_comm on`` →
  ``movable wgrad``: ring steps run alone until cp is listed.
* ``comm_with_comm off``: a segment holding comm never pairs with a segment holding comm;
  ``on`` leaves it to the cost model (a local and a cross-node transfer overlap, two transfers
  on one lane do not).
* ``forbid A with B``: no op matching A in one segment beside an op matching B in the other,
  whichever strand each is in.
* Always: never two comm ops over the same axis — TP collective with TP collective, ring
  step with ring step (the reference code's rules), and likewise EP all-to-all with EP
  all-to-all: both strands would share one communicator, which serialises them.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from dhelix.dsl.core.mesh import base_axis
from dhelix.dsl.core.program import OVERLAP_KINDS, LayerDag, Op, Strands
from dhelix.dsl.planner.sequences import selector_names


@attrs.frozen
class PairingRules:
    """The strands block's pairing constraints, with selectors resolved to op names."""

    overlap: frozenset[str] = frozenset(OVERLAP_KINDS)
    comm_with_comm: bool = True
    forbid: tuple[tuple[frozenset[str], frozenset[str]], ...] = ()
    forbid_text: tuple[str, ...] = ()


def rules_of(strands: Strands, forward: LayerDag, backward: LayerDag) -> PairingRules:
    """The PairingRules of a checked strands block for the two DAGs."""
    forbid = tuple((selector_names(a, forward, backward), selector_names(b, forward, backward))
                   for a, b in strands.forbid)
    text = tuple(f"{a} with {b}" for a, b in strands.forbid)
    return PairingRules(frozenset(strands.overlap), strands.comm_with_comm, forbid, text)


def restriction(fwd_ops: Sequence[Op], bwd_ops: Sequence[Op], rules: PairingRules) -> str | None:
    """Why the two segments may not be co-executed, or None when they may (always when
    either is empty)."""
    if not fwd_ops or not bwd_ops:
        return None
    for op in [*fwd_ops, *bwd_ops]:
        if op.kind == "comm" and base_axis(str(op.axis)) not in rules.overlap:
            return f"{op.name} communicates over {op.axis}, which `overlap` does not list"
    fwd_comm = {op.axis: op.name for op in fwd_ops if op.kind == "comm"}
    for op in bwd_ops:
        if op.kind == "comm" and op.axis in fwd_comm:
            return f"{fwd_comm[op.axis]} and {op.name} both communicate over {op.axis}"
    if not rules.comm_with_comm and fwd_comm and any(op.kind == "comm" for op in bwd_ops):
        return "comm_with_comm is off and both segments communicate"
    fwd_names, bwd_names = {op.name for op in fwd_ops}, {op.name for op in bwd_ops}
    for (a, b), text in zip(rules.forbid, rules.forbid_text, strict=True):
        if (fwd_names & a and bwd_names & b) or (fwd_names & b and bwd_names & a):
            return f"forbid {text}"
    return None


@attrs.frozen
class Traits:
    """A segment's constraint-relevant facts as bits, so a pair check is a few ANDs."""

    pinned: bool  # holds comm that `overlap` does not list
    comm: bool
    axes: int  # one bit per communication axis
    first: int  # bit r: matches the first selector of forbid rule r
    second: int  # bit r: matches the second selector

    def allows(self, other: Traits, comm_with_comm: bool) -> bool:
        """Whether this segment may be co-executed with ``other`` (of the other strand)."""
        return not (self.pinned or other.pinned or self.axes & other.axes
                    or (not comm_with_comm and self.comm and other.comm)
                    or self.first & other.second or self.second & other.first)


def traits_of(ops: Sequence[Op], rules: PairingRules, axis_bits: dict[str, int]) -> Traits:
    comm = [op for op in ops if op.kind == "comm"]
    names = {op.name for op in ops}
    axes = 0
    for op in comm:
        axes |= axis_bits.setdefault(str(op.axis), 1 << len(axis_bits))
    first = sum(1 << r for r, (a, _) in enumerate(rules.forbid) if names & a)
    second = sum(1 << r for r, (_, b) in enumerate(rules.forbid) if names & b)
    return Traits(any(base_axis(str(op.axis)) not in rules.overlap for op in comm), bool(comm), axes, first, second)
