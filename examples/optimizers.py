"""Param groups, an LR scheduler and other torch optimizers with zeroshard.ShardedOptimizer.

    torchrun --nproc-per-node 2 examples/optimizers.py

ShardedOptimizer is a ``torch.optim.Optimizer``: param groups with their own
hyperparameters (here weight decay on the matrices, none on biases and
LayerNorms) and ``torch.optim.lr_scheduler`` work as with ``torch.optim.AdamW``.
By default the update is zeroshard's fused AdamW; ``optimizer_class=`` runs any
of torch's elementwise optimizers instead (SGD, Adam, RMSprop, ...), with the
remaining keyword arguments passed to that class, each rank stepping only its
shard. The script trains the same model twice, with AdamW and with SGD +
momentum, each at ZeRO-2 on N ranks, and checks each against plain torch (the
same optimizer class and scheduler in one process, whole batches).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import _device  # examples/_device.py: NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo
import zeroshard

STEPS, BATCH, DIM, WARMUP = 20, 32, 32, 5
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
def held_out_loss(model, device):
    x, y = (t.to(device) for t in batch(10_000))  # a fixed batch no step trains on, the same on every rank
    return F.mse_loss(model(x), y).item()


def param_groups(model, weight_decay):
    """The usual split: decay the weight matrices, not the biases and LayerNorm parameters."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train(model, opt, device, rank=0, world=1):
    # warmup, then linear decay: the scheduler drives the ShardedOptimizer's param groups as torch's
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / WARMUP, (STEPS - s) / (STEPS - WARMUP)))
    lrs = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in batch(step, rank, world))
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        lrs.append(opt.param_groups[0]["lr"])
        sched.step()
    return lrs


def compare(name, make_sharded, make_torch, device, rank, world):
    torch.manual_seed(0)
    model = Net().to(device)
    opt, before = make_sharded(model), held_out_loss(model, device)
    lrs, after = train(model, opt, device, rank, world), held_out_loss(model, device)
    torch.manual_seed(0)  # plain torch in this process, whole batches: the reference
    ref = Net().to(device)
    train(ref, make_torch(ref), device)
    err = max(((p - r).norm() / r.norm()).item() for p, r in zip(model.parameters(), ref.parameters()))
    mem = opt.memory_report()
    state = mem.get("optimizer_state", mem["exp_avg"] + mem["exp_avg_sq"])
    if rank == 0:
        print(
            f"{name:<12} held-out loss {before:.4f} -> {after:.4f} | lr peak {max(lrs):.0e} | rank 0's "
            f"optimizer state {state:,} bytes | vs plain torch: max relative error {err:.1e}"
        )
    assert err < 1e-5, f"{name}: ShardedOptimizer differs from plain torch (relative error {err})"
    assert after < 0.5 * before, f"{name}: the loss did not go down: {before:.4f} -> {after:.4f}"
    return err


def main():
    device = _device.setup()  # the process group, and this rank's GPU (or the CPU)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()

    # 1. The default: zeroshard's fused AdamW, over two param groups.
    adamw = compare(
        "AdamW",
        lambda m: zeroshard.ShardedOptimizer(param_groups(m, 0.1), lr=3e-3, stage=2),  # zeroshard
        lambda m: torch.optim.AdamW(param_groups(m, 0.1), lr=3e-3),
        device,
        rank,
        world,
    )

    # 2. Another torch optimizer: optimizer_class= plus that class's own keyword arguments.
    sgd = compare(
        "SGD+momentum",
        lambda m: zeroshard.ShardedOptimizer(
            param_groups(m, 1e-4), optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9, stage=2
        ),  # zeroshard
        lambda m: torch.optim.SGD(param_groups(m, 1e-4), lr=0.05, momentum=0.9),
        device,
        rank,
        world,
    )

    if rank == 0:
        print(
            f"optimizers: AdamW and SGD with param groups and a scheduler on {world} ranks equal plain torch "
            f"(max relative error {max(adamw, sgd):.1e})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
