"""Offload: where the optimizer's state shards live, and how offloaded ranges step.

[Note: offload] A policy the shard sources and the update rule consult, not a
branch inside them:
* Choosing. ``offload_fraction`` f of this rank's shard is offloaded in whole
  parameters (ZeRO-1/2) or whole units (ZeRO-3), taken in the order backward
  reduces them, as many as bring the offloaded elements closest to f of the
  shard (f > 0 offloads at least one; f = 1 all). ``memory_report()`` says
  exactly how many bytes went where. (Megatron's offload_fraction splits by
  parameter too; DeepSpeed's ratio by sub-group.)
* Storage. ``Storage.zeros(placement, n)``: DEVICE: the parameters' device;
  HOST: host memory (pinned when the parameters are on CUDA); DISK: a view of
  one file per rank under ``offload_dir``, allocated in full up front
  (posix_fallocate: a full disk is an error at construction, never a crash
  mid-step) and mapped shared, so state dicts and checkpoints read and write
  it like any tensor, one region at a time, through the page cache. The file
  is deleted when the optimizer is.
* Stepping. A segment is *streamed* when its state is on disk, or in host
  memory while its gradients are on CUDA; the update rule runs the others as
  before. ``Streamer.update`` steps streamed ranges in windows (at most
  ZEROSHARD_OFFLOAD_WINDOW_MB for both windows' tensors together, and at
  most a quarter of what one call steps): while window k is updated by
  zeroshard's CPU AdamW kernel (multi-threaded), two I/O threads read window
  k+1's state from the file into the other buffer and write window k-1's
  back (double buffering), so host memory holds two windows, not the shard;
  only the tensors that are staged (on disk or on the device) get a buffer. Gradients
  come from host copies made during backward ([Note: offloaded gradients]); a
  gradient still on the device is copied per window; an fp32 parameter on CUDA (ZeRO-3's
  unit shard) is copied in and back; a low-precision parameter on CUDA is
  written from the updated fp32 master.

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

[Note: offloaded gradients] The CPU steps offloaded state from host copies of
the gradients, made as backward reduces them rather than in step():
* ZeRO-1/2: a buffer whose state the CPU steps keeps a pinned *mirror* of
  this rank's reduced gradient shard. As each bucket is folded into the shard
  its range is copied to the mirror (``HostCopies``, on a side stream); the
  end of backward waits for the copies. The device shard stays the gradient
  (backward accumulates into it); the step reads the mirror, and what torch's
  utilities do to ``p.grad`` afterwards (clip, GradScaler's unscale) is done
  to both (``Segment.grad_views``).
* ZeRO-3: a unit the CPU steps keeps its gradient shard itself in pinned host
  memory (``Unit.grad_to_host``), as offload_params does: each reduced chunk
  is divided on the device and copied there as the unit is reduced.
``memory_report()`` counts both as host bytes.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import enum
import os
import shutil
import weakref
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .kernels import fused_adamw_

# elements per state tensor in one window of the streamed step (two windows of
# four fp32 tensors: 64 MiB by default); ZEROSHARD_OFFLOAD_WINDOW_MB sets the total
_WINDOW_ENV = "ZEROSHARD_OFFLOAD_WINDOW_MB"


class Placement(enum.Enum):
    """Where a state shard lives."""
    DEVICE = "device"   # with the parameters (no offload)
    HOST = "host"       # host memory: offload="cpu"
    DISK = "disk"       # a file under offload_dir: offload="nvme"


@dataclass(frozen=True)
class Offload:
    """The validated offload arguments of ShardedOptimizer."""
    placement: Placement        # where the offloaded share goes
    directory: Optional[str]    # DISK: where the files go
    fraction: float             # share of this rank's shard offloaded

    @property
    def active(self) -> bool:
        return self.placement is not Placement.DEVICE and self.fraction > 0


NO_OFFLOAD = Offload(Placement.DEVICE, None, 0.0)


def parse(offload, offload_dir, offload_fraction, optimizer_class=None) -> Offload:
    """Checks ShardedOptimizer's offload arguments (see [Note: offload]); ``optimizer_class``:
    the torch optimizer asked for instead of the fused AdamW, if any."""
    kinds = {None: Placement.DEVICE, "cpu": Placement.HOST, "nvme": Placement.DISK}
    if offload not in kinds:
        raise ValueError(f"offload must be None, 'cpu' or 'nvme', got {offload!r}")
    try:
        fraction = float(offload_fraction)
    except (TypeError, ValueError):
        raise ValueError(f"offload_fraction must be a number in [0, 1], got {offload_fraction!r}") from None
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"offload_fraction must be in [0, 1] (the share of this rank's shard whose state is "
                         f"offloaded), got {offload_fraction!r}")
    if offload == "nvme":
        if offload_dir is None:
            raise ValueError("offload='nvme' needs offload_dir=<a directory on a fast local disk> for the "
                             "optimizer-state files (one per rank)")
        check_directory(str(offload_dir))
    elif offload_dir is not None:
        raise ValueError(f"offload_dir={offload_dir!r} is only used with offload='nvme' (got offload={offload!r})")
    if offload is not None and optimizer_class is not None:
        raise ValueError(f"offload={offload!r} steps the offloaded state with zeroshard's fused AdamW; "
                         f"optimizer_class={optimizer_class.__name__} keeps its own state on the parameters' "
                         "device: drop offload or optimizer_class")
    return Offload(kinds[offload], None if offload_dir is None else str(offload_dir), fraction)


def check_directory(directory: str) -> None:
    if not os.path.isdir(directory):
        raise ValueError(f"offload_dir {directory!r} does not exist or is not a directory; create it on a "
                         "fast local disk")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"offload_dir {directory!r} is not writable by this process; pick a directory it "
                         "can write")


def choose(sizes: Sequence[int], fraction: float) -> int:
    """How many of ``sizes`` (in order) to offload: the prefix whose sum comes
    closest to ``fraction`` of the total (ties: the larger); at least one when
    ``fraction`` > 0, all when it is 1."""
    total = sum(sizes)
    if fraction <= 0 or not sizes:
        return 0
    if fraction >= 1:
        return len(sizes)
    target, best, best_err, acc = fraction * total, 1, None, 0
    for k, n in enumerate(sizes, 1):
        acc += n
        err = abs(acc - target)
        if best_err is None or err <= best_err:
            best, best_err = k, err
        if acc >= target:
            break
    return best


def offloaded_params(params: List[torch.Tensor], trainable: List[int], offload: Offload) -> set:
    """ZeRO-1/2: the trainable parameters whose state is offloaded, whole ones in the
    order backward reduces them (the reverse of ``trainable``)."""
    order = list(reversed(trainable))
    return set(order[:choose([params[i].numel() for i in order], offload.fraction)] if offload.active else ())


class DiskFile:
    """One rank's state file: allocated in full, mapped shared, read and written by offset."""

    def __init__(self, directory: str, rank: int, numel: int, err: Callable[[str], str]):
        check_directory(directory)
        self.path = os.path.join(directory, f"zeroshard-rank{rank}-pid{os.getpid()}-{id(self):x}.optstate")
        nbytes = max(4, 4 * numel)
        free = shutil.disk_usage(directory).free
        if free < nbytes:
            raise ValueError(err(f"offload_dir {directory!r} has {free / 2**30:.2f} GiB free but this rank's "
                                 f"offloaded optimizer state needs {nbytes / 2**30:.2f} GiB; free space, use "
                                 "another directory or a smaller offload_fraction"))
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._cleanup = weakref.finalize(self, _close, self.fd, self.path)
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as e:
            self._cleanup()
            raise ValueError(err(f"cannot allocate {nbytes / 2**30:.2f} GiB for the offloaded optimizer state in "
                                 f"{directory!r}: {e.strerror}; free space or use another directory")) from None
        self.mapped = torch.from_file(self.path, shared=True, size=max(1, numel), dtype=torch.float32)
        self.used = 0

    def take(self, n: int) -> torch.Tensor:
        """The next ``n`` elements of the file, as a mapped view (zeros)."""
        t = self.mapped[self.used:self.used + n]
        self.used += n
        return t

    def holds(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.untyped_storage().data_ptr() == self.mapped.untyped_storage().data_ptr()

    def read(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (contiguous fp32 host tensor) := ``src`` (a mapped view), by pread."""
        _transfer(os.preadv, self.fd, dst, 4 * src.storage_offset())

    def write(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (a mapped view) := ``src`` (contiguous fp32 host tensor), by pwrite."""
        _transfer(os.pwritev, self.fd, src, 4 * dst.storage_offset())

    @property
    def nbytes(self) -> int:
        return os.fstat(self.fd).st_size


def _transfer(op, fd: int, t: torch.Tensor, offset: int) -> None:
    view = memoryview(t.numpy()).cast("B")
    done = 0
    while done < len(view):     # short reads and writes continue where they stopped
        n = op(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"offload file I/O stopped at byte {offset + done} (end of file or disk error)")
        done += n


def _close(fd: int, path: str) -> None:
    try:
        os.close(fd)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


# the state tensors Storage placed off the device (a weak map: a freed tensor leaves it)
# (by identity: tensors compare elementwise)
_PLACED = WeakIdKeyDictionary()


def placement_of(t: torch.Tensor) -> Placement:
    """Where Storage put ``t`` (DEVICE for a tensor it did not place)."""
    return _PLACED.get(t, Placement.DEVICE)


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
            t = torch.zeros(n, device=self.device)
            if placement is not Placement.DEVICE:
                _PLACED[t] = placement
            return t
        t = self.disk.take(n) if placement is Placement.DISK else host_zeros(n, self.device)
        _PLACED[t] = placement
        return t

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` := ``src`` without touching a mapped ``dst``'s pages (pwrite, window by window)."""
        if self.disk is None or not self.disk.holds(dst):
            dst.copy_(src)
            return
        w = window_elements()
        for a in range(0, dst.numel(), w):
            self.disk.write(dst[a:a + w], src[a:a + w].to("cpu", torch.float32).contiguous())

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
        t = (torch.zeros(n, dtype=dtype, device="meta") if self.device.type == "meta"
             else host_zeros(n, self.device, dtype))
        _PLACED[t] = Placement.HOST
        return t

    def streamer_for_step(self) -> "Streamer":
        if self.streamer is None:
            self.streamer = Streamer(self.disk)
        return self.streamer


class HostCopies:
    """Device-to-host copies of reduced gradients ([Note: offloaded gradients]), on one
    stream per source. The stream buys the overlap: the copy engine moves each
    gradient while backward's kernels keep the compute stream busy, instead of
    the copies queuing between them. Each copy waits (on the device) for the
    compute stream's work so far, which produced the gradient; ``wait()`` at the
    end of backward blocks the host until every copy has landed."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pending = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (host) := ``src``, asynchronously on CUDA; ``src`` must not be written
        before ``wait()`` (a freed ``src`` is kept until the copy is done)."""
        if self.stream is None:
            dst.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.stream)
        self.pending = True

    def wait(self) -> None:
        if self.pending:
            self.stream.synchronize()
            self.pending = False


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


def host_zeros(n: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zeros in host memory for state, shards or gradients of ``device``'s parameters:
    pinned when that is CUDA, so copies to and from it run asynchronously."""
    return torch.zeros(n, dtype=dtype, pin_memory=device.type == "cuda")


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
            if k + 1 < len(chunks):   # the other buffer is free once window k-1 is written back
                upcoming = self.io.submit(self._after, last, self._load, chunks[k + 1],
                                          self._slot((k + 1) % 2, pin, n, keys))
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

    def _load(self, chunk, slot) -> None:
        (p, _, m, v, _), a, b = chunk
        for key, t in (("p", p), ("m", m), ("v", v)):
            if self._staged(t):
                self.disk.read(slot[key][:b - a], t[a:b])

    def _store(self, chunk, slot) -> None:
        (p, _, m, v, _), a, b = chunk
        for key, t in (("p", p), ("m", m), ("v", v)):
            if self._staged(t):
                self.disk.write(t[a:b], slot[key][:b - a])

    def _compute(self, chunk, slot, hyper: dict, step: int) -> None:
        (p, g, m, v, out), a, b = chunk
        n = b - a
        host = {}
        for key, t in (("p", p), ("m", m), ("v", v)):
            if self._staged(t):
                host[key] = slot[key][:n]
            elif t.device.type != "cpu":        # ZeRO-3's fp32 unit shard on CUDA: in and back out
                host[key] = slot[key][:n].copy_(t[a:b])
            else:
                host[key] = t[a:b]
        grad = g[a:b] if g.device.type == "cpu" else slot["g"][:n].copy_(g[a:b])
        host_out = out is not None and out.device.type == "cpu"
        fused_adamw_([host["p"]], [grad], [host["m"]], [host["v"]], outs=[out[a:b]] if host_out else None,
                     step=step, **hyper)
        if p.device.type != "cpu":
            p[a:b].copy_(host["p"], non_blocking=True)
        if out is not None and not host_out:
            out[a:b].copy_(host["p"], non_blocking=True)
