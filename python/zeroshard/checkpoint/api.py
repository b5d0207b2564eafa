"""Sharded checkpoints: save_checkpoint, load_checkpoint, export_full_state_dict.

[Note: checkpoint format]
A checkpoint is a directory:
* ``rank{r}.safetensors``, one per rank r of the saving process group: the
  pieces of parameters and optimizer states that rank owns. Each piece is a
  1-D safetensors tensor named ``{key}@{start}`` holding elements
  ``start .. start+numel`` of the flattened tensor ``key``. Keys are
  ``param:<name>``, ``buffer:<name>``, ``exp_avg:<name>`` and
  ``exp_avg_sq:<name>``, with the unwrapped model's names. Tensors that every
  rank holds whole (parameters nobody shards, buffers, plain AdamW state) are
  written by rank 0 only.
* ``extra{r}.pt``: ``torch.save`` of the ``extra`` object rank r passed (RNG
  states differ per rank, so each rank's is kept).
* ``manifest.json``, written last. It lists every tensor key with its global
  shape, its stored dtype and the model's dtype, and which byte range of
  which file holds which element range, with a CRC32 per 1 MiB block. It
  lists every file with its size and a CRC32 (of the safetensors header, or
  of the whole extra file). It also holds the param groups (hyperparameters,
  parameter names, step counts), the saving world size and stage, and a CRC32
  of itself.

Why the native format is not torch.distributed.checkpoint: DCP keeps no
checksums and commits no atomic rename, and describes a shard as a rectangular
chunk of a tensor where ours are flat element ranges cut at arbitrary points
(bucket and unit boundaries). A flat range is a few rectangles, so the same
pieces also go through DCP: [Note: DCP adapter] in checkpoint/dcp.py.

Files are written by a streaming writer of the safetensors format: a header,
then each piece's bytes straight from the shard (no copy on CPU; one piece at
a time from a GPU). The library's own writer needs every tensor in memory at
once, which would double a rank's memory. Any safetensors reader opens the
files.

Save: rank 0 makes ``.{name}.partial-{id}`` beside the target. Every rank
writes and fsyncs its files there (starting the kernel's writeback every
8 MB as it writes, so the disk works while later pieces are checksummed and
the fsync waits only for the tail; ``sync_files=False``: neither), then the
ranks exchange what they wrote. Rank 0 writes and fsyncs the manifest, then
makes the directory the checkpoint with one atomic rename (a new path), or
by atomically exchanging it
with the previous checkpoint (``renameat2(RENAME_EXCHANGE)``; filesystems
without it: two renames, and a load that finds the path missing uses the
``.{name}.old-*`` left between them). Only then is the old one deleted: after
an exchange, by a thread of rank 0 while training goes on (freeing the blocks
of fsynced files is a large part of a blocking save's time); the
next save, and the process's exit, wait for it. A crash before the rename
leaves only a ``.partial`` directory, which has no manifest, is never loaded,
and is removed by the next save beside it. The steps are in checkpoint/save.py;
``background=True`` runs them in a thread on a copy (see [Note: background
save] there).

Load: each rank reads only the blocks of the entries that overlap the element
ranges it owns under the new layout (any world size, any stage, or plain
torch), verifies each block's CRC, and copies the elements in. Every step
that could fail on one rank ends in an exchange of outcomes. So a bad file
raises on every rank, naming the file and tensor, instead of leaving the
other ranks waiting in a collective.
"""

from __future__ import annotations

import concurrent.futures
import glob
import io
import os
import types
import uuid
import warnings
import zlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from . import files
from .. import comm
from . import save
from .files import CheckpointError
from .holdings import Holdings, leave_out_frozen, optimizers_of
from .peers import Peers


