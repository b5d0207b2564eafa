"""tests/integration/test_restarts.py's job: rank 1 kills itself in the first `kills` attempts; in
every later attempt it reaches the process group 2 s after rank 0 (as after a longer
import). `plain`: torch.distributed.init_process_group; `zeroshard`: zeroshard.init_distributed."""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

mode, kills = sys.argv[1], int(sys.argv[2])
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if mode == "zeroshard":
    import zeroshard
if rank == 1 and attempt > 0:
    time.sleep(2)  # arrives late, as after a longer import
timeout = datetime.timedelta(seconds=15)
if mode == "zeroshard":
    zeroshard.init_distributed("gloo", timeout=timeout)
else:
    dist.init_process_group("gloo", timeout=timeout)
t = torch.ones(1)
dist.all_reduce(t)
print(f"UP attempt {attempt} rank {rank} sum {int(t.item())}", flush=True)
if attempt < kills and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier() if attempt >= kills else time.sleep(60)
dist.destroy_process_group()
