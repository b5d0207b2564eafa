"""The one harness every benchmark runs on (``python -m benchmarks NAME [options]``).

A benchmark is a spec module in ``benchmarks/specs/``: its docstring (the help),
``OPTIONS`` (a list of ``opt(...)``: its command line, declared as data), ``JSON``
(the file name it writes in ``benchmarks/out/``; default ``NAME.json``; None: it
writes none) and ``run(args)``, which measures and returns what the JSON holds (or
None). The harness parses the command line (adding ``--json``), runs the spec, adds
the date, torch version and machine where the result lacks them, and writes the JSON.

What the specs share is here too:
  spawn(target, world, *extra)   ranks: ``target(rank, world, port, queue, *extra)`` in
                                 one process each; what rank 0 put in the queue
  init_dist(rank, world, port)   a rank's process group (gloo on CPU, NCCL on CUDA)
  paired_times(fns, turns)       every variant's step taken in turn, the order rotated
                                 each turn; paired_ratio: the median per-turn ratio
  machine_info(device)           what a run ran on (recorded in every JSON)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import platform
import queue as queues
import socket
import statistics
import subprocess
import sys
import time
from datetime import date
from typing import Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(HERE, "out")
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:  # the examples' models (train_gpt, moe, tensor_parallel) are the benchmarks' too
    sys.path.append(EXAMPLES)


# ---------------------------------------------------------------- machine


def git_commit() -> str:
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], text=True, cwd=HERE, stderr=subprocess.DEVNULL
        ).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str = "cpu") -> dict:
    """cpu, cpus (usable by this process), gpu (name when ``device`` is cuda,
    else None), torch, python, os, commit, and ``description``: one line for
    titles and tables, e.g. "AMD EPYC, 2 CPUs" or "NVIDIA H100 80GB HBM3 x 1"."""
    import torch

    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    gpu = gpus = None
    if device == "cuda" and torch.cuda.is_available():
        gpu, gpus = torch.cuda.get_device_name(), torch.cuda.device_count()
    cpu = cpu_model()
    desc = f"{gpu} x {gpus} (host {cpu}, {cpus} CPUs)" if gpu else f"{cpu}, {cpus} CPUs"
    return dict(
        description=desc,
        cpu=cpu,
        cpus=cpus,
        gpu=gpu,
        gpus=gpus,
        torch=torch.__version__,
        python=platform.python_version(),
        os=platform.platform(),
        commit=git_commit(),
    )


# ---------------------------------------------------------------- ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_dist(rank: int, world: int, port: int, cuda: bool = False):
    """One process of a benchmark's group on this machine: NCCL with GPU ``rank``, or gloo
    with an equal share of the CPU threads. Returns the device."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if cuda:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        return torch.device("cuda", rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return torch.device("cpu")


class RanksFailed(RuntimeError):
    pass


def spawn(target: Callable, world: int, *extra, what: str = "ranks", every: bool = False, skip_failed: bool = False):
    """Runs ``target(rank, world, port, queue, *extra)`` in ``world`` fresh processes (spawned,
    so CUDA and gloo start clean); returns the first thing rank 0 put in the queue (every
    thing put, in order, with ``every``). A rank that fails raises RanksFailed, or with
    ``skip_failed`` prints ``what`` failed and returns None."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, q) + extra) for r in range(world)]
    for p in procs:
        p.start()
    got: List = []

    def drain(timeout: float) -> None:
        try:
            while True:
                got.append(q.get(timeout=timeout))
        except queues.Empty:
            pass

    while any(p.is_alive() for p in procs):  # read while they run: a full pipe would block a rank's exit
        drain(0.2)
    for p in procs:
        p.join()
    drain(0.5)
    codes = [p.exitcode for p in procs]
    if any(codes):
        if skip_failed:
            print(f"{what}: failed (exit codes {codes})")
            return None
        raise RanksFailed(f"{what}: a rank failed (exit codes {codes})")
    if every:
        return got
    return got[0] if got else None


def command(name: str, *args: str) -> List[str]:
    """The command line that runs benchmark ``name`` (a spec that re-launches itself for a
    part, e.g. under torchrun, passes run_env() as the environment)."""
    return [sys.executable, "-m", "benchmarks", name, *args]


def torchrun(world: int, name: str, *args: str) -> List[str]:
    """command() under ``torch.distributed.run`` with ``world`` ranks on this machine (with run_env())."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "-m",
        "benchmarks",
        name,
        *args,
    ]


def run_env(**extra: str) -> dict:
    """The environment for command(): the repository on PYTHONPATH, so ``-m benchmarks`` imports."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


# ---------------------------------------------------------------- paired timing


def rotated(items: list, i: int) -> list:
    """``items`` starting at index i (mod its length): turn i's order."""
    k = i % len(items)
    return items[k:] + items[:k]


