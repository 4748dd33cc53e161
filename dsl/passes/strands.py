"""The strands pass: the selectors of the strands block, resolved against the layer's DAGs.

The checker builds the block's :class:`Strands` (its communication kinds and on/off values
need no DAG); this pass checks that every selector it holds names operators of the
layer's forward or backward DAG. A selector names operators of the layer's forward or derived backward DAG:

* an op name (``qkv``) or a backward op's full name (``qkv.wgrad``, ``ag1.bwd``);
* an operator or class of the op library (``gemm``, ``attention``, ``all_gather``, ``norm``);
* a derived class: ``dgrad``, ``wgrad``, ``bwd`` (every backward op), ``compute``, ``comm``;
* ``X.fwd`` / ``X.bwd`` / ``X.dgrad`` / ``X.wgrad``: the forward ops matching X, or the
  backward ops derived from them (``attention.bwd``).
"""

from __future__ import annotations

from dhelix.dsl.core import syntax as s
from dhelix.dsl.core.errors import CheckError, ErrorCollector
from dhelix.dsl.core.oplib import BWD, DGRAD, OPS, WGRAD, part_of
from dhelix.dsl.core.program import LayerDag, Op, Strands
from dhelix.dsl.core.wording import did_you_mean

_PHASES = ("fwd", "bwd", "dgrad", "wgrad")


def select(selector: s.Selector, forward: LayerDag, backward: LayerDag) -> list[Op]:
    """The ops of either DAG that ``selector`` names (forward first, in DAG order)."""
    text = str(selector)
    every = list(forward.ops) + list(backward.ops)
    exact = [op for op in every if op.name == text]
    if exact:
        return exact
    *head, last = selector.parts
    if head and last in _PHASES:
        base = {op.name for op in forward.ops if _matches(op, ".".join(head))}
        if last == "fwd":
            return [op for op in forward.ops if op.name in base]
        return [op for op in backward.ops if op.forward in base and _phase(op, last)]
    return [op for op in every if _matches(op, text)]


def _matches(op: Op, word: str) -> bool:
    if word in ("compute", "comm"):
        return op.kind == word
    if word == BWD:
        return op.forward is not None
    if word in (DGRAD, WGRAD):
        return part_of(op.op) == word
    return word in (op.name, op.op, op.op_class) or (op.forward is None and op.name.split(".")[0] == word)


def _phase(op: Op, phase: str) -> bool:
    return phase == BWD or part_of(op.op) == phase


def known_words(forward: LayerDag, backward: LayerDag) -> set[str]:
    """Every word a selector may start with, for "did you mean" notes."""
    words = {op.name for op in forward.ops + backward.ops} | set(OPS)
    words |= {spec.op_class for spec in OPS.values()} | {"dgrad", "wgrad", "bwd", "compute", "comm"}
    return words


def check_selectors(strands: Strands, forward: LayerDag, backward: LayerDag) -> None:
    """Raise a CheckError (or an ErrorGroup) for every selector of a written strands block
    that matches no operator of ``forward`` or ``backward``, saying why. The defaults of a
    program without a strands block are not checked: a layer without GEMMs has no wgrad to
    move, and that is no mistake of the user's."""
    if strands.span is None:
        return
    errors = ErrorCollector()
    for selector in strands.movable + tuple(sel for pair in strands.forbid for sel in pair):
        _check_selector(selector, forward, backward, errors)
    errors.raise_if_any()


_SELECTOR_NOTE = ("a selector names an op (qkv, qkv.wgrad), an operator or class (gemm, norm), "
                  "dgrad/wgrad/bwd/compute/comm, or X.fwd / X.bwd")


def _check_selector(selector: s.Selector, forward, backward, errors: ErrorCollector) -> None:
    if not select(selector, forward, backward):
        errors.add(CheckError(f"'{selector}' matches no operator of layer {forward.name}", selector.span,
                              _selector_hints(selector, forward, backward) + [_SELECTOR_NOTE]))


def _selector_hints(selector: s.Selector, forward: LayerDag, backward: LayerDag) -> list[str]:
    """Why a selector matched nothing: a misspelt word, or a phase its ops do not have."""
    words = known_words(forward, backward)
    head, *rest = selector.parts
    if head in words and rest and rest[-1] in _PHASES:
        base = {op.name for op in forward.ops if _matches(op, head)}
        derived = [op.name for op in backward.ops if op.forward in base]
        if not base:
            return [f"layer {forward.name} has no '{head}' op"]
        return [f"the backward ops of '{head}' are {', '.join(derived)}" if derived
                else f"no backward op derives from '{head}'"]
    if head in words and not rest:
        return [f"layer {forward.name} has no op of kind '{head}'"]
    close = did_you_mean(str(selector), words) or did_you_mean(head, words)
    return close
