"""How step time grows with model size and world size: `python -m benchmarks sweep`.

For each model size (GPT, about 3M, 25M and 100M parameters) and world size
(2, 3 and 4 CPU processes with gloo), every variant is timed *paired* with
DDP + fused AdamW: one process group builds the two (each on its own copy
of the model), takes their steps in turn (--paired steps each after
--warmup, the order alternating), and the ratio is the median over turns of
the variant's step time over DDP's in the same turn. One pair at a time
keeps the 100M runs within memory (two copies per rank, not nine).

On a machine with fewer cores than ranks the ranks share them (each rank
gets max(1, cores // world) threads): the sweep prints by how much, and
ratios there measure contention as much as the library.

Writes benchmarks/out/sweep.json and two plots beside it: sweep_size.png (ratio
against model size, one panel per world size) and sweep_world.png (ratio
against world size, one panel per model size). ``--plot-only`` redraws them
from the JSON. The options are the step benchmark's (with --batch 2 --warmup 1
--paired 4) and those below. With ``--variants`` or ``--sizes`` the new points replace
theirs in an existing sweep.json and the others are kept (each point names
its run, and the file lists the runs). ``--memory`` measures instead the
exact tensor peak of the ZeRO-3 variants at every point
(benchmarks/out/sweep_memory.json).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from datetime import date

import torch

from benchmarks import peers
from benchmarks.gpt import GPT, GPTConfig
from benchmarks.report import sweep_memory_table, sweep_table
from benchmarks.harness import git_commit, machine_info, opt, paired_ratio, spawn
from benchmarks.specs.step import options
from benchmarks.training import paired_worker, worker

OPTIONS = options(batch=2, warmup=1, paired=4) + [
    opt("--sizes", default=None, help="comma-separated model sizes (3M,25M,100M; default all)"),
    opt(
        "--memory",
        action="store_true",
        help="the exact tensor peak of the ZeRO-3 variants at every point instead of time (sweep_memory.json)",
    ),
    opt("--plot-only", action="store_true", help="redraw the plots and print the table from the JSON"),
]
# (layers, dim) of the swept GPTs (4 heads, seq 64, vocab 1021): 3.0M, 25.8M, 100.7M parameters
SIZES = {"3M": (4, 240), "25M": (8, 512), "100M": (12, 832)}
WORLDS = (2, 3, 4)
VARIANTS = [
    "zeroshard-1",
    "zeroshard-2",
    "zeroshard-2+overlap",
    "zeroshard-3",
    "fsdp2-3",
    "deepspeed-1",
    "deepspeed-2",
    "deepspeed-3",
]


def run(args):
    if args.plot_only:
        with open(args.json) as f:
            data = json.load(f)
        print(sweep_table(data))
        plot(data, os.path.dirname(args.json))
        return None
    if args.memory:
        args.json = os.path.join(os.path.dirname(args.json), "sweep_memory.json")
        return memory(args)
    return timing(args)


def timing(args) -> dict:
    """The sweep: one process group per pair (the variant and DDP)."""
    variants = peers.runnable(args.variants.split(",") if args.variants else VARIANTS)
    cores = os.cpu_count() or 1
    points, t0 = [], time.time()
    sizes = args.sizes.split(",") if args.sizes else list(SIZES)
    for label, (layers, dim) in ((s, SIZES[s]) for s in sizes):
        cfg = GPTConfig(layers=layers, dim=dim, heads=4, seq=args.seq, vocab=args.vocab)
        for world in WORLDS:
            for v in variants:
                times = spawn(
                    paired_worker, world, ["ddp", v], cfg, args, what=f"{label} world {world} {v}", skip_failed=True
                )
                if times is None:
                    continue
                ratio = paired_ratio(times[v], times["ddp"])
                points.append(
                    dict(
                        size=label,
                        layers=layers,
                        dim=dim,
                        world=world,
                        variant=v,
                        ratio=ratio,
                        ms=1e3 * statistics.median(times[v]),
                        ddp_ms=1e3 * statistics.median(times["ddp"]),
                    )
                )
                print(
                    f"{label:>5} world {world}: {v:<20} {ratio:5.2f}x DDP  ({points[-1]['ms']:.0f} ms vs "
                    f"{points[-1]['ddp_ms']:.0f} ms)  [{time.time() - t0:.0f} s]",
                    flush=True,
                )
    params = {label: _params(*SIZES[label], args) for label in SIZES}
    run_info = dict(date=str(date.today()), commit=git_commit(), variants=variants, sizes=sizes, paired=args.paired)
    for p in points:
        p["run"] = f"{run_info['date']} {run_info['commit']}"
    out = dict(
        date=str(date.today()),
        torch=torch.__version__,
        machine=machine_info("cpu"),
        batch=args.batch,
        seq=args.seq,
        warmup=args.warmup,
        paired=args.paired,
        cores=cores,
        params=params,
        points=points,
        runs=[run_info],
    )
    if (args.variants or args.sizes) and os.path.exists(args.json):
        out = _merged(args.json, out)
    print(sweep_table(out))
    plot(out, os.path.dirname(args.json))
    return out


MEMORY_VARIANTS = ["zeroshard-3", "fsdp2-3", "deepspeed-3"]


def memory(args) -> dict:
    """``--memory``: the exact tensor peak (the step benchmark's "tensor MB": live tensor bytes
    from the CPU allocator's process-wide count, over what the built model holds, two steps) of each
    ZeRO-3 variant at every size and world size of the sweep."""
    variants = peers.runnable(args.variants.split(",") if args.variants else MEMORY_VARIANTS)
    sizes = args.sizes.split(",") if args.sizes else list(SIZES)
    args.steps, args.warmup, args.comm = 1, 0, False  # (the peak is measured in a build of its own)
    rows, t0 = [], time.time()
    for label in sizes:
        layers, dim = SIZES[label]
        cfg = GPTConfig(layers=layers, dim=dim, heads=4, seq=args.seq, vocab=args.vocab)
        for world in WORLDS:
            for v in variants:
                row = spawn(worker, world, v, cfg, args, True, what=f"{label} world {world} {v}", skip_failed=True)
                if row is None:
                    continue
                rows.append(dict(size=label, world=world, variant=v, tensor_mb=row["tensor_mb"]))
                print(
                    f"{label:>5} world {world}: {v:<14} {row['tensor_mb']:8.1f} MB  [{time.time() - t0:.0f} s]",
                    flush=True,
                )
    out = dict(
        date=str(date.today()),
        commit=git_commit(),
        torch=torch.__version__,
        machine=machine_info("cpu"),
        batch=args.batch,
        seq=args.seq,
        param_dtype=args.param_dtype,
        rows=rows,
    )
    if (args.variants or args.sizes) and os.path.exists(args.json):  # keep the other rows
        with open(args.json) as f:
            redone = {(r["variant"], r["size"], r["world"]) for r in rows}
            out["rows"] = [
                r for r in json.load(f)["rows"] if (r["variant"], r["size"], r["world"]) not in redone
            ] + rows
    print(sweep_memory_table(out))
    return out


def _merged(path: str, new: dict) -> dict:
    """A sweep of some variants or sizes (--variants, --sizes) replaces those points in
    the last sweep's file and keeps the others (each point says which run it came from)."""
    with open(path) as f:
        old = json.load(f)
    redone = {(p["variant"], p["size"], p["world"]) for p in new["points"]}
    kept = [p for p in old["points"] if (p["variant"], p["size"], p["world"]) not in redone]
    for p in kept:
        p.setdefault("run", old["date"])
    runs = old.get(
        "runs", [dict(date=old["date"], variants=sorted({p["variant"] for p in kept}), paired=old["paired"])]
    )
    return dict(new, points=kept + new["points"], runs=runs + new["runs"])


def _params(layers: int, dim: int, args) -> int:
    with torch.device("meta"):
        model = GPT(GPTConfig(layers=layers, dim=dim, heads=4, seq=args.seq, vocab=args.vocab))
    return sum(p.numel() for p in model.parameters())


def plot(d: dict, folder: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return
    ratio = {(p["variant"], p["size"], p["world"]): p["ratio"] for p in d["points"]}
    variants = list(dict.fromkeys(p["variant"] for p in d["points"]))
    sizes = [s for s in SIZES if any(k[1] == s for k in ratio)]
    for name, panels, xs, key, xlabel in (
        ("sweep_size.png", WORLDS, sizes, lambda v, panel, x: (v, x, panel), "model size"),
        ("sweep_world.png", sizes, WORLDS, lambda v, panel, x: (v, panel, x), "world size"),
    ):
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), sharey=True, squeeze=False)
        for ax, panel in zip(axes[0], panels):
            for v in variants:
                pts = [(i, ratio[key(v, panel, x)]) for i, x in enumerate(xs) if key(v, panel, x) in ratio]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=v, linestyle="-" if v.startswith("zeroshard") else "--")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks(range(len(xs)), [str(x) for x in xs])
            ax.set_xlabel(xlabel)
            ax.set_title(f"world size {panel}" if xlabel == "model size" else f"GPT {panel}")
        axes[0][0].set_ylabel("step time / DDP's (paired)")
        axes[0][-1].legend(fontsize=7)
        fig.suptitle(f"CPU gloo, {d['cores']} cores, {d['date']}", fontsize=9)
        fig.tight_layout()
        path = os.path.join(folder, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"wrote {path}")
