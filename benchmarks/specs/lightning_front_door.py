"""One LightningModule under Lightning's Trainer with different strategies: step time and
peak memory, in one torchrun launch.

    torchrun --nproc-per-node 2 -m benchmarks lightning_front_door [--steps 8] [--rounds 3] [--batch 8]

(from the repository's root, or with it on PYTHONPATH)

The module is the benchmarks' GPT (benchmarks/gpt.py) with AdamW (lr 3e-4, weight decay
0.1), clipping at 1.0, one micro-batch per step; the Trainer is the same for every row
but ``strategy=``: Lightning's DDPStrategy, ``"zeroshard_stage_2"``, ``"zeroshard_stage_3"``
and Lightning's FSDPStrategy (FULL_SHARD and SHARD_GRAD_OP, ``auto_wrap_policy={Block}``)
and DeepSpeedStrategy at stages 2 and 3.

Lightning accepts FSDPStrategy and DeepSpeedStrategy on CUDA only, while torch's FSDP and
DeepSpeed (``DS_ACCELERATOR=cpu``) themselves train on the CPU with gloo. On a machine without
CUDA the two rows therefore use the subclasses below, which change only what stands between
Lightning and the CPU: FSDPStrategy's model is wrapped with ``device_id=cpu`` (Lightning passes
the device's index, None on the CPU, which torch's FSDP refuses), and DeepSpeedStrategy skips
Lightning's CUDA-only check and reports the local rank as its device index (which DeepSpeed's
engine reads). Everything else (optimizer setup, precision, clipping, the loop) is Lightning's.
Lightning's FSDPPrecision refuses ``gradient_clip_algorithm="norm"``; for FSDP the module clips
with torch's ``FullyShardedDataParallel.clip_grad_norm_`` (the global norm), the call that
FSDPPrecision's source names, so every row clips at 1.0 by the global norm. "last loss" is rank 0's loss at the last
step of the last round: the same data, seed and steps in every row, so the rows train alike.

"step ms": the median, over rounds, of each strategy's median step time on rank 0 (from
the start of a training batch to its end, after warmup steps); the strategies take
turns round by round in one process group, so they see the same machine load, and
"vs ddp" is the median of the per-round ratios to DDPStrategy (the one to read on a shared
machine). "tensor MB" (CPU) is rank 0's exact peak of live tensor bytes over the built
module during a fit of two steps (the CPU allocator's count, benchmarks/cpu_memory.py);
on CUDA, torch.cuda.max_memory_allocated over the same.
Writes benchmarks/out/lightning_front_door.json (--json) and prints the table.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from datetime import date

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when DeepSpeedStrategy first imports deepspeed

import lightning as L
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import zeroshard.integrations.lightning  # noqa: F401  registers strategy="zeroshard..."
from benchmarks.cpu_memory import TensorBytes
from benchmarks.gpt import GPT, Block, GPTConfig
from benchmarks.harness import machine_info, opt


class LitGPT(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = GPT(GPTConfig())

    def training_step(self, batch, batch_idx):
        return self.model(batch[0][:, :-1], batch[0][:, 1:])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if isinstance(self.trainer.strategy, FSDPStrategy):  # FSDPPrecision refuses "norm": FSDP's own global norm
            self.trainer.model.clip_grad_norm_(gradient_clip_val)
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


class FSDPOnCPU(FSDPStrategy):
    """Lightning's FSDPStrategy with torch's FSDP given the CPU device (see the module's docstring)."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(
            model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )
        return super()._setup_model(model)  # Lightning's own steps for a module the user wrapped


