"""Muon on sharded state (issue 39): Muon over the hidden matrices and AdamW over the
rest, at each ZeRO stage, against DDP + torch.optim.Muon + torch.optim.AdamW.

    python -m benchmarks muon [--sizes 25M,100M] [--worlds 2,3,4] [--steps 3] [--warmup 1]
    python -m benchmarks muon --sizes 100M --worlds 4 --steps 1 --batch-variants 1 \
        --variants zeroshard-1,zeroshard-2,zeroshard-3,deepspeed-1,deepspeed-2,deepspeed-3   # in chunks
    python -m benchmarks muon --ns-fp32 --sizes 3M --variants zeroshard-1,zeroshard-2,zeroshard-3,fsdp2
    python -m benchmarks muon --plot-only                       # table and plot from the JSON

The model is the sweep's GPT at 25M and 100M parameters (batch 2 x seq 64 per
rank, fp32, CPU gloo). Muon (lr 0.02, momentum 0.95) takes the 2-D weights inside the
blocks (qkv, proj, fc, out); AdamW (lr 3e-4, weight decay 0.1) the embeddings (the head is
tied to them), norms and biases. Variants:
  ddp            DDP + torch.optim.Muon + torch.optim.AdamW(fused): every rank runs every
                 matrix's Newton-Schulz (the baseline)
  zeroshard-1/2  two zeroshard.ShardedOptimizer(stage=1/2), Muon's through optimizer_class=
  zeroshard-3    zeroshard.FullyShard(wrap={Block}) and the same two optimizers
  fsdp2          FSDP2 fully_shard per block + root (the step benchmark's fsdp2-3) + torch.optim.Muon
                 and torch.optim.AdamW over its DTensor parameters
  deepspeed-1/2/3  DeepSpeed's Muon ({"type": "Muon"}, its MuonWithAuxAdam; its default
                 Newton-Schulz, "gram") at ZeRO-1/2/3, tagged (use_muon) with the same split
Each (size, world size) runs in one process group. Variants are built in batches
(--batch-variants, so the 100M copies fit in memory), each batch next to a fresh DDP: the
batch and DDP start from the same weights and take their steps in turn on the same data
(the order rotated every turn), so every variant is paired with DDP under the same load.

Per variant, on rank 0:
  opt ms       median of the two optimizers' step() calls (the engine's step() for
               DeepSpeed), after a barrier that ends the backward; "vs DDP/N" is it over
               (DDP's opt ms / N): the target of the issue is <= 1.2x
  step ms      median of the whole step (forward, backward, barrier, steps, zero_grad);
               "vs DDP" is the median over turns of its time over DDP's in the same turn
               (target <= 0.95x)
  comm MB      what rank 0 sends in one more step, counted as the step benchmark does
               (benchmarks/comm_count.py: the backend's events, ring model); "vs AdamW" is
               it over the same stage with AdamW over every parameter (target <= 1.10x)
  update err   max over parameters of |p - p_DDP| / |p_DDP - p_0| (Frobenius) after the
               timed steps: how far its update is from DDP's (in the JSON also over Muon's
               matrices and AdamW's parameters apart). torch's Newton-Schulz runs
               in bf16, so reduction order alone moves it by a few percent; DeepSpeed's
               Muon is another implementation (its own Newton-Schulz and lr scaling).
Also printed: each rank's summed Newton-Schulz cost (rows x cols x min(rows, cols)) of the
matrices zeroshard gives it (ShardedOptimizer.whole_tensor_rule.balance()), and the
largest deviation from the mean (target within 15%).

--ns-fp32 runs the torch-Muon variants (DDP, zeroshard, FSDP2) with Newton-Schulz in fp32
(tests/multiprocess/test_whole_tensor.py's Muon32): where the update is right, its distance from DDP's is
then fp32 rounding, not bf16's (benchmarks/out/muon_ns_fp32.json).

Writes benchmarks/out/muon.json (points of other sizes and world sizes already there are
kept, so the run can be taken in chunks) and benchmarks/out/muon.png. On the 2-core VM the
100M points take --steps 1 and --batch-variants 1 (each variant next to its own DDP, so
that the 100M copies fit in its 23 GB at world sizes 3 and 4).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from datetime import date

import torch
import torch.distributed as dist

from benchmarks import peers, training
from benchmarks.comm_count import count_comm
from benchmarks.gpt import Block, GPTConfig
from benchmarks.harness import ROOT, git_commit, machine_info, opt, spawn
from benchmarks.specs.sweep import SIZES

VARIANTS = ["zeroshard-1", "zeroshard-2", "zeroshard-3", "fsdp2", "deepspeed-1", "deepspeed-2", "deepspeed-3"]
MUON, ADAMW, split = training.MUON, training.ADAMW, training.muon_split
DS_MUON = {
    "type": "Muon",
    "params": {
        "muon_lr": MUON["lr"],
        "momentum": MUON["momentum"],
        "adam_lr": ADAMW["lr"],
        "weight_decay": ADAMW["weight_decay"],
    },
}
TARGETS = dict(opt=1.2, step=0.95, comm=1.10, balance=0.15)


def _tag_like_ours(config_class, model):
    """deepspeed.set_optimizer_flags in its place: use_muon on the same matrices as the
    others (DeepSpeed's own rule would give Muon the 2-D embeddings too)."""
    hidden = {id(p) for p in split(model)[0]}
    for p in model.parameters():
        p.use_muon = id(p) in hidden


def muon_class(ns_fp32: bool):
    """torch.optim.Muon, or with --ns-fp32 tests/multiprocess/test_whole_tensor.py's Muon32 (torch's
    update with Newton-Schulz in fp32: a reference whose only noise is fp32 rounding)."""
    if not ns_fp32:
        return torch.optim.Muon
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_whole_tensor import Muon32

    return Muon32


def build(variant, model, muon=torch.optim.Muon):
    """(model to call, [optimizers]); "zeroshard-S+adamw": the same stage with AdamW over
    every parameter (the bytes' reference); ``muon``: the Muon class of the torch-Muon variants."""
    import zeroshard as zs

    name, _, only_adamw = variant.partition("+")
    if peers.is_deepspeed(name):
        import deepspeed

        deepspeed.set_optimizer_flags = _tag_like_ours
        engine, _ = peers.build_deepspeed(name, model, torch.float32, ADAMW["lr"], optimizer=DS_MUON)
        return engine, [engine]
    wrapped = model
    if name == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    elif name == "fsdp2":
        wrapped, _ = training.build("fsdp2-3", model, torch.float32)
    elif name == "zeroshard-3":
        wrapped = zs.FullyShard(model, wrap={Block})
    stage = None if name in ("ddp", "fsdp2") else int(name[-1])
    return wrapped, training.muon_optimizers(wrapped, stage, muon, fused=name == "ddp", only_adamw=bool(only_adamw))


def train(wrapped, opts, data):
    """One step: (seconds of the forward and backward, seconds of the optimizers' steps),
    a barrier between them, so the second is the step alone."""
    t0 = time.perf_counter()
    loss = wrapped(data[:, :-1], data[:, 1:])
    backward = getattr(opts[0], "backward", None)  # DeepSpeed's engine runs the backward
    backward(loss) if backward is not None else loss.backward()
    dist.barrier()
    t1 = time.perf_counter()
    for o in opts:
        o.step()
    for o in opts:
        o.zero_grad()
    return t1 - t0, time.perf_counter() - t1


def timed(wrapped, opts, data):
    """(whole step, optimizer step) seconds of one step started together on every rank."""
    dist.barrier()
    fwd_bwd, opt = train(wrapped, opts, data)
    return fwd_bwd + opt, opt


def full_params(variant, wrapped):
    """{name: full fp32 tensor} of every parameter (collective: every rank calls it)."""
    if variant == "ddp" or peers.is_deepspeed(variant):
        module = wrapped.module
        if variant == "deepspeed-3":
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                return {n: p.detach().clone().float() for n, p in module.named_parameters()}
        return {n: p.detach().clone().float() for n, p in module.named_parameters()}
    if variant == "zeroshard-3":
        return {n: t.float() for n, t in wrapped.state_dict().items()}
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone().float()
        for n, p in wrapped.named_parameters()
    }