def paired_times(
    fns: Dict[str, Callable], turns: int, warmup: int = 0, timer: Optional[Callable[[Callable], float]] = None
) -> Dict[str, List[float]]:
    """Seconds of each of ``fns`` in each of ``turns`` turns (after ``warmup`` turns): every
    turn calls each once, in an order rotated per turn, so all see the same machine load.
    ``timer(fn)``: seconds of one call (default: wall clock around it)."""
    timer = timer or _wall
    names = list(fns)
    times: Dict[str, List[float]] = {n: [] for n in names}
    for i in range(warmup + turns):
        for n in rotated(names, i):
            seconds = timer(fns[n])
            if i >= warmup:
                times[n].append(seconds)
    return times


def _wall(fn: Callable) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def barrier_timer(fn: Callable) -> float:
    """paired_times' timer for ranks: barrier, the call, barrier."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def paired_ratio(times: List[float], ref: List[float]) -> float:
    """The median over turns of ``times`` over ``ref`` in the same turn."""
    return statistics.median(a / b for a, b in zip(times, ref))


# ---------------------------------------------------------------- command line and JSON


def opt(*flags: str, **kw) -> tuple:
    """One option of a spec's OPTIONS: argparse's add_argument(*flags, **kw)."""
    return flags, kw


def sized_options(**sizes: int) -> list:
    """OPTIONS of the paired step benchmarks (experts, tensor_parallel_step): --world-size 4,
    --repeats 9 and an int option per entry of ``sizes`` (its default)."""
    return [opt("--world-size", type=int, default=4), opt("--repeats", type=int, default=9)] + [
        opt(f"--{name}", type=int, default=default) for name, default in sizes.items()
    ]


def specs() -> List[str]:
    """Every benchmark's name (the modules of benchmarks/specs)."""
    from benchmarks import specs as package

    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))


def spec(name: str):
    return importlib.import_module(f"benchmarks.specs.{name.replace('-', '_')}")


def json_name(name: str, module) -> Optional[str]:
    return getattr(module, "JSON", f"{name}.json")


def parser(name: str, module=None) -> argparse.ArgumentParser:
    module = module or spec(name)
    ap = argparse.ArgumentParser(
        prog=f"python -m benchmarks {name}",
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flags, kw in getattr(module, "OPTIONS", []):
        ap.add_argument(*flags, **kw)
    out = json_name(name, module)
    if out is not None:
        ap.add_argument("--json", default=os.path.join(OUT, out), help="where the result goes (default: %(default)s)")
    return ap


def parse(name: str, argv: Optional[List[str]] = None) -> argparse.Namespace:
    module = spec(name)
    ap = parser(name, module)
    args = ap.parse_args(argv)
    check = getattr(module, "check", None)
    if check is not None:
        problem = check(args)
        if problem:
            ap.error(problem)
    return args


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def with_run_info(data: dict, device: str = "cpu") -> dict:
    """``data`` with the date, torch version and machine where it lacks them."""
    import torch

    data.setdefault("date", str(date.today()))
    data.setdefault("torch", torch.__version__)
    data.setdefault("machine", machine_info(device))
    return data


def run(name: str, argv: Optional[List[str]] = None) -> int:
    """Runs benchmark ``name`` with the command line ``argv``; writes its JSON. The exit status."""
    module = spec(name)
    args = parse(name, argv)
    result = module.run(args)
    if isinstance(result, int):  # a part run for a parent process, or a verdict
        return result
    if result is not None and getattr(args, "json", None):
        write_json(args.json, with_run_info(result, getattr(args, "device", "cpu")))
        shown = os.path.relpath(args.json)
        print(f"wrote {args.json if shown.startswith(os.pardir) else shown}")
    return 0


def time_variants(built: Dict[str, tuple], repeats: int, step: Callable, world: int):
    """(seconds per step of each variant, each repeat; bytes rank 0 sends in a step, by
    process group) of ``step(*built[variant])`` on every rank, the variants' steps taken
    in turn (paired_times, between barriers) after one warm-up step each."""
    from benchmarks.comm_count import GroupCount

    times = paired_times(built, repeats, warmup=1, timer=lambda b: barrier_timer(lambda: step(*b)))
    sent = {}
    for v, b in built.items():
        with GroupCount(world, None) as by_group:
            step(*b)
        sent[v] = {group: g["sent"] for group, g in by_group.groups.items()}
    return times, sent


def print_rows(times: dict, sent: dict, ref: str) -> None:
    """A row per variant: median step time, paired ratio against ``ref``, bytes sent by group."""
    print(f"{'variant':<16}{'step ms':>9}{'vs ' + ref:>14}   sent per step (MB, by group)")
    for v, ts in times.items():
        groups = ", ".join(f"{g}: {b / 2**20:.2f}" for g, b in sorted(sent[v].items()))
        print(f"{v:<16}{1e3 * statistics.median(ts):>9.1f}{paired_ratio(ts, times[ref]):>13.2f}x   {groups}")
