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

Why not torch.distributed.checkpoint: DCP describes a shard as a rectangular
chunk of a tensor. Our shards are flat element ranges cut at arbitrary points
(bucket and unit boundaries), which are not rectangles for 2-D tensors. DCP
also keeps no checksums and commits no atomic rename.

Files are written by a streaming writer of the safetensors format: a header,
then each piece's bytes straight from the shard (no copy on CPU; one piece at
a time from a GPU). The library's own writer needs every tensor in memory at
once, which would double a rank's memory. Any safetensors reader opens the
files.

Save: rank 0 makes ``.{name}.partial-{id}`` beside the target. Every rank
writes and fsyncs its files there, then the ranks exchange what they wrote.
Rank 0 writes and fsyncs the manifest, then makes the directory the
checkpoint with one atomic rename (a new path), or by atomically exchanging it
with the previous checkpoint (``renameat2(RENAME_EXCHANGE)``; filesystems
without it: two renames, and a load that finds the path missing uses the
``.{name}.old-*`` left between them). Only then is the old one deleted. A
crash before the rename leaves only a ``.partial`` directory, which has no
manifest and is never loaded.

Load: each rank reads only the blocks of the entries that overlap the element
ranges it owns under the new layout (any world size, any stage, or plain
torch), verifies each block's CRC, and copies the elements in. Every step
that could fail on one rank ends in an exchange of outcomes. So a bad file
raises on every rank, naming the file and tensor, instead of leaving the
other ranks waiting in a collective.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import io
import json
import os
import shutil
import struct
import uuid
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .fully_shard import FullyShard

FORMAT, VERSION = "zeroshard-checkpoint", 1
_BLOCK = 1 << 20          # bytes per CRC block (saves): a load reads whole blocks around the ranges it needs
_MANIFEST = "manifest.json"
_ST_DTYPE = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL"}
_SKIP_HYPER = ("params", "foreach", "fused", "capturable", "differentiable")
_stats = {"bytes_read": 0}   # of this process's last load_checkpoint (tests and benchmarks read it)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file and tensor."""


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the manifest")
    return dt


@dataclass
class _Spec:
    """One tensor of the checkpoint."""
    shape: tuple
    dtype: torch.dtype           # as stored
    model_dtype: torch.dtype     # the model's parameter dtype (export writes this by default)
    step: Optional[int] = None   # optimizer states: the parameter's step count


@dataclass
class _Piece:
    """Elements start .. start+numel of a checkpoint tensor, held by this rank."""
    key: str
    start: int
    data: torch.Tensor           # 1-D; saved from, or loaded into
    replicated: bool             # every rank holds it: rank 0 writes it, every rank reads it
    writeback: Optional[torch.Tensor] = None   # load: copy data here afterwards (non-contiguous target)