def update_error(p, ref, p0, names) -> float:
    """max over the parameters ``names`` of |p - ref| / |ref - p0|."""
    return max(float((p[n] - ref[n]).norm() / (ref[n] - p0[n]).norm().clamp_min(1e-30)) for n in names)


def measure_batch(batch, cfg, args, data, p0, world):
    """Steps of a fresh DDP and ``batch``'s variants in turn; then each one's distance from
    DDP, and the bytes of one more step of the zeroshard ones. {variant: row} on rank 0."""
    rank = dist.get_rank()
    built, failed = {}, {}
    for v in ["ddp"] + batch:
        try:
            built[v] = build(v, training.new_model(cfg, args, data.device), muon_class(args.ns_fp32))
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here: reported, not fatal
            failed[v] = dict(variant=v, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            if rank == 0:
                print(f"  {v} failed to build: {failed[v]['error']}", flush=True)
    names = list(built)
    whole, opt = ({v: [] for v in names} for _ in range(2))
    for i in range(args.warmup + args.steps):
        k = i % len(names)
        for v in names[k:] + names[:k]:
            w, o = timed(*built[v], data)
            if i >= args.warmup:
                whole[v].append(w)
                opt[v].append(o)
    ref = full_params("ddp", built["ddp"][0]) if rank == 0 else None  # (only rank 0 compares)
    rows = {}
    for v in names:
        row = dict(
            variant=v,
            step_ms=1e3 * statistics.median(whole[v]),
            opt_ms=1e3 * statistics.median(opt[v]),
            step_ratio=statistics.median(a / b for a, b in zip(whole[v], whole["ddp"])),
            opt_ratio=statistics.median(opt[v]) / (statistics.median(opt["ddp"]) / world),
        )
        full = full_params(v, built[v][0]) if v != "ddp" else None  # (collective)
        if rank == 0 and v != "ddp":
            matrices = [n for n in ref if ref[n].dim() == 2 and "blocks." in n]
            row.update(
                update_err=update_error(full, ref, p0, ref),
                update_err_muon=update_error(full, ref, p0, matrices),
                update_err_adamw=update_error(full, ref, p0, [n for n in ref if n not in matrices]),
            )
        del full
        if v.startswith("zeroshard"):
            row["balance"] = built[v][1][0].whole_tensor_rule.balance()
            row["comm_mb"] = comm_mb(built[v], data, world)
        rows[v] = row
    del built
    release_memory()
    return {**rows, **failed}


def release_memory():
    """Frees the last batch's copies and hands the C heap's free pages back to the system
    (glibc keeps them otherwise: at 100M and 4 ranks the next build then ran out of memory)."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def comm_mb(built, data, world):
    """MB rank 0 sends in one step (the step benchmark's "comm MB"); None on the other ranks."""
    if dist.get_rank() != 0:
        train(*built, data)
        return None
    _, sent, _ = count_comm(lambda: train(*built, data), world)
    return None if sent is None else sent / 2**20


def worker(rank, world, port, q, cfg, args):
    _, data, _ = training.setup(rank, world, port, cfg, args)
    p0 = (
        {n: p.detach().clone() for n, p in training.new_model(cfg, args, data.device).named_parameters()}
        if rank == 0
        else None
    )
    rows = {}
    variants = peers.runnable(args.variants)
    for k in range(0, len(variants), args.batch_variants):
        batch = variants[k : k + args.batch_variants]
        t0 = time.time()
        got = measure_batch(batch, cfg, args, data, p0, world)
        ddp = got.pop("ddp")
        rows.setdefault("ddp", dict(ddp, batches=[]))["batches"].append(ddp)  # one DDP per batch
        rows.update(got)
        if rank == 0:
            print(f"  {batch}: {time.time() - t0:.0f} s", flush=True)
    p0 = None
    for v in (v for v in variants if v.startswith("zeroshard")):  # the same stage with AdamW only
        release_memory()
        built = build(v + "+adamw", training.new_model(cfg, args, data.device))
        train(*built, data)
        sent = comm_mb(built, data, world)
        if rank == 0 and sent is not None and rows[v].get("comm_mb"):
            rows[v].update(comm_adamw_mb=sent, comm_ratio=rows[v]["comm_mb"] / sent)
        del built
    if rank == 0:
        q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- report


def balance_spread(load) -> float:
    mean = sum(load) / len(load)
    return max(abs(x - mean) for x in load) / mean


def table(d: dict) -> str:
    """Markdown: one row per (size, world, variant)."""
    lines = [
        "| size | world | variant | opt ms | opt vs DDP/N | step ms | step vs DDP (paired) | comm MB | "
        "comm vs AdamW | update err Muon / AdamW |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(r, key, fmt):
        return fmt.format(r[key]) if r.get(key) is not None else "—"

    for p in d["points"]:
        for r in p["rows"]:
            if "error" in r:
                lines.append(f"| {p['size']} | {p['world']} | {r['variant']} | failed: {r['error']} |||||||")
                continue
            lines.append(
                f"| {p['size']} | {p['world']} | {r['variant']} | {r['opt_ms']:.0f} | "
                + (f"{r['opt_ratio']:.2f}x" if r["variant"] != "ddp" else f"(N = {p['world']})")
                + f" | {r['step_ms']:.0f} | "
                + (f"{r['step_ratio']:.2f}x" if r["variant"] != "ddp" else "1")
                + f" | {cell(r, 'comm_mb', '{:.1f}')} | {cell(r, 'comm_ratio', '{:.2f}x')} | "
                + f"{cell(r, 'update_err_muon', '{:.3f}')} / {cell(r, 'update_err_adamw', '{:.3f}')} |"
            )
    return "\n".join(lines)


def balance_lines(d: dict) -> str:
    out = []
    for p in d["points"]:
        load = p.get("balance")
        if load:
            out.append(
                f"{p['size']} world {p['world']}: Newton-Schulz cost per rank "
                f"{', '.join(f'{x / 1e9:.2f}e9' for x in load)}; largest deviation from the mean "
                f"{100 * balance_spread(load):.1f}%"
            )
    return "\n".join(out)


def plot(d: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("opt_ratio", "optimizer step / (DDP's / N)", TARGETS["opt"]),
        ("step_ratio", "whole step / DDP's (paired)", TARGETS["step"]),
        ("comm_ratio", "bytes sent / same stage with AdamW", TARGETS["comm"]),
    ]
    sizes = list(dict.fromkeys(p["size"] for p in d["points"]))
    if not sizes:
        return
    fig, axes = plt.subplots(len(sizes), len(panels), figsize=(4.4 * len(panels), 3.4 * len(sizes)), squeeze=False)
    for row, size in zip(axes, sizes):
        pts = [p for p in d["points"] if p["size"] == size]
        variants = list(dict.fromkeys(r["variant"] for p in pts for r in p["rows"] if r["variant"] != "ddp"))
        for ax, (key, label, target) in zip(row, panels):
            for v in variants:
                xy = [(p["world"], r[key]) for p in pts for r in p["rows"] if r["variant"] == v and r.get(key)]
                if xy:
                    ax.plot(
                        *zip(*xy),
                        marker="o",
                        label=v,
                        color=f"C{VARIANTS.index(v) % 10}",
                        linestyle="-" if v.startswith("zeroshard") else "--",
                    )
            ax.axhline(target, color="red", linewidth=0.8, linestyle=":", label="target")
            ax.axhline(1.0, color="black", linewidth=0.6)
            ax.set_xticks(sorted({p["world"] for p in pts}))
            ax.set_xlabel("world size")
            ax.set_title(f"GPT {size}: {label}", fontsize=9)
        row[0].legend(fontsize=7)
    fig.suptitle(
        f"Muon + AdamW against DDP + torch.optim.Muon, CPU gloo, {d['machine']['description']}, {d['date']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    print(f"wrote {path}")


def report(d: dict, png) -> None:
    print(table(d))
    print(balance_lines(d))
    if png:
        plot(d, png)


OPTIONS = [
    opt("--sizes", default="25M,100M"),
    opt("--worlds", default="2,3,4"),
    opt("--variants", default=",".join(VARIANTS)),
    opt("--steps", type=int, default=3, help="timed steps of every variant"),
    opt("--warmup", type=int, default=1),
    opt(
        "--batch-variants",
        type=int,
        default=4,
        help="variants built together next to one DDP (fewer: less memory, more DDP steps)",
    ),
    opt("--batch", type=int, default=2),
    opt("--plot-only", action="store_true"),
    opt(
        "--ns-fp32",
        action="store_true",
        help="the torch-Muon variants with Newton-Schulz in fp32 (checks their update against DDP's "
        "to fp32 rounding; writes --json, default benchmarks/out/muon_ns_fp32.json)",
    ),
    opt(
        "--keep-other-variants",
        action="store_true",
        help="at the points this run takes, keep the JSON's rows of the variants it does not run "
        "(each row keeps the commit it was measured at and its own paired DDP)",
    ),
]


def run(args):
    if args.ns_fp32 and os.path.basename(args.json) == "muon.json":
        args.json = args.json.replace(".json", "_ns_fp32.json")
    path = args.json
    png = None if args.ns_fp32 else path.replace(".json", ".png")
    if args.plot_only:
        with open(path) as f:
            report(json.load(f), png)
        return None
    args.variants = args.variants.split(",")
    args.device, args.dtype = "cpu", "float32"  # (training.setup's and training.new_model's)
    points, t0 = [], time.time()
    command = " ".join(["python -m benchmarks"] + sys.argv[1:])
    for size in args.sizes.split(","):
        layers, dim = SIZES[size]
        cfg = GPTConfig(layers=layers, dim=dim, heads=4)
        for world in map(int, args.worlds.split(",")):
            rows = spawn(worker, world, cfg, args, what=f"{size} world {world}", skip_failed=True)
            if rows is None:
                continue
            n = sum(p.numel() for p in training.new_model(cfg, args, torch.device("cpu")).parameters())
            balance = next((r["balance"] for r in rows.values() if r.get("balance")), None)
            commit = git_commit()
            points.append(
                dict(
                    size=size,
                    params=n,
                    world=world,
                    balance=balance,
                    steps=args.steps,
                    warmup=args.warmup,
                    command=command,
                    date=str(date.today()),
                    commit=commit,
                    rows=[dict(r, commit=commit) for r in rows.values()],
                )
            )
            print(f"{size} world {world} done [{time.time() - t0:.0f} s]", flush=True)
    out = dict(
        date=str(date.today()),
        torch=torch.__version__,
        machine=machine_info("cpu"),
        batch=args.batch,
        seq=GPTConfig().seq,
        points=points,
    )
    if os.path.exists(path):  # keep the points of the sizes and world sizes this run did not take
        with open(path) as f:
            old = {(p["size"], p["world"]): p for p in json.load(f)["points"]}
        for p in points if args.keep_other_variants else ():
            was = old.get((p["size"], p["world"]), dict(rows=[]))
            p["rows"] += [
                dict(r, commit=r.get("commit", was.get("commit")))
                for r in was["rows"]
                if r["variant"] != "ddp" and r["variant"] not in args.variants
            ]
            p["rows"].sort(
                key=lambda r: (
                    r["variant"] != "ddp",
                    list(VARIANTS).index(r["variant"]) if r["variant"] in VARIANTS else 99,
                )
            )
        done = {(p["size"], p["world"]) for p in points}
        out["points"] = [p for k, p in old.items() if k not in done] + points
    out["points"].sort(key=lambda p: (list(SIZES).index(p["size"]), p["world"]))
    report(out, png)
    return out
