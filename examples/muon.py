"""Muon over the hidden matrices and AdamW over the rest, both sharded.

    torchrun --nproc-per-node 2 examples/muon.py

A DDP script that trains with Muon holds two torch optimizers: torch.optim.Muon
over the hidden 2-D weight matrices, torch.optim.AdamW over everything else
(embedding-like input layer, output head, norms, biases). It converts the way an
AdamW script does: each becomes a zeroshard.ShardedOptimizer over the same
parameters, Muon through ``optimizer_class=``. Each matrix's Newton-Schulz
update then runs once in the whole job, on the rank that owns it, and Muon's
momentum lives on that rank only. At ZeRO-3 wrap the model in FullyShard first
and build the same two optimizers over its parameters, Muon's first (it lays
the units out so each matrix lies inside its owner's shard). The script trains
at ZeRO-2 and at ZeRO-3 on N ranks, checks each result against plain torch in
one process (the same two torch optimizers, whole batches), and that the
momentum of every matrix is held exactly once. torch's Newton-Schulz runs in bf16, so a different summation
order alone (N ranks' gradients against one batch) moves the parameters by
about 1% over these steps; the test suite checks equality to fp32 rounding
with Newton-Schulz in fp32 (tests/multiprocess/test_whole_tensor.py).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import _device  # examples/_device.py: NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo
import zeroshard

STEPS, BATCH, DIM = 20, 48, 32
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


def split(model):
    """The usual split: Muon takes the hidden matrices; AdamW the input layer, the
    head, biases and norms."""
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and n.startswith("blocks."))]
    return hidden, rest


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


def train(model, opts, device, rank=0, world=1):
    for step in range(STEPS):
        x, y = (t.to(device) for t in batch(step, rank, world))
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the global norm, over both
        for opt in opts:
            opt.step()
            opt.zero_grad()


def sharded_run(stage, device, rank, world):
    """Trains at ``stage`` (2: ShardedOptimizer alone; 3: FullyShard too); returns the
    held-out loss before and after, the full parameters (on CPU), and the Muon optimizer."""
    torch.manual_seed(0)
    model = Net().to(device)
    if stage == 3:
        model = zeroshard.FullyShard(model, wrap={Block})  # its parameters keep their full shapes
    hidden, rest = split(model)
    before = held_out_loss(model, device)
    stage_kw = dict(stage=stage) if stage != 3 else {}
    muon = zeroshard.ShardedOptimizer(
        hidden, optimizer_class=torch.optim.Muon, lr=0.02, momentum=0.95, **stage_kw
    )  # was: torch.optim.Muon(...)
    adamw = zeroshard.ShardedOptimizer(rest, lr=3e-3, weight_decay=0.1, **stage_kw)  # was: torch.optim.AdamW(...)
    train(model, [muon, adamw], device, rank, world)
    after = held_out_loss(model, device)
    return before, after, {k: v.cpu() for k, v in model.state_dict().items()}, muon  # (FullyShard's: CPU already)


def main():
    device = _device.setup()  # the process group, and this rank's GPU (or the CPU)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # plain torch in this process, whole batches: the reference
    ref = Net().to(device)
    ref_hidden, ref_rest = split(ref)
    train(
        ref,
        [torch.optim.Muon(ref_hidden, lr=0.02, momentum=0.95), torch.optim.AdamW(ref_rest, lr=3e-3, weight_decay=0.1)],
        device,
    )
    ref_after, ref_params = held_out_loss(ref, device), {k: v.cpu() for k, v in ref.state_dict().items()}
    matrices = sum(4 * p.numel() for p in ref_hidden)

    for stage in (2, 3):
        before, after, params, muon = sharded_run(stage, device, rank, world)
        err = max(((params[n] - r).norm() / r.norm()).item() for n, r in ref_params.items())
        held = torch.tensor([float(muon.memory_report()["optimizer_state"])], device=device)  # NCCL: on the GPU
        dist.all_reduce(held)  # Muon's momentum, summed over the ranks
        assert held.item() == matrices, f"Muon's state is {held.item():.0f} bytes over the ranks, not {matrices}"
        assert err < 0.1, f"ZeRO-{stage} differs from plain torch beyond bf16's rounding (relative error {err})"
        assert abs(after - ref_after) < 0.1 * ref_after, f"held-out loss {after:.4f}, plain torch's {ref_after:.4f}"
        assert after < 0.5 * before, f"the loss did not go down: {before:.4f} -> {after:.4f}"
        if rank == 0:
            print(
                f"muon: Muon + AdamW at ZeRO-{stage} on {world} ranks: held-out loss {before:.4f} -> {after:.4f} "
                f"(plain torch: {ref_after:.4f}; parameters' max relative error {err:.1e}); Muon's momentum held "
                f"once ({matrices:,} bytes over the ranks, rank 0 {muon.memory_report()['optimizer_state']:,})"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
