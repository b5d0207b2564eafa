"""Do offload's device-to-host gradient copies overlap the backward? One profiled step.

    python -m benchmarks offload_trace [--stage 2] [--offload cpu] [--out DIR]    # CUDA only

GPT-2 124M (benchmarks/gpt.py: 12 layers, 768 wide, sequence 1024, vocabulary 50257),
batch 8, bf16 parameters, world size 1 with NCCL, ShardedOptimizer(stage, offload=...) or
FullyShard + ShardedOptimizer(offload=...) at --stage 3. After two warm-up steps one step
runs under torch.profiler with the device synchronized between the forward, the backward
and the optimizer step, so each phase's GPU work lies inside its own interval. From the
profiler's trace (kernels and memory copies with their streams):

  backward       the interval's kernel time (the union of kernel intervals), its
                 device-to-host copies (count, MB, copy time) and the share of that copy
                 time during which a kernel ran on another stream: the overlap
  exposed        the copy time during which no kernel ran on another stream (what the
                 copies could add to the step; the buckets that complete last, such as
                 the one holding a tied embedding's gradient, can only be copied after
                 the backward's compute)
  gpu_ms         the phase's span on the device (first kernel to the end of the last kernel or
                 copy): when kernel_ms is much less, the host kept the device waiting, and a
                 copy not under a kernel (exposed) ran in that idle time rather than adding to it
  step           the device-to-host copies left for the optimizer step (gradients should
                 need none: [Note: offloaded gradients]) and its host-to-device copies

Prints the summary, writes it as JSON (--out/offload_trace.json) and the gzipped Chrome
trace beside it (offload_trace.json.gz; chrome://tracing or ui.perfetto.dev).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from benchmarks.gpt import GPT, Block, GPTConfig
from benchmarks.harness import free_port, init_dist, opt


def union_ms(spans) -> float:
    """Total length of the union of (start, end) intervals (µs in, ms out)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def overlap_us(span, others) -> float:
    """How much of ``span`` lies under the union of ``others`` (µs)."""
    a, b = span
    clipped = sorted((max(a, x), min(b, y)) for x, y in others if y > a and x < b)
    return union_ms(clipped) * 1e3


def phases(trace: dict) -> dict:
    """{phase: (start, end)} of the step's record_function ranges (CPU time, µs)."""
    return {
        e["name"]: (e["ts"], e["ts"] + e["dur"])
        for e in trace["traceEvents"]
        if e.get("cat") == "user_annotation" and e.get("name") in ("forward", "backward", "step")
    }


