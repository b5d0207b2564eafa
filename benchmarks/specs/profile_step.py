"""Where does a variant's step time go? Phase times and a profile, CUDA, world size 1.

    python -m benchmarks profile_step --variants adamw,zeroshard-2 [--dtype bfloat16] [--out DIR]

Each variant of the step benchmark is built on GPT-2 124M (batch 8, sequence 1024) in one
process, and after three warm-up steps takes --steps steps with the device synchronized
between the forward, the backward and the optimizer step: the median milliseconds of each
phase. Then two steps run under torch.profiler: the operators with the most host time,
and the host-device synchronisations (cudaStreamSynchronize, cudaDeviceSynchronize,
cudaMemcpy, aten::item / _local_scalar_dense) counted per step, since each stalls the
host until the device catches up (--stack: with the Python frames each is called
from). Writes --out/profile_<variant>.txt and prints the phase table.
--host: the host's time per phase without synchronizing, against the wall time.
--alone: one step timed alone under the profiler, its timeline printed (per phase the
host's span and the device work it launched; the device's tail and longest idle gaps)
and its Chrome trace written gzipped.
"""

from __future__ import annotations

import gzip
import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks import training
from benchmarks.gpt import GPTConfig
from benchmarks.harness import OUT, free_port, init_dist, opt
from benchmarks.specs import offload_trace

SYNCS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaMemcpy",
    "cudaEventSynchronize",
    "aten::item",
    "aten::_local_scalar_dense",
)


def phase_ms(model, opt, data, steps):
    """Median milliseconds of (forward, backward, step) with the device synchronized between."""
    out = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(data[:, :-1], data[:, 1:])
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        out.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    return [1e3 * statistics.median(x[i] for x in out) for i in range(3)]


