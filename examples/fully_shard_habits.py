"""FullyShard with the habits of real FSDP2 scripts, checked against one process.

    torchrun --nproc-per-node 2 examples/fully_shard_habits.py

Each block returns a dataclass; one block is applied twice per forward (its
weights shared); the blocks' base weights are frozen and small adapters train
(as with LoRA), so only the adapters' gradients are reduce-scattered; the
loss applies the head to chunks of the hidden states after the trunk (it is
called outside the model's forward) and adds a term from a method other than
``forward``, registered with ``zeroshard.register_forward_method``; the
gradients are clipped by their 1-norm with torch's ``clip_grad_norm_``
(``foreach=True``). The script checks the trained model against the same
training in one process with plain torch.
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import _device  # examples/_device.py: NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo
import zeroshard

STEPS, BATCH, DIM, RANK = 10, 16, 48, 4  # BATCH is the global batch, split over the ranks


@dataclasses.dataclass
class BlockOut:
    h: torch.Tensor
    aux: torch.Tensor  # a per-block regulariser the loss adds


class Block(nn.Module):
    def __init__(self, d=DIM, r=RANK):
        super().__init__()
        self.base = nn.Linear(d, d)  # frozen below: gathered, never reduced
        self.down, self.up = nn.Linear(d, r, bias=False), nn.Linear(r, d, bias=False)  # the adapter

    def forward(self, x):
        h = x + torch.tanh(self.base(x) + self.up(self.down(x)))
        return BlockOut(h, self.down(x).square().mean())

    def features(self, x):  # another method that needs the unit's weights
        return self.base(x).mean(-1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.b1, self.shared, self.b2 = Block(), Block(), Block()
        self.head = nn.Linear(DIM, 1)
        for b in (self.b1, self.shared, self.b2):
            b.base.requires_grad_(False)

    def forward(self, x):
        o1 = self.b1(x)
        o2 = self.shared(o1.h)
        o3 = self.shared(o2.h)  # the same unit again
        o4 = self.b2(o3.h)
        return o4.h, o1.aux + o2.aux + o3.aux + o4.aux


def loss_of(model, x, y):
    h, aux = model(x)
    pred = torch.cat([model.head(c) for c in h.split(4)]).squeeze(-1)  # the head, chunk by chunk
    return F.mse_loss(pred, y) + 0.01 * aux + 0.01 * model.b1.features(x).square().mean()


def batch(step, rank=0, world=1):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, DIM, generator=g)
    y = torch.sin(x.sum(-1) / 4)
    n = BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def train(model, opt, device, rank, world):
    for step in range(STEPS):
        loss = loss_of(model, *(t.to(device) for t in batch(step, rank, world)))
        loss.backward()
        trainable = [p for p in model.parameters() if p.requires_grad]
        torch.nn.utils.clip_grad_norm_(trainable, 1.0, norm_type=1.0, foreach=True)
        opt.step()
        opt.zero_grad()
    return loss.item()


def main():
    device = _device.setup()  # the process group, and this rank's GPU (or the CPU)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = zeroshard.FullyShard(Net().to(device), wrap={Block})
    zeroshard.register_forward_method(model, model.module.b1, "features")
    opt = zeroshard.ShardedOptimizer([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = train(model, opt, device, rank, world)
    sent = {u.name: (u.grad_numel, u.numel) for u in model.units if u.name}
    sd = model.state_dict(to=0)  # the full state dict, on CPU, on rank 0

    if rank == 0:
        torch.manual_seed(0)  # the same training in one process, plain torch, whole batches
        ref = Net().to(device)  # on the device the sharded run used
        ref_loss = train(
            ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2), device, 0, 1
        )
        err = max((sd[k] - v.cpu()).abs().max().item() for k, v in ref.state_dict().items())
        reduced = ", ".join(f"{n}: {g:,} of {t:,}" for n, (g, t) in sent.items())
        print(
            f"fully_shard_habits: last loss {loss:.4f} on rank 0 (one process: {ref_loss:.4f}); elements "
            f"reduce-scattered per block ({reduced}); max error against one process {err:.1e}"
        )
        assert err < 1e-5, f"training differs from one process (max error {err})"
        assert all(4 * g < t for g, t in sent.values()), f"frozen weights were reduced: {sent}"
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
