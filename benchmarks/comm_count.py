"""What one training step sends, counted two ways on rank 0 (the step benchmark's).

By backend kind (``count_comm``'s first result): the profiler's events of the
backend ("gloo:all_reduce", "nccl:_all_gather_base", ...), so what the transport
actually ran; on gloo FSDP2's reduce-scatter runs as an all-reduce and
zeroshard's reduce-scatter and all-gather as sends and receives.

By process group (``count_comm``'s third result): every c10d operator the step
dispatched (the API-level collective: reduce_scatter, all_gather, all_reduce,
send, ...), seen by a TorchDispatchMode, with the process group it ran on. This
sees DDP's, FSDP2's and zeroshard's collectives alike (zeroshard's C++ calls the
same c10d operators), and names the group by its ranks: "world" (every rank),
"shard" (this rank's block of S consecutive ranks, as torchrun numbers them node
by node: inside one node), "replicate" (the ranks at this rank's offset in every
block: across nodes, the slow link) or the ranks themselves.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

ELEMENT_BYTES = {
    "float": 4,
    "double": 8,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
}

# c10d operator -> the collective kind it is (the API's name)
_OP_KIND = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
    "barrier": "barrier",
}


def comm_kind(name):
    """The collective kind of a backend's profiler event ("gloo:all_reduce",
    "nccl:_all_gather_base", ...), or None for events that are not collectives."""
    backend, _, op = name.partition(":")
    if backend not in ("gloo", "nccl", "xccl", "ucc", "mpi") or not op:
        return None
    for kind in ("all_reduce", "allreduce", "reduce_scatter", "all_gather", "allgather", "broadcast"):
        if kind in op:
            return kind.replace("allreduce", "all_reduce").replace("allgather", "all_gather")
    return op


def group_role(ranks, rank: int, world: int, shard_size: Optional[int]) -> str:
    """A process group's name in the report, from its ranks (see the module's doc)."""
    ranks = sorted(ranks)
    if ranks == list(range(world)):
        return "world"
    if shard_size and ranks == list(range(rank - rank % shard_size, rank - rank % shard_size + shard_size)):
        return "shard"
    if shard_size and ranks == list(range(rank % shard_size, world, shard_size)):
        return "replicate"
    return "ranks " + ",".join(map(str, ranks))


def _tensor_bytes(arg) -> int:
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    if isinstance(arg, (list, tuple)):
        return sum(_tensor_bytes(a) for a in arg)
    return 0


class GroupCount(TorchDispatchMode):
    """Counts the c10d operators dispatched while active: {group: {"size": ranks in it,
    "sent": ring-model bytes this rank sends on it, kind: {calls, bytes}}}. A
    collective's bytes are its largest tensor argument's (all-reduce: the tensor;
    all-gather: the gathered output; reduce-scatter: the input; send/recv: the
    message); "sent" applies the ring model with the group's own size n (all-reduce
    2(n-1)/n of its bytes, other collectives (n-1)/n, a send its bytes, a receive 0)."""

    def __init__(self, world: int, shard_size: Optional[int]):
        super().__init__()
        self.world, self.shard_size, self.rank = world, shard_size, dist.get_rank()
        self.groups: Dict[str, Dict[str, Dict[str, int]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func._opname in _OP_KIND:
            pg = next(
                (
                    dist.ProcessGroup.unbox(a)
                    for a in args
                    if isinstance(a, torch.ScriptObject) and a._type().qualified_name().endswith("ProcessGroup")
                ),
                None,
            )
            ranks = dist.get_process_group_ranks(pg) if pg is not None else []
            role = group_role(ranks, self.rank, self.world, self.shard_size) if ranks else "?"
            g = self.groups.setdefault(role, {"size": len(ranks), "sent": 0.0})
            kind, n, size = _OP_KIND[func._opname], max(1, len(ranks)), max([_tensor_bytes(a) for a in args] or [0])
            k = g.setdefault(kind, {"calls": 0, "bytes": 0})
            k["calls"] += 1
            k["bytes"] += size
            g["sent"] += (
                size
                if kind == "send"
                else 0
                if kind in ("recv", "barrier")
                else size * (2 if kind == "all_reduce" else 1) * (n - 1) / n
            )
        return func(*args, **(kwargs or {}))


def count_comm(step, world, shard_size=None):
    """Runs ``step`` once under the profiler and a GroupCount; returns ({kind: {calls,
    bytes}} from the backend's events, the ring-model bytes this rank sends (None when
    an element size is unknown), {group: {kind: {calls, bytes}}} from the c10d operators)."""
    from torch.profiler import ProfilerActivity, profile

    with (
        profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof,
        GroupCount(world, shard_size) as by_group,
    ):
        step()
    kinds, sent = {}, 0.0
    for e in prof.events():
        kind = comm_kind(e.name)
        if kind is None:
            continue
        size = 0
        for shape, dtype in zip(e.input_shapes, e.input_dtypes):
            if not shape:
                continue
            if dtype not in ELEMENT_BYTES:
                sent = None
                continue
            size += ELEMENT_BYTES[dtype] * int(torch.Size(shape).numel())
        if kind == "all_gather":
            size *= world  # the backend event's input is this rank's chunk
        k = kinds.setdefault(kind, {"calls": 0, "bytes": 0})
        k["calls"] += 1
        k["bytes"] += size
        if sent is not None:  # a send is its own bytes; a receive sends nothing
            sent += (
                size
                if kind == "send"
                else 0
                if kind == "recv"
                else size * (2 if kind == "all_reduce" else 1) * (world - 1) / world
            )
    return kinds, sent, by_group.groups


def format_groups(groups) -> str:
    """One line per group: "shard (2 ranks): sends 1.20 MB | reduce_scatter 4x 2.40 MB, ..."
    (MB = 2**20 bytes)."""
    return "\n".join(
        f"  {name} ({g['size']} ranks): sends {g['sent'] / 2**20:.2f} MB | "
        + ", ".join(
            f"{kind} {v['calls']}x {v['bytes'] / 2**20:.2f} MB" for kind, v in sorted(g.items()) if isinstance(v, dict)
        )
        for name, g in sorted(groups.items())
    )
