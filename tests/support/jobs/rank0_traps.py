"""Code under ``if rank == 0:`` reaching a collective zeroshard call, for
tests/integration/test_gpt_script.py: rank 0 alone calls SCENARIO's call while rank 1 goes on
training. Each rank prints one JSON line (what it raised, after how long, and its
flight record's last entries) and leaves with os._exit(0), as a script that
catches the error and exits would.

    torchrun --nproc-per-node 2 tests/support/jobs/rank0_traps.py eval|opt_state_dict|save DIR
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard as zs
import zeroshard.comm.watchdog as watchdog

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/
from support.models import Residual  # noqa: E402

watchdog.CHECK_IN_DEFAULT = float(os.environ.get("CHECK_IN_SECONDS", "4"))  # the 60 s default, scaled down


def main(scenario, out_dir):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(Residual(16), Residual(16), nn.Linear(16, 4))
    if scenario in ("eval", "save"):
        model = zs.FullyShard(model, wrap={Residual})
    opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2)
    x = torch.randn(8, 16)

    def train_step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    train_step()
    start = time.time()
    outcome = {"rank": rank}
    try:
        if rank == 0:
            if scenario == "eval":
                model.eval()
                with torch.no_grad():
                    model(x)
            elif scenario == "opt_state_dict":
                opt.state_dict()
            else:
                zs.save_checkpoint(os.path.join(out_dir, "ck"), model, opt)
        train_step()
        outcome["error"] = None
    except Exception as e:  # noqa: BLE001 - the test reads it
        outcome["error"] = f"{type(e).__name__}: {e}"
    outcome["seconds"] = time.time() - start
    outcome["records"] = [(r["kind"], r["what"], r["end"] is not None) for r in zs.flight_record()[-4:]]
    print("RESULT " + json.dumps(outcome), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
