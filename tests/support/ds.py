"""What the DeepSpeed tests share (tests/integration/test_deepspeed_engine.py and its rank-side
jobs in support/jobs/): the base config, the model, each rank's micro-batch, DeepSpeed set up
to run on CPU, and an engine's full parameters."""

import copy
import math
import os

import torch
import torch.nn as nn

SCHEDULE = {
    "type": "WarmupDecayLR",
    "params": {"total_num_steps": 10, "warmup_num_steps": 3, "warmup_max_lr": 1e-2, "warmup_type": "linear"},
}


ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "weight_decay": 0.1, "torch_adam": True}}


def base(stage, **extra):
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "optimizer": copy.deepcopy(ADAMW),
        "scheduler": copy.deepcopy(SCHEDULE),
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    cfg.update(extra)
    return cfg


class Net(nn.Module):
    """Awkward sizes (7, 13) so shards are padded; blocks in a ModuleList become stage-3 units."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.blocks = nn.ModuleList([nn.Linear(13, 13) for _ in range(2)])
        self.out = nn.Linear(13, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.out(h)


def batch(step, micro, rank, world, n, inject=()):
    """This rank's micro-batch: a slice of one global batch per step (the same global batch
    at any world size). ``inject``: steps whose rank-0 input holds an inf."""
    g = torch.Generator().manual_seed(step)
    total = n * world * 64
    x, y = torch.randn(total, 7, generator=g), torch.randn(total, 1, generator=g)
    i = (micro * world + rank) * n
    x, y = x[i : i + n].clone(), y[i : i + n]
    if step in inject and rank == 0 and micro == 0:
        x[0, 0] = math.inf
    return x, y


def ds_setup():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    type(get_accelerator()).is_fp16_supported = lambda self: True
    return deepspeed


def params_of(engine, deepspeed=False):
    """{name: fp32 full parameter} (collective at stage 3)."""
    if deepspeed and engine.zero_optimization_stage() == 3:
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p).float().clone() for n, p in engine.module.named_parameters()}
    if not deepspeed and engine.zero_optimization_stage() == 3:
        return {k: v.float() for k, v in engine.module_state_dict().items()}
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