class _Holdings:
    """What this rank holds of a (model, optimizer) pair, by checkpoint key."""

    def __init__(self, model: nn.Module, optimizer, for_load: bool):
        from .sharded import ShardedOptimizer
        fs = model if isinstance(model, FullyShard) else None
        inner = model.module if fs is not None or isinstance(model, nn.parallel.DistributedDataParallel) else model
        sharded_opt = optimizer if isinstance(optimizer, ShardedOptimizer) else None
        if fs is not None:
            self.group = fs.process_group
        elif sharded_opt is not None:
            self.group = sharded_opt.process_group
        else:
            self.group = dist.group.WORLD if dist.is_initialized() else None
        self.world = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.stage = 3 if fs is not None else (sharded_opt.stage if sharded_opt is not None else 0)
        self.specs: Dict[str, _Spec] = {}
        self.pieces: List[_Piece] = []
        self.groups: Optional[list] = None
        self.aliases: Dict[str, str] = {}
        self._finish: List[Callable[[dict], None]] = []
        if fs is not None and fs._device.type == "meta":
            raise CheckpointError("this FullyShard keeps its shards on meta (device='meta'); it has no values "
                                  "to save or load")

        self.names: Dict[int, str] = {}    # id(parameter) -> canonical name
        for name, p in (fs if fs is not None else inner).named_parameters(remove_duplicate=False):
            if id(p) in self.names:
                self.aliases[name] = self.names[id(p)]
            else:
                self.names[id(p)] = name
        covered = set()
        if fs is not None:
            for u in fs._units:
                for q in u.params:
                    key = "param:" + q.names[0]
                    self.specs[key] = _Spec(tuple(q.shape), torch.float32, q.dtype)
                    if q.sharded.numel():
                        self.pieces.append(_Piece(key, q.tensor_offset, q.sharded.detach(), False))
                    covered.add(id(q.sharded))
            self._finish.append(lambda man: fs._invalidate())
        if sharded_opt is not None:
            self._sharded_optimizer(sharded_opt, covered)
        elif optimizer is not None:
            if fs is not None:
                raise CheckpointError("FullyShard parameters are updated by zeroshard.ShardedOptimizer; "
                                      f"got {type(optimizer).__name__}")
            self._torch_adamw(optimizer, for_load)
        for p in (inner.parameters() if fs is None else ()):
            if id(p) not in covered:
                name = self.names[id(p)]
                self.specs["param:" + name] = _Spec(tuple(p.shape), p.dtype, p.dtype)
                self._whole("param:" + name, p)
        for name, b in _persistent_buffers(inner):
            self.specs["buffer:" + name] = _Spec(tuple(b.shape), b.dtype, b.dtype)
            self._whole("buffer:" + name, b)

    def _name_of(self, p: torch.Tensor, i: int) -> str:
        name = self.names.get(id(p))
        if name is None:
            raise CheckpointError(f"optimizer parameter {i} (shape {tuple(p.shape)}) is not a parameter of the "
                                  "model; pass the model whose parameters the optimizer updates")
        return name

    def _whole(self, key: str, t: torch.Tensor):
        t = t.detach()
        if t.is_contiguous():
            self.pieces.append(_Piece(key, 0, t.view(-1), True))
        else:
            self.pieces.append(_Piece(key, 0, t.reshape(-1).clone(), True, writeback=t))

    def _groups(self, opt, group_names: List[List[str]]):
        """Record opt's param groups (hyperparameters and parameter names) for a
        save, and have a load restore the hyperparameters: each group takes those
        of the saved group holding its first parameter."""
        self.groups = []
        for g, names in zip(opt.param_groups, group_names):
            hyper = {}
            for k, v in g.items():
                if k in _SKIP_HYPER:
                    continue
                try:
                    json.dumps(v)
                except TypeError:
                    continue
                hyper[k] = v
            self.groups.append({"params": list(names), "hyper": hyper})

        def finish(man):
            where = {n: g["hyper"] for g in man["param_groups"] for n in g["params"]}
            for g, names in zip(opt.param_groups, group_names):
                saved = next((where[n] for n in names if n in where), None)
                for k, v in (saved or {}).items():
                    g[k] = tuple(v) if k == "betas" else v
        self._finish.append(finish)

    def _sharded_optimizer(self, opt, covered: set):
        names = [self._name_of(p, i) for i, p in enumerate(opt._params)]
        for i in opt._trainable:
            step = opt._steps[opt._group_of[i]]
            for kind in ("exp_avg", "exp_avg_sq"):
                self.specs[f"{kind}:{names[i]}"] = _Spec(tuple(opt._full_shapes[i]), torch.float32, torch.float32,
                                                          step)
        for reg in opt._regions:
            if reg.values is not None:
                for i, *_ in reg.frags:
                    p = opt._params[i]
                    self.specs["param:" + names[i]] = _Spec(tuple(p.shape), reg.values.dtype, p.dtype)
                    covered.add(id(p))
            for i, start, sl in reg.owned(self.rank):
                if reg.values is not None:
                    self.pieces.append(_Piece("param:" + names[i], start, reg.values[sl], False))
                for kind in ("exp_avg", "exp_avg_sq"):
                    self.pieces.append(_Piece(f"{kind}:{names[i]}", start, getattr(reg, kind)[sl], False))
        group_names = [[n for n, g in zip(names, opt._group_of) if g == gi] for gi in range(len(opt.param_groups))]
        self._groups(opt, group_names)
        self._finish.append(lambda man: opt._shards_loaded([_group_step(man, nm) for nm in group_names]))

    def _torch_adamw(self, opt, for_load: bool):
        if not isinstance(opt, (torch.optim.AdamW, torch.optim.Adam)):
            raise CheckpointError(f"optimizer {type(opt).__name__} is not supported: checkpoints hold "
                                  "zeroshard.ShardedOptimizer or torch.optim.AdamW/Adam state")
        group_names = []
        for g in opt.param_groups:
            nm = []
            for p in g["params"]:
                name = self._name_of(p, len(nm))
                nm.append(name)
                state = opt.state.get(p)
                if for_load and not state:
                    state = opt.state[p] = {
                        "step": torch.tensor(0.0, device=p.device if g.get("capturable") or g.get("fused") else None),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                if state:
                    step = int(float(state["step"]))   # once: a fused/capturable step is on the GPU
                    for kind in ("exp_avg", "exp_avg_sq"):
                        self.specs[f"{kind}:{name}"] = _Spec(tuple(p.shape), state[kind].dtype, p.dtype, step)
                        self._whole(f"{kind}:{name}", state[kind])
            group_names.append(nm)
        self._groups(opt, group_names)

        def finish(man):
            for g, nm in zip(opt.param_groups, group_names):
                for p, name in zip(g["params"], nm):
                    opt.state[p]["step"].fill_(_group_step(man, [name]))
        self._finish.append(finish)

    def finish_load(self, man: dict):
        for p in self.pieces:
            if p.writeback is not None:
                p.writeback.copy_(p.data.view(p.writeback.shape))
        for f in self._finish:
            f(man)


def _persistent_buffers(module: nn.Module):
    for mname, mod in module.named_modules():
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set:
                yield (f"{mname}.{bname}" if mname else bname), b


def _group_step(man: dict, names: List[str]) -> int:
    steps = [man["tensors"].get(f"exp_avg:{n}", {}).get("step") for n in names]
    return max([s for s in steps if s is not None], default=0)


# ------------------------------------------------------------------ collectives
def _collective(h: _Holdings, fn: Callable[[], Any], gather: bool = False):
    """Run fn on every rank and exchange the outcomes; if any rank failed, raise on
    every rank (the failing rank's own exception there, its message elsewhere).
    Returns fn's result, or with ``gather`` every rank's results in rank order."""
    try:
        value, exc = fn(), None
        out = (None, value if gather else None)
    except Exception as e:  # noqa: BLE001 - every failure must reach every rank
        value, exc = None, e
        out = (f"{type(e).__name__}: {e}", None)
    everyone = [out]
    if h.world > 1:
        everyone = comm.all_gather_object(out, group=h.group)
    if exc is not None:
        raise exc
    for r, (err, _) in enumerate(everyone):
        if err is not None:
            raise CheckpointError(f"rank {r} failed: {err}")
    return [v for _, v in everyone] if gather else value


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(e, os.strerror(e), b)


# ---------------------------------------------------------------- file format
def _memory(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the caller keeps t alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def _host(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous CPU tensor (no copy when it already is one)."""
    return t.detach().cpu().contiguous()


def _write_safetensors(path: str, items: list):
    """Write ``items`` = [(name, dtype, shape, produce)] as a safetensors file,
    calling ``produce()`` for one tensor at a time. Returns (CRC32 of the header,
    file size, [(byte offset, [CRC32 per block])] per item). Fsyncs the file."""
    header, off = {}, 0
    for name, dtype, shape, _ in items:
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    placed = []
    with open(path, "wb") as f:
        f.write(head)
        for name, dtype, shape, produce in items:
            t = _host(produce())
            mv = _memory(t)
            lo, hi = header[name]["data_offsets"]
            if mv.nbytes != hi - lo:
                raise CheckpointError(f"{path}: tensor '{name}' has {mv.nbytes} bytes, expected {hi - lo}")
            placed.append((len(head) + lo, [zlib.crc32(mv[k:k + _BLOCK]) for k in range(0, mv.nbytes, _BLOCK)]))
            f.write(mv)
        f.flush()
        os.fsync(f.fileno())
    return zlib.crc32(head), len(head) + off, placed


def _write_bytes(path: str, data: bytes):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _manifest_bytes(body: dict) -> bytes:
    text = json.dumps(body, sort_keys=True)
    return json.dumps({"format": FORMAT, "version": VERSION, "crc32": zlib.crc32(text.encode()),
                       "body": body}, sort_keys=True).encode()


def _read_manifest(path: str) -> dict:
    mpath = os.path.join(path, _MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a checkpoint directory (it does not exist)")
    if not os.path.exists(mpath):
        raise CheckpointError(f"{path} is not a complete zeroshard checkpoint: it has no {_MANIFEST} (a save "
                              "into it did not finish, or it is not a checkpoint)")
    try:
        with open(mpath, "rb") as f:
            doc = json.loads(f.read())
        body = doc["body"]
        ok = doc.get("format") == FORMAT and zlib.crc32(json.dumps(body, sort_keys=True).encode()) == doc["crc32"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{mpath} is corrupt: {e}") from None
    if not ok:
        raise CheckpointError(f"{mpath} is corrupt: its checksum does not match its contents")
    if doc["version"] > VERSION:
        raise CheckpointError(f"{mpath} has format version {doc['version']}; this zeroshard reads up to "
                              f"{VERSION}: upgrade zeroshard")
    return body


class _Reader:
    """Reads element ranges of checkpoint tensors, verifying each block read."""

    def __init__(self, path: str, man: dict):
        self.path, self.man, self.files = path, man, {}
        self.block = int(man["block_bytes"])
        self._staging = torch.empty(0, dtype=torch.uint8)   # reused: at most the largest read

    def close(self):
        for f in self.files.values():
            f.close()
        self.files = {}
        self._staging = torch.empty(0, dtype=torch.uint8)

    def _file(self, fname: str, key: str):
        f = self.files.get(fname)
        if f is not None:
            return f
        fpath = os.path.join(self.path, fname)
        info = self.man["files"].get(fname)
        if info is None:
            raise CheckpointError(f"{os.path.join(self.path, _MANIFEST)} names file {fname} for tensor '{key}' "
                                  "but does not describe it: the manifest is corrupt")
        if not os.path.exists(fpath):
            raise CheckpointError(f"{fpath} is missing (it holds tensor '{key}'); the checkpoint is incomplete: "
                                  "restore the file or load another checkpoint")
        size = os.path.getsize(fpath)
        if size != info["size"]:
            raise CheckpointError(f"{fpath} has {size} bytes but the manifest says {info['size']} (truncated or "
                                  f"overwritten; it holds tensor '{key}')")
        f = open(fpath, "rb")
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        head += f.read(max(0, min(n, size)))
        if zlib.crc32(head) != info["crc32"]:
            f.close()
            raise CheckpointError(f"{fpath}: the safetensors header fails its checksum (the file is corrupt; "
                                  f"it holds tensor '{key}')")
        self.files[fname] = f
        return f

    def _spans(self, key: str, lo: int, hi: int):
        """(entry, a, b, x0, x1, r0, r1) for each entry of ``key`` overlapping elements
        lo..hi: elements a..b of the tensor are bytes x0..x1 of the entry, read as the
        whole blocks r0..r1."""
        item = _dtype(self.man["tensors"][key]["dtype"]).itemsize
        for e in self.man["tensors"][key]["entries"]:
            start, numel = e[2], e[3]
            a, b = max(lo, start), min(hi, start + numel)
            if a < b:
                x0, x1 = (a - start) * item, (b - start) * item
                r0, r1 = x0 // self.block * self.block, min(-(-x1 // self.block) * self.block, numel * item)
                yield e, a, b, x0, x1, r0, r1

    def prepare(self, wanted: list):
        """Check every file the (key, lo, hi) ranges need (present, its size, its
        header) and allocate the one staging buffer the largest read needs, before
        anything is modified."""
        most = 0
        for key, lo, hi in wanted:
            for e, *_, r0, r1 in self._spans(key, lo, hi):
                self._file(e[0], key)
                most = max(most, r1 - r0)
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._staging = torch.empty(most, dtype=torch.uint8)

    def read(self, key: str, lo: int, dest: torch.Tensor):
        """Fill dest (1-D) with elements lo .. lo+len(dest) of tensor ``key``."""
        dtype, hi, done = _dtype(self.man["tensors"][key]["dtype"]), lo + dest.numel(), 0
        item = dtype.itemsize
        for (fname, byte0, start, numel, crcs), a, b, x0, x1, r0, r1 in self._spans(key, lo, hi):
            f = self._file(fname, key)
            if self._staging.numel() < r1 - r0:
                self._staging = torch.empty(0, dtype=torch.uint8)
                self._staging = torch.empty(r1 - r0, dtype=torch.uint8)
            buf = self._staging[:r1 - r0]
            mv = _memory(buf)
            f.seek(byte0 + r0)
            if f.readinto(mv) != r1 - r0:
                raise CheckpointError(f"{os.path.join(self.path, fname)} ends early inside tensor '{key}'")
            _stats["bytes_read"] += r1 - r0
            for k in range(r0 // self.block, -(-r1 // self.block)):
                s_, e_ = k * self.block - r0, min((k + 1) * self.block, numel * item) - r0
                if zlib.crc32(mv[s_:e_]) != crcs[k]:
                    raise CheckpointError(
                        f"{os.path.join(self.path, fname)}: tensor '{key}' fails its checksum in elements "
                        f"{start + (s_ + r0) // item}..{start + (e_ + r0) // item} (the file is corrupt); "
                        "load another checkpoint")
            dest[a - lo:b - lo].copy_(buf[x0 - r0:x1 - r0].view(dtype))
            done += b - a
        if done != hi - lo:
            raise CheckpointError(f"{os.path.join(self.path, _MANIFEST)}: tensor '{key}' elements {lo}..{hi} are "
                                  f"not all in the checkpoint's files ({done} found); the manifest is corrupt")

    def full(self, key: str) -> torch.Tensor:
        t = self.man["tensors"][key]
        out = torch.empty(int(torch.Size(t["shape"]).numel()), dtype=_dtype(t["dtype"]))
        self.read(key, 0, out)
        return out.view(t["shape"])


# ------------------------------------------------------------------------ API
def save_checkpoint(path, model: nn.Module, optimizer=None, extra: Any = None) -> None:
    """Save ``model`` (and ``optimizer``) to the directory ``path``: every rank
    writes what it owns, concurrently, and the directory appears complete or not
    at all (see [Note: checkpoint format] in zeroshard/checkpoint.py).

    Collective over the model's (or optimizer's) process group: every rank
    must call it with the same ``path``, on a filesystem all ranks see. Works
    with FullyShard, ShardedOptimizer (any stage), and plain models with
    ``torch.optim.AdamW`` (with or without torch.distributed). ``extra`` (any
    picklable object, e.g. ``{"step": step, "rng": torch.get_rng_state()}``)
    is kept per rank and returned by ``load_checkpoint``. An existing
    checkpoint at ``path`` is replaced only once the new one is complete; an
    existing directory that is not a zeroshard checkpoint is never touched.
    """
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    h = _Holdings(model, optimizer, for_load=False)   # same outcome on every rank

    def prepare():
        if h.rank != 0:
            return None
        os.makedirs(parent, exist_ok=True)
        if os.path.lexists(path) and not (os.path.isdir(path) and (
                os.path.exists(os.path.join(path, _MANIFEST)) or not os.listdir(path))):
            raise CheckpointError(f"{path} exists and is not a zeroshard checkpoint; refusing to replace it "
                                  "(choose another path or remove it yourself)")
        for stale in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.partial-*")):
            shutil.rmtree(stale, ignore_errors=True)     # an earlier save that never finished
        tmp = os.path.join(parent, f".{name}.partial-{uuid.uuid4().hex[:12]}")
        os.mkdir(tmp)
        return tmp
    tmp = _collective(h, prepare, gather=True)[0]

    def write():
        mine = [p for p in h.pieces if (not p.replicated or h.rank == 0) and p.data.numel()]
        fname, entries, files = f"rank{h.rank}.safetensors", [], {}
        if mine:          # (a rank of a replicated model owns nothing and writes no file)
            crc, size, placed = _write_safetensors(
                os.path.join(tmp, fname),
                [(f"{p.key}@{p.start}", p.data.dtype, (p.data.numel(),), lambda p=p: p.data) for p in mine])
            entries = [(p.key, [fname, off, p.start, p.data.numel(), crcs]) for p, (off, crcs) in zip(mine, placed)]
            files[fname] = {"size": size, "crc32": crc}
        if extra is not None:
            buf = io.BytesIO()
            torch.save(extra, buf)
            data = buf.getvalue()
            _write_bytes(os.path.join(tmp, f"extra{h.rank}.pt"), data)
            files[f"extra{h.rank}.pt"] = {"size": len(data), "crc32": zlib.crc32(data)}
        return entries, files

    def commit(written):
        if h.rank != 0:
            return None
        tensors = {k: {"shape": list(s.shape), "dtype": _dtype_name(s.dtype), "model_dtype": _dtype_name(s.model_dtype),
                       "step": s.step, "entries": []} for k, s in h.specs.items()}
        files = {}
        for entries, fl in written:
            files.update(fl)
            for key, e in entries:
                tensors[key]["entries"].append(e)
        for t in tensors.values():
            t["entries"].sort(key=lambda e: e[2])
        body = {"world_size": h.world, "stage": h.stage, "block_bytes": _BLOCK, "tensors": tensors,
                "aliases": h.aliases, "param_groups": h.groups, "files": files, "extra": extra is not None,
                "torch_version": torch.__version__}
        _write_bytes(os.path.join(tmp, _MANIFEST), _manifest_bytes(body))
        _fsync_dir(tmp)
        if not os.path.lexists(path):
            os.rename(tmp, path)
        elif _exchange(tmp, path):
            shutil.rmtree(tmp)                  # tmp now holds the previous checkpoint
        else:
            old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:12]}")
            os.rename(path, old)                # a crash here: load_checkpoint finds `old`
            os.rename(tmp, path)
            _fsync_dir(parent)
            shutil.rmtree(old)
        _fsync_dir(parent)
        return None

    try:
        written = _collective(h, write, gather=True)
        _collective(h, lambda: commit(written))
    except BaseException:
        if h.rank == 0 and tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _find(path: str) -> str:
    """The checkpoint directory for ``path``: itself, or the previous checkpoint a
    save on a filesystem without atomic exchange left beside it when it was cut
    between its two renames."""
    if os.path.exists(path):
        return path
    parent, name = os.path.split(path)
    old = [d for d in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.old-*"))
           if os.path.exists(os.path.join(d, _MANIFEST))]
    if len(old) == 1:
        warnings.warn(f"{path} is missing but a save replacing it was interrupted; loading the previous "
                      f"checkpoint from {old[0]} (rename it to {path} to keep it)")
        return old[0]
    return path


def _check_match(h: _Holdings, man: dict, path: str, with_optimizer: bool):
    tensors, where = man["tensors"], f"the checkpoint {path}"
    if with_optimizer and man["param_groups"] is None:
        raise CheckpointError(f"{where} was saved without an optimizer; pass optimizer=None to load the model only")
    for key, s in h.specs.items():
        t = tensors.get(key)
        if t is None and key.startswith(("exp_avg:", "exp_avg_sq:")):
            continue          # saved before that parameter had optimizer state: it starts at zero
        if t is None:
            raise CheckpointError(f"{where} has no tensor '{key}'; it is a checkpoint of another model")
        if list(t["shape"]) != list(s.shape):
            raise CheckpointError(f"{where}: tensor '{key}' has shape {tuple(t['shape'])} but the model's is "
                                  f"{tuple(s.shape)}; it is a checkpoint of another model")
    extra = [k for k in tensors if k.startswith(("param:", "buffer:")) and k not in h.specs]
    if extra:
        raise CheckpointError(f"{where} has tensors the model lacks, e.g. '{extra[0]}' ({len(extra)} in all); "
                              "it is a checkpoint of another model")


def load_checkpoint(path, model: nn.Module, optimizer=None) -> Any:
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
    """
    path = _find(os.path.abspath(os.fspath(path)))
    h = _Holdings(model, optimizer, for_load=True)    # same outcome on every rank
    man = _collective(h, lambda: _read_manifest(path))
    _collective(h, lambda: _check_match(h, man, path, optimizer is not None))
    reader = _Reader(path, man)
    _stats["bytes_read"] = 0

    @torch.no_grad()
    def read():
        try:
            reader.prepare([(p.key, p.start, p.start + p.data.numel()) for p in h.pieces if p.key in man["tensors"]])
            for p in h.pieces:
                if p.key in man["tensors"]:
                    reader.read(p.key, p.start, p.data)
                else:
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

    extra = _collective(h, read)
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
    path = _find(os.path.abspath(os.fspath(path)))
    out_file = os.fspath(out_file)
    if not out_file.endswith(".safetensors"):
        raise ValueError(f"out_file {out_file!r}: export writes safetensors; give a name ending in .safetensors")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    man = _read_manifest(path)
    reader = _Reader(path, man)
    items = []

    def add(name, key):
        t = man["tensors"][key]
        dt = _dtype(t["model_dtype"])
        if key.startswith("param:") and dtype is not None and dt.is_floating_point:
            dt = dtype
        items.append((name, dt, tuple(t["shape"]), lambda: reader.full(key).to(dt)))

    for key in man["tensors"]:
        if key.startswith(("param:", "buffer:")):
            add(key.split(":", 1)[1], key)
    for alias, canonical in man["aliases"].items():
        add(alias, "param:" + canonical)
    tmp = f"{out_file}.partial-{uuid.uuid4().hex[:12]}"
    try:
        _write_safetensors(tmp, items)
        os.replace(tmp, out_file)
    finally:
        reader.close()
        if os.path.exists(tmp):
            os.remove(tmp)
