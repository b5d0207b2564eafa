"""A pool of gloo ranks reused across tests.

Starting a torch process costs seconds, so each world size gets one pool of
worker processes for the whole session. ``pool.run(fn, *args)`` runs ``fn``
(an importable module-level function) on every rank and returns the per-rank
results. A rank that raises fails the test with that rank's traceback; ranks
that do not answer within the timeout (a hang in a collective) fail the test
and the pool is torn down and rebuilt for the next test.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stack_file(port: int, rank: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"zeroshard-pool-{port}-rank{rank}.stacks")


def _worker(rank, world_size, port, tasks, results, sys_path):
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    # On a hang the parent sends SIGUSR1: every thread's Python stack goes to a
    # file the parent puts in the test's failure message.
    faulthandler.register(signal.SIGUSR1, file=open(_stack_file(port, rank), "w"), all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankError(AssertionError):
    pass


class DistPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs = []
        self._start()

    def _start(self):
        ctx = mp.get_context("spawn")
        port = self._port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, self.world_size, port, self._tasks[r], self._results, list(sys.path)))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float = None, **kwargs):
        """Run fn(*args, **kwargs) on every rank; return [result of rank 0, 1, ...].
        ``timeout`` defaults to $ZEROSHARD_TEST_TIMEOUT seconds, else 120."""
        timeout = timeout or float(os.environ.get("ZEROSHARD_TEST_TIMEOUT", 120))
        if not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for t in self._tasks:
            t.put((fn, args, kwargs))
        out, errors = {}, {}
        try:
            for _ in range(self.world_size):
                rank, ok, value = self._results.get(timeout=timeout)
                (out if ok else errors)[rank] = value
        except queue.Empty:
            missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
            stuck = self._where(missing)
            self.close()
            self._start()
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankError(f"{fn.__name__}: ranks {missing} did not finish within {timeout}s "
                            f"(hang in a collective?){detail}{stuck}")
        if errors:
            raise RankError("".join(f"\n--- rank {r} raised ---\n{tb}" for r, tb in sorted(errors.items())))
        return [out[r] for r in range(self.world_size)]

    def _where(self, ranks) -> str:
        """For each rank: its exit code if it died, else its threads' Python stacks."""
        alive = [r for r in ranks if self._procs[r].is_alive()]
        for r in alive:
            os.kill(self._procs[r].pid, signal.SIGUSR1)
        time.sleep(1.0)
        out = []
        for r in ranks:
            if r not in alive:
                out.append(f"\n--- rank {r} died with exit code {self._procs[r].exitcode} ---")
                continue
            try:
                with open(_stack_file(self._port, r)) as f:
                    out.append(f"\n--- rank {r} stacks ---\n{f.read()}")
            except OSError as e:
                out.append(f"\n--- rank {r}: no stacks ({e}) ---")
        return "".join(out)

    def close(self):
        for t in self._tasks:
            try:
                t.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []


def piece_of(p):
    """What this rank holds of parameter ``p``: its piece under FullyShard (``p.to_local()``),
    else ``p`` itself (detached)."""
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


def torchrun_jobs(tmp_path_factory, name: str, job: str, timeout: float) -> dict:
    """{world size: rank 0's results} of ``job`` launched with torchrun at world sizes 2
    and then 3; the world-3 launch gets the world-2 directory as its second argument (to
    resume what world 2 saved). Each writes ``results-w<world>.pt`` into its directory."""
    out = {}
    for world in (2, 3):
        out[world] = torchrun_job(tmp_path_factory, f"{name}-w{world}", job, world, [] if world == 2 else
                                  [out[2]["dir"]], f"results-w{world}.pt", timeout)
    return out


def torchrun_job(tmp_path_factory, name: str, job: str, world: int, args: list, results: str,
                 timeout: float) -> dict:
    """Rank 0's results of ``job`` launched with torchrun at ``world`` ranks as ``job [--flags]
    DIR [args]``, DIR a fresh directory where rank 0 writes the file ``results``."""
    import subprocess

    import torch
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    d = tmp_path_factory.mktemp(name)
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(d))
    flags = [a for a in args if a.startswith("--")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), job,
           *flags, str(d), *[a for a in args if not a.startswith("--")]]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    out = torch.load(os.path.join(d, results), weights_only=False)
    out["dir"] = str(d)
    return out


def worst(a: dict, b: dict) -> float:
    """The largest elementwise difference between two state dicts with the same keys."""
    assert a.keys() == b.keys() and len(a) > 0
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def close(a: list, b: list, tol: float = 1e-5) -> bool:
    """Two equally long, non-empty lists of numbers within ``tol`` of each other."""
    return len(a) == len(b) > 0 and max(abs(x - y) for x, y in zip(a, b)) <= tol


class Timeline:
    """What a test observes through its own hooks, placed among the collectives of the
    flight record: ``mark(what, name)`` notes an observation; ``events()`` returns the
    marks and the collectives issued since the Timeline was made, in order, as
    (what, name) pairs: collectives as ("reduce_scatter" / "all_gather" / ..., the bucket
    index or unit name their flight record names), marks as given. A mark made after
    the n-th collective comes after it and before the (n + 1)-th."""

    def __init__(self):
        from zeroshard.comm import flight
        self._flight, self._start, self._marks = flight, flight.issued(), []

    def mark(self, what: str, name) -> None:
        self._marks.append((self._flight.issued(), (what, name)))

    def grad_hooks(self, named_params) -> list:
        """Marks ("grad", name) each time autograd accumulates one of ``named_params``'
        gradients (after the library's own hook for it, registered earlier)."""
        return [p.register_post_accumulate_grad_hook(lambda p, n=n: self.mark("grad", n))
                for n, p in named_params if p.requires_grad]

    def events(self) -> list:
        import re
        recs = self._flight.flight_record()
        first = self._flight.issued() - len(recs) + 1      # the issue number of recs[0]
        out, marks = [], iter(self._marks)
        mark = next(marks, None)
        for n, rec in enumerate(recs, start=first):
            if n <= self._start:
                continue
            while mark is not None and mark[0] < n:
                out.append(mark[1])
                mark = next(marks, None)
            unit = re.search(r"unit '([^']*)'", rec["what"])
            bucket = re.search(r"bucket (\d+)", rec["what"])
            out.append((rec["kind"], unit.group(1) if unit else int(bucket.group(1)) if bucket else rec["what"]))
        out += [m[1] for m in ([mark] if mark is not None else []) + list(marks)]
        return out


def unit_gather_dtypes(since: float) -> list:
    """The dtypes of the units' all-gathers this rank issued since ``since`` (time.time()), from the flight record."""
    import zeroshard
    return sorted({r["dtype"] for r in zeroshard.flight_record()
                   if r["kind"] == "all_gather" and "all-gather" in r["what"] and ", unit '" in r["what"]
                   and r["start"] >= since})
