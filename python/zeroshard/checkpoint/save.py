"""Saving a checkpoint: take what this rank writes, then prepare, write and
commit, each step ending in an exchange of outcomes among the ranks; inline,
or in a thread (``background=True``). See [Note: checkpoint format] in
checkpoint/api.py.

[Note: background save]
``save_checkpoint(..., background=True)`` copies what this rank writes (its
pieces into host memory, pinned where they live on a GPU, and the pickled
``extra``) and returns a ``concurrent.futures.Future``. A thread then
prepares, writes, fsyncs and commits exactly as a blocking save does, so
the checkpoint appears complete or not at all, and ``result()`` returns
once it is durable (or raises what failed, on every rank). Training goes on
meanwhile and may change the originals: the copy is the state at the call.

The thread's exchanges of outcomes run over a gloo group of the same ranks
kept for checkpoints (made by the ranks' first background save, which is
collective), never over the training's group, so they cannot interleave
with the training's collectives. One save is in flight per process: the
next ``save_checkpoint``, ``load_checkpoint`` and ``export_full_state_dict``
wait for it first, and the process's exit waits for it (the thread is not a
daemon). Call ``result()`` before ``destroy_process_group()``: the thread
needs its group. The cost: host memory for one copy of what this rank
writes, held until the write ends, and the write's CPU time (checksums,
copies into the page cache) beside the training's.
"""

from __future__ import annotations

import concurrent.futures
import glob
import io
import os
import pickle
import shutil
import threading
import uuid
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import files
from .files import CheckpointError
from .holdings import Holdings
from .peers import Peers


@dataclass
class Taken:
    """What this rank writes, taken at the call: its pieces and the pickled
    ``extra``, or why taking them failed (raised in the first exchange, so every
    rank hears of it)."""

    pieces: List[Tuple[str, int, torch.Tensor]] = field(default_factory=list)  # (key, start, 1-D values)
    extra: Optional[bytes] = None
    error: Optional[Exception] = None

    @staticmethod
    def of(h: Holdings, extra: Any, copy: bool) -> "Taken":
        """``copy``: copies (host memory, pinned for GPU pieces) that training may not
        change; otherwise the live tensors, read while the save blocks."""
        taken = Taken()
        try:
            if h.replica_rank != 0:  # hybrid sharding: the first shard group writes
                return taken
            mine = [p for p in h.pieces if (not p.replicated or h.rank == 0) and p.data.numel()]
            for p in mine:
                t = p.data
                if copy:
                    t = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda).copy_(t, non_blocking=True)
                taken.pieces.append((p.key, p.start, t))
            if copy and any(p.data.is_cuda for p in mine):
                torch.cuda.synchronize()  # the copies landed before the originals may change
            if extra is not None:
                buf = io.BytesIO()
                torch.save(extra, buf)
                taken.extra = buf.getvalue()
        except Exception as e:  # noqa: BLE001 - reported in the first exchange
            taken.error = e
        return taken


def save(h: Holdings, path: str, extra: Any, sync: bool, background: bool) -> Optional[concurrent.futures.Future]:
    """Save ``h`` to ``path``; with ``background`` return a Future at once (see
    [Note: background save]). Hybrid sharding: every rank of every replica takes
    part in the exchanges (the replicas learn the outcome); the first writes."""
    group = h.every if h.replicas > 1 else h.group
    taken = Taken.of(h, extra, copy=background)
    if not background:
        _save(h, Peers(group), path, taken, sync)
        return None
    peers = Peers(_checkpoint_group(group))
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_running_or_notify_cancel()  # a collective save cannot be cancelled

    def run():
        try:
            _yield_cpu()
            _save(h, peers, path, taken, sync)
            done.set_result(None)
        except BaseException as e:  # noqa: BLE001 - handed to result(), and said here
            gone = peers.group is not None and not dist.is_initialized()
            warnings.warn(
                f"zeroshard: the background save of {path} failed ({type(e).__name__}: {e}); "
                f"{path} still holds the checkpoint before it, if there was one"
                + (
                    "; the process group was destroyed before the save ended: call result() on "
                    "the Future save_checkpoint returned before destroy_process_group()"
                    if gone
                    else ""
                ),
                RuntimeWarning,
            )
            done.set_exception(e)

    thread = threading.Thread(target=run, name="zeroshard-checkpoint-save")
    _in_flight.append(thread)
    thread.start()
    return done


_in_flight: List[threading.Thread] = []
_groups: Dict[Tuple[int, ...], Tuple[Any, dist.ProcessGroup]] = {}  # ranks -> (WORLD when made, group)


NICE = 19  # the writer thread's niceness: training's threads come first on a shared core


def _yield_cpu():
    """Lower this thread's CPU priority (Linux: a thread id names one thread), so the
    write takes the cores training leaves idle instead of slowing its steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):  # elsewhere the write runs at training's priority
        pass


def wait() -> None:
    """Wait for this process's background save, if one is writing."""
    while _in_flight:
        _in_flight.pop().join()


def _checkpoint_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """A gloo group of ``group``'s ranks for background saves' exchanges, made once
    (collective over those ranks) per process group initialisation."""
    if group is None:
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    made = _groups.get(ranks)
    if made is None or made[0] is not dist.group.WORLD:
        made = _groups[ranks] = (
            dist.group.WORLD,
            dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True),
        )
    return made[1]


