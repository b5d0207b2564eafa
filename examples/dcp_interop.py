"""A torch.distributed.checkpoint (DCP) checkpoint from FSDP2, trained on at ZeRO-3, and back.

    torchrun --nproc-per-node 2 examples/dcp_interop.py

What it does (docs/checkpoints.md, "DCP and other tools"):
* FSDP2 (``fully_shard`` + ``torch.optim.AdamW``) trains 3 steps and saves with
  ``get_state_dict`` and ``dcp.save``, then trains 3 more: the reference;
* zeroshard (``FullyShard`` + ``ShardedOptimizer``) loads that checkpoint with
  ``dcp_state_dict``, ``dcp.load`` and ``load_dcp_state_dict``, trains the same 3
  steps, and ends where FSDP2 ended;
* zeroshard saves its own DCP checkpoint, and FSDP2 loads it with ``set_state_dict``.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import _device  # examples/_device.py: where the examples run
import zeroshard
from zeroshard.checkpoint import dcp_state_dict, load_dcp_state_dict


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.mlp = (
            nn.LayerNorm(dim),
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)),
        )

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def build(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 48), Block(48), Block(48), nn.Linear(48, 5)).to(device)


def train(model, opt, steps, device):
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x, y = torch.randn(16, 10, generator=g).to(device), torch.randn(16, 5, generator=g).to(device)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def fsdp2(device):
    model = build(device)
    for block in (model[1], model[2]):
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def main():
    device = _device.setup()
    work = zeroshard.all_gather_object(tempfile.mkdtemp() if dist.get_rank() == 0 else None)[0]  # rank 0's

    # 1. FSDP2 trains and saves through torch's own helpers
    model, opt = fsdp2(device)
    train(model, opt, range(3), device)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(work, "fsdp2"))
    train(model, opt, range(3, 6), device)
    reference = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))[0]

    # 2. zeroshard loads FSDP2's checkpoint and trains on
    ours = zeroshard.FullyShard(build(device), wrap={Block})
    zopt = zeroshard.ShardedOptimizer(ours.parameters(), lr=1e-3, weight_decay=0.1)
    msd, osd = dcp_state_dict(ours, zopt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(work, "fsdp2"))
    load_dcp_state_dict(ours, zopt, model_state_dict=msd, optim_state_dict=osd)
    train(ours, zopt, range(3, 6), device)
    got = ours.state_dict()
    worst = max((got[k].to(device) - reference[k]).abs().max().item() for k in reference)
    assert worst < 1e-5, f"zeroshard after FSDP2's checkpoint differs from FSDP2 by {worst}"

    # 3. and back: zeroshard's DCP checkpoint into FSDP2
    msd, osd = dcp_state_dict(ours, zopt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(work, "zeroshard"))
    model, opt = fsdp2(device)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(work, "zeroshard"))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    back = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))[0]
    assert all(torch.equal(back[k].cpu(), got[k].cpu()) for k in got), "FSDP2 loaded other values"
    if dist.get_rank() == 0:
        print(
            f"dcp_interop: FSDP2's checkpoint trained on at ZeRO-3 on {dist.get_world_size()} ranks "
            f"({device.type}), {worst:.1e} from FSDP2; zeroshard's loaded back into FSDP2 exactly"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
