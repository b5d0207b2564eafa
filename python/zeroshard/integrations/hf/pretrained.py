"""What ``save_pretrained`` writes, written from a zeroshard checkpoint: the
config (and generation config) and the weights as safetensors files of at most
``max_shard_size`` with their index, under the model's own names, tied
parameters once. Rank 0 streams the checkpoint's full state dict (one tensor
read at a time, one output file held), so no rank ever holds the whole model,
and ``AutoModel*.from_pretrained(folder)`` loads the result on any machine. A
peft model writes its adapter alone (``save_adapter``), as peft's
``save_pretrained`` does: ``PeftModel.from_pretrained`` loads it.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import uuid
from typing import Optional

import safetensors.torch
import torch
import torch.nn as nn
from huggingface_hub import split_torch_state_dict_into_shards

import zeroshard
from zeroshard.checkpoint import full_state_dict_meta, read_full_state_dict

from .tensor_parallel import full_state_dict, is_tensor_parallel

WEIGHTS_PATTERN = "model{suffix}.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# the scratch checkpoint a stage-3 save_model writes and exports from
SCRATCH = ".zeroshard-save"


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model under a FullyShard (or the model itself)."""
    return model.module if isinstance(model, zeroshard.FullyShard) else model


def write_config(model: nn.Module, out_dir: str) -> None:
    """The config files ``save_pretrained`` writes beside the weights."""
    config = getattr(model, "config", None)
    if config is None:
        return
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if generation is not None and can_generate():
        generation.save_pretrained(out_dir)


def _remove_stale_weights(out_dir: str, keep: set) -> None:
    for f in glob.glob(os.path.join(out_dir, "model*.safetensors")) + [os.path.join(out_dir, INDEX_NAME)]:
        if os.path.basename(f) not in keep and os.path.isfile(f):
            os.remove(f)


def export_pretrained(
    checkpoint: str, model: nn.Module, out_dir: str, max_shard_size, dtype: Optional[torch.dtype] = None
) -> None:
    """On one rank, no communication: the ``save_pretrained`` files of ``model`` (the
    Hugging Face model, for its config) into ``out_dir`` from the zeroshard
    checkpoint ``checkpoint``. Memory: one output file's tensors."""
    os.makedirs(out_dir, exist_ok=True)
    meta = full_state_dict_meta(checkpoint, dtype, tied=False)
    split = split_torch_state_dict_into_shards(meta, filename_pattern=WEIGHTS_PATTERN, max_shard_size=max_shard_size)
    left = {f: len(names) for f, names in split.filename_to_tensors.items()}
    held = {}
    for name, t in read_full_state_dict(checkpoint, dtype, tied=False):
        f = split.tensor_to_filename[name]
        held.setdefault(f, {})[name] = t.contiguous()
        left[f] -= 1
        if left[f] == 0:
            tmp = os.path.join(out_dir, f"{f}.partial-{uuid.uuid4().hex[:8]}")
            safetensors.torch.save_file(held.pop(f), tmp, metadata={"format": "pt"})
            os.replace(tmp, os.path.join(out_dir, f))
    keep = set(split.filename_to_tensors)
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
        with open(os.path.join(out_dir, INDEX_NAME), "w") as fh:
            json.dump(index, fh, indent=2, sort_keys=True)
        keep.add(INDEX_NAME)
    _remove_stale_weights(out_dir, keep)
    write_config(model, out_dir)


def save_pretrained(model: nn.Module, out_dir: str, *, is_main_process: bool, max_shard_size="50GB") -> None:
    """Collective at stage 3 (every rank calls it): ``model`` (a FullyShard, or a
    plain Hugging Face model whose parameters every rank holds) saved as
    ``save_pretrained`` would, by the main process. At stage 3 the ranks write a
    scratch zeroshard checkpoint in ``out_dir`` (each its own shards), the main
    process streams it into the Hugging Face files and removes it."""
    out_dir = os.fspath(out_dir)
    if not isinstance(model, zeroshard.FullyShard):
        whole = full_state_dict(model) if is_tensor_parallel(model) else None  # (collective over tp)
        if is_main_process:
            model.save_pretrained(out_dir, max_shard_size=max_shard_size, state_dict=whole)
        return
    if is_peft(model.module):
        return save_adapter(model, out_dir, is_main_process=is_main_process)
    scratch = os.path.join(out_dir, SCRATCH)
    zeroshard.save_checkpoint(scratch, model, None, sync_files=False)
    if is_main_process:
        try:
            export_pretrained(scratch, hf_model(model), out_dir, max_shard_size)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def is_peft(model: nn.Module) -> bool:
    """A peft model (its ``save_pretrained`` writes the adapter alone)."""
    try:
        import peft
    except ImportError:
        return False
    return isinstance(model, peft.PeftModel)


def save_adapter(fs: "zeroshard.FullyShard", out_dir: str, *, is_main_process: bool) -> None:
    """Collective: a peft model's adapter as its ``save_pretrained`` writes it (what
    ``PeftModel.from_pretrained`` loads), from the units holding trainable parameters
    alone, gathered to rank 0."""
    inner = fs.module
    keys = [n for n, p in inner.named_parameters() if p.requires_grad]
    sd = fs.state_dict(to=0, keys=keys)
    if is_main_process:
        inner.save_pretrained(out_dir, state_dict=sd)
