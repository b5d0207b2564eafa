"""Compressed weight gathers at ZeRO-3, in one run (docs/compressed-communication.md).

    python -m benchmarks compressed [--steps 300] [--dim 128] [--layers 4] [--rounds 5]

Four gloo ranks on this machine; the demo's GPT (examples/train_gpt.py, character data)
under FullyShard, one unit per block, bf16 gathers, trained ``--steps`` steps in each
variant from the same start on the same batches: bf16 gathers (the reference),
bf16 gathers on other batches (how far the final loss moves by chance alone),
``gather_dtype="int8"`` in blocks of 256, 128 and 64, ``"fp8"``, and int8 with
``reshard_after_forward=2`` (each pair of ranks standing for a node). Printed per variant: the bytes one step's weight
all-gathers moved over every rank and inside the pairs (exact, from the flight record:
the records' elements times their size), against the bf16 run's; the median step time
of ``--rounds`` paired rounds of 10 steps (each variant in turn, after the training);
and the final loss (mean of the last 20 steps) against the bf16 run's. Writes
benchmarks/out/compressed.json.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.harness import opt, spawn

VARIANTS = {
    "bf16 gathers": dict(),
    "bf16 gathers, other batches": dict(seed=2),  # (the noise floor of the final loss)
    "int8 gathers, blocks of 256": dict(gather_dtype="int8", block=256),
    "int8 gathers, blocks of 128": dict(gather_dtype="int8", block=128),
    "int8 gathers, blocks of 64": dict(gather_dtype="int8", block=64),
    "fp8 gathers, blocks of 256": dict(gather_dtype="fp8", block=256),
    "int8 (128) + reshard_after_forward=2": dict(gather_dtype="int8", block=128, after=2),
}


def _gathered_bytes(rec: dict, world: int) -> int:
    """The bytes an all-gather's record stands for, every rank's chunk counted: a gather of
    chunks of different lengths (the quantized wire records, a post-forward gather) records
    its whole output; one of equal chunks (bf16) records this rank's chunk, one of ``world``."""
    item = 2 if rec["dtype"] == "bfloat16" else 4
    whole = any(k in rec["what"] for k in (" in int8", " in fp8", "post-forward"))
    return rec["numel"] * item * (1 if whole else world)


def _worker(rank: int, world: int, port: int, out, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import zeroshard as zs
    from benchmarks.gpt import GPT, Block, GPTConfig
    from train_gpt import CharData, make_corpus

    data = CharData(make_corpus(), vocab=64)
    cfg = GPTConfig(vocab=64, dim=args.dim, layers=args.layers)

    def build(v):
        torch.manual_seed(0)
        mp = zs.MixedPrecision(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            gather_dtype=v.get("gather_dtype"),
            gather_block_size=v.get("block", 256),
        )
        model = zs.FullyShard(GPT(cfg), wrap={Block}, mixed_precision=mp, reshard_after_forward=v.get("after", True))
        return model, zs.ShardedOptimizer(model.parameters(), lr=1e-3)

    def step(model, opt_, k, seed=1):
        x, y = data.batch(8, cfg.seq, k, rank, 0, seed)
        loss = model(x, y)
        loss.backward()
        opt_.step()
        opt_.zero_grad()
        return loss.item()

    world_group = dist.group.WORLD.group_name
    runs, losses, moved = {}, {}, {}
    for name, v in VARIANTS.items():
        model, opt_ = build(v)
        curve = []
        for k in range(args.steps):
            start = time.time()  # (the flight record keeps its last records: select by start time)
            curve.append(step(model, opt_, k, v.get("seed", 1)))
        recs = [
            r for r in zs.flight_record() if r["start"] >= start and r["kind"] == "all_gather" and "unit" in r["what"]
        ]
        size = lambda r: _gathered_bytes(r, world)  # noqa: E731
        moved[name] = dict(
            every=sum(size(r) for r in recs if r["group"] == world_group),
            pairs=sum(size(r) for r in recs if r["group"] != world_group),
        )
        losses[name] = curve
        runs[name] = (model, opt_)
    times = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name, (model, opt_) in runs.items():
            dist.barrier()
            t = time.perf_counter()
            for k in range(10):
                step(model, opt_, args.steps + 10 * r + k)
            times[name].append((time.perf_counter() - t) / 10)
    if rank == 0:
        out.put(
            dict(
                world=world,
                steps=args.steps,
                params=sum(p.numel() for p in GPT(cfg).parameters()),
                moved=moved,
                ms={k: 1e3 * statistics.median(v) for k, v in times.items()},
                final={k: sum(v[-20:]) / len(v[-20:]) for k, v in losses.items()},
                curves=losses,
            )
        )
    dist.destroy_process_group()


OPTIONS = [
    opt("--steps", type=int, default=300),
    opt("--dim", type=int, default=128),
    opt("--layers", type=int, default=4),
    opt("--rounds", type=int, default=5),
]


def run(args):
    res = spawn(_worker, 4, args)
    ref = res["moved"]["bf16 gathers"]["every"]
    base_ms, base_loss = res["ms"]["bf16 gathers"], res["final"]["bf16 gathers"]
    print(f"{res['params'] / 1e6:.2f}M parameters, {res['world']} gloo ranks, {res['steps']} steps")
    print(
        "| variant | bytes over every rank | vs bf16 | bytes inside pairs | ms/step | vs bf16 | final loss | vs bf16 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in VARIANTS:
        m, ms, fl = res["moved"][name], res["ms"][name], res["final"][name]
        print(
            f"| {name} | {m['every']:,} | {m['every'] / ref:.3f}x | {m['pairs']:,} | {ms:.1f} | {ms / base_ms:.2f}x "
            f"| {fl:.4f} | {(fl - base_loss) / base_loss:+.2%} |"
        )
    return res
