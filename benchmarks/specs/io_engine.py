"""The I/O engine's bandwidth against raw O_DIRECT: the same bytes, the same file, one run.

One file of --gib GiB under --dir (a local disk: direct I/O), allocated up front as the
offload file is. Each round writes the whole file and reads it back with every variant,
in turn (the order rotated from round to round):
  raw          a plain sequential loop of os.pwrite / os.preadv on an O_DIRECT descriptor,
               --block-mb at a time, one request at a time (what dd oflag=direct /
               iflag=direct bs=4M does), from and into the same two window buffers as
               the engine
  engine       zeroshard's I/O engine (offload/io_engine.py) as the streamed step uses it:
               windows of --window-mb from page-aligned tensors, two windows in flight,
               each cut into 1 MiB pieces, at most 8 in flight, through io_uring
  engine-aio   the same through the kernel's AIO (the fallback where io_uring is refused)
  raw-1buf, engine-1buf   both again from and into one --block-mb buffer, dd's footprint
               (on a virtual disk, whose host copies the data, a buffer that stays in the
               CPU's cache writes faster)
The file's extents are written once before the timed rounds, as a running offload file's
are. Writes end with fdatasync (in the time) for every variant. GB/s are medians over the
rounds; each engine variant's ratio is to the raw loop over the same memory. Written to
benchmarks/out/io_engine.json.

    python -m benchmarks io_engine [--dir /var/tmp] [--gib 1] [--rounds 3]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from datetime import date

import torch

from benchmarks.harness import machine_info, opt
from zeroshard.offload.io_engine import IoEngine, congruent_start


# each engine variant and the raw loop it is measured against (the same memory)
PAIRS = [("engine", "raw"), ("engine-aio", "raw"), ("engine-1buf", "raw-1buf")]


def raw(path: str, bufs, nbytes: int, block: int, write: bool) -> float:
    """Seconds for one O_DIRECT sequential pass, one ``block`` request at a time, moving the
    same windows from the same memory as the engine does (window k from ``bufs[k % 2]``)."""
    views = [memoryview(b.numpy()) for b in bufs]
    window = len(views[0])
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, block):
            view = views[off // window % 2][off % window : off % window + block]
            n = os.pwrite(fd, view, off) if write else os.preadv(fd, [view], off)
            assert n == block, (off, n)
        if write:
            os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def engine_pass(engine: IoEngine, bufs, nbytes: int, write: bool, sync_fd: int) -> float:
    """Seconds for one pass through the engine: window after window, two in flight."""
    window = bufs[0].numel()
    inflight = []
    t0 = time.perf_counter()
    for k, off in enumerate(range(0, nbytes, window)):
        if len(inflight) == 2:
            inflight.pop(0).wait()
        buf = bufs[k % 2]
        inflight.append(engine.write(buf, off) if write else engine.read(buf, off))
    for h in inflight:
        h.wait()
    if write:
        os.fdatasync(sync_fd)
    return time.perf_counter() - t0


def aligned(n: int) -> torch.Tensor:
    """``n`` random bytes in a page-aligned tensor (the streamed step's window buffers are
    placed congruent with the file; at offset 0 that is page-aligned)."""
    t = torch.empty(n + 4096, dtype=torch.uint8)
    k = congruent_start(t, 0)
    return t[k : k + n].random_(0, 256)


OPTIONS = [
    opt("--dir", default="/var/tmp", help="a directory on a local disk"),
    opt("--gib", type=float, default=1.0),
    opt("--rounds", type=int, default=3),
    opt("--block-mb", type=int, default=4, help="the raw loop's request size"),
    opt("--window-mb", type=int, default=8, help="the engine's window (one transfer)"),
]


def check(args):
    return "--block-mb must divide --window-mb" if (args.window_mb << 20) % (args.block_mb << 20) else None


def run(args):
    window, block = args.window_mb << 20, args.block_mb << 20
    nbytes = int(args.gib * 2**30) // window * window
    fd, path = tempfile.mkstemp(dir=args.dir, prefix="zeroshard-io-bench-")
    try:
        os.posix_fallocate(fd, 0, nbytes)
        engines = {"engine": IoEngine(path, backend="io_uring"), "engine-aio": IoEngine(path, backend="aio")}
        bufs = [aligned(window), aligned(window)]
        one = aligned(block)  # dd's footprint: one buffer, in the CPU's cache
        raw(path, bufs, nbytes, block, True)  # the file's extents written once, untimed
        variants = {
            "raw": lambda w: raw(path, bufs, nbytes, block, w),
            **{name: (lambda w, e=e: engine_pass(e, bufs, nbytes, w, fd)) for name, e in engines.items()},
            "raw-1buf": lambda w: raw(path, [one, one], nbytes, block, w),
            "engine-1buf": lambda w: engine_pass(engines["engine"], [one, one], nbytes, w, fd),
        }
        seconds = {(v, w): [] for v in variants for w in ("write", "read")}
        names = list(variants)
        for r in range(args.rounds):
            for v in names[r % len(names) :] + names[: r % len(names)]:
                for w in ("write", "read"):
                    seconds[(v, w)].append(variants[v](w == "write"))
        back = aligned(window).zero_()  # what the engine writes, it reads back
        engines["engine"].write(bufs[0], nbytes - window).wait()
        engines["engine-aio"].read(back, nbytes - window).wait()
        assert torch.equal(back, bufs[0])
    finally:
        os.close(fd)
        os.unlink(path)
    gbs = {f"{v}_{w}_gb_per_s": nbytes / statistics.median(s) / 1e9 for (v, w), s in seconds.items()}
    row = {
        "bytes": nbytes,
        "dir": args.dir,
        "block_mb": args.block_mb,
        "window_mb": args.window_mb,
        "rounds": args.rounds,
        **gbs,
        **{
            f"{v}_{w}_vs_{ref}": gbs[f"{v}_{w}_gb_per_s"] / gbs[f"{ref}_{w}_gb_per_s"]
            for v, ref in PAIRS
            for w in ("write", "read")
        },
        "runs_s": {f"{v} {w}": s for (v, w), s in seconds.items()},
    }
    print(f"{nbytes / 2**30:.2f} GiB in {args.dir}, {args.rounds} rounds | commit {machine_info('cpu')['commit']}")
    for w in ("write", "read"):
        print(
            f"{w:5}: "
            + " | ".join(
                f"{v} {gbs[f'{v}_{w}_gb_per_s']:.2f} GB/s ({row[f'{v}_{w}_vs_{ref}']:.2f}x {ref})" for v, ref in PAIRS
            )
            + f" | raw {gbs[f'raw_{w}_gb_per_s']:.2f}, raw-1buf {gbs[f'raw-1buf_{w}_gb_per_s']:.2f} GB/s"
        )
    return {"date": date.today().isoformat(), "machine": machine_info("cpu"), "torch": torch.__version__, **row}
