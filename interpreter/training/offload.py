"""Optimizer-state offload to host memory (``train { offload = optimizer }``).

ZeRO-Offload's ``offload_optimizer``, FSDP's ``CPUOffload`` and Megatron-LM's optimizer CPU
offload keep the fp32 master weights and the AdamW moments of a rank's part of each bucket
in host memory. A step then runs in three parts, one after another:

1. the bucket's averaged (and clipped) fp32 gradient part goes device -> host into a host
   buffer (:meth:`HostStaging.take`), and the host waits for it (:meth:`HostStaging.landed`);
2. AdamW updates the host's masters and moments there, on the host's CPU (torch's fused
   CPU kernel, the one a CPU rank runs anyway);
3. the updated masters, rounded on the host to the parameters' dtype, go host -> device
   into a new device tensor (:meth:`HostStaging.give`), which the optimizer publishes as it
   publishes a device update (copied into the parameters, or ZeRO-1's all-gather).

With ``offload_percent = P`` (Megatron-LM's offload fraction) only the first ``P`` % of each
bucket part's elements are the host's; the rest keep their masters and moments on the device
(:class:`DeviceTail`), updated there by the device's AdamW, launched between steps 1 and 2 so
that on a GPU it runs while the host computes; the two updated pieces are joined before they
are published.

On CUDA the host tensors are pinned and both copies are ``non_blocking`` on the current
stream (the wait of step 1 is an event on it; the copy of step 3 is ordered before anything
that reads its result). On a CPU rank "host" and "device" are the same memory, but the path
is the GPU run's: a separate fp32 master copy, the gradients copied to it, the step there,
the weights copied back. The simulator prices the same three parts
(:func:`~dhelix.dsl.planner.costmodel.offload_time`) and counts the host bytes
(:func:`~dhelix.dsl.simulator.memory.host_bytes`).
"""

from __future__ import annotations

import torch

#: Where offloaded states live.
HOST = torch.device("cpu")


def host_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor of ``numel`` zeros, pinned when ``device`` (the rank's) is a GPU, so
    that copies to and from it can run ``non_blocking``."""
    return torch.zeros(numel, dtype=dtype, pin_memory=device.type == "cuda")


def host_copy(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new host fp32 copy of ``value`` (pinned for a GPU ``device``)."""
    return host_zeros(value.numel(), torch.float32, device).copy_(value.reshape(-1))


class HostStaging:
    """The host buffers of one offloaded bucket part of ``numel`` elements: the fp32
    gradients landing from the device and (for parameters not in fp32) the updated weights
    rounded to ``dtype`` before they go back; ``device`` is the rank's."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.device, self.dtype = device, dtype
        self.grad = host_zeros(numel, torch.float32, device)
        self.out = host_zeros(numel, dtype, device) if dtype != torch.float32 else None
        self._copied: torch.cuda.Event | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Its host buffers."""
        return [self.grad] + ([self.out] if self.out is not None else [])

    def take(self, grad: torch.Tensor) -> None:
        """Start copying the device part ``grad`` into the host buffer (:meth:`landed` waits)."""
        self.grad.copy_(grad, non_blocking=True)
        self._copied = None
        if grad.device.type == "cuda":  # the host reads it next: an event after the copy to wait for
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(grad.device))

    def landed(self) -> torch.Tensor:
        """The host buffer once :meth:`take`'s copy has landed."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self.grad

    def give(self, master: torch.Tensor) -> torch.Tensor:
        """The host's updated fp32 ``master`` part as a new device tensor in the parameters'
        dtype: rounded on the host (half the bytes over the link for 16-bit weights), then
        copied host -> device on the current stream. Its host buffer is written again only
        after the next :meth:`take` has waited for that stream."""
        source = master if self.out is None else self.out.copy_(master)
        landed = torch.empty(source.numel(), dtype=self.dtype, device=self.device)
        return landed.copy_(source, non_blocking=True)


class DeviceTail:
    """The elements of an offloaded bucket part that stay on the device (``offload_percent``
    below 100): their fp32 masters and AdamW moments, ``numel`` each, on ``device``."""

    def __init__(self, numel: int, device: torch.device):
        self.exp_avg, self.exp_avg_sq, self.master = (torch.zeros(numel, dtype=torch.float32, device=device)
                                                      for _ in range(3))

    def tensors(self) -> list[torch.Tensor]:
        """Its moments and masters."""
        return [self.exp_avg, self.exp_avg_sq, self.master]
