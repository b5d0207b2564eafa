"""The memory planner against DeepSpeed's estimators and against measured peaks.

    python -m benchmarks plan_vs_deepspeed [--world-size 8] [--seq 128] [--batch 2]

For the example's GPT (examples/train_gpt.py, "tiny") and a GPT-2 124M-shaped
model (12 layers, dim 768, 12 heads, vocab 50257; the sequence shortened to
--seq so that eight ranks step it on a small CPU machine), bf16 mixed
precision, at --world-size ranks (CPU, gloo):
* DeepSpeed's own estimate per GPU: ``estimate_zero2_model_states_mem_needs``
  / ``estimate_zero3_model_states_mem_needs`` with the parameter counts its
  ``*_all_live`` functions take from the model (no offload), and
* zeroshard's plan (``zeroshard.plan.plan_model`` with the same micro-batch,
  ``transport="gloo"``, as measured here): model state (exactly what
  memory_report() says) and the predicted peak,
against the measured peak of live tensor bytes on rank 0 while each library
wraps the built model and takes two training steps at ZeRO-2 and ZeRO-3
(the CPU allocator's own accounting, benchmarks/cpu_memory.py; the built
model's bytes count, the transient of building it does not: that peaks on
its own, the same for both). DeepSpeed's estimators count model
states only: the "est./peak" column shows how far that is from a real
step. DeepSpeed is a benchmark-only extra (`make bench-deps`); without it
its columns read "-".
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from datetime import date

import torch
import torch.distributed as dist


from benchmarks import peers
from benchmarks.cpu_memory import TensorBytes
from benchmarks.harness import init_dist, machine_info, opt, spawn
import train_gpt  # (examples/train_gpt.py, on the path the harness sets)

MODELS = {"example GPT (tiny)": ("tiny", dict()), "GPT-2 124M shape": ("124m", dict(vocab=50257))}


def _build(name: str, seq: int):
    size, kw = MODELS[name]
    return lambda: train_gpt.build_model(size, **dict(kw, seq=seq))


def _batch(name: str, seq: int, batch: int):
    size, kw = MODELS[name]
    return lambda: train_gpt.example_batch(size, batch=batch, **dict(kw, seq=seq))


def measure(rank, world, port, out, lib, stage, name, seq, batch, steps):
    """``steps`` steps of ``lib`` ("zeroshard" / "deepspeed") at ``stage`` in bf16; rank 0 puts its peak."""
    init_dist(rank, world, port)
    torch.manual_seed(0)
    vocab = MODELS[name][1].get("vocab", 64)
    x = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(rank))
    import zeroshard as zs

    with TensorBytes() as t:
        model = _build(name, seq)()
        t.mark()  # (building the model peaks on its own, the same for both libraries)
        if lib == "deepspeed":
            model, opt = peers.build_deepspeed(f"deepspeed-{stage}", model, torch.bfloat16, 1e-3)
        elif stage == 3:
            model = zs.FullyShard(
                model,
                wrap={train_gpt.Block},
                mixed_precision=zs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            )
            opt = zs.ShardedOptimizer(model.parameters(), lr=1e-3)
        else:
            model.to(torch.bfloat16)
            opt = zs.ShardedOptimizer(model.parameters(), lr=1e-3, stage=stage)
        for _ in range(steps):
            loss = model(x[:, :-1], x[:, 1:])
            opt.backward(loss) if lib == "deepspeed" else loss.backward()
            opt.step()
            opt.zero_grad()
    if rank == 0:
        out.put(t.peak)
    dist.barrier()
    dist.destroy_process_group()


def deepspeed_estimates(build, world: int) -> dict:
    """DeepSpeed's per-GPU model-state estimates (no offload), as its *_all_live functions compute them."""
    if peers.available():
        return {}
    from deepspeed.runtime.zero import stage3
    from deepspeed.runtime.zero import stage_1_and_2 as stage2

    model = build()  # a real one: DeepSpeed counts parameters by data_ptr (on meta all are 0)
    with contextlib.redirect_stdout(io.StringIO()):
        total, largest = stage3.model_to_params(model)
        z2 = stage2.estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=world, cpu_offload=False)[1]
        z3 = stage3.estimate_zero3_model_states_mem_needs(
            total, largest, num_gpus_per_node=world, cpu_offload=False, cpu_offload_params=False
        )[1]
    return {2: z2, 3: z3}


