"""Thousands of ranks, rehearsed on one machine: what grows with the world size N in
zeroshard's own host work (issue 57).

    python -m benchmarks scale [--worlds 8,64,512,4096] [--variants ...] [--steps 12]
    python -m benchmarks scale --plot-only          # table and plot from the JSON

One process plays rank 0 of N over the no-op process group ([Note: no-op process group]
in python/zeroshard/comm/noop.py): every collective returns at once, so what is timed is
the host's own work, the part that sits between kernels on a GPU cluster. The model is
8 blocks (LayerNorm, Linear 264 -> 1056, GELU, Linear 1056 -> 264; 4.47M parameters,
fp32), a batch of 4 x 264. Variants:
  zeroshard-1/2/3         ShardedOptimizer(stage=1/2), FullyShard(wrap={Block}) + ShardedOptimizer
  hybrid-2/3              the same with shard_size=8 (from N = 16)
  muon-2/3, muon-hybrid-2/3  Muon over the 16 matrices (optimizer_class=torch.optim.Muon),
                          AdamW over the rest: each matrix updated whole on one owner rank
  zeroshard-3/fake-pg     zeroshard-3 over torch's fake process group (backend "fake") instead,
                          which copies each all-gather's input into all N chunks of its output
Each (variant, N) runs in its own process. Columns:
  build ms    construction of the wrapper and the optimizer(s)
  step ms     host time of one step (forward, backward, step, zero_grad): the quickest of
              --steps after 3 warm-up steps; "x N=first" is it over the variant's first N
  colls       collectives one step issues (all of them single-tensor when "tensors" is 1:
              the most tensors any one collective was given, N + 1 for a chunk list)
  state / formula   this rank's parameter, gradient and optimizer-state bytes (memory_report's
              total, padding included) over the planner's formula for the stage (fp32:
              16 bytes a parameter over N at ZeRO-3, over S = 8 with hybrid sharding); with
              Muon rank 0 owns a matrix from N = 16 on, which it holds whole
  padding     the bytes of that total that the layout adds
Then, for the same model at each N (no process group needed):
  diagnosis lines   the watchdog's message for a divergence where rank N/8 is one
              collective behind the others and one rank did not answer
  manifest MB       the checkpoint manifest of a ZeRO-3 save at N ranks (synthetic, with
              the layout of FullyShard's equal unit chunks: one entry per piece of each
              parameter and state on each rank); "plan ms" is the time one rank of a
              load at N/2 ranks takes to find the entries its pieces overlap
Writes benchmarks/out/scale.json and benchmarks/out/scale.png; prints a markdown table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from benchmarks.harness import command, machine_info, opt, run_env, write_json

D, BLOCKS, BATCH, SHARD = 264, 8, 4, 8
VARIANTS = [
    "zeroshard-1",
    "zeroshard-2",
    "zeroshard-3",
    "hybrid-2",
    "hybrid-3",
    "muon-2",
    "muon-3",
    "muon-hybrid-2",
    "muon-hybrid-3",
    "zeroshard-3/fake-pg",
]


def _model():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(D)
            self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.ln(x))))

    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(BLOCKS)]), Block


def _build(variant: str):
    import torch
    import zeroshard as zs

    model, block = _model()
    stage = int(variant[-1])
    hybrid = {"shard_size": SHARD} if "hybrid" in variant else {}
    if stage == 3:
        model = zs.FullyShard(model, wrap={block}, **hybrid)
        hybrid, kw = {}, {}
    else:
        kw = {"stage": stage}
    if variant.startswith("muon"):
        mats = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        opts = [
            zs.ShardedOptimizer(mats, optimizer_class=torch.optim.Muon, lr=0.02, **kw, **hybrid),
            zs.ShardedOptimizer(rest, lr=1e-3, **kw, **hybrid),
        ]
    else:
        opts = [zs.ShardedOptimizer(model.parameters(), lr=1e-3, **kw, **hybrid)]
    return model, opts


def run_one(variant: str, world: int, steps: int) -> dict:
    """One (variant, N) point, in this process."""
    import contextlib
    import torch
    import torch.distributed as dist
    from zeroshard.comm import noop

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # (the no-op backend leaves float outputs as they were)

    @contextlib.contextmanager
    def fake_world():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        try:
            yield
        finally:
            dist.destroy_process_group()

    x = torch.randn(BATCH, D)
    with fake_world() if variant.endswith("fake-pg") else noop.noop_world(world):
        t0 = time.perf_counter()
        model, opts = _build(variant.split("/")[0])
        built = time.perf_counter() - t0
        times = []
        for i in range(3 + steps):
            if i == 3:
                noop.calls.clear()
            t = time.perf_counter()
            model(x).square().mean().backward()
            for o in opts:
                o.step()
                o.zero_grad()
            times.append(time.perf_counter() - t)
            if i == 3:
                colls = dict(noop.calls)
        import zeroshard as zs

        rep = (
            model.memory_report()
            if isinstance(model, zs.FullyShard)
            else {k: sum(o.memory_report()[k] for o in opts) for k in ("total", "padding")}
        )
        params = sum(p.numel() for p in _model()[0].parameters())
    stage = int(variant.split("/")[0][-1])
    from zeroshard.plan.formula import model_state_bytes

    formula = model_state_bytes(params, world, "fp32", SHARD if "hybrid" in variant else None)[f"ZeRO-{stage}"]
    return {
        "variant": variant,
        "world": world,
        "build_ms": built * 1e3,
        "step_ms": min(times[3:]) * 1e3,
        "collectives": sum(colls.values()),
        "most_tensors": max((n for _, n in colls), default=0),
        "state_bytes": rep["total"],
        "formula_bytes": formula["total"],
        "padding_bytes": rep["padding"],
        "params": params,
    }


# ---------------------------------------------------------------- diagnosis and manifest


def diagnosis_lines(world: int) -> int:
    """Lines of the watchdog's diagnosis of a divergence at ``world`` ranks (pure)."""
    from zeroshard.comm import watchdog

    def rec(seq, kind, what, end):
        return {
            "seq": seq,
            "group": "0",
            "kind": kind,
            "what": what,
            "numel": 10,
            "dtype": "float32",
            "start": 0.0,
            "end": end,
        }

    common = [
        rec(41, "reduce_scatter", "step 7, backward", 1.0),
        rec(42, "all_gather", "unit 'blocks.1'", 1.0),
        rec(43, "all_gather", "unit 'blocks.2'", None),
    ]
    odd = world // 8
    reports = {
        r: {"cause": "timed out", "records": common[:1] if r == odd else common} for r in range(world) if r != world - 1
    }
    return len(watchdog.diagnose(reports, "0", world, now=30.0).splitlines())