def _save(h: Holdings, peers: Peers, path: str, taken: Taken, sync: bool) -> None:
    commits = h.rank == 0 and h.replica_rank == 0

    def prepare():
        if taken.error is not None:
            raise taken.error
        return _prepare(path) if commits else None

    tmp = next(t for t in peers.run(prepare, gather=True) if t is not None)
    try:
        peers.run(lambda: _write(h, tmp, taken, sync) if h.replica_rank == 0 else None)
        peers.run(lambda: _commit(h, tmp, path, _indexes(tmp, h.world), taken, sync) if commits else None)
    except BaseException:
        if commits and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _prepare(path: str) -> str:
    """Refuse a path that is not a checkpoint, drop stale partial saves, make the
    partial directory; returns its path."""
    parent, name = os.path.split(path)
    _wait_discards()
    os.makedirs(parent, exist_ok=True)
    if os.path.lexists(path) and not (
        os.path.isdir(path) and (os.path.exists(os.path.join(path, files.MANIFEST)) or not os.listdir(path))
    ):
        raise CheckpointError(
            f"{path} exists and is not a zeroshard checkpoint; refusing to replace it "
            "(choose another path or remove it yourself)"
        )
    for stale in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.partial-*")):
        shutil.rmtree(stale, ignore_errors=True)  # an earlier save that never finished
    tmp = os.path.join(parent, f".{name}.partial-{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp)
    return tmp


def _write(h: Holdings, tmp: str, taken: Taken, sync: bool):
    """This rank's files in ``tmp``, and its index for the committer: see ``_indexes``."""
    fname, entries, listing = f"rank{h.rank}.safetensors", [], {}
    if taken.pieces:  # (a rank of a replicated model owns nothing and writes no file)
        items = [(f"{key}@{start}", t.dtype, (t.numel(),), lambda t=t: t) for key, start, t in taken.pieces]
        crc, size, placed = files.write_safetensors(os.path.join(tmp, fname), items, sync)
        entries = [
            (key, [fname, off, start, t.numel(), crcs]) for (key, start, t), (off, crcs) in zip(taken.pieces, placed)
        ]
        listing[fname] = {"size": size, "crc32": crc}
    if taken.extra is not None:
        files.write_bytes(os.path.join(tmp, f"extra{h.rank}.pt"), taken.extra, sync)
        listing[f"extra{h.rank}.pt"] = {"size": len(taken.extra), "crc32": zlib.crc32(taken.extra)}
    with open(os.path.join(tmp, f"{INDEX}{h.rank}"), "wb") as f:
        pickle.dump((entries, listing, dict(h.local_specs), h.groups), f)


INDEX = "index-of-rank"  # (a save's own file, read by the committer and deleted before the commit)


def _indexes(tmp: str, world: int) -> list:
    """Each writing rank's (manifest entries, files, the tensors it alone holds (whole-tensor
    states, its experts'), its param groups), from
    the index files in ``tmp``, which are then deleted. The writers leave them there instead of
    sending them to the committer: an exchange would hand every rank every rank's entries,
    bytes growing as the square of the world size; here only the committer reads them."""
    out = []
    for r in range(world):
        name = os.path.join(tmp, f"{INDEX}{r}")
        with open(name, "rb") as f:
            out.append(pickle.load(f))
        os.remove(name)
    return out


def _commit(h: Holdings, tmp: str, path: str, written: list, taken: Taken, sync: bool):
    """The committer: write the manifest, then make ``tmp`` the checkpoint at ``path`` atomically."""
    parent, name = os.path.split(path)
    specs = dict(h.specs)
    for _, _, local, _ in written:  # what some ranks alone hold (whole-tensor states, experts)
        specs.update(local)
    tensors = {
        k: {
            "shape": list(s.shape),
            "dtype": files.dtype_name(s.dtype),
            "model_dtype": files.dtype_name(s.model_dtype),
            "step": s.step,
            "entries": [],
        }
        for k, s in specs.items()
    }
    listing = {}
    for entries, fl, _, _ in written:
        listing.update(fl)
        for key, e in entries:
            tensors[key]["entries"].append(e)
    for t in tensors.values():
        t["entries"].sort(key=lambda e: e[2])
    body = {
        "world_size": h.world,
        "stage": h.stage,
        "block_bytes": files.BLOCK,
        "tensors": tensors,
        "aliases": h.aliases,
        "param_groups": _merged_groups([w[3] for w in written]),
        "files": listing,
        "extra": taken.extra is not None,
        "torch_version": torch.__version__,
    }
    files.write_bytes(os.path.join(tmp, files.MANIFEST), files.manifest_bytes(body), sync)
    files.fsync_dir(tmp, sync)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif files.exchange(tmp, path):
        _discard(tmp)  # tmp now holds the previous checkpoint
    else:
        old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:12]}")
        os.rename(path, old)  # a crash here: load_checkpoint finds `old`
        os.rename(tmp, path)
        files.fsync_dir(parent, sync)
        shutil.rmtree(old)
    files.fsync_dir(parent, sync)


def _merged_groups(every: list) -> Optional[list]:
    """The param groups of the manifest: each rank's lists the names of its parameters, the
    same on every rank but for the experts' ([Note: expert checkpoints] in
    checkpoint/parallel.py); each group lists every rank's, in rank order, once."""
    if every[0] is None:
        return None
    out = [{"params": list(g["params"]), "hyper": g["hyper"]} for g in every[0]]
    for theirs in every[1:]:
        for g, t in zip(out, theirs or ()):
            seen = set(g["params"])
            g["params"] += [n for n in t["params"] if n not in seen]
    return out


_discards: List[threading.Thread] = []  # deleting replaced checkpoints (see [Note: checkpoint format])


def _discard(path: str):
    """Delete the replaced checkpoint ``path`` in a thread (not a daemon: the process's
    exit waits for it)."""

    def discard():
        _yield_cpu()
        shutil.rmtree(path, ignore_errors=True)

    t = threading.Thread(target=discard, name="zeroshard-checkpoint-discard")
    t.start()
    _discards.append(t)


def _wait_discards():
    while _discards:
        _discards.pop().join()
