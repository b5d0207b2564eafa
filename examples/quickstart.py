"""Quickstart: a DDP + AdamW training script converted to ZeRO-2 by changing two lines.

    torchrun --nproc-per-node 2 examples/quickstart.py

The DDP version of this script had

    model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

zeroshard deletes the first line and replaces the second with one
``zeroshard.ShardedOptimizer(..., stage=2)`` (marked ``# zeroshard`` below).
Everything else (the loop, ``loss.backward()``, ``opt.step()``,
``opt.zero_grad()``, printing on rank 0) stays as it was. Each rank now keeps
only its 1/N share of the gradients and of AdamW's state; after every step
the updated parameters are all-gathered, so at the end every rank holds the
same parameters, which the script checks.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import _device  # examples/_device.py: NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo
import zeroshard

STEPS, BATCH, DIM = 30, 32, 32  # BATCH is the global batch, split over the ranks


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


W = torch.randn(16, generator=torch.Generator().manual_seed(1234)) / 4  # the function to learn


def batch(step, rank, world):
    """This rank's share of the global batch of ``step`` (random x, y = sin(2 x.W))."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 16, generator=g)
    y = torch.sin(2 * (x @ W))
    n = BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def main():
    device = _device.setup()  # the process group, and this rank's GPU (or the CPU)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = Net().to(device)
    # DDP: model = torch.nn.parallel.DistributedDataParallel(model)      <- deleted
    opt = zeroshard.ShardedOptimizer(model.parameters(), lr=3e-3, weight_decay=0.1, stage=2)  # zeroshard

    losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in batch(step, rank, world))
        loss = F.mse_loss(model(x), y)
        loss.backward()  # gradients are reduce-scattered: each rank keeps its shard
        opt.step()  # each rank updates its shard, then the parameters are all-gathered
        opt.zero_grad()
        losses.append(loss.item())
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d} | loss {loss.item():.4f}")

    # Every rank holds the full, identical parameters (as under DDP).
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()  # objects go as CPU tensors
    others = zeroshard.all_gather_object(flat)  # a script's last collective on gloo: see docs/cpp-core.md
    worst = max((o - flat).abs().max().item() for o in others)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    mem = opt.memory_report()
    if rank == 0:
        print(
            f"rank 0 holds {mem['grads']:,} gradient bytes and {mem['exp_avg'] + mem['exp_avg_sq']:,} "
            f"AdamW-state bytes of {flat.numel():,} parameters (1/{world} of each)"
        )
        print(
            f"quickstart: loss {first:.4f} -> {last:.4f} over {STEPS} steps on {world} ranks; "
            f"parameters identical on every rank (max difference {worst:g})"
        )
    assert worst == 0.0, f"ranks hold different parameters (max difference {worst})"
    assert last < 0.5 * first, f"the loss did not go down: {first:.4f} -> {last:.4f}"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