OPTIONS = [
    opt("--world-size", type=int, default=8),
    opt("--seq", type=int, default=128),
    opt("--batch", type=int, default=2),
    opt(
        "--steps", type=int, default=2, help="training steps measured (the first allocates DeepSpeed's optimizer state)"
    ),
    opt("--models", default=",".join(MODELS)),
    opt("--merge", action="store_true", help="keep the rows of other models already in --json"),
]


def run(args):
    from zeroshard.plan import plan_model

    libs = ["zeroshard"] + (["deepspeed"] if not peers.available() else [])
    if len(libs) == 1:
        print(f"DeepSpeed not importable ({peers.available()}): its columns are '-' (`make bench-deps`)")
    rows = []
    for name in args.models.split(","):
        build = _build(name, args.seq)
        plan = plan_model(
            build,
            args.world_size,
            "bf16",
            wrap={train_gpt.Block},
            example=_batch(name, args.seq, args.batch),
            transport="gloo",
        )
        ds = deepspeed_estimates(build, args.world_size)
        for stage in (2, 3):
            st = plan["stages"][f"ZeRO-{stage}"]
            peaks = {
                lib: spawn(
                    measure,
                    args.world_size,
                    lib,
                    stage,
                    name,
                    args.seq,
                    args.batch,
                    args.steps,
                    what=f"{name} {lib} ZeRO-{stage}",
                    skip_failed=True,
                )
                for lib in libs
            }
            rows.append(
                dict(
                    model=name,
                    params=plan["params"],
                    stage=stage,
                    seq=args.seq,
                    batch=args.batch,
                    steps=args.steps,
                    ds_estimate=ds.get(stage),
                    ds_peak=peaks.get("deepspeed"),
                    plan_state=st["model_state"],
                    plan_peak=st["peak"],
                    peak=peaks["zeroshard"],
                )
            )
            print(rows[-1], flush=True)
    if args.merge and os.path.exists(args.json):
        with open(args.json) as f:
            rows = [r for r in json.load(f)["rows"] if r["model"] not in args.models.split(",")] + rows
    print(table(rows, args))
    return dict(
        date=str(date.today()),
        torch=torch.__version__,
        machine=machine_info("cpu"),
        world_size=args.world_size,
        seq=args.seq,
        batch=args.batch,
        rows=rows,
    )


def table(rows: list, args) -> str:
    def mb(x):
        return "-" if x is None else f"{x / 2**20:.1f}"

    def ratio(a, b):
        return "-" if a is None or not b else f"{a / b:.2f}"

    lines = [
        f"bf16, {args.world_size} ranks, MiB on rank 0",
        "",
        "| model (batch x seq, steps) | stage | DeepSpeed estimate | DeepSpeed measured peak | est./peak | zeroshard plan: "
        "state | plan: peak | zeroshard measured peak | plan/peak |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['params'] / 1e6:.1f}M; {r.get('batch')} x {r.get('seq')}, "
            f"{r.get('steps')}) | ZeRO-{r['stage']} | {mb(r['ds_estimate'])} | "
            f"{mb(r['ds_peak'])} | {ratio(r['ds_estimate'], r['ds_peak'])} | {mb(r['plan_state'])} | "
            f"{mb(r['plan_peak'])} | {mb(r['peak'])} | {ratio(r['plan_peak'], r['peak'])} |"
        )
    return "\n".join(lines)
