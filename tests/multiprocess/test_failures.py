"""A rank that dies mid-training: the survivors fail at once with an error that
names the collective (from the flight record) and the rank that stopped
answering, instead of gloo's bare "Connection reset by peer" or a hang. Real
processes, SIGKILL; the store lives in rank 0, as without torchrun."""

import os
import signal
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroshard as zs
from support.launch import launch


def _killed_in_backward(rank, port, stage, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    if stage == 3:
        model = zs.FullyShard(model, wrap={nn.Linear})
        opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2)
    else:
        opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2, stage=stage, bucket_mb=4000 / 2**20)
    for k in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(model(torch.randn(8, 64)), torch.randint(0, 3, (8,)))
        if k == 2 and rank == 1:  # dies as its backward begins
            loss.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
        try:
            loss.backward()
            opt.step()
        except Exception as e:  # noqa: BLE001 - report what the survivor saw
            results.put((rank, type(e).__name__, str(e)))
            results.close()
            results.join_thread()
            os._exit(3)
    os._exit(0)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_rank_killed_mid_backward_makes_the_other_fail_naming_the_collective(stage):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = launch("processes")
    results = ctx.Queue()
    procs = [ctx.Process(target=_killed_in_backward, args=(r, port, stage, results)) for r in range(2)]
    t0 = time.time()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    elapsed = time.time() - t0
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [3, -signal.SIGKILL]
    rank, kind, msg = results.get(timeout=5)
    assert rank == 0 and kind == "CollectiveError", (kind, msg)
    assert msg.startswith("[rank 0/2] collective #") and "process group" in msg, msg
    expected = "step 3, bucket" if stage == 2 else "step 3"  # ZeRO-3: "step 3 backward, unit '...'"
    assert expected in msg and (stage == 2 or "unit '" in msg) and ("reduce_scatter" in msg or "all_gather" in msg), msg
    assert "stopped answering" in msg and "flight_record()" in msg
    assert "Rank 1 did not answer" in msg, msg  # the dead rank, named
    assert "rank 0: last started #" in msg and "not completed" in msg, msg
    assert elapsed < 60, elapsed  # at once, not after a timeout
