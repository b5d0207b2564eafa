"""Which share of a rank's optimizer state is offloaded, and where to: the checked
offload arguments (``Offload``) and the choice of whole parameters or units.

[Note: offload] A policy the shard sources and the update rule consult, not a
branch inside them:
* Choosing. ``offload_fraction`` f of this rank's shard is offloaded in whole
  parameters (ZeRO-1/2) or whole units (ZeRO-3), taken in the order backward
  reduces them, as many as bring the offloaded elements closest to f of the
  shard (f > 0 offloads at least one; f = 1 all). ``memory_report()`` says
  exactly how many bytes went where. (Megatron's offload_fraction splits by
  parameter too; DeepSpeed's ratio by sub-group.)
* Storage. ``Storage.zeros(placement, n)``: DEVICE: the parameters' device;
  HOST: host memory (pinned when the parameters are on CUDA); DISK: a view of
  one file per rank under ``offload_dir``, allocated in full up front
  (posix_fallocate: a full disk is an error at construction, never a crash
  mid-step) and mapped shared, so state dicts and checkpoints read and write
  it like any tensor, one region at a time, through the page cache; the
  streamed step reads and writes it by O_DIRECT through the file's I/O engine
  ([Note: I/O engine] in csrc/io_engine.h), never through the mapping. The
  file is deleted when the optimizer is.
* Stepping. A segment is *streamed* when its state is on disk, or in host
  memory while its gradients are on CUDA; the update rule runs the others as
  before. ``Streamer.update`` steps streamed ranges in windows (at most
  ZEROSHARD_OFFLOAD_WINDOW_MB for both windows' tensors together, and at
  most a quarter of what one call steps): while window k is updated by
  zeroshard's CPU AdamW kernel (multi-threaded), two I/O threads read window
  k+1's state from the file into the other buffer and write window k-1's
  back (double buffering; a window's tensors in flight together, each placed
  congruent with its bytes in the file), so host memory holds two windows,
  not the shard; a file deleted or truncated under the job is an error
  naming it;
  only the tensors that are staged (on disk or on the device) get a buffer. Gradients
  come from host copies made during backward ([Note: offloaded gradients]); a
  gradient still on the device is copied per window; an fp32 parameter on CUDA (ZeRO-3's
  unit shard) is copied in and back; a low-precision parameter on CUDA is
  written from the updated fp32 master.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch


class Placement(enum.Enum):
    """Where a state shard lives."""

    DEVICE = "device"  # with the parameters (no offload)
    HOST = "host"  # host memory: offload="cpu"
    DISK = "disk"  # a file under offload_dir: offload="nvme"


def checked_fraction(value, what: str) -> float:
    """``value`` as a share in [0, 1]; ``what`` names the argument in the error."""
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number in [0, 1], got {value!r}") from None
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(
            f"{what} must be in [0, 1] (the share of this rank's shard whose state is offloaded), got {value!r}"
        )
    return fraction


KINDS = {None: Placement.DEVICE, "cpu": Placement.HOST, "nvme": Placement.DISK}


@dataclass(frozen=True, kw_only=True)
class Offload:
    """Where state leaves the accelerator for: an offload policy ([Note: offload]).

    Args:
        optimizer: where the optimizer's state (exp_avg, exp_avg_sq, and the fp32
            master copies at stages 1/2) lives: None (with the parameters),
            ``"cpu"`` (host memory, pinned on CUDA) or ``"nvme"`` (a file per rank
            under ``directory``, read and written by O_DIRECT). ShardedOptimizer's.
        params: ZeRO-3 only (FullyShard's): None, or ``"cpu"`` to keep the fp32
            parameter shards and gradient shards in host memory, as FSDP2's
            ``CPUOffloadPolicy`` ([Note: offload params]); the optimizer's state of
            those units then lives in host memory at least.
        directory: the directory of the ``"nvme"`` files (a fast local disk).
        fraction: the share of this rank's optimizer state offloaded, 0 to 1
            (whole parameters or units, in the order backward reduces them).
    """

    optimizer: Optional[str] = None
    params: Optional[str] = None
    directory: Optional[str] = None
    fraction: float = 1.0

    def __post_init__(self):
        if self.optimizer not in KINDS:
            raise ValueError(f"Offload(optimizer=...) must be None, 'cpu' or 'nvme', got {self.optimizer!r}")
        if self.params not in (None, "cpu", "nvme"):
            raise ValueError(f"Offload(params=...) must be None or 'cpu', got {self.params!r}")
        if self.params == "nvme":
            raise NotImplementedError(
                "Offload(params='nvme'): parameter shards on disk are not supported yet; "
                "params='cpu' keeps them in host memory, and optimizer='nvme' puts the "
                "optimizer's state (12 of its 16 bytes a parameter) on disk"
            )
        object.__setattr__(self, "fraction", checked_fraction(self.fraction, "Offload(fraction=...)"))
        if self.optimizer == "nvme":
            if self.directory is None:
                raise ValueError(
                    "offload of the optimizer to 'nvme' needs a directory on a fast local disk for "
                    "the optimizer-state files (one per rank): Offload(optimizer='nvme', directory=...)"
                )
            object.__setattr__(self, "directory", str(self.directory))
            check_directory(self.directory)
        elif self.directory is not None:
            raise ValueError(
                f"Offload(directory={self.directory!r}) is only used with optimizer='nvme' "
                f"(got optimizer={self.optimizer!r})"
            )

    @property
    def placement(self) -> Placement:
        """Where the offloaded share of the optimizer's state goes."""
        return KINDS[self.optimizer]

    @property
    def active(self) -> bool:
        return self.placement is not Placement.DEVICE and self.fraction > 0


NO_OFFLOAD = Offload()


def parse_offload(offload, offload_dir, offload_fraction, optimizer_class=None) -> Offload:
    """ShardedOptimizer's offload, from its loose arguments (``offload`` a string, as before the
    policy) or a policy (``offload`` an ``Offload``; then the loose ones are None); ``optimizer_class``:
    the torch optimizer asked for instead of the fused AdamW, if any. See [Note: offload]."""
    if isinstance(offload, Offload):
        policy = offload
    else:
        if offload not in KINDS:
            raise ValueError(f"offload must be None, 'cpu' or 'nvme', got {offload!r} (or a zeroshard.Offload policy)")
        if offload == "nvme" and offload_dir is None:
            raise ValueError(
                "offload='nvme' needs offload_dir=<a directory on a fast local disk> for the "
                "optimizer-state files (one per rank)"
            )
        if offload != "nvme" and offload_dir is not None:
            raise ValueError(f"offload_dir={offload_dir!r} is only used with offload='nvme' (got offload={offload!r})")
        fraction = 1.0 if offload_fraction is None else checked_fraction(offload_fraction, "offload_fraction")
        policy = Offload(optimizer=offload, directory=offload_dir, fraction=fraction)
    if policy.params is not None:
        raise ValueError(
            f"Offload(params={policy.params!r}) is FullyShard's: parameter shards are the model's; "
            "pass it to zeroshard.FullyShard(offload=...), and the optimizer's to ShardedOptimizer"
        )
    if policy.optimizer is not None and optimizer_class is not None:
        raise ValueError(
            f"offload={policy.optimizer!r} steps the offloaded state with zeroshard's fused AdamW; "
            f"optimizer_class={optimizer_class.__name__} keeps its own state on the parameters' "
            "device: drop offload or optimizer_class"
        )
    return policy


def check_directory(directory: str) -> None:
    if not os.path.isdir(directory):
        raise ValueError(
            f"offload_dir {directory!r} does not exist or is not a directory; create it on a fast local disk"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"offload_dir {directory!r} is not writable by this process; pick a directory it can write")


def choose(sizes: Sequence[int], fraction: float) -> int:
    """How many of ``sizes`` (in order) to offload: the prefix whose sum comes
    closest to ``fraction`` of the total (ties: the larger); at least one when
    ``fraction`` > 0, all when it is 1."""
    total = sum(sizes)
    if fraction <= 0 or not sizes:
        return 0
    if fraction >= 1:
        return len(sizes)
    target, best, best_err, acc = fraction * total, 1, None, 0
    for k, n in enumerate(sizes, 1):
        acc += n
        err = abs(acc - target)
        if best_err is None or err <= best_err:
            best, best_err = k, err
        if acc >= target:
            break
    return best


def offloaded_params(params: List[torch.Tensor], trainable: List[int], offload: Offload) -> set:
    """ZeRO-1/2: the trainable parameters whose state is offloaded, whole ones in the
    order backward reduces them (the reverse of ``trainable``)."""
    order = list(reversed(trainable))
    return set(order[: choose([params[i].numel() for i in order], offload.fraction)] if offload.active else ())
