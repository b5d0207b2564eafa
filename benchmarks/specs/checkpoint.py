"""Checkpoint save and load of a small GPT: time, bytes written and peak memory per rank.

Variants (world size 2, CPU + gloo by default), each in fresh processes:
  fsdp2-3+dcp   FSDP2 fully_shard per block + root, saved and loaded with
                torch.distributed.checkpoint (get_state_dict / dcp.save / dcp.load / set_state_dict)
  zeroshard-3+dcp, zeroshard-2+dcp   zeroshard's state dicts through torch.distributed.checkpoint
                (dcp_state_dict / dcp.save / dcp.load / load_dcp_state_dict)
  zeroshard-3   zeroshard.FullyShard + ShardedOptimizer, save_checkpoint / load_checkpoint
  zeroshard-2   zeroshard.ShardedOptimizer(stage=2), save_checkpoint / load_checkpoint
  zeroshard-3+nosync, zeroshard-2+nosync   the same with save_checkpoint(..., sync_files=False):
                no fsync, as DeepSpeed's torch.save (the like-for-like comparison with it)
  zeroshard-3+background, zeroshard-2+background   save_checkpoint(..., background=True): "save ms"
                is the time the call blocks training (copying this rank's pieces); "durable ms"
                is from the call to the Future's result() (written, fsynced, committed), and
                "step ms" a training step taken while the write runs against one without
                (what training loses to the save: the call plus that step's slowdown)
  deepspeed-3, deepspeed-2   DeepSpeed's engine.save_checkpoint / load_checkpoint (where
                deepspeed is installed: `make bench-deps`; skipped otherwise, saying so)
FSDP2 + DCP and zeroshard write fsynced files; DeepSpeed's torch.save does not fsync
("fsync ms": rank 0's time inside os.fsync per save, the durability's share). Each
save follows a training step, as in training (zeroshard deletes the checkpoint a save
replaced in a thread, which the steps after it overlap; the next save waits for it). "save ms" / "load ms" are medians over --repeats
on rank 0 (barrier-to-barrier); "MB/rank" is what each rank wrote (its data
file; rank 0 also the metadata/manifest); "peak MB" is the rise of rank 0's
peak resident memory over what it held before the call (save, load), and
"save tensor MB" the most tensor bytes a save holds live on rank 0 beyond what
was live before it, a background save's write included (the CPU allocator's
exact count, benchmarks/cpu_memory.py, in one more untimed save).

    python -m benchmarks checkpoint [--world-size 2] [--layers 4 --dim 512] [--repeats 3]
    python -m benchmarks checkpoint --paired 9 [--runs 3]     # checkpoint-paired.json
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import Future
from datetime import date

import torch
import torch.distributed as dist

from benchmarks import peers
from benchmarks.cpu_memory import TensorBytes
from benchmarks.gpt import GPT, GPTConfig
from benchmarks.harness import barrier_timer, init_dist, machine_info, opt, rotated, spawn
from benchmarks.report import PAIRED_REFS, lost_ms, paired_ratios, ratio_range
from benchmarks.training import build, reset_peak_rss, rss_mb, train_step

VARIANTS = [
    "fsdp2-3+dcp",
    "zeroshard-3+dcp",
    "zeroshard-2+dcp",
    "zeroshard-3",
    "zeroshard-2",
    "zeroshard-3+nosync",
    "zeroshard-2+nosync",
    "zeroshard-3+background",
    "zeroshard-2+background",
    "deepspeed-3",
    "deepspeed-2",
]
SUFFIXES = ("+dcp", "+nosync", "+background")


def base(variant: str) -> str:
    """The variant's model and optimizer (the step benchmark's name)."""
    for s in SUFFIXES:
        variant = variant.removesuffix(s)
    return variant


def save_load(variant, model, opt):
    if peers.is_deepspeed(variant):  # model is the engine
        # universal_checkpoint_info: what ds_to_universal requires of the client (Megatron-DeepSpeed
        # fills it; a plain model has no tensor/pipeline parallel layout to describe)
        return (
            lambda path: model.save_checkpoint(path, tag="bench", client_state={"universal_checkpoint_info": {}})
        ), (lambda path: model.load_checkpoint(path, tag="bench"))
    if variant in ("fsdp2-3+dcp", "ddp+dcp"):  # torch's own state-dict helpers
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        def save(path):
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

        def load(path):
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

        return save, load
    import zeroshard as zs

    if variant.endswith("+dcp"):  # zeroshard's state dicts through torch.distributed.checkpoint
        import torch.distributed.checkpoint as dcp
        from zeroshard.checkpoint import dcp_state_dict, load_dcp_state_dict

        def save(path):
            msd, osd = dcp_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

        def load(path):
            msd, osd = dcp_state_dict(model, opt)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
            load_dcp_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

        return save, load
    sync, background = not variant.endswith("+nosync"), variant.endswith("+background")
    return (lambda path: zs.save_checkpoint(path, model, opt, sync_files=sync, background=background)), (
        lambda path: zs.load_checkpoint(path, model, opt)
    )


class FsyncClock:
    """Times every os.fsync in this process while active (what a save spends waiting for
    the disk to make its files durable: zeroshard's and DCP's writers fsync each file and
    directory; DeepSpeed's torch.save does not)."""

    def __enter__(self):
        self.seconds, self._real = 0.0, os.fsync

        def fsync(fd):
            t0 = time.perf_counter()
            try:
                self._real(fd)
            finally:
                self.seconds += time.perf_counter() - t0

        os.fsync = fsync
        return self

    def __exit__(self, *exc):
        os.fsync = self._real


def timed(fn, repeats, between=lambda: None):
    times, peaks = [], []
    for _ in range(repeats):
        between()
        dist.barrier()
        reset_peak_rss()
        base = rss_mb()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        peaks.append(rss_mb("VmHWM") - base)
    return 1e3 * statistics.median(times), max(peaks)


def background_costs(save, path, step, repeats):
    """A background save's time to durable (call to result(), barrier to barrier) and
    a training step's time while its write runs, against the step alone (medians)."""
    durable, during, alone = [], [], []
    for i in range(repeats):  # each save to a new path: no deletion of a replaced one runs beside a step
        step()
        dist.barrier()
        t0 = time.perf_counter()
        save(f"{path}-durable{i}").result()
        dist.barrier()
        durable.append(time.perf_counter() - t0)
        for times, saving in ((alone, False), (during, True)):
            dist.barrier()
            pending = save(f"{path}-during{i}") if saving else None
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            if pending is not None:
                pending.result()
    dist.barrier()
    if dist.get_rank() == 0:
        for d in glob.glob(f"{glob.escape(path)}-d*"):
            shutil.rmtree(d)
    return dict(
        durable_ms=1e3 * statistics.median(durable),
        step_ms=1e3 * statistics.median(alone),
        step_during_ms=1e3 * statistics.median(during),
    )


def save_tensor_peak(save, path, finish):
    """The most tensor bytes live during one save (and a background save's write) beyond
    what was live before it: the CPU allocator's exact count (cpu_memory.TensorBytes)."""
    finish()
    dist.barrier()
    with TensorBytes() as t:
        settle(save(path))
    return t.peak / 2**20


def settle(done) -> None:
    """Wait for what a save returned: a background save's Future (DeepSpeed's save
    returns True, the others None)."""
    if isinstance(done, Future):
        done.result()


def worker(rank, world, port, out, variant, cfg, args, root):
    init_dist(rank, world, port)
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())  # before wrapping (FullyShard leaves shards)
    wrapped, opt = build(base(variant), model, torch.float32)
    data = torch.randint(0, cfg.vocab, (4, cfg.seq + 1), generator=torch.Generator().manual_seed(rank))
    train_step(wrapped, opt, data, lambda: None)  # one step, so every optimizer state exists
    save, load = save_load(variant, wrapped, opt)
    path = os.path.join(root, variant)
    step = lambda: train_step(wrapped, opt, data, lambda: None)  # noqa: E731
    extra = background_costs(save, path, step, args.repeats) if variant.endswith("+background") else {}
    pending = []

    def finish_then_step():  # a background save's write ends before the next call
        while pending:
            settle(pending.pop())
        step()

    with FsyncClock() as fsync:
        save_ms, save_peak = timed(lambda: pending.append(save(path)), args.repeats, between=finish_then_step)
        finish_then_step()
    load_ms, load_peak = timed(lambda: load(path), args.repeats)
    save_tensor_mb = save_tensor_peak(save, path, finish_then_step)
    if rank == 0:  # what each rank wrote, read from the shared directory
        everyone = [
            sum(
                os.path.getsize(f)
                for f in glob.glob(os.path.join(path, "**"), recursive=True)
                if os.path.isfile(f) and _written_by(os.path.basename(f), r)
            )
            / 2**20
            for r in range(world)
        ]
        out.put(
            dict(
                variant=variant,
                params=n_params,
                save_ms=save_ms,
                fsync_ms=1e3 * fsync.seconds / args.repeats,
                load_ms=load_ms,
                mb_per_rank=everyone,
                save_peak_mb=save_peak,
                load_peak_mb=load_peak,
                save_tensor_mb=save_tensor_mb,
                **extra,
            )
        )
    dist.barrier()
    dist.destroy_process_group()


