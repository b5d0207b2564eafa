"""DeepSpeed's ``zero_to_fp32`` over the checkpoints ``engine.save_checkpoint`` writes:
the full fp32 state dict under the model's own names, read one tensor at a time
(``zeroshard.checkpoint.read_full_state_dict``), at any saving world size and stage.

    python -m zeroshard.zero_to_fp32 CHECKPOINT_DIR OUTPUT [-t TAG] [--safe_serialization]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
from typing import Optional

import torch

from zeroshard import checkpoint

from .checkpoints import tag_dir

WEIGHTS = {False: "pytorch_model.bin", True: "model.safetensors"}


def _checkpoint(checkpoint_dir, tag: Optional[str]) -> str:
    path = tag_dir(checkpoint_dir, tag)
    if path is None:
        raise ValueError(
            f"Unable to find 'latest' file at {os.path.join(os.fspath(checkpoint_dir), 'latest')}; pass tag="
        )
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Directory '{path}' doesn't exist")
    return path


def _refuse(exclude_frozen_parameters: bool, lazy_mode: bool = False) -> None:
    if exclude_frozen_parameters or lazy_mode:
        raise NotImplementedError(
            "exclude_frozen_parameters / lazy_mode: zeroshard reads every tensor, one at a time; leave them False"
        )


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir, tag: Optional[str] = None, exclude_frozen_parameters: bool = False, lazy_mode: bool = False
):
    """The full state dict of ``checkpoint_dir/tag`` (default: the tag in ``latest``):
    parameters as their fp32 master values, buffers in their dtype, on CPU, loadable
    with ``model.load_state_dict`` into the plain model. Memory: the result, plus one tensor."""
    _refuse(exclude_frozen_parameters, lazy_mode)
    return collections.OrderedDict(
        checkpoint.read_full_state_dict(_checkpoint(checkpoint_dir, tag), dtype=torch.float32)
    )


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag: Optional[str] = None):
    """As DeepSpeed's: ``model`` moved to the CPU and loaded (``strict=False``) with the fp32
    state dict of ``checkpoint_dir/tag`` (default: the tag in ``latest``); returns it. The
    plain model it fills is no longer an engine's (build a new engine to train it again)."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def _shard_bytes(size) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B)\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size {size!r}: expected bytes or a size such as \"5GB\"")
    return int(float(m.group(1)) * 1000 ** "BKMGT".index(m.group(2)[0]))


def _save(sd: dict, path: str, safe: bool) -> None:
    if safe:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, path, metadata={"format": "pt"})
    else:
        torch.save(sd, path)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir,
    output_dir,
    max_shard_size="5GB",
    safe_serialization: bool = False,
    tag: Optional[str] = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the fp32 state dict of ``checkpoint_dir/tag`` to files, one shard of at
    most ``max_shard_size`` in memory at a time. ``output_dir`` is a directory (files
    named as DeepSpeed and Hugging Face name them: ``pytorch_model.bin`` or
    ``model.safetensors``, ``-0000i-of-0000n`` shards plus an index when sharded), or a
    file path ending in ``.bin``, ``.pt`` or ``.safetensors`` (one file, as older DeepSpeed)."""
    _refuse(exclude_frozen_parameters)
    path, out = _checkpoint(checkpoint_dir, tag), os.fspath(output_dir)
    items = checkpoint.read_full_state_dict(path, dtype=torch.float32)
    if out.endswith((".bin", ".pt", ".safetensors")):
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        _save(collections.OrderedDict(items), out, out.endswith(".safetensors"))
        return
    os.makedirs(out, exist_ok=True)
    limit = _shard_bytes(max_shard_size) if max_shard_size is not None else None
    shards, current, size = [], collections.OrderedDict(), 0  # shards: (keys, bytes) written

    def flush():
        _save(current, os.path.join(out, f"partial-{len(shards)}-{WEIGHTS[safe_serialization]}"), safe_serialization)
        shards.append((list(current), size))

    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if current and limit is not None and size + nbytes > limit:
            flush()
            current, size = collections.OrderedDict(), 0
        current[name], size = t, size + nbytes
    flush()
    _name_shards(out, shards, safe_serialization)


def _name_shards(out: str, shards: list, safe: bool) -> None:
    """One shard: the plain file name; several: ``x-0000i-of-0000n`` and the index JSON
    (``weight_map``: tensor -> file), as Hugging Face's sharded checkpoints."""
    weights = WEIGHTS[safe]
    if len(shards) == 1:
        os.replace(os.path.join(out, f"partial-0-{weights}"), os.path.join(out, weights))
        return
    stem, ext = os.path.splitext(weights)
    weight_map = {}
    for i, (keys, _) in enumerate(shards):
        final = f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}"
        os.replace(os.path.join(out, f"partial-{i}-{weights}"), os.path.join(out, final))
        weight_map.update(dict.fromkeys(keys, final))
    index = {"metadata": {"total_size": sum(b for _, b in shards)}, "weight_map": weight_map}
    with open(os.path.join(out, weights + ".index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="a zeroshard.initialize checkpoint -> one fp32 state dict")
    parser.add_argument("checkpoint_dir", help="the folder holding 'latest' and the tag folders")
    parser.add_argument("output_dir", help="a directory (pytorch_model.bin / model.safetensors), or a file path")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        args.max_shard_size,
        args.safe_serialization,
        args.tag,
        args.exclude_frozen_parameters,
    )
