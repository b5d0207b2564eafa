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
                blocks' matrices and AdamW over the rest (benchmarks/muon.py's split and
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

    python benchmarks/step.py [--world-size 2] [--steps 6] [--layers 4 --dim 256]
    python benchmarks/step.py --sweep [--variants zeroshard-2,fsdp2-3]        # benchmarks/sweep.py
    python benchmarks/step.py --device cuda --world-size 1 --layers 12 --dim 768 --heads 12 \
        --seq 1024 --vocab 50257 --dtype bfloat16                                  # GPT-2 124M
    python benchmarks/step.py --device cuda --world-size 1 --layers 24 --dim 1024 \
        --param-dtype bfloat16 --variants fsdp2-3,zeroshard-3                      # 350M-sized, bf16
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import date

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from comm_count import count_comm, format_groups  # noqa: E402
from cpu_memory import TensorBytes  # noqa: E402
from gpt import GPT, Block, GPTConfig  # noqa: E402
from machine import machine_info  # noqa: E402

# the DeepSpeed variants run where deepspeed is installed (make bench-deps) and are skipped otherwise
VARIANTS = ["ddp", "ddp+zero", "fsdp2", "zeroshard-1", "zeroshard-2", "zeroshard-2@5", "fsdp2-3", "zeroshard-3",
            "zeroshard-3@p0", "deepspeed-1", "deepspeed-2", "deepspeed-3"]