# ------------------------------------------------------------------------ API
def save_checkpoint(
    path,
    model: nn.Module,
    optimizer=None,
    extra: Any = None,
    *,
    sync_files: bool = True,
    background: bool = False,
    exclude_frozen: bool = False,
) -> Optional[concurrent.futures.Future]:
    """Save ``model`` (and ``optimizer``) to the directory ``path``: every rank
    writes what it owns, concurrently, and the directory appears complete or not
    at all (see [Note: checkpoint format] in checkpoint/api.py).

    Collective over the model's (or optimizer's) process group: every rank
    must call it with the same ``path``, on a filesystem all ranks see. Works
    with FullyShard, ShardedOptimizer (any stage), and plain models with
    ``torch.optim.AdamW`` (with or without torch.distributed). ``extra`` (any
    picklable object, e.g. ``{"step": step, "rng": torch.get_rng_state()}``)
    is kept per rank and returned by ``load_checkpoint``. With hybrid sharding
    the first shard group writes (each shard once; its ranks' ``extra``) and
    the replicas wait for it. An existing
    checkpoint at ``path`` is replaced only once the new one is complete; an
    existing directory that is not a zeroshard checkpoint is never touched.

    ``sync_files`` (as torch.distributed.checkpoint's FileSystemWriter): fsync
    every file and directory before returning, so the checkpoint survives a
    crash of the machine, not only of the process. ``False`` leaves the
    writing back to the OS, as ``torch.save`` and DeepSpeed do: the commit is
    still atomic for the processes, but a power loss or kernel crash soon
    after may leave a checkpoint whose blocks fail their CRC when loaded (the
    load then names the file), with the previous one already deleted.

    ``background`` (as torch.distributed.checkpoint's ``async_save``): copy
    what this rank writes into host memory and return a
    ``concurrent.futures.Future`` at once; a thread writes, fsyncs (with
    ``sync_files``) and commits, and ``result()`` returns when the checkpoint
    is complete, or raises what failed. Training may go on meanwhile: the
    checkpoint holds the state at the call. The next save or load waits for
    it, and so does the process's exit; call ``result()`` before
    ``torch.distributed.destroy_process_group()``. It costs host memory for a
    copy of what this rank writes until the write ends (see [Note: background
    save] in checkpoint/save.py). Returns None without ``background``.

    ``exclude_frozen`` (DeepSpeed's ``exclude_frozen_parameters``): leave out the
    parameters that do not require grad (a LoRA run's base model); such a
    checkpoint loads with ``load_checkpoint(..., strict=False)``, which keeps the
    model's own values for them.
    """
    path = os.path.abspath(os.fspath(path))
    save.wait()  # one save in flight per process
    for opt in optimizers_of(optimizer):
        getattr(opt, "wait_params", lambda: None)()  # overlap_param_gather: complete parameters
    h = Holdings(model, optimizer, for_load=False)  # same outcome on every rank
    if exclude_frozen:
        leave_out_frozen(h, model)
    _check_in(h, "save_checkpoint()")
    return save.save(h, path, extra, sync_files, background)


def _check_in(h: Holdings, what: str) -> None:
    """Every rank of the checkpoint's group calls it ([Note: rank-0 code] in comm/collectives.py)."""
    if h.group is not None and h.world > 1:
        comm.check_in(
            what,
            types.SimpleNamespace(rank=h.rank, world_size=h.world),
            h.group,
            "A checkpoint is written by every rank together (each writes its shards); call it "
            "on every rank, not under `if rank == 0:`",
        )


def previous_of(path: str) -> List[str]:
    """The previous checkpoints a save replacing ``path`` left beside it when it was cut
    between its two renames ([Note: checkpoint format])."""
    parent, name = os.path.split(path)
    return glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.old-*"))


def find_checkpoint(path: str) -> str:
    """The checkpoint directory for ``path``: itself, or the previous checkpoint a
    save on a filesystem without atomic exchange left beside it when it was cut
    between its two renames."""
    if os.path.exists(path):
        return path
    old = [d for d in previous_of(path) if os.path.exists(os.path.join(d, files.MANIFEST))]
    if len(old) == 1:
        warnings.warn(
            f"{path} is missing but a save replacing it was interrupted; loading the previous "
            f"checkpoint from {old[0]} (rename it to {path} to keep it)"
        )
        return old[0]
    return path


