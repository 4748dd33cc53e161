"""No host-device synchronisation inside an SI block (issue 56).

On a GPU the host must stay ahead of the kernels: a call that copies a value to the host —
``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero`` (its output's size), a boolean-mask index, a
tensor read as a Python number or truth value — makes the thread wait for every kernel queued
before it, and the segment pair's lanes drain. On CPU nothing waits, so the rule is checked by
name: one tiny rank runs alone (``--as-rank``, links emulated by ``none``) with every such call
made to raise while an SI block runs: a dense Llama, and a MoE program over ep, whose layers
read their rows per expert back once per forward, in :func:`~dhelix.interpreter.ops.moe.to_host`
(the all_to_all's splits and the grouped GEMM's rows are host shapes: see :mod:`.moe`) —
the one call the guard lets through, counted: once per MoE layer forward, never in a backward.
"""

from __future__ import annotations

import sys
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
    """Raises :class:`HostSync` at any call of :data:`SYNCING` or boolean-mask index, but
    for one made by :func:`~dhelix.interpreter.ops.moe.to_host` (a MoE layer's declared read
    of its counts), which it counts in :attr:`reads`."""

    def __init__(self, reads: list):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCING or (func in _INDEXING and len(args) > 1 and _bool_mask(args[1])):
            if not _from_to_host():
                raise HostSync(f"{getattr(func, '__qualname__', func)} inside an SI block: a host-device sync")
            self.reads.append(func)
        return func(*args, **(kwargs or {}))


def _from_to_host(depth: int = 6) -> bool:
    # Whether the call was made by moe.to_host itself (within a few frames of the guard).
    from dhelix.interpreter.ops import moe

    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code is moe.to_host.__code__:
            return True
        frame = frame.f_back
    return False


class _Blocks(list):
    """How many SI blocks ran (``[n]``), and in :attr:`reads` the reads
    :func:`~dhelix.interpreter.ops.moe.to_host` made inside them."""


@pytest.fixture
def guarded(monkeypatch):
    """The executor's SI handler run under :class:`SyncGuard`; yields how many blocks ran
    (and the reads let through)."""
    from dhelix.interpreter.execute import executor

    run_si, blocks = executor.HANDLERS["SI"], _Blocks([0])
    reads = blocks.reads = []

    def guarded_si(self, action):
        blocks[0] += 1
        with SyncGuard(reads):
            run_si(self, action)

    monkeypatch.setitem(executor.HANDLERS, "SI", guarded_si)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield blocks
    torch.set_num_threads(threads)


def _run_rank(steps: int = 1, path: Path = TINY):
    from dhelix.interpreter.launch import join
    from dhelix.interpreter.training import train

    compiled = build_run_plan(read_source(str(path)), str(path))
    options = train.RunOptions(path=str(path), compiled=compiled, steps=steps, as_rank=0, emulate="none", seed=1)
    return join.run_as_rank(options, train.train)


#: A MoE program small enough for a test, with SI blocks on rank 0 and ep = 2 (the dispatch
#: exchanges its counts).
MOE = """import "stdlib/layers.dhx"
import "stdlib/pipelines.dhx"
model moe_tiny {
  layers = 4  hidden = 64  ffn = 128  heads = 4  kv_heads = 4  seq = 16  vocab = 256
  dtype = fp32  layer = moe  experts = 4  top_k = 2
}
cluster { nodes = 1  gpus_per_node = 8  profile = "a40" }
mesh { tp = 2  pp = 2  dp = 2  ep = 2 }
train { micro_batch = 1  microbatches = 4  seed = 3 }
fold u
pipeline w_helix
strands { overlap tp  comm_with_comm on  movable wgrad }
"""


def test_si_blocks_never_wait_for_the_device(guarded):
    _run_rank()
    assert guarded[0] > 0  # the program's schedule has SI blocks and they ran guarded
    assert guarded.reads == []  # a dense Llama reads nothing back