PAIRED = ("fsdp2-3+dcp", "zeroshard-3+dcp", "ddp+dcp", "zeroshard-2+dcp")


def paired_worker(rank, world, port, out, cfg, args, root):
    """The DCP variants side by side in the same processes, on the same data: each repeat
    saves (then loads) every variant in turn, in an order rotated per repeat, so drift of
    the machine (disk, page cache, the other core) falls on all of them alike (the ratios:
    report.paired_ratios)."""
    init_dist(rank, world, port)
    data = torch.randint(0, cfg.vocab, (4, cfg.seq + 1), generator=torch.Generator().manual_seed(rank))
    built = {}
    for variant in PAIRED:
        torch.manual_seed(0)
        wrapped, opt = build(base(variant), GPT(cfg), torch.float32)
        train_step(wrapped, opt, data, lambda: None)
        built[variant] = save_load(variant, wrapped, opt)
    times = {f"{v} {kind}": [] for v in PAIRED for kind in ("save", "load")}
    for i in range(args.paired):  # each repeat: every save in turn, then every load (the order rotated)
        for kind in ("save", "load"):
            for v in rotated(list(PAIRED), i):
                fn = functools.partial(built[v][kind == "load"], os.path.join(root, f"paired-{v}"))
                times[f"{v} {kind}"].append(barrier_timer(fn))
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def resume_worker(rank, world, port, out, variant, cfg, args, root):
    """Loads what ``worker`` saved at another world size (this one), timed end to end:
    zeroshard loads it as it is; DeepSpeed first converts it offline (ds_to_universal,
    on rank 0) and loads the universal checkpoint; FSDP2 + DCP loads it as it is."""
    init_dist(rank, world, port)
    torch.manual_seed(0)
    deepspeed = peers.is_deepspeed(variant)
    if deepspeed:
        wrapped = opt = peers.build_deepspeed(variant, GPT(cfg), torch.float32, 3e-4, universal=True)[0]
    else:
        wrapped, opt = build(base(variant), GPT(cfg), torch.float32)
    path = os.path.join(root, variant)
    _, load = save_load(variant, wrapped, opt)
    dist.barrier()
    t0 = time.perf_counter()
    failed = None
    if deepspeed:
        if rank == 0:
            try:
                peers.to_universal(path, "bench")
            except RuntimeError as e:  # reported in the table, not hidden
                failed = str(e)
        failed = comm_object(failed)
        if failed is None:
            wrapped.load_checkpoint(path, tag="bench_universal")
    else:
        load(path)
    dist.barrier()
    if rank == 0:
        out.put(failed if failed is not None else 1e3 * (time.perf_counter() - t0))
    dist.destroy_process_group()


