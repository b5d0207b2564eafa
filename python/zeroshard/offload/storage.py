"""Where state shards are allocated (device, host memory, the rank's file) and what
that implies: whether a range is streamed, whether its gradients go to host memory.

[Note: offload params] ``FullyShard(offload_params=True)`` (ZeRO-3) keeps each
unit's fp32 shard and gradient shard in host memory (pinned on CUDA), as
FSDP's CPUOffload does; the optimizer state of those units goes to host
memory too (or to disk, for the units ``offload="nvme"`` chooses), so the
whole update runs on the CPU and the device holds only gathered units and
activations. Before a unit's all-gather its shard is copied host-to-device
into its chunk of the gathered buffer, on the stream the gather is ordered
after (so a prefetched unit's copy is prefetched with it). Each unit's
reduced gradient is divided on the device and copied to its pinned gradient
shard without blocking, as the unit is reduced, so the copies queue behind
backward's remaining work instead of stalling it; the end of backward waits
for them once, before the CPU step reads them. On a CPU-only machine the
"device" is host memory already: the option only changes where
``memory_report()`` counts the bytes (``host``).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Optional

import torch

from .disk import DiskFile
from .policy import Offload, Placement
from .streamer import Streamer, window_elements


class Storage:
    """Allocates state shards where ``offload`` puts them, for one source on one rank."""

    def __init__(self, offload: Offload, device: torch.device, rank: int, err: Callable[[str], str]):
        self.offload, self.device, self.rank, self.err = offload, device, rank, err
        self.disk: Optional[DiskFile] = None
        self.streamer: Optional[Streamer] = None

    def reserve_disk(self, numel: int) -> None:
        """Creates this rank's file for ``numel`` fp32 elements (called once, before zeros(DISK, ...));
        on meta (the planner) none: the state is only counted."""
        if self.offload.placement is Placement.DISK and numel > 0 and self.device.type != "meta":
            self.disk = DiskFile(self.offload.directory, self.rank, numel, self.err)

    def zeros(self, placement: Placement, n: int) -> torch.Tensor:
        if placement is Placement.DEVICE or self.device.type == "meta":
            return torch.zeros(n, device=self.device)
        return self.disk.take(n) if placement is Placement.DISK else host_zeros(n, self.device)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` := ``src`` without touching a mapped ``dst``'s pages (the I/O engine, window by window)."""
        if self.disk is None or not self.disk.holds(dst):
            dst.copy_(src)
            return
        w = window_elements()
        for a in range(0, dst.numel(), w):
            self.disk.write(dst[a : a + w], src[a : a + w].to("cpu", torch.float32).contiguous()).wait()

    def streamed(self, placement: Placement) -> bool:
        """Whether state in ``placement`` is stepped by the Streamer (see [Note: offload])."""
        return placement is Placement.DISK or (placement is Placement.HOST and on_accelerator(self.device))

    def grads_to_host(self, placement: Placement) -> bool:
        """Whether the reduced gradients of state in ``placement`` are copied to host memory
        as backward reduces them ([Note: offloaded gradients]): the CPU steps that state
        while the gradients are on an accelerator."""
        return self.streamed(placement) and on_accelerator(self.device)

    def grad_mirror(self, placement: Placement, n: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """ZeRO-1/2: the host copy of a buffer's reduced gradient shard, or None."""
        if not self.grads_to_host(placement):
            return None
        return (
            torch.zeros(n, dtype=dtype, device="meta")
            if self.device.type == "meta"
            else host_zeros(n, self.device, dtype)
        )

    def streamer_for_step(self) -> "Streamer":
        if self.streamer is None:
            self.streamer = Streamer(self.disk)
        return self.streamer


# set while the planner plans a run of CPU processes (gloo) on meta tensors
_PLANNING_FOR_HOST = contextvars.ContextVar("zeroshard_planning_for_host", default=False)


@contextlib.contextmanager
def planning_for_host():
    """Within it, meta tensors stand for host memory, not for an accelerator's
    (``zeroshard.plan`` with transport="gloo", which plans CPU processes)."""
    token = _PLANNING_FOR_HOST.set(True)
    try:
        yield
    finally:
        _PLANNING_FOR_HOST.reset(token)


def on_accelerator(device: torch.device) -> bool:
    """Whether ``device``'s tensors live off the host: CUDA, or meta standing for it
    (the planner plans GPU runs, unless within planning_for_host())."""
    return device.type == "cuda" or (device.type == "meta" and not _PLANNING_FOR_HOST.get())


def host_empty(n: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Host memory for state, shards or gradients of ``device``'s parameters, uninitialised:
    pinned when that is CUDA, so copies to and from it run asynchronously."""
    return torch.empty(n, dtype=dtype, pin_memory=device.type == "cuda")


def host_zeros(n: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """As host_empty, zeroed."""
    return host_empty(n, device, dtype).zero_()