def _check_match(h: Holdings, man: dict, path: str, with_optimizer: bool, elsewhere: set, strict: bool = True):
    """``elsewhere``: the experts' tensors other ranks hold ([Note: expert checkpoints])."""
    tensors, where = man["tensors"], f"the checkpoint {path}"
    if with_optimizer and man["param_groups"] is None:
        raise CheckpointError(f"{where} was saved without an optimizer; pass optimizer=None to load the model only")
    for key, s in {**h.specs, **h.local_specs}.items():
        t = tensors.get(key)
        if t is None and key.startswith(("exp_avg:", "exp_avg_sq:")):
            continue  # saved before that parameter had optimizer state: it starts at zero
        if t is None and not strict and key.startswith("param:"):
            continue  # (strict=False: saved without it, exclude_frozen; it keeps the model's value)
        if t is None:
            raise CheckpointError(f"{where} has no tensor '{key}'; it is a checkpoint of another model")
        if list(t["shape"]) != list(s.shape):
            raise CheckpointError(
                f"{where}: tensor '{key}' has shape {tuple(t['shape'])} but the model's is "
                f"{tuple(s.shape)}; it is a checkpoint of another model"
            )
    extra = [k for k in tensors if k.startswith(("param:", "buffer:")) and k not in h.specs and k not in elsewhere]
    if extra:
        raise CheckpointError(
            f"{where} has tensors the model lacks, e.g. '{extra[0]}' ({len(extra)} in all); "
            "it is a checkpoint of another model"
        )


def load_checkpoint(path, model: nn.Module, optimizer=None, *, strict: bool = True) -> Any:
    """Load a checkpoint saved by :func:`save_checkpoint` into ``model`` (and
    ``optimizer``), whatever world size and stage saved it; returns the ``extra``
    this rank saved (rank r < saved world size: its own; otherwise rank 0's; None
    if none was saved).

    Collective over the model's process group. Each rank reads only the blocks
    holding what it owns, verifying their checksums. A bad manifest, a
    checkpoint of another model, or a missing or truncated file raises a
    :class:`CheckpointError` on every rank, naming the file and tensor, before
    anything is modified; a corrupt block is found while reading, so the model
    then holds a mix of old and loaded values: load another checkpoint.
    ``strict=False``: parameters the checkpoint lacks (saved with
    ``exclude_frozen=True``) keep the model's values; a tensor the model lacks is
    still refused.
    """
    save.wait()  # a background save, maybe of this path
    path = find_checkpoint(os.path.abspath(os.fspath(path)))
    for opt in optimizers_of(optimizer):
        getattr(opt, "wait_params", lambda: None)()  # no all-gather may still write the parameters
    h = Holdings(model, optimizer, for_load=True)  # same outcome on every rank
    _check_in(h, "load_checkpoint()")
    peers = Peers(h.group)
    elsewhere = h.everyones_expert_keys()
    man = peers.run(lambda: files.read_manifest(path))
    peers.run(lambda: (_check_match(h, man, path, optimizer is not None, elsewhere, strict), h.adopt(man)))
    reader = files.CheckpointReader(path, man)
    files.stats["bytes_read"] = 0

    @torch.no_grad()
    def read():
        try:
            reader.prepare([(p.key, p.start, p.start + p.data.numel()) for p in h.pieces if p.key in man["tensors"]])
            for p in h.pieces:
                if p.key in man["tensors"]:
                    reader.read(p.key, p.start, p.data)
                elif strict or not p.key.startswith("param:"):
                    p.data.zero_()
            if not man["extra"]:
                return None
            fname = f"extra{h.rank if h.rank < man['world_size'] else 0}.pt"
            fpath, info = os.path.join(path, fname), man["files"].get(fname, {})
            if not os.path.exists(fpath):
                raise CheckpointError(f"{fpath} is missing (it holds the extra state); the checkpoint is incomplete")
            with open(fpath, "rb") as f:
                data = f.read()
            if len(data) != info.get("size") or zlib.crc32(data) != info.get("crc32"):
                raise CheckpointError(f"{fpath} fails its size or checksum (the file is corrupt)")
            return torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")
        finally:
            reader.close()

    extra = peers.run(read)
    with torch.no_grad():
        h.finish_load(man)
    return extra


