"""One training step of a small GPT: time and peak memory per variant, in one run.

Variants (world size 2, CPU + gloo, unless --world-size / --device say otherwise):
  adamw         no DDP, torch.optim.AdamW(fused=True): the world-size-1 baseline
  adamw-amp     the same with fp32 parameters and the forward under
                torch.autocast(bfloat16): plain mixed-precision training
  ddp           DDP + torch.optim.AdamW(fused=True)
  ddp+zero      DDP + torch ZeroRedundancyOptimizer(AdamW)
  fsdp2         FSDP2 fully_shard per block + root, reshard_after_forward=False
                (ZeRO-2-like; gloo needs set_force_sum_reduction_for_comms(True))
  zeroshard-1   zeroshard.ShardedOptimizer(stage=1)
  zeroshard-2   zeroshard.ShardedOptimizer(stage=2)
  zeroshard-2@5 the same with bucket_mb=5 (less transient bucket memory)
  fsdp2-3       FSDP2 fully_shard per block + root, reshard_after_forward=True (ZeRO-3)
  zeroshard-3   zeroshard.FullyShard(wrap={Block}) + ShardedOptimizer (ZeRO-3)
  zeroshard-3@p0  the same with prefetch=0 (CPU only: gathers each unit when it
                runs, as FSDP2 does on CPU, where its prefetching needs CUDA
                streams; the memory-matched comparison)
  zeroshard-2+cpu / +nvme   the same with offload="cpu" / "nvme"
  adamw+muon, adamw-amp+muon, zeroshard-1/2/3+muon   the variant with Muon over the
                blocks' matrices and AdamW over the rest (the muon benchmark's split and
                hyperparameters): torch.optim.Muon on the plain model, or through zeroshard
The two ZeRO-3 variants use the same units and the same mixed precision
(--param-dtype for the gathered parameters, fp32 reduction and shards).
Each variant runs in fresh processes, in --rounds rounds that each run every
variant once in turn (so all see the same machine load). "step ms" is the
median over a round's timed steps on rank 0, and the median of that over the
rounds; "peak MB" is the rise of rank 0's peak resident memory over what it
held after building the model (the optimizer, gradients, communication
buffers and activations of the steps, plus whatever the C allocator keeps
cached), in the first round. glibc runs with its default settings, as a
training job would. Ratios are against DDP, and "zs2 vs" is the variant's
time over zeroshard stage 2's.

"paired" is a steadier time ratio against DDP: after the rounds, one process
group builds every variant, each on its own copy of the model, and takes
their steps in turn (--paired steps each, the order rotated every time);
the ratio is the median over those turns of the variant's step time over
DDP's step time in the same turn. On a shared machine the load changes by
tens of percent between separate runs; within a turn it does not.

On CPU, "tensor MB" is exact: the peak of live tensor bytes over what the
built model holds, the CPU allocator's own count of live bytes in the process
(read at the profiler's memory events; benchmarks/cpu_memory.py) in a second build of the variant
running two more steps; RSS also counts what is not tensors (gloo's and
Python's memory, the allocator's fragmentation).

With --device cuda (one GPU per rank, NCCL), peak MB is exact: the rise of
torch.cuda.max_memory_allocated over what the built model holds. "alloc MB"
is the CUDA allocator's peak over what was allocated before the model was
built (the model state included), and "plan MB" the memory planner's
predicted peak for the same model, batch and stage (zeroshard.plan's
plan_model; zeroshard variants only).

"comm MB" is what one rank sends per step under the ring model of the
collectives the step actually issued, counted by the profiler on rank 0 in one
extra step after the timed ones (so it is neither timed nor in the peak): for a
collective on a buffer of S bytes (all-reduce: the tensor; all-gather: the
gathered output; reduce-scatter: the input; broadcast: the tensor), all-reduce
sends 2(N-1)/N x S and the others (N-1)/N x S (NCCL's "bus bytes"); a
point-to-point send sends its S, a receive nothing. The JSON row also has each
kind's calls and summed S. The kinds are the backend's: on gloo, FSDP2's
reduce-scatter runs as an all-reduce, and zeroshard's reduce-scatter and
all-gather as point-to-point sends and receives (see csrc/comm.h); they are
counted as such; "comm MB" takes every collective as spanning the whole world.
The same step is also counted by process group (world, shard, replicate) at
the c10d operator level, with each group's own size in the ring model
(benchmarks/comm_count.py): with --shard-size, "replicate" is the traffic over
the slow link. --no-comm skips both.

    python -m benchmarks step [--world-size 2] [--steps 6] [--layers 4 --dim 256]
    python -m benchmarks sweep [--variants zeroshard-2,fsdp2-3]             # specs/sweep.py
    python -m benchmarks step --device cuda --world-size 1 --layers 12 --dim 768 --heads 12 \
        --seq 1024 --vocab 50257 --dtype bfloat16                                  # GPT-2 124M
    python -m benchmarks step --device cuda --world-size 1 --layers 24 --dim 1024 \
        --param-dtype bfloat16 --variants fsdp2-3,zeroshard-3                      # 350M-sized, bf16
"""

