"""Fused AdamW benchmark: zeroshard's kernel against torch.optim.AdamW in the same run.

For each shard size, on CPU and (when present) CUDA, times one optimizer step of:
  zeroshard bf16     fp32 master/m/v, bf16 grad, writes the bf16 param (28 B/param)
  zeroshard fp32     fp32 param/m/v, fp32 grad, no low-precision copy   (28 B/param)
  torch fused        AdamW(fused=True), fp32 everything                 (28 B/param)
  torch fused+cast   the same plus the separate bf16 cast a ZeRO step needs (34 B/param)
  torch foreach+cast AdamW(foreach=True) plus the cast                 (34 B/param nominal)
  deepspeed cpu-adam DeepSpeedCPUAdam, fp32 everything (CPU only, when deepspeed is installed:
                     `make bench` installs it; DS_ACCELERATOR=cpu)     (28 B/param)
and a device copy (read + write bytes) measured in the same run. On CUDA each timed
sample is --queue calls queued back to back between two events, divided by --queue: a
training loop's host runs ahead of the device, so one call's host work (packing the
shard table, the launch) is hidden behind the kernel before it (--queue 1 times single
calls, the host's work included). --launches adds rows of zeroshard bf16 under other
launch choices of the CUDA kernel (zs._C.adamw_cuda_launch: cache policy, blocks per
multiprocessor), e.g. --launches streaming:8,cached:4. GB/s are
bytes-per-param x params / time under the model above; "of copy" is that
bandwidth as a fraction of the copy's; "vs ours" is time / zeroshard bf16 time. Times are the best of
`--repeat` rounds in which every variant runs once, so all see the same load (on a GPU
whose free memory cannot hold every variant at once, each variant's rounds
run alone).

    python -m benchmarks adamw            # full size sweep
    python -m benchmarks adamw --quick    # a few sizes
"""

from __future__ import annotations

import functools
import os
import platform
import time
from datetime import date

import torch

import zeroshard as zs
from benchmarks.harness import machine_info, opt

BYTES = {
    "zeroshard bf16": 28,
    "zeroshard fp32": 28,
    "torch fused": 28,
    "torch fused+cast": 34,
    "torch foreach+cast": 34,
    "deepspeed cpu-adam": 28,
}


def time_once(device, fn, queue=1):
    """Seconds per call of ``queue`` calls of fn in a row (CUDA: between two events)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(queue):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / queue
    t0 = time.perf_counter()
    for _ in range(queue):
        fn()
    return (time.perf_counter() - t0) / queue


def best_times(device, fns, repeat, queue=1):
    """Best seconds per call of each fn, timed round-robin (one sample of each per
    round, after a warm-up round) so every variant sees the same machine load."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            best[name] = min(best[name], time_once(device, fn, queue))
    return best


def copy_bandwidth(device, n, repeat, queue=1):
    """GB/s of dst.copy_(src) on fp32 buffers of n elements, counting read + write."""
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    return 8 * n / best_times(device, {"copy": lambda: dst.copy_(src)}, repeat, queue)["copy"] / 1e9


def base_name(name):
    """A variant's name without its launch choice ("zeroshard bf16 @streaming:8")."""
    return name.split(" @")[0]


# Bytes each variant holds while it runs, per parameter (its tensors plus
# foreach's temporaries, which are one fp32 copy of the parameters).
RESIDENT = {
    "zeroshard bf16": 16,
    "zeroshard fp32": 16,
    "torch fused": 16,
    "torch fused+cast": 18,
    "torch foreach+cast": 22,
    "deepspeed cpu-adam": 16,
}


