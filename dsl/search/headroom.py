"""The memory `dhelix tune` keeps free on every device: what a run needs beyond the model
states and activations the simulator counts — the CUDA context (and the kernels loaded into
it), the collective library's buffers, the caching allocator's fragmentation. A choice fits
when its simulated peak fits in the device's memory less this reserve.

A reserve is a fixed part (GB) plus a part of the device's memory (%); the default is both
(:data:`DEFAULT`), a value given by the user one or the other (:func:`parse_reserve`)."""

from __future__ import annotations

import re

import attrs

from dhelix.dsl.core.errors import UsageError
from dhelix.dsl.simulator.memory import GB


@attrs.frozen
class Reserve:
    """``gb`` gigabytes plus ``percent`` % of the device's memory, kept free per device."""

    gb: float = 0.0
    percent: float = 0.0

    def bytes_of(self, device_gb: float | None) -> float:
        """The bytes reserved on a device of ``device_gb`` GB (the fixed part alone when the
        device's memory is not known)."""
        return (self.gb + (device_gb or 0.0) * self.percent / 100) * GB

    def describe(self) -> str:
        """``1 GB + 5 %``, ``4 GB``, ``10 %``, ``none``."""
        parts = ([f"{self.gb:g} GB"] if self.gb else []) + ([f"{self.percent:g} %"] if self.percent else [])
        return " + ".join(parts) or "none"


#: The default reserve: 1 GB for the CUDA context with PyTorch's kernels loaded
#: [assumed: pytorch/pytorch#34323 measures 781 MB of device memory taken by initialising
#: CUDA from PyTorch alone; skrl's multi-process docs give ~1 GB per process, citing
#: pytorch/pytorch#12873] and 5 % of the device for the collective library's buffers and the
#: allocator's fragmentation [assumed: NCCL allocates NCCL_BUFFSIZE (4 MiB, NCCL's
#: environment docs) per protocol, channel and peer of each communicator, hundreds of MB for
#: a run's tp, dp and pp communicators; MindSpeed's memory-fragmentation guide caps PyTorch
#: at 0.94 of the device so that the collective library keeps room; vLLM leaves 10 % by
#: default (gpu_memory_utilization 0.9)]. On a 48 GB A40: 3.4 GB; on an 80 GB H100: 5 GB.
DEFAULT = Reserve(gb=1.0, percent=5.0)

_VALUE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(gb|%)?\s*$", re.IGNORECASE)


def parse_reserve(text: str) -> Reserve:
    """A reserve written ``4``, ``4GB`` or ``4 GB`` (gigabytes) or ``10%`` (of the device);
    UsageError for anything else, or a percentage of 100 or more."""
    match = _VALUE.match(text)
    if match is None:
        raise UsageError(f"{text!r} is not a memory reserve: give gigabytes (2.5 or 2.5GB) or a part of the "
                         "device's memory (8%)")
    value, unit = float(match.group(1)), (match.group(2) or "gb").lower()
    if unit == "%":
        if value >= 100:
            raise UsageError(f"a reserve of {value:g} % leaves nothing of the device's memory")
        return Reserve(percent=value)
    return Reserve(gb=value)