def per_copy(trace: dict, phase: str = "backward") -> list:
    """Each device-to-host copy of ``phase``: (ms after the phase's first kernel, ms, MB,
    share of it under a kernel on another stream)."""
    a, b = phases(trace)[phase]
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e and a <= e["ts"] <= b]
    ks = [(e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in ev if e.get("cat") == "kernel"]
    t0 = min((k[0] for k in ks), default=a)
    return [
        (
            (c["ts"] - t0) / 1e3,
            c["dur"] / 1e3,
            c.get("args", {}).get("bytes", 0) / 2**20,
            overlap_us((c["ts"], c["ts"] + c["dur"]), [(x, y) for x, y, t in ks if t != c.get("tid")]) / c["dur"],
        )
        for c in sorted(ev, key=lambda e: e["ts"])
        if c.get("cat") == "gpu_memcpy" and "DtoH" in c["name"]
    ]


def summarise(trace: dict) -> dict:
    """The summary above, from a Chrome trace of one step."""
    spans = phases(trace)
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    copies = [e for e in ev if e.get("cat") == "gpu_memcpy"]

    def inside(e, phase):
        a, b = spans[phase]
        return a <= e["ts"] <= b

    def span(e):
        return e["ts"], e["ts"] + e["dur"]

    def mb(es):
        return sum(e.get("args", {}).get("bytes", 0) for e in es) / 2**20

    out = {}
    for phase in ("backward", "step"):
        ks = [e for e in kernels if inside(e, phase)]
        d2h = [e for e in copies if inside(e, phase) and "DtoH" in e["name"]]
        h2d = [e for e in copies if inside(e, phase) and "HtoD" in e["name"]]
        copy_us = sum(e["dur"] for e in d2h)
        under = sum(overlap_us(span(c), [span(k) for k in ks if k.get("tid") != c.get("tid")]) for c in d2h)
        # the GPU's part of the phase: from its first kernel to the end of its last kernel or
        # copy; the kernels' share of it says whether the host kept the device busy
        work = [span(e) for e in ks + d2h + h2d]
        gpu_ms = (max(b for _, b in work) - min(a for a, _ in work)) / 1e3 if work else 0.0
        out[phase] = dict(
            kernel_ms=union_ms([span(k) for k in ks]),
            kernels=len(ks),
            gpu_ms=gpu_ms,
            d2h=len(d2h),
            d2h_mb=mb(d2h),
            d2h_ms=copy_us / 1e3,
            d2h_overlap=(under / copy_us) if copy_us else None,
            d2h_exposed_ms=(copy_us - under) / 1e3,
            h2d=len(h2d),
            h2d_mb=mb(h2d),
        )
    return out


def profiled_step(model, opt, data, sync_phases: bool = True):
    """One step under the profiler, its phases marked, the device idle at its start and
    synchronized at its end (``sync_phases``: also between phases); (the trace, the path
    of its JSON file, the caller's to remove)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    sync = torch.cuda.synchronize if sync_phases else (lambda: None)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        torch.cuda.synchronize()
        with torch.profiler.record_function("forward"):
            loss = model(data[:, :-1], data[:, 1:])
            sync()
        with torch.profiler.record_function("backward"):
            loss.backward()
            sync()
        with torch.profiler.record_function("step"):
            opt.step()
            opt.zero_grad()
            sync()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    return trace, path


OPTIONS = [
    opt("--stage", type=int, choices=[1, 2, 3], default=2),
    opt("--offload", choices=["cpu", "nvme"], default="cpu"),
    opt("--batch", type=int, default=8),
]


def run(args):
    import zeroshard as zs

    device = init_dist(0, 1, free_port(), cuda=True)
    cfg = GPTConfig(layers=12, dim=768, heads=12, seq=1024, vocab=50257)
    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=torch.bfloat16)
    off = dict(offload=args.offload, offload_dir=tempfile.mkdtemp() if args.offload == "nvme" else None)
    if args.stage == 3:
        model = zs.FullyShard(
            model.float(),
            wrap={Block},
            mixed_precision=zs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
        opt = zs.ShardedOptimizer(model.parameters(), lr=3e-4, **off)
    else:
        opt = zs.ShardedOptimizer(model.parameters(), lr=3e-4, stage=args.stage, **off)
    data = torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1), device=device)
    for _ in range(2):
        model(data[:, :-1], data[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    trace, path = profiled_step(model, opt, data)
    summary = dict(
        stage=args.stage,
        offload=args.offload,
        batch=args.batch,
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        **summarise(trace),
        copies=per_copy(trace),
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(path, "rb") as src, gzip.open(args.json + ".gz", "wb") as dst:  # the Chrome trace beside it
        shutil.copyfileobj(src, dst)
    os.remove(path)
    b, s = summary["backward"], summary["step"]
    print(f"offload={args.offload} stage {args.stage}, GPT-2 124M, batch {args.batch}, {summary['device']}")
    print(
        f"backward: {b['kernel_ms']:.1f} ms of kernels; {b['d2h']} device-to-host copies, {b['d2h_mb']:.1f} MB, "
        f"{b['d2h_ms']:.1f} ms of copying, "
        + (f"{100 * b['d2h_overlap']:.1f}% of it under compute" if b["d2h_overlap"] is not None else "none")
        + f"; {b['d2h_exposed_ms']:.1f} ms of it exposed; kernels ran {b['kernel_ms']:.1f} ms of the "
        f"backward's {b['gpu_ms']:.1f} ms on the device"
    )
    print(
        f"step: {s['kernel_ms']:.1f} ms of kernels; {s['d2h']} device-to-host copies ({s['d2h_mb']:.1f} MB), "
        f"{s['h2d']} host-to-device ({s['h2d_mb']:.1f} MB)"
    )
    dist.destroy_process_group()
    return summary
