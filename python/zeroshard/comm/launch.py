"""Creating the default process group so that torchrun's restarts come up
(``init_distributed``).

[Note: restarts]
Under ``torchrun --max-restarts N`` (torch 2.4 on, the c10d rendezvous that
``--standalone`` uses) the agent creates one TCPStore server for the workers at
the first rendezvous and hands every later attempt the same MASTER_ADDR and
MASTER_PORT (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py,
``next_rendezvous``: the ``_shared_tcp_store_server`` is built only while
``_bootstrap_store_info`` is None). The workers join it as clients
(``TORCHELASTIC_USE_AGENT_STORE=True``: rendezvous.py, ``_create_c10d_store``,
whose comment "we create a new TCPStore for every retry so no need to add
prefix" no longer holds), and ``init_process_group`` prefixes the store with
names that are the same in every attempt: ``default_pg/`` + group name ``0/`` +
device ``cpu/`` or ``cuda/`` (distributed_c10d.py, ``init_process_group`` and
``_new_process_group_helper``). So the keys a rank of the dead attempt
published (gloo: each rank's listening address; NCCL: rank 0's unique id) are
still there, and a restarted rank that reads them before its peer has
overwritten them connects to the dead process: gloo's ``connectFullMesh``
fails with "Connection refused, remote=<a port of the dead attempt>"; NCCL
waits on or fails with a stale ``ncclUniqueId`` (pytorch issue 167288). It
takes ranks that reach ``init_process_group`` a moment apart, which any import
or setup of different length on different ranks gives.

``init_distributed`` keys the group's store by the attempt: the agent's store
under the prefix ``zeroshard/<run id>/attempt<TORCHELASTIC_RESTART_COUNT>/``,
so no key of an earlier attempt is ever read. Every rank of a torchrun job on
one node, and every node whose agent restarted for a failure, agree on the
count. The agent does not count a restart for a membership change (a node
joining or a failed node's peers restarting because of the new rendezvous
round), so with several nodes the counts can differ: launch those with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which has torch start a new store,
on a new port, for every round, and then this prefix is not needed (no agent
store is used: ``TORCHELASTIC_USE_AGENT_STORE`` is False).
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def attempt_prefix() -> Optional[str]:
    """The store prefix of this torchrun attempt, or None when there is no agent store
    to outlive an attempt (not under torchrun, or a fresh store every round)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"zeroshard/{run_id}/attempt{int(os.environ.get('TORCHELASTIC_RESTART_COUNT', '0'))}/"


def default_backend() -> str:
    """``nccl`` where CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def check_gpus_per_rank(backend: str) -> None:
    """NCCL needs a GPU of its own for every rank of a node. torchrun starting more ranks
    on a node than it has GPUs otherwise fails later and less clearly: at
    ``set_device`` ("invalid device ordinal") or at the first collective ("Duplicate GPU
    detected"), once per rank."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "nccl" not in backend or not torch.cuda.is_available() or ranks <= torch.cuda.device_count():
        return
    raise RuntimeError(
        f"init_distributed({backend!r}): torchrun started {ranks} ranks on this node but it has "
        f"{torch.cuda.device_count()} GPU(s), and NCCL needs one GPU per rank; start at most "
        f"{torch.cuda.device_count()} per node (--nproc-per-node), or hide the GPUs (CUDA_VISIBLE_DEVICES=) "
        "to run every rank on the CPU with gloo"
    )


def init_distributed(
    backend: Optional[str] = None,
    *,
    timeout: Optional[datetime.timedelta] = None,
    device_id: Optional[torch.device] = None,
    **kwargs,
) -> dist.ProcessGroup:
    """Create the default process group, so that a job torchrun restarts comes up
    (``torch.distributed.init_process_group`` with ``init_method="env://"`` does
    not reliably: see [Note: restarts] in comm/launch.py).

    Reads what ``env://`` reads (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``). Under torchrun the process group's store is the agent's,
    under a prefix of this attempt; otherwise it is exactly
    ``init_process_group(backend, timeout=..., device_id=...)``. If a default
    group exists already, returns it and does nothing else.

    Args:
        backend: ``"nccl"``, ``"gloo"``, ``"cpu:gloo,cuda:nccl"``, ...; None:
            nccl when CUDA is available, else gloo.
        timeout: for the store and the group's collectives; None: 10 minutes
            (torch's default for nccl and gloo).
        device_id: as ``init_process_group``'s (binds the group to a GPU:
            e.g. ``torch.device("cuda", local_rank)``).
        **kwargs: passed on to ``init_process_group`` (``pg_options``, ...).
    Returns:
        the default process group (``torch.distributed.group.WORLD``).
    """
    if dist.is_initialized():
        return dist.group.WORLD
    backend = backend or default_backend()
    check_gpus_per_rank(backend)
    timeout = timeout or DEFAULT_TIMEOUT
    prefix = attempt_prefix()
    if prefix is None:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id, **kwargs)
        return dist.group.WORLD
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # the agent's store, as env:// would open it (a client: the agent hosts the server)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    store.set_timeout(timeout)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(prefix, store),
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=device_id,
        **kwargs,
    )
    return dist.group.WORLD