def rss_mb(field="VmRSS"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


class Autocast(torch.nn.Module):
    """Runs the wrapped model's forward under torch.autocast(bfloat16)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args):
        device = next(self.model.parameters()).device.type
        with torch.autocast(device, dtype=torch.bfloat16):
            return self.model(*args)


def build(variant, model, param_dtype, prefetch=1, lr=3e-4, shard_size=None, zs=None):
    """The variant's (model to call, optimizer); ``shard_size``: hybrid sharding
    (zeroshard's shard_size=, FSDP2's 2-D mesh: HSDP); DDP variants ignore it.
    ``zs``: the zeroshard module the zeroshard variants use (default: the installed
    one; benchmarks/before_after.py passes other builds)."""
    if variant.endswith("+muon"):
        return build_muon(variant[:-len("+muon")], model, param_dtype, prefetch)
    if variant == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    if variant == "adamw-amp":
        model.float()
        return Autocast(model), torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    if variant == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model), torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    if variant == "ddp+zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
    if variant in ("fsdp2", "fsdp2-3"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        zero3 = variant == "fsdp2-3"
        kw = dict(reshard_after_forward=zero3, mp_policy=MixedPrecisionPolicy(
            param_dtype=param_dtype if zero3 else None, reduce_dtype=torch.float32 if zero3 else None))
        if shard_size is not None:    # HSDP: shard within S ranks, replicate across the groups
            from torch.distributed.device_mesh import init_device_mesh
            kw["mesh"] = init_device_mesh(next(model.parameters()).device.type,
                                          (dist.get_world_size() // shard_size, shard_size),
                                          mesh_dim_names=("replicate", "shard"))
        for blk in model.blocks:
            fully_shard(blk, **kw)
        fully_shard(model, **kw)
        if dist.get_backend() == "gloo":
            model.set_force_sum_reduction_for_comms(True)
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    if peers.is_deepspeed(variant):
        return peers.build_deepspeed(variant, model, param_dtype, lr)
    if zs is None:
        import zeroshard as zs
    hybrid = {} if shard_size is None else dict(shard_size=shard_size)   # (builds before hybrid lack it)
    if variant.startswith("zeroshard-3"):
        prefetch = 0 if variant == "zeroshard-3@p0" else prefetch
        model = zs.FullyShard(model, wrap={Block}, prefetch=prefetch, mixed_precision=zs.MixedPrecision(
            param_dtype=param_dtype, reduce_dtype=torch.float32), **hybrid)
        return model, zs.ShardedOptimizer(model.parameters(), lr=lr)
    name, _, mb = variant.partition("+")[0].partition("@")   # "zeroshard-2@5": bucket_mb=5; "+...": options
    return model, zs.ShardedOptimizer(model.parameters(), lr=lr, stage=int(name[-1]),
                                      bucket_mb=float(mb) if mb else 25, **hybrid,
                                      **peers.zeroshard_options(variant))


MUON = dict(lr=0.02, momentum=0.95)           # the Muon variants' hyperparameters (and benchmarks/muon.py's)
ADAMW = dict(lr=3e-4, weight_decay=0.1)


def muon_split(model):
    """(hidden matrices, the rest): Muon's and AdamW's parameters."""
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and "blocks." in n]
    ids = {id(p) for p in hidden}
    return hidden, [p for p in model.parameters() if id(p) not in ids]


class Optimizers:
    """Several optimizers stepped as one: the "+muon" variants' Muon and AdamW."""

    def __init__(self, opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()

    def wait_params(self):
        for o in self.opts:
            settle(o)


def build_muon(base, model, param_dtype, prefetch):
    """A "+muon" variant: Muon over the blocks' matrices and AdamW over the rest, with
    muon_split, MUON and ADAMW; ``base`` "adamw" (torch's classes on the
    plain model), "adamw-amp" (the same on fp32 parameters under bf16 autocast),
    "zeroshard-1/2" (two ShardedOptimizers) or "zeroshard-3" (FullyShard as "zeroshard-3")."""
    import zeroshard as zs
    wrapped = model
    if base == "adamw-amp":
        wrapped = Autocast(model.float())
    elif base == "zeroshard-3":
        wrapped = zs.FullyShard(model, wrap={Block}, prefetch=prefetch, mixed_precision=zs.MixedPrecision(
            param_dtype=param_dtype, reduce_dtype=torch.float32))
    return wrapped, Optimizers(muon_optimizers(wrapped, int(base[-1]) if base.startswith("zeroshard") else None))


def muon_optimizers(model, stage=None, muon=torch.optim.Muon, fused=True, only_adamw=False) -> list:
    """Muon (``muon``) over ``model``'s blocks' matrices and AdamW over the rest: torch's
    classes (``stage`` None; ``fused`` AdamW), or two zeroshard.ShardedOptimizers at
    ``stage`` (3: over a FullyShard model). ``only_adamw``: AdamW over every parameter."""
    hidden, rest = muon_split(model)
    if only_adamw:
        hidden, rest = [], hidden + rest
    if stage is None:
        return [muon(hidden, **MUON), torch.optim.AdamW(rest, fused=fused, **ADAMW)]
    import zeroshard as zs
    st = {} if stage == 3 else dict(stage=stage)
    vouch = {} if muon is torch.optim.Muon else dict(whole_tensor=True)
    opts = [zs.ShardedOptimizer(hidden, optimizer_class=muon, **MUON, **st, **vouch)] if hidden else []
    return opts + [zs.ShardedOptimizer(rest, **ADAMW, **st)]


def tensor_peak_mb(variant, cfg, args, data):
    """CPU: builds the variant again and runs two steps under cpu_memory.TensorBytes;
    returns the peak of live tensor bytes over what the built model holds, the CPU
    analog of torch.cuda.max_memory_allocated's rise."""
    with TensorBytes() as t:
        model = new_model(cfg, args, torch.device("cpu"))
        t.mark()
        wrapped, opt = build(variant, model, getattr(torch, args.param_dtype), args.prefetch, shard_size=args.shard_size)
        for _ in range(2):   # (the loss is not kept: exactly the step's own tensors are counted)
            train_step(wrapped, opt, data, lambda: None)
        settle(opt)
    return max(0, t.peak - t.at_mark) / 2**20


def init_dist(rank, world, port, cuda=False):
    """One process of a benchmark's group on this machine: NCCL with GPU ``rank``, or gloo
    with an equal share of the CPU threads. Returns the device."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if cuda:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        return torch.device("cuda", rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return torch.device("cpu")


def setup(rank, world, port, cfg, args):
    """A worker's process group, its batch (one per rank) and its device sync."""
    cuda = args.device == "cuda"
    device = init_dist(rank, world, port, cuda)
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1), generator=g).to(device)
    return device, data, torch.cuda.synchronize if cuda else (lambda: None)


def new_model(cfg, args, device):
    """The benchmark's GPT, with the same initial weights in every build."""
    torch.manual_seed(0)
    return GPT(cfg).to(device=device, dtype=getattr(torch, args.dtype))


