"""Resuming at the start of a training script: the newest complete checkpoint
under a path, loaded (``resume``).

[Note: resume]
``resume(path, ...)`` accepts the two layouts users keep:

* ``path`` is one checkpoint, replaced by every save (what the examples do,
  and what a save under the same name gives: an atomic exchange, see [Note:
  checkpoint format] in checkpoint/api.py). The candidates are ``path`` and
  the previous checkpoint a save cut between its two renames left beside it.
* ``path`` is a directory of checkpoints (``step_000100/``, ``step_000200/``,
  ... as torch.distributed.checkpoint, Lightning's ``dirpath`` or DeepSpeed's
  tag folders keep them). The candidates are its subdirectories.

The newest candidate is the one committed last (its manifest's mtime; the
name breaks ties), not the largest name, so any naming works. A candidate
is complete when its manifest reads and verifies and every file it lists has
its size; an interrupted save's ``.partial-*`` directory, a directory without
a manifest, and a checkpoint with a truncated or missing file are skipped
with a warning naming them (only those newer than the one loaded). A fault
found only while loading (a block failing its CRC) skips to the next one too,
with a warning: the load that follows writes every value again. If every
checkpoint fails to load (those of another model, say), the first error is
raised rather than starting fresh over them. Rank 0
chooses and the other ranks take its choice, so every rank loads the same
checkpoint even when their views of a shared filesystem lag.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, List, Optional, Tuple

import torch.distributed as dist
import torch.nn as nn

from . import files
from .. import comm
from .api import load_checkpoint, previous_of
from .files import CheckpointError


def _is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, files.MANIFEST))


def _candidates(path: str) -> List[str]:
    """Directories that may hold a checkpoint of ``path``, in no order."""
    if not os.path.isdir(path) and not os.path.lexists(path):
        return previous_of(path)
    if _is_checkpoint(path):
        return [path]
    return [os.path.join(path, d) for d in os.listdir(path) if os.path.isdir(os.path.join(path, d))]


def _problem(path: str) -> Optional[str]:
    """Why ``path`` is not a complete checkpoint, or None."""
    if ".partial-" in os.path.basename(path):
        return "a save into it was interrupted"
    try:
        man = files.read_manifest(path)
    except CheckpointError as e:
        return str(e)
    return next(filter(None, (files.file_problem(path, fname, info) for fname, info in man["files"].items())), None)


def _committed(path: str) -> float:
    """When ``path`` was committed: its manifest's mtime, else the directory's."""
    for p in (os.path.join(path, files.MANIFEST), path):
        if os.path.exists(p):
            return os.path.getmtime(p)
    return 0.0


def newest_complete(path: str) -> Tuple[List[str], List[Tuple[str, str]]]:
    """The complete checkpoints under ``path``, newest first, and (directory, why) for each
    torn one newer than the newest complete one."""
    found = sorted(_candidates(path), key=lambda p: (_committed(p), p), reverse=True)
    good, torn = [], []
    for c in found:
        why = _problem(c)
        if why is None:
            good.append(c)
        elif not good:
            torn.append((c, why))
    return good, torn


def _choose(path: str) -> List[str]:
    """Rank 0's list of complete checkpoints (newest first), on every rank."""
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    good: List[str] = []
    if not multi or dist.get_rank() == 0:
        good, torn = newest_complete(path)
        for c, why in torn:
            warnings.warn(f"zeroshard.resume: skipping {c}, not a complete checkpoint: {why}")
    if multi:
        good = comm.all_gather_object(good, what="resume: the checkpoints to load")[0]
    return good


def resume(path, model: nn.Module, optimizer=None) -> Any:
    """Load the newest complete checkpoint under ``path`` into ``model`` (and
    ``optimizer``), whatever world size and stage saved it, and return the
    ``extra`` saved with it; None (nothing loaded) when there is none: start fresh.

    Call it on every rank at the start of a training script, after building the
    model and optimizer; torchrun's ``--max-restarts`` then continues a job from
    its last checkpoint. ``path`` is the checkpoint that every save replaces, or a
    directory of checkpoints (one subdirectory each, any names): see [Note: resume]
    in checkpoint/resume.py. A newer checkpoint that is torn (an interrupted save,
    no manifest, a truncated or corrupt file) is skipped with a warning naming it;
    if checkpoints exist but none loads, raises :class:`CheckpointError`. Collective, as :func:`load_checkpoint`.
    """
    path = os.path.abspath(os.fspath(path))
    first: Optional[CheckpointError] = None
    for c in _choose(path):
        try:
            return load_checkpoint(c, model, optimizer)
        except CheckpointError as e:  # raised on every rank (the load's exchanges of outcomes)
            warnings.warn(f"zeroshard.resume: skipping {c}, it failed to load: {e}")
            first = first or e
    if first is not None:  # checkpoints exist but none loads (another model?): never start over them
        raise first
    return None
