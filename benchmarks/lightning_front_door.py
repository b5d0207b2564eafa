"""One LightningModule under Lightning's Trainer with different strategies: step time and
peak memory, in one torchrun launch.

    torchrun --nproc-per-node 2 benchmarks/lightning_front_door.py [--steps 8] [--rounds 3] [--batch 8]

The module is the benchmarks' GPT (benchmarks/gpt.py) with AdamW (lr 3e-4, weight decay
0.1), clipping at 1.0, one micro-batch per step; the Trainer is the same for every row
but ``strategy=``: Lightning's DDPStrategy, ``"zeroshard_stage_2"``, ``"zeroshard_stage_3"``
and, where Lightning runs them (they need CUDA GPUs: on CPU their rows say so),
FSDPStrategy and DeepSpeedStrategy at stages 2 and 3.

"step ms": the median, over rounds, of each strategy's median step time on rank 0 (from
the start of a training batch to its end, after warmup steps); the strategies take
turns round by round in one process group, so they see the same machine load, and
"vs ddp" is the median of the per-round ratios to DDPStrategy (the one to read on a shared
machine). "tensor MB" (CPU) is rank 0's exact peak of live tensor bytes over the built
module during a fit of two steps (the CPU allocator's count, benchmarks/cpu_memory.py);
on CUDA, torch.cuda.max_memory_allocated over the same.
Writes lightning_front_door.json into --out (benchmarks/out) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from datetime import date

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_memory import TensorBytes  # noqa: E402
from gpt import GPT, Block, GPTConfig  # noqa: E402
from machine import machine_info  # noqa: E402

import zeroshard.integrations.lightning  # noqa: E402,F401  registers strategy="zeroshard..."


class LitGPT(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = GPT(GPTConfig())

    def training_step(self, batch, batch_idx):
        return self.model(batch[0][:, :-1], batch[0][:, 1:])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)


class StepTimes(Callback):
    def __init__(self):
        self.times, self.t0 = [], 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self.t0)


def strategies(cuda: bool) -> dict:
    """{row: the Trainer's strategy argument, or why it does not run here}."""
    rows = {"ddp": "ddp", "zeroshard stage 2": "zeroshard_stage_2", "zeroshard stage 3": "zeroshard_stage_3"}
    if cuda:
        from lightning.pytorch.strategies import FSDPStrategy
        rows.update({"fsdp (FULL_SHARD)": FSDPStrategy(auto_wrap_policy={Block}), "fsdp (SHARD_GRAD_OP)":
                     FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="SHARD_GRAD_OP"),
                     "deepspeed stage 2": "deepspeed_stage_2", "deepspeed stage 3": "deepspeed_stage_3"})
    else:
        rows.update({name: "needs CUDA GPUs (Lightning refuses it on CPU)" for name in
                     ("fsdp (FULL_SHARD)", "deepspeed stage 2", "deepspeed stage 3")})
    return rows


def fit(strategy, steps: int, batch: int, cuda: bool, callbacks=()):
    world = int(os.environ["WORLD_SIZE"])
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    data = torch.randint(0, GPTConfig().vocab, (batch * steps * world, GPTConfig().seq + 1), generator=g)
    trainer = L.Trainer(strategy=strategy, accelerator="gpu" if cuda else "cpu", devices=world, max_steps=steps,
                        gradient_clip_val=1.0, logger=False, callbacks=list(callbacks), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        trainer.fit(LitGPT(), DataLoader(TensorDataset(data), batch_size=batch))


def peak_mb(strategy, batch: int, cuda: bool) -> float:
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        fit(strategy, 2, batch, cuda)
        return torch.cuda.max_memory_allocated() / 2**20
    with TensorBytes() as t:
        t.mark()
        fit(strategy, 2, batch, cuda)
    return max(0, t.peak - t.at_mark) / 2**20


def measure(rows: dict, args, cuda: bool) -> dict:
    runnable = {k: v for k, v in rows.items() if not (isinstance(v, str) and " " in v)}
    per_round = {k: [] for k in runnable}
    for _ in range(args.rounds):
        for name, strategy in runnable.items():
            rec = StepTimes()
            fit(strategy, args.warmup + args.steps, args.batch, cuda, [rec])
            per_round[name].append(statistics.median(rec.times[args.warmup:]))
    out = {}
    for name, strategy in rows.items():
        out[name] = {"skipped": strategy} if name not in runnable else {
            "step_ms": statistics.median(per_round[name]) * 1e3,
            "vs_ddp": statistics.median(a / b for a, b in zip(per_round[name], per_round["ddp"])),
            "tensor_mb": peak_mb(strategy, args.batch, cuda)}
    return out


def table(rows: dict) -> str:
    lines = ["| strategy | step ms | vs ddp (paired) | tensor MB |", "|---|---:|---:|---:|"]
    for name, r in rows.items():
        if "skipped" in r:
            lines.append(f"| {name} | ({r['skipped']}) | — | — |")
        else:
            lines.append(f"| {name} | {r['step_ms']:.1f} | {r['vs_ddp']:.2f}x | {r['tensor_mb']:.1f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
                        help="folder of lightning_front_door.json (a GPU run writes its own)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    rows = measure(strategies(cuda), args, cuda)
    if int(os.environ["RANK"]) != 0:
        return
    cfg = GPTConfig()
    n = sum(p.numel() for p in GPT(cfg).parameters())
    head = (f"GPT {n / 1e6:.2f}M params, float32, world size {os.environ['WORLD_SIZE']}, "
            f"{'CUDA NCCL' if cuda else 'CPU gloo'}, batch {args.batch} x seq {cfg.seq} per rank, "
            f"lightning {L.__version__}; {date.today()}")
    print(head)
    print(table(rows))
    out = args.out
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "lightning_front_door.json"), "w") as f:
        json.dump({"header": head, "machine": machine_info("cuda" if cuda else "cpu"), "args": vars(args),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
