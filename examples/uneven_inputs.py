"""Ranks with different numbers of batches: torch's Join around a ShardedOptimizer loop.

    torchrun --nproc-per-node 2 examples/uneven_inputs.py

When the ranks' data loaders are not the same length (no ``drop_last``, data
split by files, dynamic batching), the rank that finishes first would leave
the others waiting in their next collective. torch's
``torch.distributed.algorithms.join.Join`` takes the optimizer (a
``Joinable``, as DDP and ZeroRedundancyOptimizer are): a rank out of batches
waits in the context's exit and shadows each iteration the others still run
with a zero gradient, so every rank ends with the same parameters and
buffers, those DDP + Join ends with. The script trains a small model with a
BatchNorm on rank r's 3 + 2r batches, at ZeRO-2 and at ZeRO-3 (a FullyShard
model: a joined rank replays its last batch's forward with a zero gradient),
and checks the result against DDP + AdamW inside Join on the same batches
(at ZeRO-3 the parameters: FullyShard broadcasts buffers once, at wrapping,
as FSDP2 does).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join

import _device  # examples/_device.py: NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo
import zeroshard


def make_model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32, bias=False), nn.BatchNorm1d(32), nn.GELU(), nn.Linear(32, 1)).to(device)


def my_batches(device="cpu"):
    """This rank's batches: 3 on rank 0, 5 on rank 1, ..."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    return [
        (torch.randn(16, 12, generator=g).to(device), torch.randn(16, 1, generator=g).to(device))
        for _ in range(3 + 2 * rank)
    ]


def train(kind: str, device) -> dict:
    model = make_model(device)
    if kind == "zero2":
        net = model
        opt = zeroshard.ShardedOptimizer(model.parameters(), lr=1e-2, stage=2)
        joinables = [opt]  # the optimizer is what joins
    elif kind == "zero3":
        net = model = zeroshard.FullyShard(model, wrap={nn.Linear})
        opt = zeroshard.ShardedOptimizer(model.parameters(), lr=1e-2)
        joinables = [opt]
    else:
        ids = [device.index] if device.type == "cuda" else None  # device_ids=[LOCAL_RANK] on a GPU
        net = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        joinables = [net]
    with Join(joinables):
        for x, y in my_batches(device):
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    return {k: v.cpu().clone() for k, v in model.state_dict().items()}  # on CPU, as FullyShard's


def main():
    device = _device.setup()  # the process group, and this rank's GPU (or the CPU)
    ddp, zero2, zero3 = train("ddp", device), train("zero2", device), train("zero3", device)
    err = max((zero2[k].double() - v.double()).abs().max().item() for k, v in ddp.items())
    err3 = max(
        (zero3[k].double() - v.double()).abs().max().item()
        for k, v in ddp.items()
        if "running" not in k and "tracked" not in k
    )
    if dist.get_rank() == 0:
        print(
            f"uneven_inputs: rank 0 trained {len(my_batches())} batches of the {3 + 2 * (dist.get_world_size() - 1)} "
            f"the last rank had; largest difference to DDP + Join: ZeRO-2 {err:.2e}, ZeRO-3 {err3:.2e}"
        )
    assert err < 1e-5 and err3 < 1e-5, (err, err3)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