def export_full_state_dict(path, out_file, dtype: Optional[torch.dtype] = None) -> None:
    """Write the full model state dict of a checkpoint as one safetensors file,
    loadable into the unwrapped model (``safetensors.torch.load_file`` then
    ``model.load_state_dict``), tied parameters under every name.

    Needs no process group: run it offline or from one rank while training.
    Parameters are written in the model's dtype, or ``dtype`` (floating ones);
    one tensor is in memory at a time. The file appears complete or not at all.
    """
    out_file = os.fspath(out_file)
    if not out_file.endswith(".safetensors"):
        raise ValueError(f"out_file {out_file!r}: export writes safetensors; give a name ending in .safetensors")
    man, reader, entries = _full_entries(path, dtype)
    items = [
        (name, dt, tuple(man["tensors"][key]["shape"]), lambda key=key, dt=dt: reader.full(key).to(dt))
        for name, key, dt in entries
    ]
    tmp = f"{out_file}.partial-{uuid.uuid4().hex[:12]}"
    try:
        files.write_safetensors(tmp, items)
        os.replace(tmp, out_file)
    finally:
        reader.close()
        if os.path.exists(tmp):
            os.remove(tmp)


def read_full_state_dict(
    path, dtype: Optional[torch.dtype] = None, *, tied: bool = True
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield a checkpoint's full model state dict as ``(name, tensor)`` pairs, one tensor
    read (and checksummed) at a time, under the unwrapped model's names (tied
    parameters under every name), on CPU.

    Needs no process group. Parameters come in the model's dtype, or ``dtype``
    (floating ones; ``torch.float32`` gives the fp32 master values); buffers in
    their own dtype. Memory: the tensors the caller keeps, plus the one being read.
    ``tied=False`` leaves out the second and later names of tied parameters (as
    ``save_pretrained`` does; ``from_pretrained`` ties them again).
    """
    _, reader, entries = _full_entries(path, dtype, tied)
    try:
        for name, key, dt in entries:
            yield name, reader.full(key).to(dt)
    finally:
        reader.close()


def full_state_dict_meta(path, dtype: Optional[torch.dtype] = None, *, tied: bool = True) -> Dict[str, torch.Tensor]:
    """What ``read_full_state_dict`` yields, as tensors on the ``meta`` device (names,
    shapes, dtypes, in the same order), read from the manifest alone: enough to plan
    files before any data is read."""
    man, reader, entries = _full_entries(path, dtype, tied)
    reader.close()
    return {name: torch.empty(man["tensors"][key]["shape"], dtype=dt, device="meta") for name, key, dt in entries}


def _full_entries(path, dtype: Optional[torch.dtype], tied: bool = True):
    """(manifest, an open reader, [(name, key, dtype)]) of a checkpoint's full model state
    dict, tied parameters under every name: what export and read_full_state_dict go over."""
    save.wait()
    path = find_checkpoint(os.path.abspath(os.fspath(path)))
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    man = files.read_manifest(path)

    def entry(name, key):
        dt = files.parse_dtype(man["tensors"][key]["model_dtype"])
        return name, key, dtype if key.startswith("param:") and dtype is not None and dt.is_floating_point else dt

    entries = [entry(key.split(":", 1)[1], key) for key in man["tensors"] if key.startswith(("param:", "buffer:"))]
    if tied:
        entries += [entry(alias, "param:" + canonical) for alias, canonical in man["aliases"].items()]
    return man, files.CheckpointReader(path, man), entries
