"""NVMe offload: GB/s the optimizer step reads and writes against the disk's own.

One process (gloo, world size 1), a stack of Linear layers of --params
parameters, ShardedOptimizer(stage=2, offload="nvme") with every state on disk
under --dir. Per step the streamed update reads and writes exp_avg and
exp_avg_sq (8 bytes per parameter each way; the parameters are fp32, so no
master). Measured in the same run:
  page cache / disk   a file of the state's size written with pwrite over its cached
                      pages (as the offload's own writes go) then out to the disk (fsync),
                      read back from the page cache, and from the disk (its pages
                      dropped with posix_fadvise first), in 8 MiB blocks
  step                median optimizer.step() time with offload="nvme", and with no
                      offload (the CPU kernel over state in memory) for comparison
"GB/s" for the step is (bytes read + bytes written) / step time.

    python -m benchmarks offload [--params 32e6] [--dir /tmp] [--steps 5]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from datetime import date

import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard as zs
from benchmarks.harness import machine_info, opt

BLOCK = 8 * 2**20


def disk_bandwidth(directory: str, nbytes: int) -> dict:
    """GB/s of one file of ``nbytes`` in ``directory``, in 8 MiB blocks: written over its
    cached pages (pwrite, as the offload's own writes go), then out to the disk (fsync),
    read back from the page cache, and read from the disk (the file's pages dropped first)."""
    buf = memoryview(bytearray(os.urandom(1024) * (BLOCK // 1024)))
    fd, path = tempfile.mkstemp(dir=directory, prefix="zeroshard-bw-")

    def timed(fn):
        t0 = time.perf_counter()
        for off in range(0, nbytes, BLOCK):
            fn(off, buf[: min(BLOCK, nbytes - off)])
        return nbytes / (time.perf_counter() - t0) / 1e9

    try:
        timed(lambda off, b: os.pwrite(fd, b, off))  # the file's pages, as the offload's fallocate
        cached_write = timed(lambda off, b: os.pwrite(fd, b, off))  # over cached pages: the step's case
        t0 = time.perf_counter()
        os.fsync(fd)
        disk_write = nbytes / (time.perf_counter() - t0) / 1e9  # the dirty pages written out
        cached_read = timed(lambda off, b: os.preadv(fd, [b], off))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        disk_read = timed(lambda off, b: os.preadv(fd, [b], off))
    finally:
        os.close(fd)
        os.unlink(path)
    return {
        "cached_write_gb_per_s": cached_write,
        "disk_write_gb_per_s": disk_write,
        "cached_read_gb_per_s": cached_read,
        "disk_read_gb_per_s": disk_read,
    }


def step_seconds(params: int, offload, directory: str, steps: int) -> float:
    torch.manual_seed(0)
    width = 2048
    layers = max(1, round(params / (width * width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = zs.ShardedOptimizer(
        model.parameters(), stage=2, offload=offload, offload_dir=directory if offload == "nvme" else None
    )
    x = torch.randn(2, width)
    times = []
    for _ in range(steps + 1):
        model(x).square().mean().backward()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        opt.zero_grad()
    return statistics.median(times[1:]), sum(p.numel() for p in model.parameters())


OPTIONS = [
    opt("--params", type=float, default=32e6),
    opt("--dir", default=tempfile.gettempdir(), help="where the offload file goes"),
    opt("--steps", type=int, default=5),
]


def run(args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29571"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    nvme, n = step_seconds(int(args.params), "nvme", args.dir, args.steps)
    memory, _ = step_seconds(int(args.params), None, args.dir, args.steps)
    state = 8 * n  # exp_avg + exp_avg_sq, fp32
    disk = disk_bandwidth(args.dir, state)
    moved = 2 * state  # read and written back
    row = {
        "params": n,
        "state_bytes": state,
        "nvme_step_s": nvme,
        "memory_step_s": memory,
        "nvme_gb_per_s": moved / nvme / 1e9,
        **disk,
        "window_mb": float(os.environ.get("ZEROSHARD_OFFLOAD_WINDOW_MB", "64")),
    }
    print(
        f"{n / 1e6:.1f}M fp32 parameters, Adam state {state / 1e9:.2f} GB in {args.dir} | "
        f"window {row['window_mb']:g} MB | commit {machine_info('cpu')['commit']}"
    )
    print(
        f"page cache: write {disk['cached_write_gb_per_s']:.2f} GB/s, read {disk['cached_read_gb_per_s']:.2f} GB/s"
        f" | disk: write (to fsync) {disk['disk_write_gb_per_s']:.2f} GB/s, read (pages dropped) "
        f"{disk['disk_read_gb_per_s']:.2f} GB/s"
    )
    print(f"step with the state in memory: {memory * 1e3:.1f} ms")
    print(
        f"step with offload='nvme':      {nvme * 1e3:.1f} ms = {row['nvme_gb_per_s']:.2f} GB/s read + written "
        f"({nvme / memory:.2f}x the in-memory step)"
    )
    dist.destroy_process_group()
    return {
        "date": date.today().isoformat(),
        "machine": machine_info("cpu"),
        "torch": torch.__version__,
        "dir": args.dir,
        **row,
    }
