"""Will it fit? The memory planner from Python, checked against a real run.

    torchrun --nproc-per-node 2 examples/plan_memory.py      # plan, then measure on 2 ranks
    python examples/plan_memory.py                           # the same in one process (world size 1)

``zeroshard.plan.model_state_bytes(params, world_size, dtype)`` is the formula
for a parameter count (what ``python -m zeroshard.plan --params 7e9`` prints).
``zeroshard.plan.plan_model(build, world_size, dtype, example=...)`` builds
your model on the meta device (no memory, any size), wraps it for every stage
on a fake process group and reads ``memory_report()``; with ``example`` (a
function returning one micro-batch of inputs) it also traces a forward and
backward for the activations and each stage's peak. It sets up its own fake
process group, so call it before ``init_process_group``. The script then runs
each stage for real and checks that this rank's ``memory_report()`` equals the
plan byte for byte.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroshard
import zeroshard.plan

DIM, BATCH = 32, 64


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


def example_batch():
    return (torch.zeros(BATCH, 16),)  # one micro-batch per rank: only its shape and dtype matter


def measure(stage):
    """This rank's memory_report() after one real training step at ``stage``."""
    torch.manual_seed(0)
    model = Net()
    if stage == 3:
        model = zeroshard.FullyShard(model, wrap={Block})
    opt = zeroshard.ShardedOptimizer(model.parameters(), lr=1e-3, **({} if stage == 3 else {"stage": stage}))
    x = torch.randn(BATCH, 16)
    F.mse_loss(model(x), x[:, 0]).backward()
    opt.step()
    return opt.memory_report()


def main():
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    # 1. The formula for a parameter count: 7B parameters, 8 ranks, mixed precision (GB = 1e9 bytes)
    rows = zeroshard.plan.model_state_bytes(7e9, world_size=8, dtype="bf16")  # zeroshard
    # 2. This model, planned exactly for 8 ranks (on meta: a 70B model costs nothing here either)
    big = zeroshard.plan.plan_model(Net, world_size=8, dtype="fp32", wrap={Block}, example=example_batch)
    # 3. ... and for the world size we are about to run at, on CPU processes (gloo)
    plan = zeroshard.plan.plan_model(
        Net, world_size=world, dtype="fp32", wrap={Block}, example=example_batch, ranks=[rank], transport="gloo"
    )  # zeroshard
    if rank == 0:
        print("7B, 8 ranks, bf16: " + ", ".join(f"{s} {r['total'] / 1e9:.1f} GB" for s, r in rows.items()))
        print(zeroshard.plan.format_model_plan(big))

    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
    else:  # plain python: a process group of one
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    keys = ("params", "grads", "master", "exp_avg", "exp_avg_sq", "padding", "total")
    for stage in (1, 2, 3):
        real = measure(stage)
        planned = plan["stages"][f"ZeRO-{stage}"]["ranks"][rank]
        diff = {k: real[k] - planned[k] for k in keys if real[k] != planned[k]}
        if rank == 0:
            print(
                f"ZeRO-{stage} at {world} ranks: planned {planned['total']:,} bytes of model state on rank 0, "
                f"measured {real['total']:,}"
            )
        assert not diff, f"rank {rank}, ZeRO-{stage}: memory_report() - plan = {diff}"
    if rank == 0:
        print(f"plan_memory: the planner's state bytes equal memory_report() at stages 1-3 on {world} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
