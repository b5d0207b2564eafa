"""The same DeepSpeed script and config under deepspeed.initialize and zeroshard.initialize:
step time and peak memory, stages 1-3 and the offload variants, in one run.

    python -m benchmarks deepspeed_front_door [--world-size 2] [--steps 8] [--batch 8]

The script is a DeepSpeed training loop (``engine(x)``, ``engine.backward(loss)``,
``engine.step()``) over the benchmarks' GPT (benchmarks/gpt.py); the config is one dict
per variant, passed unchanged to both front doors. Both use 25 MiB buckets
(``reduce_bucket_size`` / ``allgather_bucket_size`` / ``stage3_prefetch_bucket_size``, which
zeroshard accepts with a warning where it has no counterpart) and torch's AdamW
(``"torch_adam": true``: DeepSpeed's own CPU Adam is a C++ build; zeroshard runs its fused
AdamW either way). Offload variants set ``zero_force_ds_cpu_optimizer: false`` so
DeepSpeed accepts torch's AdamW for the offloaded step. DeepSpeed runs on CPU with
DS_ACCELERATOR=cpu; its NVMe offload needs its compiled ``async_io`` op, so the nvme
variant runs zeroshard alone.

As the step benchmark measures them: "step ms" is the median over the timed steps on
rank 0, DeepSpeed's and zeroshard's steps taken in turn in one process group (so both see
the same machine load; "zs/ds" is the median of the per-turn ratios); "tensor MB" is
rank 0's exact peak of live tensor bytes over what the built model holds (the CPU
allocator's count, benchmarks/cpu_memory.py) in a second build running two steps.
Writes benchmarks/out/deepspeed_front_door.json and prints the table.
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
import warnings
from datetime import date

import torch
import torch.distributed as dist

from benchmarks.cpu_memory import TensorBytes
from benchmarks.gpt import GPT, GPTConfig
from benchmarks.harness import opt, spawn

BUCKET = 25 * 2**20 // 4  # elements: 25 MiB of fp32, zeroshard's default bucket


def config(stage, offload="", batch=8, nvme_dir=None):
    zero = {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = BUCKET
    cfg = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if offload:
        zero["offload_optimizer"] = {"device": offload, **({"nvme_path": nvme_dir} if offload == "nvme" else {})}
        cfg["zero_force_ds_cpu_optimizer"] = False
    if offload == "cpu" and stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    return cfg


VARIANTS = {
    "stage 1": (1, ""),
    "stage 2": (2, ""),
    "stage 3": (3, ""),
    "stage 2 + cpu offload": (2, "cpu"),
    "stage 3 + cpu offload (optimizer, params)": (3, "cpu"),
    "stage 2 + nvme offload": (2, "nvme"),
}


def front_doors(offload):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import zeroshard

    doors = {"zeroshard": zeroshard.initialize}
    if offload != "nvme":
        import deepspeed
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo's collectives, no C++ build
        doors = {"deepspeed": deepspeed.initialize, **doors}
    return doors


def build(init, cfg):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return init(model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg))[0]


def step(engine, data):
    loss = engine(data[:, :-1], data[:, 1:])
    engine.backward(loss)
    engine.step()
    return loss


def peak_mb(init, cfg, data) -> float:
    with TensorBytes() as t:
        torch.manual_seed(0)
        model = GPT(GPTConfig())
        t.mark()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = init(model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg))[0]
        for _ in range(2):
            step(engine, data)
    return max(0, t.peak - t.at_mark) / 2**20


def measure(cfg, offload, data, args) -> dict:
    doors = front_doors(offload)
    engines = {name: build(init, cfg) for name, init in doors.items()}
    times = {name: [] for name in doors}
    for i in range(args.warmup + args.steps):
        for name, engine in engines.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(engine, data)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    del engines
    out = {name: {"step_ms": statistics.median(ts) * 1e3} for name, ts in times.items()}
    if "deepspeed" in times:
        out["ratio"] = statistics.median(z / d for z, d in zip(times["zeroshard"], times["deepspeed"]))
    for name, init in doors.items():
        out[name]["tensor_mb"] = peak_mb(init, cfg, data)
    return out


def worker(rank, world, port, q, args):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    nvme = tempfile.mkdtemp(prefix="zeroshard-bench-")
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(0, GPTConfig().vocab, (args.batch, GPTConfig().seq + 1), generator=g)
    rows = {}
    for label, (stage, offload) in VARIANTS.items():
        rows[label] = measure(config(stage, offload, args.batch, nvme), offload, data, args)
        if rank == 0:
            print(f"  {label}: {rows[label]}", flush=True)
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def table(rows) -> str:
    lines = [
        "| variant | DeepSpeed step ms | zeroshard step ms | zeroshard / DeepSpeed (paired) | "
        "DeepSpeed tensor MB | zeroshard tensor MB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, r in rows.items():
        ds = r.get("deepspeed")
        lines.append(f"| {label} | {ds['step_ms']:.1f} | " if ds else f"| {label} | (needs its aio op) | ")
        lines[-1] += f"{r['zeroshard']['step_ms']:.1f} | " + (
            f"{r['ratio']:.2f}x | {ds['tensor_mb']:.1f} | " if ds else "— | — | "
        )
        lines[-1] += f"{r['zeroshard']['tensor_mb']:.1f} |"
    return "\n".join(lines)


OPTIONS = [
    opt("--world-size", type=int, default=2),
    opt("--steps", type=int, default=8),
    opt("--warmup", type=int, default=2),
    opt("--batch", type=int, default=8),
]


def run(args):
    rows = spawn(worker, args.world_size, args, what="deepspeed_front_door", skip_failed=True)
    if rows is None:
        return 1
    cfg = GPTConfig()
    n = sum(p.numel() for p in GPT(cfg).parameters())
    head = (
        f"GPT {n / 1e6:.2f}M params, float32, world size {args.world_size}, CPU gloo, batch {args.batch} "
        f"x seq {cfg.seq} per rank; {date.today()}"
    )
    print(head)
    print(table(rows))
    return {"header": head, "args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}
