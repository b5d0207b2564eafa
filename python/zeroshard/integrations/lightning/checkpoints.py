"""Lightning checkpoints as zeroshard checkpoints, and back to one plain file.

``trainer.save_checkpoint(path)`` (every rank) writes a directory at ``path``, as
DeepSpeedStrategy does: a zeroshard checkpoint (``zeroshard.save_checkpoint``: a
file per rank and a manifest, atomic, loadable at any world size and stage) whose
``extra`` holds the rest of Lightning's checkpoint dict (loop state, LR schedulers,
callbacks, hyperparameters, the precision plugin's scaler) beside the model and
optimizer state. ``convert_checkpoint`` turns the directory into the single file
DDPStrategy would have written, for ``LightningModule.load_from_checkpoint``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

import zeroshard
from zeroshard.checkpoint import read_full_state_dict

FORMAT = "zeroshard-lightning/1"
# what zeroshard's own files hold: never in the extra state
SHARDED_KEYS = ("state_dict", "optimizer_states")


def save(path: str, model: torch.nn.Module, optimizer, checkpoint: dict) -> None:
    """Collective: ``model`` (the LightningModule or its FullyShard) and ``optimizer``
    (None for a weights-only checkpoint) into ``path``, Lightning's other entries in
    the checkpoint's extra state."""
    rest = {k: v for k, v in checkpoint.items() if k not in SHARDED_KEYS}
    with_optimizer = "optimizer_states" in checkpoint
    zeroshard.save_checkpoint(
        path,
        model,
        optimizer if with_optimizer else None,
        extra={"format": FORMAT, "lightning": rest, "with_optimizer": with_optimizer},
    )


def _lightning_dict(extra: Any, path: str) -> dict:
    if not (isinstance(extra, dict) and extra.get("format") == FORMAT):
        raise ValueError(
            f"{path} is a zeroshard checkpoint, but not one ZeroShardStrategy wrote "
            "(trainer.save_checkpoint); load it with zeroshard.load_checkpoint instead"
        )
    return dict(extra["lightning"], state_dict={})


def check_directory(path: str) -> None:
    if not os.path.isdir(path):
        what = "a file" if os.path.isfile(path) else "missing"
        raise FileNotFoundError(
            f"{path} is {what}: ZeroShardStrategy resumes from the directory trainer.save_checkpoint wrote. "
            "A plain Lightning checkpoint file (from DDPStrategy, or from convert_checkpoint) holds no "
            "sharded optimizer state: load its weights with LightningModule.load_from_checkpoint instead"
        )


def load(path: str, model: torch.nn.Module, optimizer) -> dict:
    """Collective: the model (and ``optimizer``, None when not fitting) from ``path``,
    at whatever world size and stage saved it; returns Lightning's checkpoint dict,
    its ``state_dict`` empty (the weights are loaded already)."""
    check_directory(path)
    extra = zeroshard.load_checkpoint(path, model, optimizer)
    return _lightning_dict(extra, path)


def convert_checkpoint(path, out_file, dtype: Optional[torch.dtype] = None) -> dict:
    """Write the directory ``trainer.save_checkpoint`` wrote under ZeroShardStrategy as
    one plain Lightning checkpoint file: its ``"state_dict"`` holds the full
    parameters and buffers under the LightningModule's own names (as DDPStrategy's
    file does), beside Lightning's loop state, hyperparameters and LR schedulers;
    the optimizer state is left out (what ``convert_zero_checkpoint_to_fp32_state_dict``
    does for DeepSpeedStrategy). ``LightningModule.load_from_checkpoint(out_file)``
    loads it in one process.

    Needs no process group. Parameters come in the model's dtype, or ``dtype``
    (``torch.float32``: the fp32 master values). Returns the dict written.
    """
    path = os.fspath(path)
    check_directory(path)
    extra_file = os.path.join(path, "extra0.pt")
    if not os.path.isfile(extra_file):
        raise ValueError(f"{path} has no extra0.pt: it is not a checkpoint ZeroShardStrategy wrote")
    checkpoint = _lightning_dict(torch.load(extra_file, map_location="cpu", weights_only=False), path)
    checkpoint["state_dict"] = dict(read_full_state_dict(path, dtype=dtype))
    out_file = os.fspath(out_file)
    tmp = f"{out_file}.partial"
    torch.save(checkpoint, tmp)
    os.replace(tmp, out_file)
    return checkpoint