def train_step(wrapped, opt, data, sync):
    loss = wrapped(data[:, :-1], data[:, 1:])
    backward = getattr(opt, "backward", None)   # DeepSpeed's engine runs the backward itself
    backward(loss) if backward is not None else loss.backward()
    opt.step()
    opt.zero_grad()
    sync()
    return loss


def settle(opt):
    """Waits for collectives a step left in flight (overlap_param_gather): a torch profiler
    session must not end with one still running (its results get corrupted)."""
    getattr(opt, "wait_params", lambda: None)()


def timed_step(wrapped, opt, data, sync):
    """One training step started together on every rank: (loss, seconds)."""
    dist.barrier()
    sync()
    t0 = time.perf_counter()
    loss = train_step(wrapped, opt, data, sync)
    return loss, time.perf_counter() - t0


def worker(rank, world, port, out, variant, cfg, args, measure=True):
    cuda = args.device == "cuda"
    device, data, sync = setup(rank, world, port, cfg, args)
    before_model = torch.cuda.memory_allocated() if cuda else 0
    model = new_model(cfg, args, device)
    n_params = sum(p.numel() for p in model.parameters())
    base = torch.cuda.memory_allocated() / 2**20 if cuda else rss_mb()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()
    wrapped, opt = build(variant, model, getattr(torch, args.param_dtype), args.prefetch, shard_size=args.shard_size)
    times = []
    for i in range(args.warmup + args.steps):
        loss, seconds = timed_step(wrapped, opt, data, sync)
        times.append(seconds)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mb("VmHWM")) - base
    row = dict(variant=variant, params=n_params, step_ms=1e3 * statistics.median(times[args.warmup:]),
               peak_mb=peak, loss=loss.item())
    if cuda:
        row["alloc_peak_mb"] = (torch.cuda.max_memory_allocated() - before_model) / 2**20
    if args.comm and measure:   # one more step, untimed: every rank runs it, rank 0 counts its collectives
        dist.barrier()
        if rank == 0:
            kinds, sent, groups = count_comm(lambda: (train_step(wrapped, opt, data, sync), settle(opt)), world,
                                             args.shard_size)
            row.update(comm=kinds, comm_mb=None if sent is None else sent / 2**20, comm_groups=groups)
        else:
            train_step(wrapped, opt, data, sync)
    if not cuda and measure:    # the exact tensor-byte peak, in a second build of the same variant
        del wrapped, opt, model
        dist.barrier()
        row["tensor_mb"] = tensor_peak_mb(variant, cfg, args, data)
    if rank == 0:
        out.put(row)
    dist.barrier()
    dist.destroy_process_group()


def paired_worker(rank, world, port, out, variants, cfg, args, builder=None):
    """Every variant built in one process group, each on its own copy of the
    model, their steps taken in turn (the order rotated each round): every
    variant sees the same machine load, so their time ratios are steadier
    than those of separate runs. Rank 0 puts {variant: [seconds per step]}.
    ``builder(variant, model)``: in place of build() (benchmarks/before_after.py)."""
    device, data, sync = setup(rank, world, port, cfg, args)
    builder = builder or (lambda v, model: build(v, model, getattr(torch, args.param_dtype), args.prefetch,
                                                 shard_size=args.shard_size))
    built = {v: builder(v, new_model(cfg, args, device)) for v in variants}
    times = {v: [] for v in variants}
    for i in range(args.warmup + args.paired):
        k = i % len(variants)
        for v in variants[k:] + variants[:k]:
            _, seconds = timed_step(*built[v], data, sync)
            if i >= args.warmup:
                times[v].append(seconds)
    if rank == 0:
        out.put(times)
    dist.barrier()
    dist.destroy_process_group()