def host_ms(model, opt, data, steps, each=False):
    """Without synchronizing: the host's milliseconds in each phase call (forward,
    backward, step + zero_grad) per step, the wall milliseconds per step over ``steps``
    steps in a row, and the synchronizing CUDA calls one step makes (torch's sync debug
    mode: count and where each comes from). Where the host's sum is the wall time, the
    host bounds the step; where it is less, the device does and the host runs ahead.
    ``each``: the device synchronized after every step, as the step benchmark times a step alone
    (a phase whose host time grows then waits for the device somewhere inside)."""
    import warnings

    torch.cuda.synchronize()
    phases = [0.0, 0.0, 0.0]
    t_start = time.perf_counter()
    for _ in range(steps):
        if each:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(data[:, :-1], data[:, 1:])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        for k, d in enumerate((t1 - t0, t2 - t1, t3 - t2)):
            phases[k] += d
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t_start) / steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model(data[:, :-1], data[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    where = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{os.path.basename(w.filename)}:{w.lineno}"
            where[key] = where.get(key, 0) + 1
    return [1e3 * p / steps for p in phases], 1e3 * wall, where


def alone_trace(model, opt, data, path):
    """One step timed alone as the step benchmark times it (the device idle at its start,
    synchronized at its end) under the profiler, its phases marked; the Chrome trace
    written gzipped to ``path``; returns it."""
    trace, raw = offload_trace.profiled_step(model, opt, data, sync_phases=False)
    with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    return trace


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def timeline(trace: dict, gaps: int = 6) -> str:
    """Where a step timed alone spends its wall time, from its Chrome trace: per phase
    (forward, backward, step), the host's span and the device work its calls launched
    (matched by correlation id): when that work ran, relative to the step's start, and
    how busy it kept the device; then the device's longest idle gaps, each with the
    phase that launched the work ending it. A device tail (work still running after the
    host's last call) or gaps while the host runs show what a step alone pays and steps
    in a row hide."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    spans = {
        e["name"]: (e["ts"], e["ts"] + e["dur"])
        for e in ev
        if e.get("cat") == "user_annotation" and e["name"] in ("forward", "backward", "step")
    }
    if len(spans) < 3:
        return "timeline: the trace lacks the forward/backward/step ranges"
    t0, host_end = spans["forward"][0], spans["step"][1]
    launched_in = {}
    for e in ev:
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            launched_in[e["args"]["correlation"]] = next(
                (ph for ph, (a, b) in spans.items() if a <= e["ts"] <= b), "outside"
            )
    work = sorted((e for e in ev if e.get("cat") in DEVICE_WORK), key=lambda e: e["ts"])
    lines = []
    for ph, (a, b) in spans.items():
        mine = [
            (e["ts"], e["ts"] + e["dur"]) for e in work if launched_in.get(e.get("args", {}).get("correlation")) == ph
        ]
        dev = (
            (
                f"device {(min(x for x, _ in mine) - t0) / 1e3:7.2f} -> {(max(y for _, y in mine) - t0) / 1e3:7.2f} "
                f"ms, busy {offload_trace.union_ms(mine):6.2f} ms in {len(mine)} calls"
            )
            if mine
            else "no device work"
        )
        lines.append(f"  {ph:<9} host {(a - t0) / 1e3:7.2f} -> {(b - t0) / 1e3:7.2f} ms | {dev}")
    if work:
        end = max(e["ts"] + e["dur"] for e in work)
        busy = offload_trace.union_ms([(e["ts"], e["ts"] + e["dur"]) for e in work])
        lines.append(
            f"  wall {(end - t0) / 1e3:.2f} ms: host done at {(host_end - t0) / 1e3:.2f}, device tail "
            f"{(end - host_end) / 1e3:.2f} ms; device busy {busy:.2f} ms"
        )
        idle, reach = [], work[0]["ts"]
        for e in work:
            if e["ts"] > reach:
                idle.append((e["ts"] - reach, reach, e))
            reach = max(reach, e["ts"] + e["dur"])
        for gap, at, e in sorted(idle, key=lambda g: -g[0])[:gaps]:
            lines.append(
                f"  idle {gap / 1e3:6.2f} ms from {(at - t0) / 1e3:7.2f} ms, until {e['name'][:60]} "
                f"(launched in {launched_in.get(e.get('args', {}).get('correlation'), '?')})"
            )
    return "\n".join(lines)


def profile(model, opt, data, steps=2, stack=False) -> str:
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    verbose = dict(experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True)) if stack else {}
    with torch.profiler.profile(activities=acts, with_stack=stack, **verbose) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("forward+backward"):
                model(data[:, :-1], data[:, 1:]).backward()
            with torch.profiler.record_function("optimizer"):
                opt.step()
                opt.zero_grad()
        torch.cuda.synchronize()
    avg = prof.key_averages()
    syncs = [
        f"  {e.key}: {e.count / steps:g} per step, {e.cpu_time_total / steps / 1e3:.2f} ms host"
        for e in avg
        if any(e.key.startswith(s) for s in SYNCS)
    ]
    if stack:  # where each synchronisation is called from (the Python frames nearest to it)
        syncs += [
            f"  {e.key} x{e.count} from:\n" + "\n".join(f"      {f}" for f in e.stack)
            for e in prof.key_averages(group_by_stack_n=8)
            if any(e.key.startswith(s) for s in SYNCS)
        ]
    return (
        "host-device synchronisations:\n"
        + ("\n".join(syncs) or "  none")
        + "\n\n"
        + avg.table(sort_by="self_cpu_time_total", row_limit=30)
        + "\n"
        + avg.table(sort_by="self_device_time_total", row_limit=20)
    )


OPTIONS = [
    opt("--variants", default="adamw,zeroshard-2"),
    opt("--dtype", choices=["float32", "bfloat16"], default="bfloat16"),
    opt("--param-dtype", choices=["float32", "bfloat16"], default="bfloat16"),
    opt("--steps", type=int, default=10),
    opt("--batch", type=int, default=8),
    opt("--out", default=OUT, help="where the profiles and traces go"),
    opt("--stack", action="store_true", help="also the Python stacks the synchronisations come from"),
    opt(
        "--host",
        action="store_true",
        help="only the host's time per phase without synchronizing, against the wall time, and "
        "the synchronizing calls of a step (no profile): steps in a row, then each alone",
    ),
    opt(
        "--alone",
        action="store_true",
        help="only a profiled step timed alone per variant: its timeline (where the wall time goes) "
        "printed, its Chrome trace written gzipped to --out/alone_<variant>.json.gz",
    ),
]


JSON = None  # it writes profiles and traces into --out


def run(args):
    args.prefetch, args.shard_size = 1, None
    device = init_dist(0, 1, free_port(), cuda=True)
    cfg = GPTConfig(layers=12, dim=768, heads=12, seq=1024, vocab=50257)
    data = torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1), device=device)
    os.makedirs(args.out, exist_ok=True)
    print(f"{'variant':<20} {'forward':>8} {'backward':>9} {'step':>7} {'total':>7}  (ms, {args.dtype})")
    for v in args.variants.split(","):
        model, opt = training.build(v, training.new_model(cfg, args, device), getattr(torch, args.param_dtype))
        for _ in range(3):
            training.train_step(model, opt, data, torch.cuda.synchronize)
        if args.alone:
            trace = alone_trace(model, opt, data, os.path.join(args.out, f"alone_{v}.json.gz"))
            print(f"{v}: one step timed alone\n{timeline(trace)}", flush=True)
        elif args.host:
            for each in (False, True):
                (f, b, s), wall, where = host_ms(model, opt, data, args.steps, each)
                print(
                    f"{v:<20} {'alone' if each else 'in a row'}: host forward {f:.2f} backward {b:.2f} step "
                    f"{s:.2f} = {f + b + s:.2f} ms | wall {wall:.2f} ms per step | syncs in a step: "
                    f"{where or 'none'}",
                    flush=True,
                )
        if args.alone or args.host:
            training.settle(opt)
            del model, opt
            torch.cuda.empty_cache()
            continue
        f, b, s = phase_ms(model, opt, data, args.steps)
        print(f"{v:<20} {f:>8.2f} {b:>9.2f} {s:>7.2f} {f + b + s:>7.2f}", flush=True)
        with open(os.path.join(args.out, f"profile_{v}.txt"), "w") as fh:
            fh.write(
                f"{v}: forward {f:.2f} ms, backward {b:.2f} ms, step {s:.2f} ms\n\n"
                + profile(model, opt, data, stack=args.stack)
            )
        training.settle(opt)
        del model, opt
        torch.cuda.empty_cache()
    dist.destroy_process_group()
