"""When something hangs: the watchdog's timeout, its diagnosis, and the flight record.

    torchrun --nproc-per-node 2 examples/hangs.py
    ZEROSHARD_DEBUG=1 torchrun --nproc-per-node 2 examples/hangs.py     # check each collective's kind and size

A classic distributed bug: a data-dependent ``continue`` makes rank 1 skip
step 1's backward and step, so the ranks' collectives drift apart, and the
checkpoint at the end is entered by rank 1 while rank 0 still waits in a step.
Without zeroshard's watchdog this waits for the process group's timeout (10
minutes for the group ``zeroshard.init_distributed`` creates, gloo or NCCL; 30
for gloo's default). With ``zeroshard.set_timeout(3)`` every rank raises
``zeroshard.CollectiveTimeout`` within seconds, naming the first collective
where the ranks differ and what each rank did last; with
``ZEROSHARD_DEBUG=1`` each collective's kind and size are checked across
ranks before any data moves, and the first collective where they differ (here
the checkpoint's check-in, since the drifted reductions match in kind and size)
raises ``zeroshard.CollectiveMismatch``.
``zeroshard.flight_record()`` is this rank's record of its collectives.
This script raises the error on purpose, prints it, checks it and exits 0.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import _device  # examples/_device.py: NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo
import zeroshard

DIM = 32


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def main():
    device = _device.setup()  # the process group, and this rank's GPU (or the CPU)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    zeroshard.set_timeout(3)  # zeroshard: seconds any zeroshard collective may wait (default: the group's)
    ckpt = [os.path.join(tempfile.mkdtemp(), "ckpt") if rank == 0 else None]
    dist.broadcast_object_list(ckpt)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, DIM), Block(DIM), Block(DIM), nn.Linear(DIM, 1)).to(device)
    opt = zeroshard.ShardedOptimizer(model.parameters(), lr=1e-3, stage=2, bucket_mb=0.01)
    try:
        for step in range(3):
            x = torch.randn(8, 16).to(device)
            loss = F.mse_loss(model(x).squeeze(-1), x[:, 0])
            if rank == 1 and step == 1:
                continue  # the bug: one rank skips a step that the others take
            loss.backward()
            opt.step()
            opt.zero_grad()
        zeroshard.save_checkpoint(ckpt[0], model, opt)
        raise AssertionError("the ranks diverged, yet no error was raised")
    except (zeroshard.CollectiveTimeout, zeroshard.CollectiveMismatch) as err:  # zeroshard: on every rank
        error = err

    if rank == 0:
        print(f"rank 0 caught zeroshard.{type(error).__name__}:\n{error}\n")
        print("rank 0's flight record, last 5 collectives (seq, kind, what, elements, completed):")
        for r in zeroshard.flight_record()[-5:]:  # zeroshard
            print(f"  #{r['seq']:<3} {r['kind']:<15} {r['what']:<42} {r['numel']:>6}  {r['end'] is not None}")
    other = 1 - rank
    text = str(error)
    if isinstance(error, zeroshard.CollectiveMismatch):  # ZEROSHARD_DEBUG=1
        assert "ZEROSHARD_DEBUG" in text and f"rank {other}:" in text, text
    else:
        assert "first differ at collective #" in text and f"rank {other}" in text, text
        assert "What each rank last did" in text, text
    assert "checkpoint" in text, f"the message should name the checkpoint one rank was in:\n{text}"
    assert not os.path.exists(ckpt[0]), "a failed save must not leave a checkpoint behind"
    if rank == 0:
        print(
            f"hangs: every rank raised zeroshard.{type(error).__name__} within seconds instead of hanging; "
            "the message names the first differing collective on both ranks"
        )
    # The process group is now broken (later zeroshard waits raise at once): end the job here.


if __name__ == "__main__":
    main()
