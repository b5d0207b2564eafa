"""Device-to-host copies of reduced gradients during backward.

[Note: offloaded gradients] The CPU steps offloaded state from host copies of
the gradients, made as backward reduces them rather than in step():
* ZeRO-1/2: a buffer whose state the CPU steps keeps a pinned *mirror* of
  this rank's reduced gradient shard. As each bucket is folded into the shard
  its range is copied to the mirror (``HostCopies``, on a side stream); the
  end of backward waits for the copies. The device shard stays the gradient
  (backward accumulates into it); the step reads the mirror, and what torch's
  utilities do to ``p.grad`` afterwards (clip, GradScaler's unscale) is done
  to both (``Segment.grad_views``).
* ZeRO-3: a unit the CPU steps keeps its gradient shard itself in pinned host
  memory (``Unit.grad_to_host``), as offload_params does: each reduced chunk
  is divided on the device and copied there as the unit is reduced. The
  per-step statistics' squared norms of its pieces are taken then, on the
  device (``GradShard.sumsq``), not over host memory after the backward.
``memory_report()`` counts both as host bytes.
"""

from __future__ import annotations

import torch


class HostCopies:
    """Device-to-host copies of reduced gradients ([Note: offloaded gradients]), on one
    stream per source. The stream buys the overlap: the copy engine moves each
    gradient while backward's kernels keep the compute stream busy, instead of
    the copies queuing between them. Each copy waits (on the device) for the
    compute stream's work so far, which produced the gradient; ``wait()`` at the
    end of backward blocks the host until every copy has landed."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pending = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (host) := ``src``, asynchronously on CUDA; ``src`` must not be written
        before ``wait()`` (a freed ``src`` is kept until the copy is done)."""
        if self.stream is None:
            dst.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.stream)
        self.pending = True

    def wait(self) -> None:
        if self.pending:
            self.stream.synchronize()
            self.pending = False
