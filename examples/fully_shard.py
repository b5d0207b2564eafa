"""ZeRO-3 with zeroshard.FullyShard: parameters, gradients and AdamW state all sharded.

    torchrun --nproc-per-node 2 examples/fully_shard.py

``FullyShard(model, wrap={Block})`` makes every ``Block`` a sharding unit (the
other parameters form the root unit): each rank keeps a 1/N piece of every
parameter, and a unit's full parameters exist only while it runs (all-gathered
before its forward and again before its backward). The optimizer is built over
``model.parameters()``, which are now those pieces. At the end,
``model.state_dict(to=0)`` (collective: every rank calls it) gathers the full
state dict on rank 0, which saves it with ``torch.save``; it loads into the
plain, unwrapped model. The script checks that model against the same training
done in one process with plain ``torch.optim.AdamW`` on the whole batch.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import _device  # examples/_device.py: NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo
import zeroshard

STEPS, BATCH, DIM = 20, 32, 32  # BATCH is the global batch, split over the ranks
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
    """This rank's share of the global batch of ``step`` (random x, y = sin(2 x.W))."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 16, generator=g)
    y = torch.sin(2 * (x @ W))
    n = BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def train(model, opt, device, rank, world):
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in batch(step, rank, world))
        loss = F.mse_loss(model(x), y)  # FullyShard gathers each Block before its forward, frees it after
        loss.backward()  # units re-gathered in reverse order, gradients reduce-scattered
        opt.step()  # updates this rank's fp32 shards (the master weights) in place
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main():
    device = _device.setup()  # the process group, and this rank's GPU (or the CPU)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = zeroshard.FullyShard(Net().to(device), wrap={Block})  # zeroshard: ZeRO-3 units
    opt = zeroshard.ShardedOptimizer(model.parameters(), lr=3e-3, weight_decay=0.1)  # zeroshard
    owned = sum(p.numel() for p in model.parameters())  # this rank's 1-D pieces
    if rank == 0:
        print(f"rank 0 holds {owned:,} of {sum(p.numel() for p in Net().parameters()):,} parameter elements")
    losses = train(model, opt, device, rank, world)

    sd = model.state_dict(to=0)  # collective: every rank calls it; the full state dict (CPU) on rank 0 only
    mem = model.memory_report()
    path = os.path.join(tempfile.gettempdir(), f"fully_shard_example_{os.getpid()}.pt")
    if rank == 0:
        torch.save(sd, path)
        plain = Net()  # the unwrapped model: the checkpoint is an ordinary state dict
        plain.load_state_dict(torch.load(path))
        os.remove(path)

        torch.manual_seed(0)  # the same training in one process, plain torch, whole batches
        ref = Net().to(device)  # on the device the sharded run used
        ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1), device, 0, 1)
        err = max(
            ((p - r).norm() / r.norm()).item()
            for p, r in zip(plain.state_dict().values(), (v.cpu() for v in ref.state_dict().values()))
        )
        print(
            f"rank 0 model state: {mem['total']:,} bytes (16 per element it holds: fp32 shard, "
            f"gradient shard, exp_avg, exp_avg_sq)"
        )
        print(
            f"fully_shard: rank 0's loss {losses[0]:.4f} -> {losses[-1]:.4f} (plain torch, whole batch: "
            f"{ref_losses[0]:.4f} -> {ref_losses[-1]:.4f}); reloaded unwrapped model vs plain torch: "
            f"max relative error {err:.1e}"
        )
        assert err < 1e-5, f"ZeRO-3 training differs from plain torch.optim.AdamW (relative error {err})"
        assert losses[-1] < 0.5 * losses[0], f"the loss did not go down: {losses[0]:.4f} -> {losses[-1]:.4f}"
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