def planned_peak_mb(variant, cfg, args):
    """The memory planner's predicted per-rank peak for a zeroshard variant of
    this benchmark (same model, batch, world size, dtypes and options), or
    None where the planner has no matching configuration."""
    from zeroshard.plan import plan_model
    if not variant.startswith("zeroshard"):
        return None
    base, _, suffix = variant.partition("+")      # "+cpu" / "+nvme": offload; "+muon": Muon
    name, _, opt = base.partition("@")
    stage = int(name[-1])
    if suffix not in ("", "cpu", "nvme", "muon"):
        return None
    if stage == 3:
        if args.dtype != "float32" or opt:   # the planner's ZeRO-3 keeps fp32 shards
            return None
        dtype = "bf16" if args.param_dtype == "bfloat16" else "fp32"
    else:
        dtype = "bf16" if args.dtype == "bfloat16" else "fp32"
    def example():   # called under the planner's fake-tensor mode
        idx = torch.zeros(args.batch, cfg.seq, dtype=torch.long)
        return idx, idx

    plan = plan_model(lambda: GPT(cfg), args.shard_size or args.world_size, dtype, wrap={Block}, prefetch=args.prefetch,
                      bucket_mb=float(opt) if opt and stage < 3 else 25, example=example,
                      offload=suffix if suffix in ("cpu", "nvme") else None,
                      optimizer="muon" if suffix == "muon" else "adamw")
    return plan["stages"][f"ZeRO-{stage}"]["peak"] / 2**20