def comm_object(obj):
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _written_by(name: str, r: int) -> bool:
    """Whether rank ``r`` wrote the checkpoint file ``name`` (zeroshard, DCP, DeepSpeed names)."""
    if name in (f"rank{r}.safetensors", f"__{r}_0.distcp") or f"zero_pp_rank_{r}_" in name:
        return True
    return r == 0 and (name in ("manifest.json", ".metadata", "latest") or name.startswith("mp_rank_"))


OPTIONS = [
    opt("--world-size", type=int, default=2),
    opt("--layers", type=int, default=4),
    opt("--dim", type=int, default=512),
    opt("--repeats", type=int, default=3),
    opt("--variants", default=",".join(VARIANTS)),
    opt(
        "--resume-world-size",
        type=int,
        default=3,
        help="also load each checkpoint at this world size, timed end to end with any offline "
        "conversion it needs (0: skip)",
    ),
    opt(
        "--paired",
        type=int,
        default=0,
        help="instead: the DCP variants (FSDP2's and zeroshard's) in the same processes, in turn, "
        "this many repeats; prints the median per-repeat ratios",
    ),
    opt("--runs", type=int, default=3, help="with --paired: this many launches of fresh processes"),
]


def run(args):
    cfg = GPTConfig(layers=args.layers, dim=args.dim)
    if args.paired:
        return paired(args, cfg)
    rows = []
    root = tempfile.mkdtemp(prefix="zs-ckpt-bench-")
    variants = args.variants.split(",")
    variants = peers.runnable(variants)
    try:
        for variant in variants:
            rows.append(spawn(worker, args.world_size, variant, cfg, args, root, what=variant))
            if args.resume_world_size:  # load at another world size, end to end
                rows[-1]["resume_ms"] = spawn(
                    resume_worker,
                    args.resume_world_size,
                    variant,
                    cfg,
                    args,
                    root,
                    what=f"{variant} at {args.resume_world_size}",
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ref = next((r for r in rows if r["variant"] == "fsdp2-3+dcp"), None)
    print(
        f"checkpoint of a {rows[0]['params'] / 1e6:.1f}M-parameter GPT, world size {args.world_size}, "
        f"CPU + gloo, {date.today()}"
    )
    resume = f"load at {args.resume_world_size}" if args.resume_world_size else ""
    print(
        f"{'variant':<20}{'save ms':>9}{'vs dcp':>8}{'fsync ms':>10}{'load ms':>9}{'vs dcp':>8}{'MB/rank':>16}"
        f"{'save peak MB':>14}{'load peak MB':>14}{'save tensor MB':>16}" + (f"{resume + ' ms':>18}" if resume else "")
    )
    for r in rows:
        vs = (lambda k: f"{r[k] / ref[k]:.2f}x") if ref else (lambda k: "-")
        mb = "/".join(f"{m:.1f}" for m in r["mb_per_rank"])
        print(
            f"{r['variant']:<20}{r['save_ms']:>9.1f}{vs('save_ms'):>8}{r['fsync_ms']:>10.1f}"
            f"{r['load_ms']:>9.1f}{vs('load_ms'):>8}"
            f"{mb:>16}{r['save_peak_mb']:>14.1f}{r['load_peak_mb']:>14.1f}{r['save_tensor_mb']:>16.1f}"
            + (
                f"{r['resume_ms']:>18.1f}"
                if isinstance(r.get("resume_ms"), float)
                else f"  failed: {r['resume_ms']}"
                if "resume_ms" in r
                else ""
            )
        )
    for r in rows:
        if "durable_ms" in r:
            print(
                f"{r['variant']}: the call blocks {r['save_ms']:.1f} ms; durable (result()) after "
                f"{r['durable_ms']:.1f} ms; a training step while it writes {r['step_during_ms']:.1f} ms, "
                f"{r['step_ms']:.1f} ms alone: training loses {lost_ms(r):.1f} ms to the save"
            )
    return dict(
        date=str(date.today()),
        world_size=args.world_size,
        rows=rows,
        torch=torch.__version__,
        config=vars(cfg),
        repeats=args.repeats,
        backend="CPU gloo",
        machine=machine_info("cpu"),
        resume_world_size=args.resume_world_size,
    )


def paired(args, cfg) -> dict:
    """--runs launches of paired_worker, each of --paired repeats: checkpoint-paired.json's data."""
    runs = []
    for _ in range(args.runs):
        root = tempfile.mkdtemp(prefix="zs-ckpt-paired-")
        try:
            runs.append(spawn(paired_worker, args.world_size, cfg, args, root, what="paired"))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"DCP save and load, paired ({args.runs} runs of {args.paired} repeats), world size {args.world_size}, "
        f"CPU + gloo, {date.today()}; ratios: each run's median of the per-repeat ratios, lowest-highest"
    )
    print(f"{'variant':<18}{'save ms':>9}{'vs fsdp2':>13}{'vs ddp':>13}{'load ms':>9}{'vs fsdp2':>13}{'vs ddp':>13}")
    for r in paired_ratios(runs):
        print(
            f"{r['variant']:<18}"
            + "".join(
                f"{r[kind + '_ms']:>9.1f}" + "".join(f"{ratio_range(r[kind][ref]):>13}" for ref in PAIRED_REFS)
                for kind in ("save", "load")
            )
        )
    args.json = args.json.replace(".json", "-paired.json")
    return dict(
        date=str(date.today()),
        world_size=args.world_size,
        runs_s=runs,
        torch=torch.__version__,
        config=vars(cfg),
        repeats=args.paired,
        backend="CPU gloo",
        machine=machine_info("cpu"),
    )
