"""The dispatch table from an ``Op.op`` — a library op or a derived kind such as
``gemm_dgrad`` or ``rmsnorm_bwd`` — to its role and kernel (:func:`handler`), over the kernel
modules: :mod:`.kernels` (the model's operators), :mod:`.layout_kernels`, :mod:`.routing`
and :mod:`.collective_kernels`.
"""

from __future__ import annotations

from dhelix.dsl.core.oplib import BWD, DGRAD, WGRAD, backward_parts, derived_kind

from .collective_kernels import COLLECTIVES
from .kernels import OPERATOR_KERNELS, Kernel
from .layout_kernels import LAYOUT_KERNELS
from .routing import ROUTING_KERNELS

#: Every compute operator's kernel by op kind.
KERNELS: dict[str, Kernel] = {**OPERATOR_KERNELS, **LAYOUT_KERNELS, **ROUTING_KERNELS}

#: The op kinds whose kernels read or write their run's MoE routing (``KernelCtx.routing``):
#: the others' contexts hold nothing of a run and are shared by every run of a layer.
ROUTED = frozenset({"permute", "unpermute", "grouped_gemm", "all_to_all"})

#: Roles an ``Op.op`` resolves to (:func:`handler`); a derived backward kind's role is its
#: part as the op library names it (DGRAD, WGRAD or BWD).
FORWARD, COMM = "forward", "comm"
#: ZeRO-3's weight all-gather and gradient reduce-scatter (:mod:`.fsdp`; run by LayerRun).
GATHER_W, SCATTER_DW = "gather_w", "scatter_dw"
ROLES = (FORWARD, DGRAD, WGRAD, BWD, COMM, GATHER_W, SCATTER_DW)


def _handlers() -> dict[str, tuple[str, object]]:
    # The backward kinds are those autodiff derives (the op library says which ops split).
    table: dict[str, tuple[str, object]] = {}
    for name, kernel in KERNELS.items():
        table[name] = (FORWARD, kernel)
        for part in backward_parts(name):
            table[derived_kind(name, part)] = (part, kernel)
    table.update({name: (COMM, fn) for name, fn in COLLECTIVES.items()})
    table.update({"param_gather": (GATHER_W, None), "grad_scatter": (SCATTER_DW, None)})
    return table


HANDLERS = _handlers()


def handler(op_kind: str) -> tuple[str, object]:
    """The role (one of :data:`ROLES`) and the Kernel (or collective function) of
    ``op_kind``, an ``Op.op``. Raises KeyError naming the known kinds."""
    try:
        return HANDLERS[op_kind]
    except KeyError:
        raise KeyError(f"no kernel for op '{op_kind}'; known: {', '.join(sorted(HANDLERS))}") from None
