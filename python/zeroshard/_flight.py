"""The flight record: every collective zeroshard issues on this rank.

[Note: flight record] Each collective that goes through zeroshard.comm gets
a ``Record``: its sequence number on its process group (the n-th collective
zeroshard issued there, the same n on every rank that issued the same
collectives), its kind, what it serves ("step 41, bucket 3 reduce-scatter",
"unit 'blocks.7' all-gather", "gradient statistics", ...), its size, and
when it started and completed (``end`` is None until a ``wait()`` or
``completed()`` saw it done). The last ``RING`` records are kept (a bounded
ring: always on, one small object per collective). ``zeroshard.flight_record()``
returns them, oldest first: when two ranks' records differ, the first
difference is where they took different branches. A collective that fails in
the transport (a peer died: gloo's "Connection reset by peer") raises
``CollectiveError`` naming the collective from its record.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass
from typing import List, Optional

import torch

RING = 4096

_ring: collections.deque = collections.deque(maxlen=RING)
_seq: collections.Counter = collections.Counter()


@dataclass
class Record:
    seq: int                 # n-th zeroshard collective on this process group
    group: str               # the process group's name
    kind: str                # reduce_scatter / all_gather / all_reduce / all_gather_object
    what: str                # what it serves
    numel: int               # elements of the tensor it moves (the input; all_gather_object: bytes)
    dtype: str
    start: float             # time.time() when issued
    end: Optional[float] = None   # when a wait() or completed() saw it done


def start(kind: str, group: str, what: str, t: Optional[torch.Tensor], numel: Optional[int] = None) -> Record:
    _seq[group] += 1
    rec = Record(_seq[group], group, kind, what, t.numel() if t is not None else int(numel or 0),
                 str(t.dtype).replace("torch.", "") if t is not None else "bytes", time.time())
    _ring.append(rec)
    return rec


class CollectiveError(RuntimeError):
    """A collective zeroshard issued failed in the transport; the message names it."""


def failed(rec: Record, err: BaseException) -> CollectiveError:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    return CollectiveError(
        f"[rank {rank}/{world}] collective #{rec.seq} on process group '{rec.group}' ({rec.kind} of "
        f"{rec.numel} {rec.dtype}: {rec.what or 'unlabelled'}) failed in the transport: {err}\n"
        "Another rank of the group stopped answering (it crashed, was killed, ran out of memory, or took "
        "another branch and waits elsewhere): read the other ranks' logs first. zeroshard.flight_record() "
        "lists this rank's collectives up to this one")


class Tracked:
    """A collective's handle that marks its record's end when it is seen done."""
    __slots__ = ("handle", "record")

    def __init__(self, handle, record: Record):
        self.handle, self.record = handle, record

    def wait(self):
        try:
            self.handle.wait()
        except RuntimeError as e:
            raise failed(self.record, e) from e
        if self.record.end is None:
            self.record.end = time.time()

    @property
    def waited(self) -> bool:
        return self.handle.waited

    def completed(self) -> bool:
        try:
            done = self.handle.completed()
        except RuntimeError as e:
            raise failed(self.record, e) from e
        if done and self.record.end is None:
            self.record.end = time.time()
        return done


def flight_record() -> List[dict]:
    """This rank's last collectives, oldest first, as dicts (see [Note: flight record])."""
    return [dataclasses.asdict(r) for r in _ring]
