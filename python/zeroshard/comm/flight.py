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
difference is where they took different branches. A collective that hangs or
fails raises with every rank's records compared (see [Note: watchdog] in
comm/watchdog.py).
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
_issued = 0  # collectives this rank issued since the process began


@dataclass
class Record:
    seq: int  # n-th zeroshard collective on this process group
    group: str  # the process group's name
    kind: str  # reduce_scatter / all_gather / all_reduce / all_gather_object
    what: str  # what it serves
    numel: int  # elements of the tensor it moves (the input; all_gather_object: bytes)
    dtype: str
    start: float  # time.time() when issued
    end: Optional[float] = None  # when a wait() or completed() saw it done


def start(kind: str, group: str, what: str, t: Optional[torch.Tensor], numel: Optional[int] = None) -> Record:
    global _issued
    _issued += 1
    _seq[group] += 1
    rec = Record(
        _seq[group],
        group,
        kind,
        what,
        t.numel() if t is not None else int(numel or 0),
        str(t.dtype).replace("torch.", "") if t is not None else "bytes",
        time.time(),
    )
    _ring.append(rec)
    return rec


class CollectiveError(RuntimeError):
    """A collective zeroshard issued failed in the transport; the message names it,
    what every rank last did, and which ranks stopped answering."""


def recent(n: int) -> List[dict]:
    """This rank's last ``n`` records, oldest first, as dicts."""
    return [dataclasses.asdict(r) for r in list(_ring)[-n:]]


def last_completed() -> float:
    """When the last collective this rank saw complete was issued (0 if none):
    every rank of its group had issued it too, so whatever stopped a rank
    before then is over."""
    return max((r.start for r in _ring if r.end is not None), default=0.0)


def issued() -> int:
    """How many collectives this rank has issued through zeroshard.comm (the last record
    of ``flight_record()`` is the issued()-th): a probe that notes it beside its own
    observations places them among the collectives."""
    return _issued


def flight_record() -> List[dict]:
    """This rank's last collectives, oldest first, as dicts (see [Note: flight record])."""
    return [dataclasses.asdict(r) for r in _ring]
