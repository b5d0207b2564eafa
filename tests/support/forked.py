"""Launching a script on N CPU ranks as torchrun does, without importing torch in every rank
(``launch("forked", ...)`` in support/launch.py).

A rank's process spends about 7 s of CPU importing torch, torch's compiler stack (which
constructing any torch optimizer imports) and zeroshard, several times what a documentation
example's ranks then compute. ``run(script, ranks, args, env, cwd, timeout)`` forks the ranks from one
server process that has imported all of it once (started at the first launch, kept for the
session): each rank is a fork of it that sets torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT on a free port, the
TORCHELASTIC_* of a first attempt with no agent store) and runs the script as ``__main__``
(``runpy``), so it ends as ``python script`` would (its exceptions, ``sys.exit``, threads
joined, ``atexit``). As torchrun, the first rank to fail stops the others, and every rank's
stdout and stderr are gathered. What the server imported is not imported again: what a
script reads from the environment when it runs is set before it starts, and nothing in
torch or zeroshard reads the launch's variables at import.

The agent itself (its rendezvous, the shared store, restarts) is what this launcher leaves
out; the tests that involve it (the chaos and restart tests), the GPT script's rank-0 traps
(three jobs at once, each mostly waiting) and one launch as a user types it (the
quickstart's) run torchrun itself. train_gpt's runs and the Hugging Face and Lightning jobs
run here: they find their ranks in torchrun's environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

_server: Optional[subprocess.Popen] = None


def run(
    script: str, ranks: int, args: List[str], env: Dict[str, str], cwd: str, timeout: float
) -> Tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``script args`` on ``ranks`` ranks: the first non-zero
    rank's code (or 0); -9 where the launch ran past ``timeout`` seconds and was killed."""
    global _server
    if _server is None or _server.poll() is not None:
        env0 = dict(os.environ, OMP_NUM_THREADS="1")
        _server = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env0,
        )
    job = dict(
        script=os.path.abspath(script),
        ranks=ranks,
        args=args,
        env=env,
        cwd=cwd,
        timeout=timeout,
        id=time.monotonic_ns(),
    )
    _server.stdin.write(json.dumps(job) + "\n")
    _server.stdin.flush()
    while True:  # (an answer to a launch whose test was stopped before it came is skipped)
        line = _server.stdout.readline()
        if not line:
            raise RuntimeError(f"the launch server exited (code {_server.wait()}) running {script}")
        job_id, code, out_file, err_file = json.loads(line)
        if job_id == job["id"]:
            break
    with open(out_file) as f, open(err_file) as g:
        out, err = f.read(), g.read()
    os.unlink(out_file)
    os.unlink(err_file)
    return code, out, err


def _rank_env(job: dict, rank: int, port: int) -> Dict[str, str]:
    n = str(job["ranks"])
    return dict(
        job["env"],
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        WORLD_SIZE=n,
        LOCAL_WORLD_SIZE=n,
        ROLE_WORLD_SIZE=n,
        ROLE_NAME="default",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID="none",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_USE_AGENT_STORE="False",
    )


def _wait(pids: List[int], timeout: float) -> int:
    """The ranks' exit code as torchrun reports it: the first failure stops the others."""
    deadline, codes, failed = time.monotonic() + timeout, {}, None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and failed is None:
                failed = codes[pid]
                _kill([p for p in pids if p not in codes])
            continue
        if time.monotonic() > deadline:
            failed = -9 if failed is None else failed
            _kill([p for p in pids if p not in codes])
            deadline = float("inf")
        time.sleep(0.02)
    return failed or 0


def _kill(pids: List[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _serve():
    """The server's loop: one launch per line of stdin; returns the job and rank in a forked rank."""
    import tempfile

    from support.pool import free_port

    for line in sys.stdin:
        job = json.loads(line)
        fd_out, out_file = tempfile.mkstemp(suffix=".out")
        fd_err, err_file = tempfile.mkstemp(suffix=".err")
        port, pids = free_port(), []
        sys.stdout.flush()
        for rank in range(job["ranks"]):
            pid = os.fork()
            if pid == 0:
                os.dup2(fd_out, 1)
                os.dup2(fd_err, 2)
                return job, rank, port
            pids.append(pid)
        os.close(fd_out)
        os.close(fd_err)
        code = _wait(pids, job["timeout"])
        print(json.dumps([job["id"], code, out_file, err_file]), flush=True)
    return None


def _run_rank(job: dict, rank: int, port: int) -> None:
    """In a forked rank: torchrun's environment, then the script as ``__main__``."""
    import runpy
    import tempfile

    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.environ.update(_rank_env(job, rank, port))
    tempfile.tempdir = None  # (TMPDIR is the launch's)
    os.chdir(job["cwd"])
    sys.argv = [job["script"], *job["args"]]
    sys.path[0] = os.path.dirname(job["script"])
    runpy.run_path(job["script"], run_name="__main__")


if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: support.*
    import torch
    import torch._dynamo  # noqa: F401  (what constructing a torch optimizer imports)
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import zeroshard  # noqa: F401

    torch.set_num_threads(1)
    forked = _serve()
    if forked is not None:
        _run_rank(*forked)
