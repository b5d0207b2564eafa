"""The two records a checkpoint is made of: a tensor (Spec) and this rank's element
range of it (Piece)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Spec:
    """One tensor of the checkpoint."""

    shape: tuple
    dtype: torch.dtype  # as stored
    model_dtype: torch.dtype  # the model's parameter dtype (export writes this by default)
    step: Optional[int] = None  # optimizer states: the parameter's step count


@dataclass
class Piece:
    """Elements start .. start+numel of a checkpoint tensor, held by this rank."""

    key: str
    start: int
    data: torch.Tensor  # 1-D; saved from, or loaded into
    replicated: bool  # every rank holds it: rank 0 writes it, every rank reads it
    writeback: Optional[torch.Tensor] = None  # load: copy data here afterwards (non-contiguous target)
