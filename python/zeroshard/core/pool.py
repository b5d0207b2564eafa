"""Reduction buffers recycled by size and dtype, the one policy the stage-1/2 reducer
and the planner's replay of it share."""

from __future__ import annotations

from typing import Callable, Dict, List


class BufferPool:
    """Reduction buffers recycled by (numel, dtype): ``acquire`` takes a free one of
    that size or allocates one (``alloc(numel, dtype)``); ``release`` keeps it while
    fewer than ``keep`` are free, and drops it otherwise. ``live`` / ``peak``: bytes
    allocated and not dropped (free ones included) now / at most. The stage-1/2
    reducer and the planner's replay of it use this one policy."""

    def __init__(self, keep: int, alloc: Callable):
        self.keep, self.alloc = keep, alloc
        self.free: Dict[tuple, List] = {}
        self.live = self.peak = 0

    def acquire(self, numel: int, dtype):
        free = self.free.get((numel, dtype))
        if free:
            return free.pop()
        t = self.alloc(numel, dtype)
        self.live += numel * dtype.itemsize
        self.peak = max(self.peak, self.live)
        return t

    def release(self, t) -> None:
        if sum(len(v) for v in self.free.values()) < self.keep:
            self.free.setdefault((t.numel(), t.dtype), []).append(t)
        else:
            self.live -= t.numel() * t.element_size()

    def clear(self) -> None:
        """Drop every free buffer."""
        for bufs in self.free.values():
            self.live -= sum(t.numel() * t.element_size() for t in bufs)
        self.free.clear()

    def reset_peak(self) -> None:
        self.peak = self.live
