"""Mixed precision with zeroshard: bf16 autocast, fp16 with GradScaler, and ZeRO-3's MixedPrecision.

    torchrun --nproc-per-node 2 examples/mixed_precision.py

1. ZeRO-2 + ``torch.autocast(dtype=torch.bfloat16)``: fp32 parameters, bf16
   matmuls; nothing zeroshard-specific beyond the optimizer.
2. ZeRO-2 + fp16 autocast + ``torch.amp.GradScaler``: ``scale``, ``unscale_``,
   ``clip_grad_norm_``, ``step``, ``update`` as in a DDP script. An overflow on
   any rank skips the step on every rank and backs the scale off everywhere;
   the huge initial scale here makes the first steps overflow on purpose.
3. ZeRO-3: ``FullyShard(..., mixed_precision=MixedPrecision(param_dtype=bf16,
   reduce_dtype=fp32))`` gathers bf16 parameters from fp32 shards (the master
   weights) and reduce-scatters the gradients in fp32; no autocast needed.
Each run must halve the loss on a fixed held-out batch.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import _device  # examples/_device.py: NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo
import zeroshard

STEPS, BATCH, DIM = 30, 32, 32
W = torch.randn(16, generator=torch.Generator().manual_seed(1234)) / 4  # the function to learn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, d=DIM, layers=3):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x))).squeeze(-1)


def batch(step, rank=0, world=1):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 16, generator=g)
    y = torch.sin(2 * (x @ W))
    n = BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


@torch.no_grad()
def held_out_loss(model, device, input_dtype):
    x, y = batch(10_000)  # the same on every rank (FullyShard's forward is collective)
    return F.mse_loss(model(x.to(device, input_dtype)).float(), y.to(device)).item()


def run(name, model, opt, device, rank, world, dtype=None, scaler=None, input_dtype=torch.float32):
    before, skipped = held_out_loss(model, device, input_dtype), 0
    for step in range(STEPS):
        x, y = batch(step, rank, world)
        x, y = x.to(device, input_dtype), y.to(device)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.mse_loss(model(x).float(), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)  # works on zeroshard's sharded gradients, as on DDP's
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the global norm over every shard
            scale = scaler.get_scale()
            scaler.step(opt)  # skipped on every rank if any rank's gradients overflowed
            scaler.update()
            skipped += scaler.get_scale() < scale
        opt.zero_grad()
    after = held_out_loss(model, device, input_dtype)
    if rank == 0:
        print(
            f"{name:<28} held-out loss {before:.4f} -> {after:.4f}"
            + (f" | {skipped} overflowed steps skipped, scale now {scaler.get_scale():g}" if scaler else "")
        )
    assert after < 0.5 * before, f"{name}: the loss did not go down: {before:.4f} -> {after:.4f}"
    return skipped


def main():
    device = _device.setup()  # the process group, and this rank's GPU (or the CPU)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    kw = dict(lr=3e-3, weight_decay=0.1)

    torch.manual_seed(0)  # 1. ZeRO-2 under bf16 autocast
    model = Net().to(device)
    opt = zeroshard.ShardedOptimizer(model.parameters(), stage=2, **kw)  # zeroshard
    run("ZeRO-2, bf16 autocast", model, opt, device, rank, world, dtype=torch.bfloat16)

    torch.manual_seed(0)  # 2. ZeRO-2 under fp16 autocast with a GradScaler
    model = Net().to(device)
    opt = zeroshard.ShardedOptimizer(model.parameters(), stage=2, **kw)  # zeroshard
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**24)  # too large: overflows first
    skipped = run("ZeRO-2, fp16 + GradScaler", model, opt, device, rank, world, dtype=torch.float16, scaler=scaler)
    every_rank = zeroshard.all_gather_object((skipped, scaler.get_scale()))  # must be the same everywhere
    assert skipped > 0 and len(set(every_rank)) == 1, f"ranks disagree on skipped steps / scale: {every_rank}"

    torch.manual_seed(0)  # 3. ZeRO-3: bf16 compute from fp32 shards, fp32 reductions
    mp = zeroshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # zeroshard
    model = zeroshard.FullyShard(Net().to(device), wrap={Block}, mixed_precision=mp)  # zeroshard
    opt = zeroshard.ShardedOptimizer(model.parameters(), **kw)  # zeroshard
    # the model computes in bf16: float inputs are not cast for you (no autocast here), so pass bf16 ones
    run("ZeRO-3, MixedPrecision bf16", model, opt, device, rank, world, input_dtype=torch.bfloat16)
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.float32}, f"the shards (master weights) should stay fp32, got {dtypes}"

    if rank == 0:
        print(
            f"mixed_precision: bf16 autocast, fp16 + GradScaler ({skipped} skipped steps, the same on every "
            f"rank) and FullyShard MixedPrecision all trained on {world} ranks"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