class DeepSpeedOnCPU(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy past its CUDA-only checks (see the module's docstring)."""

    @property
    def root_device(self):
        return torch.device("cpu", self.local_rank)  # DeepSpeed's engine takes the index as its local rank

    def setup_environment(self):
        DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's own refuses any accelerator but CUDA

    def setup_distributed(self):
        reset_seed()  # as DeepSpeedStrategy's, without its check that device indices are local ranks
        self.set_world_ranks()
        self._init_deepspeed_distributed()


class StepTimes(Callback):
    def __init__(self):
        self.times, self.t0, self.loss = [], 0.0, float("nan")

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self.t0)
        self.loss = float(outputs["loss"])


# DeepSpeedStrategy's buckets default to 2e8 elements (800 MB in fp32), which dominate the peak of
# a small model; these rows give DeepSpeed zeroshard's default bucket of 25 MB (in fp32 elements).
DS_25MB = {"reduce_bucket_size": 25 * 2**20 // 4, "allgather_bucket_size": 25 * 2**20 // 4}


def strategies(cuda: bool) -> dict:
    """{row: a function making the Trainer's strategy argument}: a fresh one for every fit."""
    fsdp, deepspeed = (FSDPStrategy, DeepSpeedStrategy) if cuda else (FSDPOnCPU, DeepSpeedOnCPU)
    return {
        "ddp": lambda: "ddp",
        "zeroshard stage 2": lambda: "zeroshard_stage_2",
        "zeroshard stage 3": lambda: "zeroshard_stage_3",
        "fsdp (FULL_SHARD)": lambda: fsdp(auto_wrap_policy={Block}),
        "fsdp (SHARD_GRAD_OP)": lambda: fsdp(auto_wrap_policy={Block}, sharding_strategy="SHARD_GRAD_OP"),
        "deepspeed stage 2": lambda: deepspeed(stage=2),
        "deepspeed stage 3": lambda: deepspeed(stage=3),
        "deepspeed stage 2, 25 MB buckets": lambda: deepspeed(stage=2, **DS_25MB),
        "deepspeed stage 3, 25 MB buckets": lambda: deepspeed(stage=3, **DS_25MB),
    }


def fit(strategy, steps: int, batch: int, cuda: bool, callbacks=()):
    world = int(os.environ["WORLD_SIZE"])
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    data = torch.randint(0, GPTConfig().vocab, (batch * steps * world, GPTConfig().seq + 1), generator=g)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu" if cuda else "cpu",
        devices=world,
        max_steps=steps,
        gradient_clip_val=1.0,
        logger=False,
        callbacks=list(callbacks),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
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
    per_round, loss = {k: [] for k in rows}, {}
    for _ in range(args.rounds):
        for name, make in rows.items():
            rec = StepTimes()
            fit(make(), args.warmup + args.steps, args.batch, cuda, [rec])
            per_round[name].append(statistics.median(rec.times[args.warmup :]))
            loss[name] = rec.loss
    return {
        name: {
            "step_ms": statistics.median(per_round[name]) * 1e3,
            "vs_ddp": statistics.median(a / b for a, b in zip(per_round[name], per_round["ddp"])),
            "tensor_mb": peak_mb(make(), args.batch, cuda),
            "last_loss": loss[name],
        }
        for name, make in rows.items()
    }


def table(rows: dict) -> str:
    lines = ["| strategy | step ms | vs ddp (paired) | tensor MB | last loss |", "|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['step_ms']:.1f} | {r['vs_ddp']:.2f}x | {r['tensor_mb']:.1f} | {r['last_loss']:.4f} |"
        )
    return "\n".join(lines)


OPTIONS = [
    opt("--steps", type=int, default=8),
    opt("--warmup", type=int, default=2),
    opt("--rounds", type=int, default=3),
    opt("--batch", type=int, default=8),
]


def run(args):
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    rows = measure(strategies(cuda), args, cuda)
    if int(os.environ["RANK"]) != 0:
        return None
    cfg = GPTConfig()
    n = sum(p.numel() for p in GPT(cfg).parameters())
    head = (
        f"GPT {n / 1e6:.2f}M params, float32, world size {os.environ['WORLD_SIZE']}, "
        f"{'CUDA NCCL' if cuda else 'CPU gloo'}, batch {args.batch} x seq {cfg.seq} per rank, "
        f"lightning {L.__version__}; {date.today()}"
    )
    print(head)
    print(table(rows))
    return {
        "header": head,
        "machine": machine_info("cuda" if cuda else "cpu"),
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "rows": rows,
    }
