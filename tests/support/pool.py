"""A pool of gloo ranks reused across tests (``launch("pool", world)`` in support/launch.py).

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
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
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
            ctx.Process(
                target=_worker,
                daemon=True,
                args=(r, self.world_size, port, self._tasks[r], self._results, list(sys.path)),
            )
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
            raise RankError(
                f"{fn.__name__}: ranks {missing} did not finish within {timeout}s "
                f"(hang in a collective?){detail}{stuck}"
            )
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


_pools: dict = {}


def get_pool(world_size: int) -> DistPool:
    """The session's pool of ``world_size`` gloo ranks (started at its first use)."""
    if world_size not in _pools:
        _pools[world_size] = DistPool(world_size)
    return _pools[world_size]


def close_pools() -> None:
    """Stop every pool of the session (conftest's pytest_sessionfinish)."""
    for p in _pools.values():
        p.close()
    _pools.clear()
