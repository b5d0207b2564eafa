"""Collectives and process groups: the flat-buffer reduce-scatter, all-gather and
all-reduce of the C++ core over a torch.distributed group (``collectives``), the
flight record of every collective issued (``flight``), the watchdog's bounded
waits and cross-rank diagnosis (``watchdog``), hybrid sharding's groups
(``mesh``), and the default process group that torchrun's restarts bring up
(``launch``: ``init_distributed``), and a process group whose collectives do
nothing, for rehearsing rank r of N in one process (``noop``: ``noop_world``).

May import: ``native``. Every other part issues its collectives through the
names below.
"""

from .collectives import (
    CommHandle,
    all_gather,
    all_gather_object,
    all_reduce,
    broadcast_bytes,
    check_in,
    group_name,
    on_rank,
    reduce_scatter,
    reduce_scatter_scratch_bytes,
)
from .noop import noop_world

__all__ = [
    "CommHandle",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "broadcast_bytes",
    "check_in",
    "group_name",
    "noop_world",
    "on_rank",
    "reduce_scatter",
    "reduce_scatter_scratch_bytes",
]
