"""DeepSpeed as a same-run peer in the step benchmarks (benchmark only, never a
runtime dependency of zeroshard: `make bench` installs it; without it these
variants are skipped with a message).

Variants: "deepspeed-1", "deepspeed-2", "deepspeed-3" (ZeRO stages over a client
torch.optim.AdamW) and "deepspeed-2+cpu" (ZeRO-Offload: the optimizer state in
host memory, stepped by DeepSpeedCPUAdam), with buckets of zeroshard's default
size (DeepSpeed's own defaults allocate 2 GB buckets whatever the model). DeepSpeed runs on CPU with gloo
through its CPU accelerator (DS_ACCELERATOR=cpu); its engine takes the backward
and the step (``engine.backward(loss)``, ``engine.step()``), which the step benchmark's
train_step calls when the "optimizer" it is given has a ``backward``.
"""

from __future__ import annotations

import importlib
import os
import tempfile

import torch


def available() -> str:
    """ "" if deepspeed imports, else why not."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        importlib.import_module("deepspeed")
        return ""
    except Exception as e:  # noqa: BLE001 - any failure: skip the peer, saying why
        return f"{type(e).__name__}: {str(e)[:200]}"


def is_deepspeed(variant: str) -> bool:
    return variant.startswith("deepspeed-")


def runnable(variants: list) -> list:
    """``variants`` without the DeepSpeed ones when deepspeed does not import (saying why)."""
    missing = available() if any(is_deepspeed(v) for v in variants) else ""
    if not missing:
        return variants
    print(f"DeepSpeed variants skipped (deepspeed not importable: {missing}; `make bench-deps` installs it)")
    return [v for v in variants if not is_deepspeed(v)]


def build_deepspeed(
    variant: str,
    model: torch.nn.Module,
    param_dtype: torch.dtype,
    lr: float,
    universal: bool = False,
    optimizer: dict | None = None,
):
    """(engine, engine): the engine is both the model to call and the "optimizer". The
    micro-batch size its config requires is bookkeeping (the step benchmark feeds its own batch).
    ``universal``: the engine loads universal checkpoints (made by ``to_universal``).
    ``optimizer``: the config's "optimizer" entry (DeepSpeed builds it) in place of a
    client torch.optim.AdamW (benchmarks/specs/muon.py: ``{"type": "Muon", ...}``)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    name, _, offload = variant.partition("+")
    stage = int(name.split("-")[1])
    # buckets of zeroshard's default size (25 MiB of fp32 elements): DeepSpeed's defaults
    # (5e8 elements) would allocate a 2 GB gradient bucket for any model
    bucket = 25 * 2**20 // 4
    zero = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = bucket
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    if param_dtype == torch.bfloat16:
        cfg["bf16"] = {"enabled": True}
    if optimizer is not None:
        cfg["optimizer"] = optimizer
        if optimizer.get("type") == "Muon" and stage == 3:
            zero["reduce_scatter"] = False  # its ZeRO-3 refuses Muon with reduce_scatter (the default)
        optimizer = None
    elif offload == "cpu":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        zero["offload_optimizer"] = {"device": "cpu"}
        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=lr, adamw_mode=True, weight_decay=0.01)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config=cfg,
        model_parameters=None if optimizer is not None else list(model.parameters()),
        dist_init_required=False,
    )
    return engine, engine


def zeroshard_options(variant: str) -> dict:
    """ShardedOptimizer's keywords for a variant's "+" suffix: "+cpu" / "+nvme" offload (the
    nvme file in a fresh temporary directory), "+overlap" overlap_param_gather; {} without one."""
    kind = variant.partition("+")[2]
    if kind == "cpu":
        return dict(offload="cpu")
    if kind == "nvme":
        return dict(offload="nvme", offload_dir=tempfile.mkdtemp(prefix="zeroshard-bench-"))
    if kind == "overlap":
        return dict(overlap_param_gather=True)
    return {}


def to_universal(path: str, tag: str) -> str:
    """DeepSpeed's offline conversion (ds_to_universal) of checkpoint ``path``/``tag`` into a
    universal checkpoint, which loads at another world size; returns the tag it is under."""
    import subprocess
    import sys

    out = tag + "_universal"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            os.path.join(path, tag),
            "--output_folder",
            os.path.join(path, out),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, DS_ACCELERATOR="cpu"),
    )
    if done.returncode:
        last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["(no message)"]
        raise RuntimeError(f"ds_to_universal failed: {last[0][:300]}")
    with open(os.path.join(path, "latest_universal"), "w") as f:
        f.write(out)
    return out
