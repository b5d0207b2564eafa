"""A pool of gloo ranks reused across tests.

Starting a torch process costs seconds, so each world size gets one pool of
worker processes for the whole session. ``pool.run(fn, *args)`` runs ``fn``
(an importable module-level function) on every rank and returns the per-rank
results. A rank that raises fails the test with that rank's traceback; ranks
that do not answer within the timeout (a hang in a collective) fail the test
and the pool is torn down and rebuilt for the next test.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, tasks, results, sys_path):
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
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
        port = _free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, self.world_size, port, self._tasks[r], self._results, list(sys.path)))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float = 120.0, **kwargs):
        """Run fn(*args, **kwargs) on every rank; return [result of rank 0, 1, ...]."""
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
            self.close()
            self._start()
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankError(f"{fn.__name__}: ranks {missing} did not finish within {timeout}s "
                            f"(hang in a collective?){detail}")
        if errors:
            raise RankError("".join(f"\n--- rank {r} raised ---\n{tb}" for r, tb in sorted(errors.items())))
        return [out[r] for r in range(self.world_size)]

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
