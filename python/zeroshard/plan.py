"""Memory planner: per-rank model-state bytes for DDP and ZeRO-1/2/3.

    python -m zeroshard.plan --params 7e9 --world-size 8 --dtype bf16

Conventions (the seeds use both; say which one you mean):
* ``--dtype bf16`` / ``fp16`` (mixed precision, seed 004 and seed 003's table):
  2 bytes of parameters, 2 of gradients and 12 of optimizer state (fp32
  master, exp_avg, exp_avg_sq) per parameter, 16 in all. 7B on 4 GPUs:
  112 / 49 / 38.5 / 28 GB.
* ``--dtype fp32`` (seed 000): 4 bytes of parameters, 4 of gradients, 8 of
  optimizer state (exp_avg, exp_avg_sq; the fp32 parameter is its own
  master), 16 in all. 7B on 8 GPUs: 112 / 63 / 38.5 / 14 GB.
* GB is 10^9 bytes, as in the seeds. Each stage shards, over N ranks: ZeRO-1
  the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the parameters.

This is the model state only (what ``memory_report()`` calls persistent,
without layout padding); activations, communication buckets and gathered
units come on top.
"""
from __future__ import annotations

import argparse
from typing import Dict, List

CARDS_GB = (24, 40, 80, 141)
_BYTES = {"bf16": (2, 2, 12), "fp16": (2, 2, 12), "fp32": (4, 4, 8)}   # params, grads, optimizer
STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


def model_state_bytes(params: float, world_size: int, dtype: str = "bf16") -> Dict[str, Dict[str, float]]:
    """Per-rank bytes of parameters, gradients and optimizer states for each stage."""
    if dtype not in _BYTES:
        raise ValueError(f"dtype must be one of {sorted(_BYTES)}, got {dtype!r}")
    if not params > 0:
        raise ValueError(f"params must be > 0, got {params}")
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    p, g, o = (b * params for b in _BYTES[dtype])
    n = world_size
    rows = {"DDP": (p, g, o), "ZeRO-1": (p, g, o / n), "ZeRO-2": (p, g / n, o / n), "ZeRO-3": (p / n, g / n, o / n)}
    return {s: {"params": a, "grads": b, "optimizer": c, "total": a + b + c} for s, (a, b, c) in rows.items()}


def format_table(params: float, world_size: int, dtype: str = "bf16") -> str:
    rows = model_state_bytes(params, world_size, dtype)
    gb = 1e9
    lines = [f"model state per rank: {params / 1e9:g}B parameters, {world_size} ranks, {dtype} "
             f"(GB = 10^9 bytes; activations and buffers not included)",
             f"{'stage':<8}{'params':>9}{'grads':>9}{'optimizer':>11}{'total':>9}  " +
             "".join(f"{c:>6}GB" for c in CARDS_GB)]
    for s in STAGES:
        r = rows[s]
        fits = "".join(f"{'yes' if r['total'] <= c * gb else 'no':>8}" for c in CARDS_GB)
        lines.append(f"{s:<8}{r['params'] / gb:>9.2f}{r['grads'] / gb:>9.2f}{r['optimizer'] / gb:>11.2f}"
                     f"{r['total'] / gb:>9.2f}  {fits}")
    return "\n".join(lines)


def main(argv: List[str] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m zeroshard.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, required=True, help="number of parameters, e.g. 7e9")
    ap.add_argument("--world-size", type=int, required=True, help="data-parallel ranks N")
    ap.add_argument("--dtype", choices=sorted(_BYTES), default="bf16",
                    help="bf16/fp16: mixed precision with fp32 master (default); fp32: plain fp32")
    args = ap.parse_args(argv)
    if args.world_size < 1:
        ap.error("--world-size must be >= 1")
    if not args.params > 0:
        ap.error("--params must be > 0")
    print(format_table(args.params, args.world_size, args.dtype))


if __name__ == "__main__":
    main()
