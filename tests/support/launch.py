"""One front for the three ways the tests start ranks: ``launch(kind, ...)``.

``launch("pool", world)``
    The session's pool of ``world`` gloo ranks on this machine (support/pool.py, started at
    its first use and kept): ``.run(fn, *args)`` runs an importable module-level function on
    every rank and returns their results. The multiprocess tier's tests run on it (the
    ``dist_pool`` fixture is ``launch("pool", 2)`` and ``launch("pool", 3)``).
``launch("forked", script, ranks, args=(), env=None, cwd=ROOT, timeout=240, text=None)``
    ``script args`` on ``ranks`` ranks forked from one server that imported torch and
    zeroshard once (support/forked.py), each in torchrun's environment but without its
    agent: the documentation examples, and one-rank scripts on a fake process group
    (``text``: the script's source instead of its path). A ``CompletedProcess``; its
    returncode is -9 where the launch ran past ``timeout`` and was killed.
``launch("torchrun", script, ranks, args=(), env=None, cwd=None, timeout=240, flags=(), wait=True)``
    ``python -m torch.distributed.run --standalone --nproc-per-node ranks [flags] script args``:
    torchrun itself, for the tests that involve its agent (its store, restarts, stopping the
    other ranks) and the jobs in support/jobs/. A ``CompletedProcess`` (``subprocess.run``'s:
    past ``timeout`` it raises); ``wait=False``: the running ``Popen`` (stdout and stderr piped).

``launch("processes")``
    A ``multiprocessing`` context whose processes fork from one server that imported torch
    and zeroshard once (``forkserver``, preloaded): ``ctx.Process(target=fn, args=...)`` for
    the tests that kill, stall or time ranks out, each rank a module-level function that sets
    up its own environment (the server's is the session's at its start). A spawned process
    imports torch again: seconds each on a small machine.

``env``: variables set over this process's environment (a value of None removes one).
``forked_job`` and ``forked_jobs`` launch a job of support/jobs/ on forked ranks (torchrun's
environment) and read back the results its rank 0 saved.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from typing import Dict, Optional, Sequence

from .forked import run as run_forked
from .pool import get_pool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOBS = os.path.join(ROOT, "tests", "support", "jobs")


def launch(kind: str, *args, **kwargs):
    """Start ranks of ``kind`` "pool", "forked", "torchrun" or "processes"; see this module's docstring."""
    kinds = {"pool": get_pool, "forked": _forked, "torchrun": _torchrun, "processes": _processes}
    if kind not in kinds:
        raise ValueError(f"launch kind {kind!r}: one of {sorted(kinds)}")
    return kinds[kind](*args, **kwargs)


def job(name: str) -> str:
    """The path of support/jobs/``name``."""
    return os.path.join(JOBS, name)


def environment(env: Optional[Dict[str, Optional[str]]]) -> Dict[str, str]:
    """This process's environment with ``env``'s variables set (None: removed)."""
    out = dict(os.environ)
    for k, v in (env or {}).items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def _forked(
    script: Optional[str],
    ranks: int = 1,
    args: Sequence[str] = (),
    env=None,
    cwd: str = ROOT,
    timeout: float = 240,
    text: Optional[str] = None,
) -> subprocess.CompletedProcess:
    path = script
    if text is not None:
        fd, path = tempfile.mkstemp(suffix=".py")
        with os.fdopen(fd, "w") as f:
            f.write(text)
    try:
        code, out, err = run_forked(path, ranks, list(args), environment(env), cwd, timeout)
    finally:
        if text is not None:
            os.unlink(path)
    return subprocess.CompletedProcess([path, *args], code, out, err)


def _processes():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "zeroshard"])  # (before its first use)
    return ctx


def _torchrun(
    script: str,
    ranks: int,
    args: Sequence[str] = (),
    env=None,
    cwd: Optional[str] = None,
    timeout: float = 240,
    flags: Sequence[str] = (),
    wait: bool = True,
):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        *flags,
        script,
        *args,
    ]
    if not wait:
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(env), cwd=cwd
        )
    return subprocess.run(cmd, capture_output=True, text=True, env=environment(env), cwd=cwd, timeout=timeout)


def forked_jobs(tmp_path_factory, name: str, script: str, timeout: float) -> dict:
    """{world size: rank 0's results} of ``script`` launched with torchrun at world sizes 2
    and then 3; the world-3 launch gets the world-2 directory as its second argument (to
    resume what world 2 saved). Each writes ``results-w<world>.pt`` into its directory."""
    out = {}
    for world in (2, 3):
        out[world] = forked_job(
            tmp_path_factory,
            f"{name}-w{world}",
            script,
            world,
            [] if world == 2 else [out[2]["dir"]],
            f"results-w{world}.pt",
            timeout,
        )
    return out


def forked_job(tmp_path_factory, name: str, script: str, world: int, args: list, results: str, timeout: float) -> dict:
    """Rank 0's results of ``script`` launched on ``world`` forked ranks as ``script
    [--flags] DIR [args]``, DIR a fresh directory where rank 0 writes the file ``results``."""
    import torch

    d = tmp_path_factory.mktemp(name)
    flags = [a for a in args if a.startswith("--")]
    res = launch(
        "forked",
        script,
        world,
        [*flags, str(d), *[a for a in args if not a.startswith("--")]],
        env={"OMP_NUM_THREADS": "1", "TMPDIR": str(d)},
        cwd=ROOT,
        timeout=timeout,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    out = torch.load(os.path.join(d, results), weights_only=False)
    out["dir"] = str(d)
    return out