def _pieces(numels, world: int, align: int = 4):
    """{tensor index: [(rank, start, numel)]} of one unit's tensors laid out one after another
    (each start aligned) and cut into ``world`` equal chunks, as FullyShard lays a unit out."""
    offsets, pos = [], 0
    for n in numels:
        offsets.append(pos)
        pos += -(-n // align) * align
    chunk = -(-pos // world)
    out = {}
    for i, (off, n) in enumerate(zip(offsets, numels)):
        r = off // chunk
        while r * chunk < off + n:
            lo, hi = max(off, r * chunk), min(off + n, (r + 1) * chunk)
            if lo < hi:
                out.setdefault(i, []).append((r, lo - off, hi - lo))
            r += 1
    return out


def manifest(world: int) -> tuple:
    """(manifest bytes, ms for one rank of a load at world // 2 to find its entries) of a
    synthetic ZeRO-3 checkpoint of the benchmark's model saved at ``world`` ranks."""
    import bisect
    from zeroshard.checkpoint import files

    model, _ = _model()
    units = [[(f"{b}.{n}", p) for n, p in blk.named_parameters()] for b, blk in enumerate(model)]
    tensors, entries_of = {}, {}
    for unit in units:
        for i, pieces in _pieces([p.numel() for _, p in unit], world).items():
            name, p = unit[i]
            for state in ("param", "exp_avg", "exp_avg_sq"):
                key = f"{state}:{name}"
                ents = [[f"rank{r}.safetensors", 4096 * r, s, n, [0] * -(-n * 4 // files.BLOCK)] for r, s, n in pieces]
                tensors[key] = {
                    "shape": list(p.shape),
                    "dtype": "float32",
                    "model_dtype": "float32",
                    "step": 1,
                    "entries": ents,
                }
                entries_of[key] = ents
    body = {
        "world_size": world,
        "stage": 3,
        "block_bytes": files.BLOCK,
        "tensors": tensors,
        "files": {f"rank{r}.safetensors": {"size": 1, "crc32": 0} for r in range(world)},
    }
    size = len(files.manifest_bytes(body))
    # one rank of the load at world // 2: the entries each of its pieces overlaps, found as
    # the loader finds them (bisect on the sorted starts)
    new = max(1, world // 2)
    t0 = time.perf_counter()
    found = 0
    for unit in units:
        for i, pieces in _pieces([p.numel() for _, p in unit], new).items():
            name = unit[i][0]
            for state in ("param", "exp_avg", "exp_avg_sq"):
                ents = entries_of[f"{state}:{name}"]
                starts = [e[2] for e in ents]
                for r, s, n in pieces:
                    if r != new // 3:
                        continue
                    lo = max(0, bisect.bisect_right(starts, s) - 1)
                    found += sum(1 for e in ents[lo : bisect.bisect_left(starts, s + n)] if e[2] + e[3] > s)
    return size, (time.perf_counter() - t0) * 1e3


# ---------------------------------------------------------------- table, plot, main


def table(d: dict) -> str:
    rows = d["points"]
    first = {}
    for r in rows:
        first.setdefault(r["variant"], r)
    lines = [
        "| variant | N | build ms | step ms | x N=first | colls | tensors | state / formula | padding MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['world']} | {r['build_ms']:.0f} | {r['step_ms']:.1f} | "
            f"{r['step_ms'] / first[r['variant']]['step_ms']:.2f} | {r['collectives']} | "
            f"{r['most_tensors']} | {r['state_bytes'] / r['formula_bytes']:.2f} | "
            f"{r['padding_bytes'] / 1e6:.1f} |"
        )
    lines += ["", "| N | diagnosis lines | manifest MB | plan ms (load at N/2) |", "|---:|---:|---:|---:|"]
    for w, v in sorted(d["pure"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {w} | {v['diagnosis_lines']} | {v['manifest_bytes'] / 1e6:.2f} | {v['plan_ms']:.2f} |")
    return "\n".join(lines)


def plot(d: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for v in dict.fromkeys(r["variant"] for r in d["points"]):
        pts = [r for r in d["points"] if r["variant"] == v]
        ws = [r["world"] for r in pts]
        axes[0].plot(ws, [r["step_ms"] for r in pts], marker="o", label=v)
        axes[1].plot(ws, [r["build_ms"] for r in pts], marker="o", label=v)
    for ax, title in zip(axes, ("host time of one step (ms)", "construction (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size N (rank 0 of N, no-op process group)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"zeroshard's host work against the world size ({d['machine']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


OPTIONS = [
    opt("--worlds", default="8,64,512,4096"),
    opt("--variants", default=",".join(VARIANTS)),
    opt("--steps", type=int, default=12),
    opt("--one", nargs=2, metavar=("VARIANT", "N")),
    opt("--plot-only", action="store_true"),
]


def run(a):
    path = a.json
    if a.one:  # one point, in a process of its own: its JSON on stdout
        print(json.dumps(run_one(a.one[0], int(a.one[1]), a.steps)))
        return None
    if not a.plot_only:
        worlds = [int(w) for w in a.worlds.split(",")]
        points = []
        for v in a.variants.split(","):
            for w in worlds:
                if "hybrid" in v and w <= SHARD:
                    w = 2 * SHARD
                if v.endswith("fake-pg") and w not in (worlds[0], worlds[-1]):
                    continue
                got = subprocess.run(
                    command("scale", "--one", v, str(w), "--steps", str(a.steps)),
                    capture_output=True,
                    text=True,
                    env=run_env(),
                )
                if got.returncode:
                    sys.exit(f"{v} at N={w} failed:\n{got.stderr[-3000:]}")
                points.append(json.loads(got.stdout.strip().splitlines()[-1]))
                print(
                    f"{v:>22} N={w:<5} build {points[-1]['build_ms']:8.0f} ms  step {points[-1]['step_ms']:7.1f} ms",
                    flush=True,
                )
        pure = {}
        for w in worlds:
            size, ms = manifest(w)
            pure[str(w)] = {"diagnosis_lines": diagnosis_lines(w), "manifest_bytes": size, "plan_ms": ms}
        info = machine_info()
        d = {
            "date": time.strftime("%Y-%m-%d"),
            "commit": info["commit"],
            "machine": info["description"],
            "torch": info["torch"],
            "points": points,
            "pure": pure,
        }
        write_json(path, d)
    with open(path) as f:
        d = json.load(f)
    plot(d, os.path.join(os.path.dirname(path), "scale.png"))
    print(table(d))
    return None
