"""The exchange of outcomes that ends each step of a checkpoint save or load: every
rank learns whether any rank failed, and raises if one did."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist

from .. import comm
from .files import CheckpointError


@dataclass(frozen=True)
class Peers:
    """The ranks each step of a save or load exchanges its outcome with."""

    group: Optional[dist.ProcessGroup]  # None: one process, nothing to exchange

    def run(self, fn: Callable[[], Any], gather: bool = False):
        """Run fn here and exchange the outcomes; if any rank failed, raise on every
        rank (the failing rank's own exception there, its message elsewhere).
        Returns fn's result, or with ``gather`` every rank's results in rank order."""
        try:
            value, exc = fn(), None
            out = (None, value if gather else None)
        except Exception as e:  # noqa: BLE001 - every failure must reach every rank
            value, exc = None, e
            out = (f"{type(e).__name__}: {e}", None)
        everyone = [out]
        if self.group is not None and dist.get_world_size(self.group) > 1:
            everyone = comm.all_gather_object(out, group=self.group, what="checkpoint outcome exchange")
        if exc is not None:
            raise exc
        for r, (err, _) in enumerate(everyone):
            if err is not None:
                raise CheckpointError(f"rank {r} failed: {err}")
        return [v for _, v in everyone] if gather else value
