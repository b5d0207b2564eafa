"""Memory planner: per-rank model-state bytes for DDP and ZeRO-1/2/3.

    python -m zeroshard.plan --params 7e9 --world-size 8 --dtype bf16
    python -m zeroshard.plan --params 7e9 --world-size 32 --shard-size 8   # hybrid: 4 nodes x 8 GPUs

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

    python -m zeroshard.plan --model examples/train_gpt.py:build_model --world-size 8 \
        [--input examples/train_gpt.py:example_batch --batch 16] [--wrap Block] [--dtype bf16]

builds a real model on the meta device and plans it exactly: padding, the
largest sharding unit, communication buckets, gathered units and (with an
example batch) activations; see [Note: model plan].
"""

import argparse
import importlib
import importlib.util
import os
import sys
from typing import List

from .formula import _BYTES, format_table
from .planner import format_model_plan, plan_model

__all__ = ["main"]


def _load(spec: str):
    """'pkg.module:function' or 'path/to/file.py:function' -> the function."""
    mod_name, sep, fn = spec.rpartition(":")
    if not sep or not mod_name or not fn:
        raise ValueError(f"{spec!r}: expected module:function or path/to/file.py:function")
    if mod_name.endswith(".py") or os.sep in mod_name:
        if not os.path.exists(mod_name):
            raise ValueError(f"{spec!r}: no such file {mod_name!r}")
        name = "_zeroshard_plan_" + os.path.splitext(os.path.basename(mod_name))[0]
        spec_ = importlib.util.spec_from_file_location(name, mod_name)
        module = importlib.util.module_from_spec(spec_)
        sys.modules[name] = module  # so dataclasses and pickling see it
        spec_.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            raise ValueError(
                f"{spec!r}: cannot import {mod_name!r} ({e}); give module:function importable from "
                "here, or path/to/file.py:function"
            ) from e
    if not hasattr(module, fn):
        raise ValueError(f"{spec!r}: {mod_name} has no attribute {fn!r}")
    return getattr(module, fn)


def _formula(ap: argparse.ArgumentParser, args) -> None:
    """``--params``: the formulas' table."""
    if not args.params > 0:
        ap.error("--params must be > 0")
    try:
        print(
            format_table(
                args.params,
                args.world_size,
                args.dtype,
                args.shard_size,
                args.offload,
                args.offload_fraction,
                args.ep,
                args.experts,
                args.tp,
                args.replicated,
            )
        )
    except ValueError as e:
        ap.error(str(e))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m zeroshard.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _model_options(ap)
    _layout_options(ap)
    _parallel_options(ap)
    return ap


def _model_options(ap: argparse.ArgumentParser) -> None:
    """What is planned: a parameter count or a model (with a micro-batch), and how it is wrapped."""
    ap.add_argument("--params", type=float, help="number of parameters, e.g. 7e9")
    ap.add_argument("--model", help="module:function or file.py:function returning the model (built on meta)")
    ap.add_argument("--input", help="module:function returning one micro-batch of inputs (for activations)")
    ap.add_argument("--batch", type=int, help="passed to the --input function as batch=")
    ap.add_argument(
        "--wrap", help="ZeRO-3 unit classes, comma-separated names (default: the blocks of the longest ModuleList)"
    )
    ap.add_argument("--bucket-mb", type=float, default=25, help="ShardedOptimizer bucket_mb (default 25)")
    ap.add_argument("--prefetch", type=int, default=1, help="FullyShard prefetch (default 1)")
    ap.add_argument(
        "--optimizer",
        choices=("adamw", "adafactor", "muon"),
        default="adamw",
        help="with --model: the fused AdamW (default), torch's Adafactor, or Muon over the "
        "blocks' 2-D matrices with AdamW over the rest; whole-tensor state counts on its owner",
    )
    ap.add_argument(
        "--transport",
        choices=("nccl", "gloo"),
        default="nccl",
        help="with --model: nccl (GPUs, default) or gloo (CPU processes, whose reduce-scatter takes scratch chunks)",
    )


def _layout_options(ap: argparse.ArgumentParser) -> None:
    """The ranks, the dtype and where the optimizer state lives."""
    ap.add_argument("--world-size", type=int, required=True, help="data-parallel ranks N")
    ap.add_argument(
        "--shard-size",
        type=int,
        help="hybrid sharding: shard over S ranks (a node), replicate "
        "across the N/S groups (default: shard over all N)",
    )
    ap.add_argument(
        "--dtype",
        choices=sorted(_BYTES),
        default="bf16",
        help="bf16/fp16: mixed precision with fp32 master (default); fp32: plain fp32",
    )
    ap.add_argument(
        "--offload",
        choices=("cpu", "nvme"),
        help="ShardedOptimizer offload: the offloaded state's bytes go to host memory or disk",
    )
    ap.add_argument(
        "--offload-fraction", type=float, default=1.0, help="share of the optimizer state offloaded (default 1)"
    )


def _parallel_options(ap: argparse.ArgumentParser) -> None:
    """Expert and tensor parallelism (with --params: the formulas)."""
    ap.add_argument(
        "--ep",
        type=int,
        default=1,
        help="with --params: expert-parallel degree (dividing --world-size): a rank holds 1/ep of "
        "the experts, each expert's state sharded over its N/ep edp ranks (default 1)",
    )
    ap.add_argument(
        "--experts",
        type=float,
        default=0.0,
        help="with --params: how many of the parameters are experts' (every expert once), e.g. 4.5e10",
    )
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="with --params: tensor-parallel degree (dividing --world-size = dp x tp): a rank holds "
        "1/tp of the tp-sharded parameters, its piece's state sharded over its N/tp dp ranks",
    )
    ap.add_argument(
        "--replicated",
        type=float,
        default=0.0,
        help="with --tp: how many of the parameters every tp rank holds whole (norms, row-parallel biases; default 0)",
    )


def main(argv: List[str] = None) -> None:
    ap = _parser()
    args = ap.parse_args(argv)
    if not 0 <= args.offload_fraction <= 1:
        ap.error(f"--offload-fraction must be in [0, 1], got {args.offload_fraction}")
    if args.world_size < 1:
        ap.error("--world-size must be >= 1")
    if (args.params is None) == (args.model is None):
        ap.error("give exactly one of --params and --model")
    if args.shard_size is not None and (args.shard_size < 1 or args.world_size % args.shard_size):
        ap.error(f"--shard-size must divide --world-size ({args.world_size}), got {args.shard_size}")
    if args.model is None:
        return _formula(ap, args)
    if args.ep != 1 or args.experts or args.tp != 1 or args.replicated:
        ap.error(
            "--ep, --experts, --tp and --replicated plan with --params (the formulas); --model plans a "
            "model without expert or tensor parallelism for now"
        )
    try:
        build = _load(args.model)
        example = None
        if args.input:
            fn = _load(args.input)
            example = (lambda: fn(batch=args.batch)) if args.batch else fn
        # hybrid sharding holds per rank exactly what sharding over S ranks does
        plan = plan_model(
            build,
            args.shard_size or args.world_size,
            args.dtype,
            wrap=args.wrap,
            bucket_mb=args.bucket_mb,
            prefetch=args.prefetch,
            example=example,
            offload=args.offload,
            offload_fraction=args.offload_fraction,
            transport=args.transport,
            optimizer=args.optimizer,
        )
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    if args.shard_size is not None:
        print(
            f"hybrid sharding: {args.world_size} ranks = {args.world_size // args.shard_size} replicas x "
            f"{args.shard_size} shards; per rank as when sharding over {args.shard_size} ranks:"
        )
    print(format_model_plan(plan))
