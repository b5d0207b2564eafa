"""Compressed communication at ZeRO-3: int8 weight all-gathers and a backward that gathers
inside a node.

    torchrun --nproc-per-node 4 examples/compressed.py

``MixedPrecision(gather_dtype="int8")`` makes every all-gather of a unit's weights move
one-byte codes plus a scale per block of 256 elements of each rank's shard (about half of
bf16's bytes), decoded for compute; the fp32 master shards never leave their rank.
``reshard_after_forward=2`` keeps, after each unit's forward, a piece of its gathered
weights over pairs of ranks (a node's, on 2 GPUs a node), so the backward's all-gather
stays inside the pair. The script trains the same model with and without both, checks
that the losses follow each other, and counts in the flight record where the last step's
weight all-gathers ran: the forward's in int8 over every rank, the backward's inside pairs.
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import _device  # examples/_device.py: NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo
import zeroshard

from hybrid import Block, Net, W  # examples/hybrid.py's model and the function it learns

STEPS, BATCH = 12, 32


def train(model, device, rank, world):
    """Losses of STEPS steps; the all-gathers' records of the last step."""
    opt = zeroshard.ShardedOptimizer(model.parameters(), lr=3e-3)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, 16, generator=g)
        y = torch.sin(2 * (x @ W))
        n = BATCH // world
        x, y = x[rank * n : (rank + 1) * n].to(device), y[rank * n : (rank + 1) * n].to(device)
        start = time.time()  # (the flight record keeps its last records: select by start time)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    gathers = [
        r
        for r in zeroshard.flight_record()
        if r["start"] >= start and r["kind"] == "all_gather" and "unit" in r["what"]
    ]
    return losses, gathers


def main():
    device = _device.setup()  # the process group, and this rank's GPU (or the CPU)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world % 2 == 0, "run with an even number of ranks: torchrun --nproc-per-node 4 ..."
    torch.manual_seed(0)
    plain = zeroshard.FullyShard(Net().to(device), wrap={Block})
    base, base_gathers = train(plain, device, rank, world)

    torch.manual_seed(0)
    model = zeroshard.FullyShard(
        Net().to(device),
        wrap={Block},
        mixed_precision=zeroshard.MixedPrecision(gather_dtype="int8"),  # zeroshard: int8 weight gathers
        reshard_after_forward=2 if world > 2 else True,  # zeroshard: the backward gathers within pairs
    )
    losses, gathers = train(model, device, rank, world)

    # the mean loss over the steps and the ranks (one rank's small batches are noisy)
    mean = torch.tensor([sum(losses), sum(base)], dtype=torch.float64) / STEPS
    dist.all_reduce(mean)
    drift = abs(mean[0] - mean[1]).item() / mean[1].item()
    world_group = dist.group.WORLD.group_name
    inside = sum(r["group"] != world_group for r in gathers)  # (the backward's, from the pieces)
    every = sum(r["group"] == world_group and "in int8" in r["what"] for r in gathers)
    if rank == 0:
        print(f"last step: {every} int8 all-gathers over every rank, {inside} inside pairs of ranks")
        print(f"compressed: mean loss within {drift:.2%} of the uncompressed run over {STEPS} steps")
    assert drift < 0.01, f"int8 gathers drift from the fp32 run: {losses} vs {base}"
    blocks = len(model.module.blocks)
    assert inside == (blocks if world > 2 else 0) and every >= blocks, f"{every} int8 gathers, {inside} in pairs"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