from __future__ import annotations

import statistics
from datetime import date

import torch

from benchmarks import peers
from benchmarks.comm_count import format_groups
from benchmarks.gpt import GPTConfig
from benchmarks.harness import machine_info, opt, paired_ratio, spawn
from benchmarks.training import VARIANTS, paired_worker, plan_columns, planned_peak_mb, worker


def options(**defaults) -> list:
    """The step's command line (the sweep's too, with its own ``defaults``)."""
    d = dict(batch=8, warmup=2, paired=12)
    d.update(defaults)
    return [
        opt("--world-size", type=int, default=2),
        opt(
            "--shard-size",
            type=int,
            default=None,
            help="hybrid sharding: zeroshard's shard_size, FSDP2 with a (replicate, shard) mesh (HSDP)",
        ),
        opt("--steps", type=int, default=6),
        opt("--warmup", type=int, default=d["warmup"]),
        opt("--rounds", type=int, default=3, help="rounds of every variant in turn (timing)"),
        opt(
            "--baseline",
            default=None,
            help="the variant the ratios are taken against (default: ddp, else adamw, else the first)",
        ),
        opt(
            "--paired",
            type=int,
            default=d["paired"],
            help="steps of every variant taken in turn in one process group (0: skip)",
        ),
        opt("--batch", type=int, default=d["batch"]),
        opt("--layers", type=int, default=4),
        opt("--dim", type=int, default=256),
        opt("--heads", type=int, default=4),
        opt("--seq", type=int, default=64),
        opt("--vocab", type=int, default=1021),
        opt("--device", choices=["cpu", "cuda"], default="cpu"),
        opt("--dtype", choices=["float32", "bfloat16"], default="float32"),
        opt(
            "--param-dtype",
            choices=["float32", "bfloat16"],
            default="float32",
            help="gathered-parameter dtype of the ZeRO-3 variants (mixed precision)",
        ),
        opt("--prefetch", type=int, default=1, help="zeroshard-3: units gathered ahead"),
        opt("--variants", default=None, help="comma-separated; default: all that apply"),
        opt(
            "--no-comm",
            dest="comm",
            action="store_false",
            help="skip counting each variant's collectives (one extra, profiled step)",
        ),
    ]


OPTIONS = options()


def check(args):
    if args.shard_size is not None and (args.shard_size < 1 or args.world_size % args.shard_size):
        return f"--shard-size must divide --world-size ({args.world_size})"
    return None


