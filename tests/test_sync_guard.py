"""No host-device synchronisation inside an SI block (issue 56).

On a GPU the host must stay ahead of the kernels: a call that copies a value to the host —
``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero`` (its output's size), a boolean-mask index, a
tensor read as a Python number or truth value — makes the thread wait for every kernel queued
before it, and the segment pair's lanes drain. On CPU nothing waits, so the rule is checked by
name: one tiny rank runs alone (``--as-rank``, links emulated by ``none``) with every such call
made to raise while an SI block runs. A MoE layer over ep needs its token counts on the host
(``moe.plan_layout``) and is not covered: the program is a dense Llama.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dhelix.dsl.frontend.imports import read_source
from dhelix.dsl.simulator.runplan import build_run_plan

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny_llama_cpu.dhx"

#: The calls that copy a tensor's value to the host.
SYNCING = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.nonzero, torch.Tensor.nonzero,
           torch.masked_select, torch.Tensor.masked_select, torch.Tensor.__bool__, torch.Tensor.__int__,
           torch.Tensor.__float__, torch.Tensor.__index__}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


class HostSync(RuntimeError):
    """A call inside an SI block that would wait for the device."""


def _bool_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(item, torch.Tensor) and item.dtype == torch.bool for item in items)


class SyncGuard(TorchFunctionMode):
    """Raises :class:`HostSync` at any call of :data:`SYNCING` or boolean-mask index."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCING or (func in _INDEXING and len(args) > 1 and _bool_mask(args[1])):
            raise HostSync(f"{getattr(func, '__qualname__', func)} inside an SI block: a host-device sync")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def guarded(monkeypatch):
    """The executor's SI handler run under :class:`SyncGuard`; yields how many blocks ran."""
    from dhelix.interpreter.execute import executor

    run_si, blocks = executor.HANDLERS["SI"], [0]

    def guarded_si(self, action):
        blocks[0] += 1
        with SyncGuard():
            run_si(self, action)

    monkeypatch.setitem(executor.HANDLERS, "SI", guarded_si)
    torch.set_num_threads(1)
    yield blocks


def _run_rank(steps: int = 1):
    from dhelix.interpreter.launch import spawn
    from dhelix.interpreter.training import train

    compiled = build_run_plan(read_source(str(TINY)), str(TINY))
    options = train.RunOptions(path=str(TINY), compiled=compiled, steps=steps, as_rank=0, emulate="none", seed=1)
    return spawn.run_as_rank(options, train.train)


def test_si_blocks_never_wait_for_the_device(guarded):
    _run_rank()
    assert guarded[0] > 0  # the program's schedule has SI blocks and they ran guarded


def test_the_guard_catches_an_item_in_a_kernel(guarded, monkeypatch):
    # The mutant: a GEMM that reads a value back, as a debugging line left in would.
    from dhelix.interpreter.ops import kernels

    role, gemm = kernels.HANDLERS["gemm"]

    def forward(inputs, weight, ctx):
        inputs[0].sum().item()
        return gemm.forward(inputs, weight, ctx)

    mutant = kernels.Kernel(forward, gemm.dgrad, gemm.wgrad, gemm.wgrad_into)
    monkeypatch.setitem(kernels.HANDLERS, "gemm", (role, mutant))
    with pytest.raises(Exception, match="item inside an SI block") as caught:
        _run_rank()
    assert any(isinstance(exc, HostSync) for exc in _chain(caught.value))


def _chain(exc):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__
