"""Checkpoints: save (also in the background), resume at another stage, export one file for inference.

    torchrun --nproc-per-node 2 examples/checkpoints.py [--ckpt-dir DIR]

1. Train ZeRO-3 (FullyShard) for SAVE_AT steps, then ``save_checkpoint(...,
   background=True)``: it returns a Future at once and a thread writes the
   checkpoint while training goes on; ``done.result()`` waits until it is
   complete and durable. Training continues to STEPS: the uninterrupted run.
2. A fresh job resumes at ZeRO-2 (a plain model + ``ShardedOptimizer(stage=2)``)
   with ``load_checkpoint``, which takes a checkpoint from any stage and world
   size and returns ``extra``; it trains from the saved step to STEPS and must
   equal the uninterrupted run.
3. A blocking ``save_checkpoint`` of the resumed run, then
   ``export_full_state_dict`` (no process group needed) writes the whole model
   as one safetensors file that loads into the plain model.
The checkpoint directory must be on a filesystem every rank sees.
"""

import argparse
import os
import shutil
import tempfile

import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import _device  # examples/_device.py: NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo
import zeroshard

STEPS, SAVE_AT, BATCH, DIM = 12, 6, 32, 32
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


def train(model, opt, start, stop, rank, world, device):
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, 16, generator=g).chunk(world)[rank]  # this rank's share of the batch
        y = torch.sin(2 * (x @ W))
        F.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt-dir", default=None, help="a directory every rank sees (default: a temporary one)")
    args = ap.parse_args()
    device = _device.setup()  # the process group, and this rank's GPU (or the CPU)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    root = [args.ckpt_dir or (tempfile.mkdtemp() if rank == 0 else None)]
    dist.broadcast_object_list(root)  # every rank uses rank 0's directory
    ckpt, final_ckpt = os.path.join(root[0], "step_6"), os.path.join(root[0], "final")

    # 1. ZeRO-3, with a checkpoint written in the background at SAVE_AT
    torch.manual_seed(0)
    model = zeroshard.FullyShard(Net().to(device), wrap={Block})
    opt = zeroshard.ShardedOptimizer(model.parameters(), lr=3e-3, weight_decay=0.1)
    train(model, opt, 0, SAVE_AT, rank, world, device)
    done = zeroshard.save_checkpoint(ckpt, model, opt, extra={"step": SAVE_AT}, background=True)  # zeroshard
    train(model, opt, SAVE_AT, STEPS, rank, world, device)  # goes on while a thread writes the state at SAVE_AT
    done.result()  # zeroshard: complete and durable (raises if any rank's write failed)
    uninterrupted = model.state_dict()  # collective: the full state dict (on CPU) on every rank
    del model, opt

    # 2. A new job resumes at ZeRO-2: a plain model, ShardedOptimizer(stage=2)
    torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
    model = Net().to(device)
    opt = zeroshard.ShardedOptimizer(model.parameters(), lr=1.0, stage=2)  # lr, betas, ... come from it too
    extra = zeroshard.load_checkpoint(ckpt, model, opt)  # zeroshard: any stage, any world size
    train(model, opt, extra["step"], STEPS, rank, world, device)
    err = max(
        ((p.cpu() - uninterrupted[k]).norm() / uninterrupted[k].norm()).item() for k, p in model.state_dict().items()
    )

    # 3. A blocking save of the resumed run, and one safetensors file of the model for inference
    zeroshard.save_checkpoint(final_ckpt, model, opt, extra={"step": STEPS})  # zeroshard
    if rank == 0:
        out = os.path.join(root[0], "model.safetensors")
        zeroshard.export_full_state_dict(final_ckpt, out)  # zeroshard: offline, no process group needed
        plain = Net()  # on CPU, where load_file puts the tensors
        plain.load_state_dict(safetensors.torch.load_file(out))
        exported = max((a - b.cpu()).abs().max().item() for a, b in zip(plain.parameters(), model.parameters()))
        print(f"checkpoint files: {sorted(os.listdir(ckpt))}")
        print(
            f"checkpoints: ZeRO-3 -> saved at step {SAVE_AT} (background) -> resumed at ZeRO-2 -> step {STEPS}: "
            f"vs uninterrupted max relative error {err:.1e}; exported model differs by {exported:g}"
        )
        assert err < 1e-5, f"the resumed run differs from the uninterrupted one (relative error {err})"
        assert exported == 0.0, f"the exported safetensors file differs from the model ({exported})"
        if args.ckpt_dir is None:
            shutil.rmtree(root[0])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
