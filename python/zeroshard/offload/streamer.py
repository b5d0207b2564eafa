"""The windowed, double-buffered CPU step over streamed ranges ([Note: offload] in
offload/policy.py): two I/O threads move the next and the last window, through the
file's I/O engine ([Note: I/O engine] in csrc/io_engine.h), while zeroshard's CPU
AdamW updates the current one."""

from __future__ import annotations

import concurrent.futures
import os
from typing import List, Optional

import torch

from ..native.kernels import fused_adamw_
from .disk import DiskFile
from .io_engine import BLOCK

# elements per state tensor in one window of the streamed step (two windows of
# four fp32 tensors: 64 MiB by default); ZEROSHARD_OFFLOAD_WINDOW_MB sets the total
_WINDOW_ENV = "ZEROSHARD_OFFLOAD_WINDOW_MB"


def window_elements() -> int:
    mb = float(os.environ.get(_WINDOW_ENV, "64"))
    if not mb > 0:
        raise ValueError(f"{_WINDOW_ENV} must be > 0, got {os.environ.get(_WINDOW_ENV)!r}")
    return max(64, int(mb * 2**20) // (2 * 4 * 4))


class Streamer:
    """Steps streamed ranges window by window; see [Note: offload]."""

    def __init__(self, disk: Optional[DiskFile]):
        self.disk = disk
        self.window = window_elements()
        # two I/O threads: one reads the next window while the other writes the last one back
        self.io = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="zeroshard-offload")
        self.slots: List[dict] = []

    def _slot(self, s: int, pin: bool, n: int, keys) -> dict:
        """Window buffer ``s`` (0 or 1): ``n`` elements for each of ``keys`` (of p, g, m, v:
        only the tensors that are staged), grown as needed and kept between steps."""
        while len(self.slots) <= s:
            self.slots.append({})
        slot = self.slots[s]
        n += BLOCK // 4  # a block to spare: each transfer's window sits congruent with its file offset
        for k in keys:
            if k not in slot or slot[k].numel() < n:
                slot[k] = torch.empty(n, pin_memory=pin)
        return slot

    def _keys(self, parts: list) -> set:
        """Which of p, g, m, v go through a window buffer: what is on disk or on the device."""
        keys = set()
        for p, g, m, v, _ in parts:
            keys |= {k for k, t in (("p", p), ("m", m), ("v", v)) if self._staged(t) or t.device.type != "cpu"}
            keys |= {"g"} if g.device.type != "cpu" else set()
        return keys

    def update(self, parts: list, hyper: dict, step: int) -> None:
        """AdamW on each (param, grad, exp_avg, exp_avg_sq, out) range of ``parts``."""
        if self.disk is not None:
            self.disk.check()  # deleted or truncated under the job: an error naming it
        total = sum(part[0].numel() for part in parts)
        # windows of at most a quarter of what this call steps: the two buffers together
        # hold at most half of it, however small the shard is against the window
        w = min(self.window, max(64, -(-total // 4)))
        chunks = [(part, a, min(a + w, part[0].numel())) for part in parts for a in range(0, part[0].numel(), w)]
        if not chunks:
            return
        n, keys = max(b - a for _, a, b in chunks), self._keys(parts)
        pin = any(t is not None and t.device.type == "cuda" for part in parts for t in part)
        scale = hyper.get("scale")
        hyper = dict(hyper, scale=None if scale is None else scale.to("cpu", torch.float32))
        # the futures of window k's load, the next window's load and the last two write-backs
        # (older ones are done: the load two windows on waited for them)
        older = last = None
        upcoming = self.io.submit(self._load, chunks[0], self._slot(0, pin, n, keys))
        for k, chunk in enumerate(chunks):
            slot, loading = self._slot(k % 2, pin, n, keys), upcoming
            if k + 1 < len(chunks):  # the other buffer is free once window k-1 is written back
                upcoming = self.io.submit(
                    self._after, last, self._load, chunks[k + 1], self._slot((k + 1) % 2, pin, n, keys)
                )
            loading.result()
            self._compute(chunk, slot, hyper, step)
            older, last = last, self.io.submit(self._store, chunk, slot)
        for f in (older, last):
            if f is not None:
                f.result()

    @staticmethod
    def _after(first, fn, *args):
        if first is not None:
            first.result()
        return fn(*args)

    def _staged(self, t: torch.Tensor) -> bool:
        return self.disk is not None and self.disk.holds(t)

    def _window(self, slot, key: str, t: torch.Tensor, a: int, n: int) -> torch.Tensor:
        """Where window buffer ``slot`` holds ``t[a:a + n]``: for a staged tensor, placed
        congruent with its bytes in the file (no copy through a bounce buffer)."""
        return self.disk.window(slot[key], t[a:], n) if self._staged(t) else slot[key][:n]

    @staticmethod
    def _free(slot) -> None:
        """Wait until the device has read what the last window copied out of ``slot``
        (its non-blocking host-to-device copies): only then may it be written again."""
        done = slot.pop("read", None)
        if done is not None:
            done.synchronize()

    def _load(self, chunk, slot) -> None:
        self._free(slot)
        (p, _, m, v, _), a, b = chunk
        _wait_all(
            [
                self.disk.read(self._window(slot, key, t, a, b - a), t[a:b])
                for key, t in (("p", p), ("m", m), ("v", v))
                if self._staged(t)
            ]
        )

    def _store(self, chunk, slot) -> None:
        (p, _, m, v, _), a, b = chunk
        _wait_all(
            [
                self.disk.write(t[a:b], self._window(slot, key, t, a, b - a))
                for key, t in (("p", p), ("m", m), ("v", v))
                if self._staged(t)
            ]
        )

    def _compute(self, chunk, slot, hyper: dict, step: int) -> None:
        (p, g, m, v, out), a, b = chunk
        n = b - a
        host = {}
        for key, t in (("p", p), ("m", m), ("v", v)):
            if self._staged(t):
                host[key] = self._window(slot, key, t, a, n)
            elif t.device.type != "cpu":  # ZeRO-3's fp32 unit shard on CUDA: in and back out
                host[key] = slot[key][:n].copy_(t[a:b])
            else:
                host[key] = t[a:b]
        grad = g[a:b] if g.device.type == "cpu" else slot["g"][:n].copy_(g[a:b])
        host_out = out is not None and out.device.type == "cpu"
        fused_adamw_(
            [host["p"]], [grad], [host["m"]], [host["v"]], outs=[out[a:b]] if host_out else None, step=step, **hyper
        )
        if p.device.type != "cpu":
            p[a:b].copy_(host["p"], non_blocking=True)
        if out is not None and not host_out:
            out[a:b].copy_(host["p"], non_blocking=True)
        in_slot = self._staged(p) or p.device.type != "cpu"  # host["p"] is the window buffer's
        if in_slot and (p.device.type != "cpu" or (out is not None and not host_out)):
            # the copies above read the window buffer after this call returns, while the
            # I/O thread may already load a later window into it: it waits for this event
            slot["read"] = torch.cuda.Event()
            slot["read"].record()


def _wait_all(handles) -> None:
    """Waits for every handle (all of a window's requests are in flight together), then
    raises the first error."""
    errors = []
    for h in handles:
        try:
            h.wait()
        except OSError as e:
            errors.append(e)
    if errors:
        raise errors[0]
