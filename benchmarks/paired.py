"""What the paired step benchmarks (experts.py, tensor_parallel.py) share: one step of
every variant in turn in the same processes, in an order rotated per repeat, and the
rows they print (medians of the per-repeat ratios against a reference variant)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import date
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from comm_count import GroupCount
from machine import machine_info
from step import free_port


def time_variants(built: Dict[str, tuple], repeats: int, step: Callable, world: int) -> Tuple[dict, dict]:
    """(seconds per step of each variant, each repeat; bytes rank 0 sends in a step, by
    process group) of ``step(*built[variant])``, after one warm-up step each."""
    variants = list(built)
    for v in variants:
        step(*built[v])
    times: Dict[str, List[float]] = {v: [] for v in variants}
    for i in range(repeats):
        for v in variants[i % len(variants):] + variants[:i % len(variants)]:
            dist.barrier()
            t0 = time.perf_counter()
            step(*built[v])
            dist.barrier()
            times[v].append(time.perf_counter() - t0)
    sent = {}
    for v in variants:
        with GroupCount(world, None) as by_group:
            step(*built[v])
        sent[v] = {group: g["sent"] for group, g in by_group.groups.items()}
    return times, sent


def spawn(worker: Callable, world: int, args) -> dict:
    """Run ``worker(rank, world, port, args, queue)`` on ``world`` processes; what rank 0 put."""
    q = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(world, free_port(), args, q), nprocs=world, start_method="spawn")
    return q.get()


def print_rows(times: dict, sent: dict, ref: str) -> None:
    """A row per variant: median step time, ratio against ``ref``, bytes sent by group."""
    print(f"{'variant':<16}{'step ms':>9}{'vs ' + ref:>14}   sent per step (MB, by group)")
    for v, ts in times.items():
        ratio = statistics.median(a / b for a, b in zip(ts, times[ref]))
        groups = ", ".join(f"{g}: {b / 2**20:.2f}" for g, b in sorted(sent[v].items()))
        print(f"{v:<16}{1e3 * statistics.median(ts):>9.1f}{ratio:>13.2f}x   {groups}")


def arguments(doc: str, json_name: str, **sizes: int) -> argparse.Namespace:
    """The command line: --world-size 4, --repeats 9, --json out/``json_name``, and an int
    option per entry of ``sizes`` (its default)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=9)
    for name, default in sizes.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", json_name))
    return ap.parse_args()


def save_json(args: argparse.Namespace, res: dict, **meta) -> None:
    """The run's results, configuration and machine, as JSON at ``args.json``."""
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(date=str(date.today()), world_size=args.world_size, **meta, config=vars(args),
                       torch=torch.__version__, machine=machine_info("cpu"), **res), f, indent=1)
