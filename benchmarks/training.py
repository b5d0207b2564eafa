"""Building each benchmark variant on the benchmarks' GPT and taking its training step
(what the step, sweep, muon, checkpoint, before_after and profile_step benchmarks share).

A variant is named as in ``python -m benchmarks step --help`` ("ddp", "fsdp2-3",
"zeroshard-2@5", "deepspeed-3", "zeroshard-1+muon", ...): ``build(variant, model, ...)``
returns (the model to call, the optimizer); ``train_step`` takes one step with them;
``worker`` and ``paired_worker`` are the ranks of a step run (times, peak memory,
collectives) and of a paired run (every variant's steps in turn in one process group).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from benchmarks import peers
from benchmarks.comm_count import count_comm
from benchmarks.cpu_memory import TensorBytes
from benchmarks.gpt import GPT, Block
from benchmarks.harness import init_dist, paired_times

# the DeepSpeed variants run where deepspeed is installed (make bench-deps) and are skipped otherwise
VARIANTS = [
    "ddp",
    "ddp+zero",
    "fsdp2",
    "zeroshard-1",
    "zeroshard-2",
    "zeroshard-2@5",
    "fsdp2-3",
    "zeroshard-3",
    "zeroshard-3@p0",
    "deepspeed-1",
    "deepspeed-2",
    "deepspeed-3",
]


def rss_mb(field="VmRSS"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
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
    one; benchmarks/specs/before_after.py passes other builds)."""
    if variant.endswith("+muon"):
        return build_muon(variant[: -len("+muon")], model, param_dtype, prefetch)
    if variant == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    if variant == "adamw-amp":
        model.float()
        return Autocast(model), torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    if variant == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model), torch.optim.AdamW(
            model.parameters(), lr=lr, fused=True
        )
    if variant == "ddp+zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
    if variant in ("fsdp2", "fsdp2-3"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        zero3 = variant == "fsdp2-3"
        kw = dict(
            reshard_after_forward=zero3,
            mp_policy=MixedPrecisionPolicy(
                param_dtype=param_dtype if zero3 else None, reduce_dtype=torch.float32 if zero3 else None
            ),
        )
        if shard_size is not None:  # HSDP: shard within S ranks, replicate across the groups
            from torch.distributed.device_mesh import init_device_mesh

            kw["mesh"] = init_device_mesh(
                next(model.parameters()).device.type,
                (dist.get_world_size() // shard_size, shard_size),
                mesh_dim_names=("replicate", "shard"),
            )
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
    hybrid = {} if shard_size is None else dict(shard_size=shard_size)  # (builds before hybrid lack it)
    if variant.startswith("zeroshard-3"):
        prefetch = 0 if variant == "zeroshard-3@p0" else prefetch
        model = zs.FullyShard(
            model,
            wrap={Block},
            prefetch=prefetch,
            mixed_precision=zs.MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32),
            **hybrid,
        )
        return model, zs.ShardedOptimizer(model.parameters(), lr=lr)
    name, _, mb = variant.partition("+")[0].partition("@")  # "zeroshard-2@5": bucket_mb=5; "+...": options
    return model, zs.ShardedOptimizer(
        model.parameters(),
        lr=lr,
        stage=int(name[-1]),
        bucket_mb=float(mb) if mb else 25,
        **hybrid,
        **peers.zeroshard_options(variant),
    )


MUON = dict(lr=0.02, momentum=0.95)  # the Muon variants' hyperparameters (and benchmarks/specs/muon.py's)
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
        wrapped = zs.FullyShard(
            model,
            wrap={Block},
            prefetch=prefetch,
            mixed_precision=zs.MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32),
        )
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
        wrapped, opt = build(
            variant, model, getattr(torch, args.param_dtype), args.prefetch, shard_size=args.shard_size
        )
        for _ in range(2):  # (the loss is not kept: exactly the step's own tensors are counted)
            train_step(wrapped, opt, data, lambda: None)
        settle(opt)
    return max(0, t.peak - t.at_mark) / 2**20


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
    backward = getattr(opt, "backward", None)  # DeepSpeed's engine runs the backward itself
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
    row = dict(
        variant=variant,
        params=n_params,
        step_ms=1e3 * statistics.median(times[args.warmup :]),
        peak_mb=peak,
        loss=loss.item(),
    )
    if cuda:
        row["alloc_peak_mb"] = (torch.cuda.max_memory_allocated() - before_model) / 2**20
    if args.comm and measure:  # one more step, untimed: every rank runs it, rank 0 counts its collectives
        dist.barrier()
        if rank == 0:
            kinds, sent, groups = count_comm(
                lambda: (train_step(wrapped, opt, data, sync), settle(opt)), world, args.shard_size
            )
            row.update(comm=kinds, comm_mb=None if sent is None else sent / 2**20, comm_groups=groups)
        else:
            train_step(wrapped, opt, data, sync)
    if not cuda and measure:  # the exact tensor-byte peak, in a second build of the same variant
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
    ``builder(variant, model)``: in place of build() (benchmarks/specs/before_after.py)."""
    device, data, sync = setup(rank, world, port, cfg, args)
    builder = builder or (
        lambda v, model: build(v, model, getattr(torch, args.param_dtype), args.prefetch, shard_size=args.shard_size)
    )
    built = {v: builder(v, new_model(cfg, args, device)) for v in variants}
    times = paired_times(built, args.paired, args.warmup, timer=lambda b: timed_step(*b, data, sync)[1])
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
    base, _, suffix = variant.partition("+")  # "+cpu" / "+nvme": offload; "+muon": Muon
    name, _, opt = base.partition("@")
    stage = int(name[-1])
    if suffix not in ("", "cpu", "nvme", "muon"):
        return None
    if stage == 3:
        if args.dtype != "float32" or opt:  # the planner's ZeRO-3 keeps fp32 shards
            return None
        dtype = "bf16" if args.param_dtype == "bfloat16" else "fp32"
    else:
        dtype = "bf16" if args.dtype == "bfloat16" else "fp32"

    def example():  # called under the planner's fake-tensor mode
        idx = torch.zeros(args.batch, cfg.seq, dtype=torch.long)
        return idx, idx

    plan = plan_model(
        lambda: GPT(cfg),
        args.shard_size or args.world_size,
        dtype,
        wrap={Block},
        prefetch=args.prefetch,
        bucket_mb=float(opt) if opt and stage < 3 else 25,
        example=example,
        offload=suffix if suffix in ("cpu", "nvme") else None,
        optimizer="muon" if suffix == "muon" else "adamw",
    )
    return plan["stages"][f"ZeRO-{stage}"]["peak"] / 2**20


def plan_columns(r) -> str:
    """'plan MB  plan/alloc' of a CUDA row ('-' where the planner has no prediction)."""
    if not r.get("plan_mb"):
        return f"{'-':>10} {'-':>10}"
    return f"{r['plan_mb']:>10.1f} {r['plan_mb'] / r['alloc_peak_mb']:>10.2f}x"