def run(args):
    cfg = GPTConfig(layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq, vocab=args.vocab)
    rows = []
    variants = (
        args.variants.split(",")
        if args.variants
        else (VARIANTS if args.world_size > 1 else ["adamw", "adamw-amp"] + [v for v in VARIANTS if v != "ddp+zero"])
    )
    if args.device == "cuda" and not args.variants:  # FSDP2 prefetches on CUDA: compare like with like
        variants = [v for v in variants if v != "zeroshard-3@p0"]
    variants = peers.runnable(variants)
    for k in range(max(1, args.rounds)):
        for v in variants:
            row = spawn(worker, args.world_size, v, cfg, args, k == 0, what=v, skip_failed=True)
            if row is None:
                continue
            if k == 0:
                row["step_ms_rounds"] = [row["step_ms"]]
                rows.append(row)
            else:
                first = next((r for r in rows if r["variant"] == v), None)
                if first is not None:
                    first["step_ms_rounds"].append(row["step_ms"])
    if not rows:
        return 1
    for r in rows:
        r["step_ms"] = statistics.median(r["step_ms_rounds"])
    base = (
        next((r for r in rows if r["variant"] == args.baseline), None)
        if args.baseline
        else next((r for r in rows if r["variant"] in ("ddp", "adamw")), rows[0])
    )
    if base is None:
        print(
            f"--baseline {args.baseline}: that variant has no row (failed or not run); ratios vs {rows[0]['variant']}"
        )
        base = rows[0]
    if args.device == "cuda":
        for r in rows:
            r["plan_mb"] = planned_peak_mb(r["variant"], cfg, args)
    paired = (
        spawn(
            paired_worker,
            args.world_size,
            [r["variant"] for r in rows],
            cfg,
            args,
            what="paired timing",
            skip_failed=True,
        )
        if args.paired > 0
        else None
    )
    for r in rows if paired else []:
        r["paired_s"] = paired[r["variant"]]  # every turn's step time (ratios per turn)
        r["paired_ms"] = 1e3 * statistics.median(paired[r["variant"]])
        r["paired_ratio"] = paired_ratio(paired[r["variant"]], paired[base["variant"]])
    ours = next((r for r in rows if r["variant"] == "zeroshard-2"), base)
    where = "CPU gloo" if args.device == "cpu" else f"{torch.cuda.get_device_name()} NCCL"
    hybrid = f" ({args.world_size // args.shard_size} replicas x {args.shard_size} shards)" if args.shard_size else ""
    print(
        f"\nGPT {rows[0]['params'] / 1e6:.2f}M params ({args.dtype}) | world size {args.world_size}{hybrid} | {where} | "
        f"torch {torch.__version__} | {date.today()} | ratios vs {base['variant']}"
    )
    exact = args.device == "cpu"
    print(
        f"{'variant':<17} {'step ms':>9} {'ratio':>7} {'paired':>7} {'zs2 vs':>7} {'peak MB':>9} {'ratio':>7} {'loss':>7}"
        f"{' comm MB' if args.comm else ''}{' tensor MB  ratio' if exact else '  alloc MB   plan MB  plan/alloc'}"
    )
    for r in rows:
        comm = r.get("comm_mb")
        pr = f"{r['paired_ratio']:>6.2f}x" if "paired_ratio" in r else f"{'-':>7}"
        print(
            f"{r['variant']:<17} {r['step_ms']:>9.1f} {r['step_ms'] / base['step_ms']:>6.2f}x {pr} "
            f"{r['step_ms'] / ours['step_ms']:>6.2f}x {r['peak_mb']:>9.1f} {r['peak_mb'] / base['peak_mb']:>6.2f}x "
            f"{r['loss']:>7.3f}"
            + ("" if not args.comm else f"{comm:>8.1f}" if comm is not None else f"{'?':>8}")
            + (
                f"{r['tensor_mb']:>10.1f} {r['tensor_mb'] / base['tensor_mb']:>5.2f}x"
                if exact
                else f"{r['alloc_peak_mb']:>10.1f}" + plan_columns(r)
            )
        )
    if args.comm:
        print("communication by process group (c10d operators on rank 0, one step; benchmarks/comm_count.py):")
        for r in rows:
            print(f"{r['variant']}:\n{format_groups(r.get('comm_groups', {}))}")
    f3 = next((r for r in rows if r["variant"] == "fsdp2-3"), None)
    for z3 in (r for r in rows if r["variant"].startswith("zeroshard-3")):
        if f3:
            print(
                f"ZeRO-3 ({args.param_dtype} params): {z3['variant']} / fsdp2-3 = "
                f"{z3['step_ms'] / f3['step_ms']:.2f}x time, {z3['peak_mb'] / f3['peak_mb']:.2f}x peak memory"
                + (f", {z3['tensor_mb'] / f3['tensor_mb']:.2f}x exact tensor peak" if exact else "")
            )
    return dict(
        date=str(date.today()),
        torch=torch.__version__,
        world_size=args.world_size,
        shard_size=args.shard_size,
        param_dtype=args.param_dtype,
        config=vars(cfg),
        rows=rows,
        machine=machine_info(args.device),
        device=args.device,
        backend=where,
        dtype=args.dtype,
        batch=args.batch,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        prefetch=args.prefetch,
        paired=args.paired,
        baseline=base["variant"],
    )