@functools.lru_cache(None)
def deepspeed_cpu_adam():
    """DeepSpeedCPUAdam's class, or None (with the reason printed once) when deepspeed
    or its compiled cpu_adam op is not available: a benchmark-only peer."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001 - any import or build failure means: skip the peer
        print(f"(DeepSpeedCPUAdam skipped: {type(e).__name__}: {str(e)[:200]}; `make bench` installs deepspeed)")
        return None


def bench_size(device, n, repeat, queue=1, launches=()):
    """Best seconds per step of every variant at n parameters. All variants are
    built together and timed round-robin when they fit in the device's free
    memory; otherwise (1B parameters on an 80 GB GPU) each is built, timed and
    freed in turn."""
    g = torch.Generator(device=device).manual_seed(0)

    def ours(grad_dtype, with_out, launch=None):
        p = torch.randn(n, device=device, generator=g)
        grad = torch.randn(n, device=device, generator=g).to(grad_dtype)
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        out = [torch.empty(n, device=device, dtype=torch.bfloat16)] if with_out else None
        step = [0]

        def run():
            step[0] += 1
            if launch:  # this row's launch choice, then the default back
                zs._C.adamw_cuda_launch(*launch)
            zs.fused_adamw_([p], [grad], [m], [v], lr=1e-3, weight_decay=0.01, step=step[0], outs=out)
            if launch:
                zs._C.adamw_cuda_launch(*default_launch)

        return run

    def torch_adamw(cast, **kw):
        p = torch.nn.Parameter(torch.randn(n, device=device, generator=g))
        p.grad = torch.randn(n, device=device, generator=g)
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **kw)
        if not cast:
            return opt.step
        low = torch.empty(n, device=device, dtype=torch.bfloat16)
        return lambda: (opt.step(), low.copy_(p.detach()))

    def deepspeed(cls):
        p = torch.nn.Parameter(torch.randn(n, device=device, generator=g))
        p.grad = torch.randn(n, device=device, generator=g)
        return cls([p], lr=1e-3, weight_decay=0.01, adamw_mode=True).step

    makers = {
        "zeroshard bf16": lambda: ours(torch.bfloat16, True),
        "zeroshard fp32": lambda: ours(torch.float32, False),
        "torch fused": lambda: torch_adamw(False, fused=True),
        "torch fused+cast": lambda: torch_adamw(True, fused=True),
        "torch foreach+cast": lambda: torch_adamw(True, foreach=True),
    }
    default_launch = zs._C.adamw_cuda_launch() if device == "cuda" else None
    for access, blocks in launches if device == "cuda" else ():
        makers[f"zeroshard bf16 @{access}:{blocks}"] = lambda a=access, b=blocks: ours(
            torch.bfloat16, True, (a == "streaming", b)
        )
    ds = deepspeed_cpu_adam() if device == "cpu" else None
    if ds is not None:
        makers["deepspeed cpu-adam"] = lambda: deepspeed(ds)
    resident = sum(RESIDENT[base_name(name)] for name in makers)
    if device != "cuda" or resident * n < 0.9 * torch.cuda.mem_get_info()[0]:
        return best_times(device, {name: make() for name, make in makers.items()}, repeat, queue)
    best = {}
    for name, make in makers.items():
        best.update(best_times(device, {name: make()}, repeat, queue))
        torch.cuda.empty_cache()
    return best


def device_name(device):
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


OPTIONS = [
    opt("--quick", action="store_true", help="a few sizes only"),
    opt("--devices", default="cpu,cuda", help="comma-separated; cuda is skipped when absent"),
    opt("--sizes", default=None, help="comma-separated parameter counts, e.g. 1e6,2.5e8"),
    opt("--repeat", type=int, default=None),
    opt(
        "--queue",
        type=int,
        default=None,
        help="calls per timed sample on CUDA, queued back to back (default 4; 1 on CPU)",
    ),
    opt(
        "--launches",
        default="",
        help="CUDA: more zeroshard bf16 rows under these launch choices, ACCESS:BLOCKS_PER_SM "
        "comma-separated (ACCESS cached or streaming)",
    ),
]


def check(args):
    if any(x.split(":")[0] not in ("cached", "streaming") for x in args.launches.split(",") if x):
        return f"--launches: ACCESS must be cached or streaming, got {args.launches!r}"
    return None


def run(args):
    devices = [d for d in args.devices.split(",") if d == "cpu" or torch.cuda.is_available()]
    launches = [(a, int(b)) for a, b in (x.split(":") for x in args.launches.split(",") if x)]
    machine = machine_info("cuda" if "cuda" in devices else "cpu")
    report = {
        "date": date.today().isoformat(),
        "commit": machine["commit"],
        "torch": torch.__version__,
        "machine": machine,
        "build": zs.build_info(),
        "bytes_per_param": BYTES,
        "results": [],
    }
    for device in devices:
        if args.sizes:
            sizes = [int(float(s)) for s in args.sizes.split(",")]
        elif device == "cuda":
            sizes = [2**20, 2**24, 2**26] if args.quick else [2**20, 2**24, 2**26, 2**28, 2**29, 2**30]
        else:
            sizes = [2**20, 2**22, 2**24] if args.quick else [2**20, 2**22, 2**24, 2**26]
        repeat = args.repeat or (7 if device == "cpu" else 20)
        queue = 1 if device == "cpu" else (args.queue or 4)
        copy_gbs = copy_bandwidth(device, max(sizes[-1], 2**24) if device == "cuda" else sizes[-1], repeat, queue)
        launch = zs._C.adamw_cuda_launch() if device == "cuda" else None
        print(
            f"\n{device}: {device_name(device)} | torch {torch.__version__} | commit {report['commit']}"
            + (f" | {queue} calls per sample | kernel launch {launch}" if device == "cuda" else "")
        )
        print(f"device copy (read+write): {copy_gbs:.1f} GB/s")
        print(f"{'params':>12} {'variant':<19} {'ms/step':>9} {'GB/s':>8} {'of copy':>8} {'vs ours':>8}")
        for n in sizes:
            try:
                rows = bench_size(device, n, repeat, queue, launches)
            except torch.OutOfMemoryError:
                print(f"{n:>12,} out of memory: stopping the sweep here")
                break
            finally:
                if device == "cuda":
                    torch.cuda.empty_cache()
            base = rows["zeroshard bf16"]
            for name, t in rows.items():
                gbs = BYTES[base_name(name)] * n / t / 1e9
                print(f"{n:>12,} {name:<19} {t * 1e3:>9.3f} {gbs:>8.1f} {gbs / copy_gbs:>8.1%} {t / base:>7.2f}x")
                report["results"].append(
                    {
                        "device": device,
                        "device_name": device_name(device),
                        "params": n,
                        "variant": name,
                        "seconds": t,
                        "gb_per_s": gbs,
                        "calls_per_sample": queue,
                        "copy_gb_per_s": copy_gbs,
                        "fraction_of_copy": gbs / copy_gbs,
                        "time_vs_zeroshard_bf16": t / base,
                    }
                )
    return report