def plan_columns(r) -> str:
    """'plan MB  plan/alloc' of a CUDA row ('-' where the planner has no prediction)."""
    if not r.get("plan_mb"):
        return f"{'-':>10} {'-':>10}"
    return f"{r['plan_mb']:>10.1f} {r['plan_mb'] / r['alloc_peak_mb']:>10.2f}x"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(ctx, target, world, what, *extra):
    """Runs ``target(rank, world, port, queue, *extra)`` in one process per
    rank; returns what rank 0 put in the queue, or None if a rank failed."""
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, q) + extra) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        print(f"{what}: failed (exit codes {[p.exitcode for p in procs]})")
        return None
    return q.get()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--shard-size", type=int, default=None,
                    help="hybrid sharding: zeroshard's shard_size, FSDP2 with a (replicate, shard) mesh (HSDP)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every variant in turn (timing)")
    ap.add_argument("--baseline", default=None,
                    help="the variant the ratios are taken against (default: ddp, else adamw, else the first)")
    ap.add_argument("--paired", type=int, default=12,
                    help="steps of every variant taken in turn in one process group (0: skip)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1021)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="gathered-parameter dtype of the ZeRO-3 variants (mixed precision)")
    ap.add_argument("--prefetch", type=int, default=1, help="zeroshard-3: units gathered ahead")
    ap.add_argument("--variants", default=None, help="comma-separated; default: all that apply")
    ap.add_argument("--no-comm", dest="comm", action="store_false",
                    help="skip counting each variant's collectives (one extra, profiled step)")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "step.json"))
    ap.add_argument("--sweep", action="store_true",
                    help="model sizes 3M/25M/100M x world sizes 2/3/4, every variant paired with DDP "
                         "(benchmarks/sweep.py; defaults there: --batch 2 --warmup 1 --paired 4)")
    ap.add_argument("--sizes", default=None, help="with --sweep: comma-separated model sizes (3M,25M,100M; default all)")
    ap.add_argument("--memory", action="store_true",
                    help="with --sweep: the exact tensor peak of the ZeRO-3 variants at every point instead of time")
    if "--sweep" in sys.argv:
        ap.set_defaults(batch=2, warmup=1, paired=4)
    args = ap.parse_args()
    if args.sweep:
        import sweep
        if args.memory:
            sweep.memory(args, spawn, worker, mp.get_context("spawn"))
        else:
            sweep.run(args, spawn, paired_worker, mp.get_context("spawn"))
        return
    if args.shard_size is not None and (args.shard_size < 1 or args.world_size % args.shard_size):
        ap.error(f"--shard-size must divide --world-size ({args.world_size})")
    cfg = GPTConfig(layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq, vocab=args.vocab)
    ctx = mp.get_context("spawn")
    rows = []
    variants = args.variants.split(",") if args.variants else (
        VARIANTS if args.world_size > 1 else ["adamw", "adamw-amp"] + [v for v in VARIANTS if v != "ddp+zero"])
    if args.device == "cuda" and not args.variants:   # FSDP2 prefetches on CUDA: compare like with like
        variants = [v for v in variants if v != "zeroshard-3@p0"]
    variants = peers.runnable(variants)
    for k in range(max(1, args.rounds)):
        for v in variants:
            row = spawn(ctx, worker, args.world_size, v, v, cfg, args, k == 0)
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
        return
    for r in rows:
        r["step_ms"] = statistics.median(r["step_ms_rounds"])
    base = next((r for r in rows if r["variant"] == args.baseline), None) if args.baseline else \
        next((r for r in rows if r["variant"] in ("ddp", "adamw")), rows[0])
    if base is None:
        print(f"--baseline {args.baseline}: that variant has no row (failed or not run); ratios vs {rows[0]['variant']}")
        base = rows[0]
    if args.device == "cuda":
        for r in rows:
            r["plan_mb"] = planned_peak_mb(r["variant"], cfg, args)
    paired = (spawn(ctx, paired_worker, args.world_size, "paired timing", [r["variant"] for r in rows], cfg, args)
              if args.paired > 0 else None)
    for r in rows if paired else []:
        r["paired_s"] = paired[r["variant"]]       # every turn's step time (ratios per turn)
        r["paired_ms"] = 1e3 * statistics.median(paired[r["variant"]])
        r["paired_ratio"] = statistics.median(a / b for a, b in zip(paired[r["variant"]], paired[base["variant"]]))
    ours = next((r for r in rows if r["variant"] == "zeroshard-2"), base)
    where = "CPU gloo" if args.device == "cpu" else f"{torch.cuda.get_device_name()} NCCL"
    hybrid = f" ({args.world_size // args.shard_size} replicas x {args.shard_size} shards)" if args.shard_size else ""
    print(f"\nGPT {rows[0]['params'] / 1e6:.2f}M params ({args.dtype}) | world size {args.world_size}{hybrid} | {where} | "
          f"torch {torch.__version__} | {date.today()} | ratios vs {base['variant']}")
    exact = args.device == "cpu"
    print(f"{'variant':<17} {'step ms':>9} {'ratio':>7} {'paired':>7} {'zs2 vs':>7} {'peak MB':>9} {'ratio':>7} {'loss':>7}"
          f"{' comm MB' if args.comm else ''}{' tensor MB  ratio' if exact else '  alloc MB   plan MB  plan/alloc'}")
    for r in rows:
        comm = r.get("comm_mb")
        pr = f"{r['paired_ratio']:>6.2f}x" if "paired_ratio" in r else f"{'-':>7}"
        print(f"{r['variant']:<17} {r['step_ms']:>9.1f} {r['step_ms'] / base['step_ms']:>6.2f}x {pr} "
              f"{r['step_ms'] / ours['step_ms']:>6.2f}x {r['peak_mb']:>9.1f} {r['peak_mb'] / base['peak_mb']:>6.2f}x "
              f"{r['loss']:>7.3f}" + ("" if not args.comm else f"{comm:>8.1f}" if comm is not None else f"{'?':>8}")
              + (f"{r['tensor_mb']:>10.1f} {r['tensor_mb'] / base['tensor_mb']:>5.2f}x" if exact else
                 f"{r['alloc_peak_mb']:>10.1f}" + plan_columns(r)))
    if args.comm:
        print("communication by process group (c10d operators on rank 0, one step; benchmarks/comm_count.py):")
        for r in rows:
            print(f"{r['variant']}:\n{format_groups(r.get('comm_groups', {}))}")
    f3 = next((r for r in rows if r["variant"] == "fsdp2-3"), None)
    for z3 in (r for r in rows if r["variant"].startswith("zeroshard-3")):
        if f3:
            print(f"ZeRO-3 ({args.param_dtype} params): {z3['variant']} / fsdp2-3 = "
                  f"{z3['step_ms'] / f3['step_ms']:.2f}x time, {z3['peak_mb'] / f3['peak_mb']:.2f}x peak memory"
                  + (f", {z3['tensor_mb'] / f3['tensor_mb']:.2f}x exact tensor peak" if exact else ""))
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(date=str(date.today()), torch=torch.__version__, world_size=args.world_size,
                       shard_size=args.shard_size,
                       param_dtype=args.param_dtype, config=vars(cfg), rows=rows,
                       machine=machine_info(args.device), device=args.device, backend=where, dtype=args.dtype,
                       batch=args.batch, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
                       prefetch=args.prefetch, paired=args.paired,
                       baseline=base["variant"]), f, indent=1)


if __name__ == "__main__":
    main()
