"""The ZeRO-1/2 tests' model and its reference run: a Net of awkward sizes (prime widths, a
parameter larger than a bucket, a frozen layer, a layer the forward never uses), its data,
and single-process torch AdamW on the whole batch to compare ShardedOptimizer with."""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroshard as zs

BATCH = 12  # divisible by 2 and 3: every rank gets an equal slice


TINY_BUCKET_MB = 1000 / 2**20  # ~1000 bytes: buckets split tensors, big.weight spans several


class Net(nn.Module):
    """Awkward sizes: prime widths, a parameter larger than a bucket, a frozen
    layer and a layer the forward never uses."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(37, 13)
        self.fc1 = nn.Linear(13, 29)
        self.big = nn.Linear(29, 31)
        self.frozen = nn.Linear(31, 31)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(5, 7)
        self.head = nn.Linear(31, 3)

    def forward(self, x):
        h = self.emb(x).mean(1)
        h = torch.tanh(self.fc1(h))
        h = torch.tanh(self.big(h))
        h = self.frozen(h)
        return self.head(h)


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return Net().to(dtype)


def param_groups(model, lr=1e-2):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1, "lr": lr}, {"params": no_decay, "weight_decay": 0.0, "lr": lr / 2}]


def batches(steps, seed=1, micro=1):
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randint(0, 37, (BATCH, 5), generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(micro)
        ]
        for _ in range(steps)
    ]


def local(x, rank, world):
    n = x.shape[0] // world
    return x[rank * n : (rank + 1) * n]


def reference(steps, micro=1, clip=None, dtype=torch.float32, state_after=None):
    """Single-process torch AdamW on the whole batch; returns the model (and norms)."""
    model = make_model(dtype=torch.float32)
    if dtype != torch.float32:  # same (rounded) starting point as the low-precision run
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype).float())
    opt = torch.optim.AdamW(param_groups(model), foreach=False)
    norms = []
    for k, mbs in enumerate(batches(steps, micro=micro)):
        opt.zero_grad()
        for x, y in mbs:
            (F.cross_entropy(model(x), y) / micro).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        if state_after is not None and k + 1 == state_after:
            return model, opt
    return model, norms


def train_ours(
    steps,
    stage,
    micro=1,
    no_sync=False,
    clip=None,
    dtype=torch.float32,
    reduce_dtype=None,
    bucket_mb=TINY_BUCKET_MB,
    model=None,
    opt=None,
    first_step=0,
    **hybrid,
):
    rank, world = dist.get_rank(), dist.get_world_size()
    if model is None:
        model = make_model(dtype=dtype)
        opt = zs.ShardedOptimizer(
            param_groups(model), stage=stage, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype, **hybrid
        )
    norms = []
    for mbs in batches(first_step + steps, micro=micro)[first_step:]:
        opt.zero_grad()
        for j, (x, y) in enumerate(mbs):
            ctx = opt.no_sync() if (no_sync and j < micro - 1) else contextlib.nullcontext()
            with ctx:
                (F.cross_entropy(model(local(x, rank, world)), local(y, rank, world)) / micro).backward()
        if clip is not None:
            norms.append(opt.clip_grad_norm_(clip).item())
        opt.step()
    return model, opt, norms
