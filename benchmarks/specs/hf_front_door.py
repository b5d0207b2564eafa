"""One model under Hugging Face's Trainer with different sharding: step time and peak
memory. The Trainer, its arguments and the data are the same for every row but the
one argument that picks the sharding:

    python -m benchmarks hf_front_door [--world 2] [--steps 6] [--rounds 3] [--batch 4]

Rows: the Trainer's own DDP; ``ZeroShardTrainer(zeroshard=dict(stage=2))`` and
``stage=3``; FSDP2 (``fsdp="full_shard"``, ``fsdp_config={"fsdp_version": 2,
"transformer_layer_cls_to_wrap": ["GPT2Block"]}``; GPUs only: on CPU Accelerate ignores it);
FSDP2 applied before the Trainer (``fully_shard`` on each block and the model, which the
Trainer then trains through its own path for FSDP2-sharded models: the one that runs on CPU);
DeepSpeed (``deepspeed=`` a ZeRO
config, stages 2 and 3; the Trainer's AdamW as its client optimizer). The model is a
GPT-2 built from its config (float32), AdamW (lr 3e-4, weight decay 0.1), clipping at
1.0, one micro-batch per step.

Each (round, row) is its own torchrun launch (DeepSpeed and FSDP leave process-wide
state behind them), the rows taking turns round by round so that they see the same
machine load. "step ms": the median over rounds of a launch's median step (the
Trainer's ``on_step_begin`` to ``on_step_end`` on rank 0, after warmup steps); "vs
ddp": the median of the per-round ratios to the Trainer's DDP; "spread": the
smallest and largest per-round ratio. "tensor MB" (CPU): rank 0's exact peak of live
tensor bytes over a 2-step ``train()`` with the model built inside it
(benchmarks/cpu_memory.py); on CUDA torch.cuda.max_memory_allocated over the same.
Writes benchmarks/out/hf_front_door.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date

import torch

from benchmarks.harness import machine_info, opt, run_env, torchrun

ROWS = {
    "trainer ddp": {},
    "zeroshard stage 2": {"zeroshard": 2},
    "zeroshard stage 3": {"zeroshard": 3},
    "fsdp2 full_shard": {"fsdp": True},
    "fsdp2 sharded model": {"fully_shard": True},
    "deepspeed stage 2": {"deepspeed": 2},
    "deepspeed stage 3": {"deepspeed": 3},
}
VOCAB, SEQ = 8192, 64
# Accelerate turns FSDP on for multi-GPU runs only: on CPU the Trainer given fsdp= trains
# with DDP without a word (its model holds no FSDP module), so that row runs on GPUs only
CUDA_ONLY = {"fsdp2 full_shard": "needs GPUs: on CPU Accelerate ignores fsdp= and the Trainer trains with DDP"}


def build():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=384, n_layer=6, n_head=6, bos_token_id=0, eos_token_id=0)
    )


def trainer_for(row: dict, steps: int, batch: int, out: str, callbacks=()):
    import transformers
    from transformers import Trainer, TrainingArguments

    transformers.logging.set_verbosity_error()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, VOCAB, (batch * steps * world, SEQ), generator=g)
    data = [{"input_ids": x, "labels": x} for x in ids]
    kw = dict(
        output_dir=out,
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=3e-4,
        weight_decay=0.1,
        max_grad_norm=1.0,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=10**6,
        dataloader_drop_last=True,
    )
    if row.get("fsdp"):
        kw.update(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]})
    if row.get("deepspeed"):
        # the "auto" sizes of Hugging Face's DeepSpeed example configs (DeepSpeed's own defaults hold
        # 5e8-element buckets: 2 GB of fp32 on each rank for this model)
        zero = {
            "stage": row["deepspeed"],
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": "auto",
        }
        if row["deepspeed"] == 3:
            zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
        else:
            zero.update(allgather_bucket_size=2e8)
        kw.update(
            deepspeed={
                "zero_optimization": zero,
                "gradient_clipping": "auto",
                "train_micro_batch_size_per_gpu": "auto",
                "train_batch_size": "auto",
                "gradient_accumulation_steps": "auto",
            }
        )
    args = TrainingArguments(**kw)
    model = build()
    if row.get("fully_shard"):
        # FSDP2 applied before the Trainer (each GPT2Block, then the model), flagged as transformers
        # flags a model it loaded sharded: the Trainer then prepares it without DDP and defers FSDP's
        # reduction over accumulation, its own path for FSDP2-managed models (which runs on CPU too)
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        model._is_distributed_loading_by_transformers = True
    if row.get("zeroshard"):
        from zeroshard.integrations.hf import ZeroShardTrainer

        return ZeroShardTrainer(
            model=model,
            args=args,
            train_dataset=data,
            callbacks=list(callbacks),
            zeroshard=dict(stage=row["zeroshard"]),
        )
    return Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))


def worker(name: str, args) -> None:
    """One row under torchrun: a 2-step train() under the memory count, then the timed one."""
    from transformers import TrainerCallback
    from benchmarks.cpu_memory import TensorBytes

    class Steps(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    row, out = ROWS[name], tempfile.mkdtemp()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        trainer_for(row, 2, args.batch, out).train()
        peak = torch.cuda.max_memory_allocated()
    else:
        with TensorBytes() as t:
            t.mark()
            trainer_for(row, 2, args.batch, out).train()
        peak = max(0, t.peak - t.at_mark)
    rec = Steps()
    trainer_for(row, args.warmup + args.steps, args.batch, out, [rec]).train()
    if int(os.environ["RANK"]) == 0:
        with open(args.result, "w") as f:
            json.dump({"step_s": statistics.median(rec.times[args.warmup :]), "peak_bytes": peak}, f)
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's CPU teardown can abort at interpreter exit; the result is written


def launch(name: str, args) -> dict:
    with tempfile.TemporaryDirectory() as d:
        result = os.path.join(d, "result.json")
        env = run_env(
            DS_ACCELERATOR="cpu" if not torch.cuda.is_available() else "cuda",
            OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.world)),
        )
        cmd = torchrun(
            args.world,
            "hf_front_door",
            "--row",
            name,
            "--result",
            result,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--batch",
            str(args.batch),
        )
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
        if not os.path.isfile(result):
            raise RuntimeError(f"{name}: no result\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
        with open(result) as f:
            return json.load(f)


OPTIONS = [
    opt("--world", type=int, default=2),
    opt("--steps", type=int, default=6),
    opt("--warmup", type=int, default=2),
    opt("--rounds", type=int, default=3),
    opt("--batch", type=int, default=4),
    opt("--row", help=argparse.SUPPRESS),
    opt("--result", help=argparse.SUPPRESS),
]


def run(args):
    if args.row:
        return worker(args.row, args)
    runnable = [n for n in ROWS if torch.cuda.is_available() or n not in CUDA_ONLY]
    per_round = {name: [] for name in runnable}
    peaks = {name: [] for name in runnable}
    for r in range(args.rounds):
        for name in runnable:
            got = launch(name, args)
            per_round[name].append(got["step_s"])
            peaks[name].append(got["peak_bytes"])
            print(
                f"round {r + 1}: {name}: {got['step_s'] * 1e3:.1f} ms, {got['peak_bytes'] / 2**20:.1f} MB", flush=True
            )
    rows = {name: {"skipped": CUDA_ONLY[name]} if name not in runnable else {} for name in ROWS}
    for name in runnable:
        ratios = [a / b for a, b in zip(per_round[name], per_round["trainer ddp"])]
        rows[name] = {
            "step_ms": statistics.median(per_round[name]) * 1e3,
            "vs_ddp": statistics.median(ratios),
            "spread": [min(ratios), max(ratios)],
            "tensor_mb": statistics.median(peaks[name]) / 2**20,
            "per_round_ms": [t * 1e3 for t in per_round[name]],
        }
    import transformers

    n = sum(p.numel() for p in build().parameters())
    head = (
        f"GPT-2 {n / 1e6:.2f}M params, float32, world size {args.world}, "
        f"{'CUDA NCCL' if torch.cuda.is_available() else 'CPU gloo'}, batch {args.batch} x seq {SEQ} per rank, "
        f"transformers {transformers.__version__}; {date.today()}"
    )
    lines = [head, "| sharding | step ms | vs trainer ddp (paired) | spread | tensor MB |", "|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        if "skipped" in r:
            lines.append(f"| {name} | ({r['skipped']}) | — | — | — |")
            continue
        lines.append(
            f"| {name} | {r['step_ms']:.1f} | {r['vs_ddp']:.2f}x | {r['spread'][0]:.2f}-"
            f"{r['spread'][1]:.2f}x | {r['tensor_mb']:.1f} |"
        )
    print("\n".join(lines))
    return {
        "header": head,
        "machine": machine_info("cuda" if torch.cuda.is_available() else "cpu"),
        "args": {k: v for k, v in vars(args).items() if k not in ("row", "result", "json")},
        "rows": rows,
    }