def _count_calls(monkeypatch, kind: str) -> list:
    # Count the forward calls of kernel ``kind`` (made while the guard is on or not).
    from dhelix.interpreter.ops import handlers, kernels

    role, kernel = handlers.HANDLERS[kind]
    calls = []

    def forward(inputs, weight, ctx):
        calls.append(isinstance(torch.overrides._get_current_function_mode(), SyncGuard))
        return kernel.forward(inputs, weight, ctx)

    monkeypatch.setitem(handlers.HANDLERS, kind, (role, kernels.Kernel(forward, kernel.dgrad, kernel.wgrad,
                                                                       kernel.wgrad_into)))
    return calls


def test_a_moe_layer_reads_its_counts_back_once_per_forward(guarded, monkeypatch, tmp_path):
    path = tmp_path / "moe_tiny.dhx"
    path.write_text(MOE)
    permutes = _count_calls(monkeypatch, "permute")
    _run_rank(path=path)
    assert guarded[0] > 0
    in_blocks = sum(permutes)  # the MoE layer forwards run inside SI blocks
    assert in_blocks > 0
    # One read of the exchanged count table per layer forward: none in a backward, none for
    # the grouped GEMM (the dispatch left it host counts) or the unpermute.
    assert guarded.reads == [torch.Tensor.tolist] * in_blocks


def test_the_guard_catches_an_item_in_a_kernel(guarded, monkeypatch):
    # The mutant: a GEMM that reads a value back, as a debugging line left in would.
    from dhelix.interpreter.ops import handlers, kernels

    role, gemm = handlers.HANDLERS["gemm"]

    def forward(inputs, weight, ctx):
        inputs[0].sum().item()
        return gemm.forward(inputs, weight, ctx)

    mutant = kernels.Kernel(forward, gemm.dgrad, gemm.wgrad, gemm.wgrad_into)
    monkeypatch.setitem(handlers.HANDLERS, "gemm", (role, mutant))
    with pytest.raises(Exception, match="item inside an SI block") as caught:
        _run_rank()
    assert any(isinstance(exc, HostSync) for exc in _chain(caught.value))


def test_the_guard_catches_an_item_on_the_compiled_path(guarded, monkeypatch):
    # The mutant: the compiled layer ops' collective issue (layer_calls, the hot path SI blocks
    # call instead of the runs' methods) reads a value back before issuing.
    from dhelix.interpreter.execute import layer_calls

    bound = layer_calls.bound

    def mutant(kind, fn, ctx, bare=False):
        issue = bound(kind, fn, ctx, bare)

        def reading(x):
            x.sum().item()
            return issue(x)
        return reading

    monkeypatch.setattr(layer_calls, "bound", mutant)
    with pytest.raises(Exception, match="item inside an SI block") as caught:
        _run_rank()
    assert any(isinstance(exc, HostSync) for exc in _chain(caught.value))


@pytest.mark.parametrize("where", ["grouped_gemm", "permute"])
def test_the_guard_catches_an_item_in_a_moe_layer(guarded, monkeypatch, tmp_path, where):
    # The mutants: a grouped GEMM that reads a value back, and a permute that reads its counts
    # back itself (as it did with a bincount's tolist) instead of through moe.to_host.
    from dhelix.interpreter.ops import handlers, kernels

    path = tmp_path / "moe_tiny.dhx"
    path.write_text(MOE)
    role, kernel = handlers.HANDLERS[where]

    def forward(inputs, weight, ctx):
        out = kernel.forward(inputs, weight, ctx)
        if where == "permute":
            ctx.routing["counts"].tolist()
        else:
            inputs[0].sum().item()
        return out

    monkeypatch.setitem(handlers.HANDLERS, where, (role, kernels.Kernel(forward, kernel.dgrad, kernel.wgrad,
                                                                        kernel.wgrad_into)))
    with pytest.raises(Exception, match="inside an SI block") as caught:
        _run_rank(path=path)
    assert any(isinstance(exc, HostSync) for exc in _chain(caught.value))


def _chain(exc):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__
