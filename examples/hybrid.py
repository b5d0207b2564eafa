"""Hybrid sharding: shard inside groups of shard_size ranks (a node), replicate across them.

    torchrun --nproc-per-node 4 examples/hybrid.py

With ``zeroshard.Sharding(shard_size=2)`` on 4 ranks, ranks {0, 1} and {2, 3} are two shard
groups (torchrun numbers ranks node by node, so shard_size = GPUs per node
makes a shard group a node). Each group holds one sharded copy of the state;
gradients are reduce-scattered inside the group, and each rank's shard is
all-reduced with the same shard of the other group (its replica), so only 1/S
of the gradient crosses the slow link. The script trains ZeRO-2 and ZeRO-3
this way and checks both against plain torch.optim.AdamW in one process.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import _device  # examples/_device.py: NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo
import zeroshard

STEPS, BATCH, DIM, SHARD = 10, 32, 32, 2
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


def train(model, opt, device, rank=0, world=1):
    for step in range(STEPS):
        x, y = (t.to(device) for t in batch(step, rank, world))
        F.mse_loss(model(x), y).backward()  # reduce-scatter in the shard group, all-reduce across replicas
        opt.step()  # all-gather in the shard group
        opt.zero_grad()


def main():
    device = _device.setup()  # the process group, and this rank's GPU (or the CPU)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world % SHARD == 0, f"run with a multiple of {SHARD} ranks: torchrun --nproc-per-node 4 ..."
    torch.manual_seed(0)
    ref = Net().to(device)  # plain torch in this process, whole batches: the reference
    train(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1), device)
    expected = {k: v.cpu().clone() for k, v in ref.state_dict().items()}  # on CPU, as FullyShard's state dict
    n = sum(v.numel() for v in expected.values())

    # ZeRO-2, hybrid: the optimizer state and gradients sharded over 2 ranks, replicated world/2 times
    torch.manual_seed(0)
    model = Net().to(device)
    opt = zeroshard.ShardedOptimizer(
        model.parameters(), lr=3e-3, weight_decay=0.1, stage=2, sharding=zeroshard.Sharding(shard_size=SHARD)
    )  # zeroshard: hybrid
    train(model, opt, device, rank, world)
    err2 = max(((v.cpu() - expected[k]).norm() / expected[k].norm()).item() for k, v in model.state_dict().items())
    rep2, crossed = opt.memory_report(), opt.comm_elements["replica_all_reduce"]

    # ZeRO-3, hybrid: the parameters too
    torch.manual_seed(0)
    model = zeroshard.FullyShard(
        Net().to(device), wrap={Block}, sharding=zeroshard.Sharding(shard_size=SHARD)
    )  # zeroshard: hybrid
    opt = zeroshard.ShardedOptimizer(model.parameters(), lr=3e-3, weight_decay=0.1)
    train(model, opt, device, rank, world)
    owned = sum(p.to_local().numel() for p in model.parameters())  # this rank's pieces
    full = model.state_dict()  # collective: every rank builds the full state dict
    err3 = max(((v - expected[k]).norm() / expected[k].norm()).item() for k, v in full.items())

    if rank == 0:
        print(
            f"ZeRO-2 shard_size={SHARD}: rank 0 holds exp_avg for {rep2['exp_avg'] // 4:,} of {n:,} elements; "
            f"{crossed:,} gradient elements all-reduced across replicas in {STEPS} steps"
        )
        print(f"ZeRO-3 shard_size={SHARD}: rank 0 holds {owned:,} of {n:,} parameter elements")
        print(
            f"hybrid: {world} ranks = {world // SHARD} replicas x {SHARD} shards; ZeRO-2 and ZeRO-3 equal plain "
            f"torch (max relative error {max(err2, err3):.1e})"
        )
    assert err2 < 1e-5 and err3 < 1e-5, f"hybrid sharding differs from plain torch: {err2}, {err3}"
    assert crossed > 0 and abs(owned * SHARD - n) < 0.01 * n, f"not sharded over {SHARD} ranks: {owned} of {n}"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
