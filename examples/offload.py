"""Offload: AdamW's state (and the fp32 master) in host memory or in a file on disk.

    torchrun --nproc-per-node 2 examples/offload.py [--offload-dir /local/nvme]

``ShardedOptimizer(..., offload=zeroshard.Offload(optimizer="cpu"))`` keeps this
rank's optimizer state in host memory and steps it on the CPU;
``Offload(optimizer="nvme", directory=...)`` keeps it in one file per rank
under that directory (a fast local disk), streamed through in windows at each
step. ``Offload(fraction=...)`` offloads only part of the rank's
shard (whole parameters, in backward order). The script trains the same model
three times at ZeRO-2 (no offload, everything in host memory, half of it on
disk), prints each rank-0 ``memory_report()`` split into device / host / disk
bytes, and checks that the offloaded runs equal the run without offload.
On a CPU-only machine the "device" is host memory too: only the report's
split changes there, while the disk file is real.
"""

import argparse
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import _device  # examples/_device.py: NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo
import zeroshard

STEPS, BATCH, DIM = 10, 32, 32
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


def batch(step, rank, world):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 16, generator=g)
    y = torch.sin(2 * (x @ W))
    n = BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def run(label, device, rank, world, offload=None):
    torch.manual_seed(0)
    model = Net().to(device)  # the model computes on the device; offload= moves the optimizer's share
    opt = zeroshard.ShardedOptimizer(
        model.parameters(), lr=3e-3, weight_decay=0.1, stage=2, offload=offload
    )  # zeroshard
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in batch(step, rank, world))
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()  # the offloaded share is stepped on the CPU, from host memory or the file
        opt.zero_grad()
        losses.append(loss.item())
    rep = opt.memory_report()
    if rank == 0:
        print(
            f"{label:<30} loss {losses[0]:.4f} -> {losses[-1]:.4f} | rank 0 state: "
            f"device {rep['device']:>7,} host {rep['host']:>7,} disk {rep['disk']:>7,} bytes"
        )
    return torch.cat([p.detach().flatten() for p in model.parameters()]), rep


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--offload-dir", default=None, help="where 'nvme' puts its files (default: a temporary dir)")
    args = ap.parse_args()
    device = _device.setup()  # the process group, and this rank's GPU (or the CPU)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()

    with tempfile.TemporaryDirectory(dir=args.offload_dir) as nvme_dir:
        plain, _ = run("no offload", device, rank, world)
        on_host, host_rep = run("offload='cpu'", device, rank, world, zeroshard.Offload(optimizer="cpu"))  # zeroshard
        on_disk, disk_rep = run(
            "offload='nvme', fraction 0.5",
            device,
            rank,
            world,
            zeroshard.Offload(optimizer="nvme", directory=nvme_dir, fraction=0.5),
        )  # zeroshard
        dist.barrier()  # every rank's optimizer (and its file) is gone before the directory goes

    err = max((on_host - plain).abs().max().item(), (on_disk - plain).abs().max().item())
    # on a GPU the offloaded share steps with the CPU's AdamW kernel, the rest with the GPU's: equal up to rounding
    tol = 1e-6 if device.type == "cpu" else 1e-5
    if rank == 0:
        print(
            f"offload: 'cpu' and 'nvme' (fraction 0.5) on {world} ranks equal the run without offload "
            f"(max difference {err:.1e}); disk held {disk_rep['disk']:,} bytes of rank 0's state"
        )
    assert err < tol, f"offloaded training differs from training without offload (max difference {err})"
    assert host_rep["host"] > 0 and disk_rep["disk"] > 0, "memory_report() shows nothing offloaded"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
