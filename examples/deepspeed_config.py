"""A DeepSpeed training script and config, run by zeroshard: the only change from the
DeepSpeed script is ``zeroshard.initialize`` in place of ``deepspeed.initialize``.

    torchrun --nproc-per-node 2 examples/deepspeed_config.py [--stage 3] [--ckpt-dir DIR]

The config is DeepSpeed's: batch sizes (any two give the third), gradient clipping,
an AdamW optimizer with a WarmupDecayLR schedule, ZeRO stage 2 (``--stage`` changes it)
with a tuning key zeroshard has no counterpart for (accepted, with a warning). The
script trains with the engine's ``backward`` / ``step``, saves a checkpoint halfway
with ``engine.save_checkpoint`` (DeepSpeed's ``global_step{N}`` tags and ``latest``
file), resumes it in a fresh engine at another stage and checks that the resumed run
equals the uninterrupted one, then reads the checkpoint back as one fp32 state dict
with ``zero_to_fp32`` and loads it into the plain model.
"""

import argparse
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroshard
from zeroshard.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

STEPS, DIM = 8, 32

ds_config = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 2,  # so 4 samples per rank per micro-batch on 2 ranks
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"total_num_steps": STEPS, "warmup_num_steps": 2, "warmup_max_lr": 3e-3, "warmup_type": "linear"},
    },
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7},
    "steps_per_print": 4,
}


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(F.gelu(self.ln(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, DIM)
        self.blocks = nn.ModuleList([Block(DIM) for _ in range(3)])  # stage 3: one unit per block
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).squeeze(-1)


def micro_batch(step, micro, n):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    x = torch.randn(n, 16, generator=g)
    return x, torch.sin(x.sum(-1))


def train(engine, first, last):
    for step in range(first, last):
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = micro_batch(step, micro, engine.train_micro_batch_size_per_gpu())
            x, y = x.to(engine.device), y.to(engine.device)  # (the GPU the engine put the model on)
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
    return loss.item()


def make_engine(stage):
    torch.manual_seed(0)
    model = Net()
    config = dict(ds_config, zero_optimization=dict(ds_config["zero_optimization"], stage=stage))
    engine, optimizer, _, scheduler = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def full_params(engine):
    sd = engine.module_state_dict()
    return {k: v.to("cpu", torch.float32, copy=True) for k, v in sd.items() if k in dict(Net().named_parameters())}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--ckpt-dir", default=None)
    args = parser.parse_args()
    ckpt = args.ckpt_dir or tempfile.mkdtemp(prefix="zeroshard-ds-")

    engine = make_engine(args.stage)  # creates the process group from torchrun's environment
    rank = dist.get_rank()
    if args.ckpt_dir is None:  # every rank must use the same directory
        holder = [ckpt]
        dist.broadcast_object_list(holder, src=0)
        ckpt = holder[0]
    train(engine, 0, STEPS // 2)
    engine.save_checkpoint(ckpt, client_state={"epoch": 1})
    at_save = full_params(engine)
    last_loss = train(engine, STEPS // 2, STEPS)
    whole = full_params(engine)

    resumed = make_engine(3 if args.stage != 3 else 2)  # resume at another stage
    path, client_state = resumed.load_checkpoint(ckpt)
    assert client_state == {"epoch": 1} and resumed.global_steps == STEPS // 2
    train(resumed, STEPS // 2, STEPS)
    again = full_params(resumed)
    worst = max((whole[k] - again[k]).abs().max().item() for k in whole)
    assert worst < 1e-5, f"the resumed run differs from the uninterrupted one by {worst}"

    plain = Net()
    plain.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(ckpt))  # the tag in ckpt/latest
    assert all(torch.equal(p, at_save[n]) for n, p in plain.named_parameters())
    if rank == 0:
        print(
            f"deepspeed_config: stage {args.stage}, {engine.global_steps} steps, loss {last_loss:.4f}, lr "
            f"{engine.get_lr()[0]:.2e}; checkpoint {path} resumed at stage {resumed.zero_optimization_stage()} "
            f"(max difference {worst:.1e}); zero_to_fp32 loads into the plain model"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
