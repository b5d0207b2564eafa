"""The checkpoint files: a streaming safetensors writer, the checksummed
manifest, a block-verifying reader, and the filesystem steps of an atomic
commit. See [Note: checkpoint format] in checkpoint/api.py."""

from __future__ import annotations

import bisect
import ctypes
import errno
import json
import os
import struct
import zlib
from typing import Dict, List, Optional

import torch

from ..native.ext import _C

FORMAT, VERSION = "zeroshard-checkpoint", 1
BLOCK = 1 << 20  # bytes per CRC block (saves): a load reads whole blocks around the ranges it needs
MANIFEST = "manifest.json"
# safetensors' names of the dtypes it stores (a tensor of another dtype is refused, named)
ST_DTYPE = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
# the blocks' checksum: zlib's CRC-32, from the C++ core where the CPU folds it with
# PCLMULQDQ (well ahead of zlib's; csrc/crc32.h), else zlib's own
crc32 = _C.crc32 if _C.crc32_is_fast() else zlib.crc32
stats = {"bytes_read": 0}  # of this process's last load_checkpoint (tests and benchmarks read it)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file and tensor."""


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the manifest")
    return dt


def fsync_dir(path: str, sync: bool = True):
    if not sync:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_file_range():
    fn = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
WRITEBACK_BYTES = 8 << 20  # start the disk writing every this many bytes written


class Writeback:
    """Starts the kernel's writeback of a file's pages as they are written (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait), so the disk
    writes the first pieces while the next are checksummed and copied, and the
    closing fsync waits only for the tail. Where the call is missing or refused,
    the fsync does all of it, as before."""

    def __init__(self, f, sync: bool):
        self.f, self.done, self.ok = f, 0, sync and _SYNC_FILE_RANGE is not None

    def wrote(self, end: int):
        """Bytes up to ``end`` are written."""
        if not self.ok or end - self.done < WRITEBACK_BYTES:
            return
        self.f.flush()
        if _SYNC_FILE_RANGE(self.f.fileno(), self.done, end - self.done, 2) != 0:  # SYNC_FILE_RANGE_WRITE
            self.ok = False
        self.done = end


def exchange(a: str, b: str) -> bool:
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
def memory(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the caller keeps t alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def host(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous CPU tensor (no copy when it already is one)."""
    return t.detach().cpu().contiguous()


def write_safetensors(path: str, items: list, sync: bool = True):
    """Write ``items`` = [(name, dtype, shape, produce)] as a safetensors file,
    calling ``produce()`` for one tensor at a time. Returns (CRC32 of the header,
    file size, [(byte offset, [CRC32 per block])] per item). Fsyncs the file
    (``sync``), starting the writeback as it goes (Writeback)."""
    header, off = {}, 0
    for name, dtype, shape, _ in items:
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        if dtype not in ST_DTYPE:
            raise CheckpointError(
                f"{name.split('@')[0]} is {dtype}, which the safetensors format does not store "
                f"(it stores {', '.join(dtype_name(d) for d in ST_DTYPE)}); keep that tensor "
                "out of the state dict (a non-persistent buffer) or convert it"
            )
        header[name] = {"dtype": ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    placed = []
    with open(path, "wb") as f:
        f.write(head)
        writeback = Writeback(f, sync)
        for name, dtype, shape, produce in items:
            t = host(produce())
            mv = memory(t)
            lo, hi = header[name]["data_offsets"]
            if mv.nbytes != hi - lo:
                raise CheckpointError(f"{path}: tensor '{name}' has {mv.nbytes} bytes, expected {hi - lo}")
            placed.append((len(head) + lo, [crc32(mv[k : k + BLOCK]) for k in range(0, mv.nbytes, BLOCK)]))
            f.write(mv)
            writeback.wrote(len(head) + hi)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    return zlib.crc32(head), len(head) + off, placed


def write_bytes(path: str, data: bytes, sync: bool = True):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())


def manifest_bytes(body: dict) -> bytes:
    text = json.dumps(body, sort_keys=True)
    return json.dumps(
        {"format": FORMAT, "version": VERSION, "crc32": zlib.crc32(text.encode()), "body": body}, sort_keys=True
    ).encode()


def read_manifest(path: str) -> dict:
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a checkpoint directory (it does not exist)")
    if not os.path.exists(mpath):
        raise CheckpointError(
            f"{path} is not a complete zeroshard checkpoint: it has no {MANIFEST} (a save "
            "into it did not finish, or it is not a checkpoint)"
        )
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
        raise CheckpointError(
            f"{mpath} has format version {doc['version']}; this zeroshard reads up to {VERSION}: upgrade zeroshard"
        )
    return body


def file_problem(path: str, fname: str, info: dict) -> Optional[str]:
    """Why file ``fname`` of the checkpoint at ``path`` cannot be what the manifest
    describes (missing, or of another size), or None."""
    fpath = os.path.join(path, fname)
    if not os.path.exists(fpath):
        return f"{fpath} is missing"
    size = os.path.getsize(fpath)
    if size != info.get("size"):
        return f"{fpath} has {size} bytes but the manifest says {info.get('size')} (truncated or overwritten)"
    return None


class CheckpointReader:
    """Reads element ranges of checkpoint tensors, verifying each block read."""

    def __init__(self, path: str, man: dict):
        self.path, self.man, self.files = path, man, {}
        self._starts: Dict[str, List[int]] = {}  # key -> its entries' first elements (a load's lookups)
        self.block = int(man["block_bytes"])
        self._staging = torch.empty(0, dtype=torch.uint8)  # reused: at most the largest read

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
            raise CheckpointError(
                f"{os.path.join(self.path, MANIFEST)} names file {fname} for tensor '{key}' "
                "but does not describe it: the manifest is corrupt"
            )
        problem = file_problem(self.path, fname, info)
        if problem is not None:
            raise CheckpointError(
                f"{problem}; it holds tensor '{key}': the checkpoint is incomplete: restore the "
                "file or load another checkpoint"
            )
        size = os.path.getsize(fpath)
        f = open(fpath, "rb")
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        head += f.read(max(0, min(n, size)))
        if zlib.crc32(head) != info["crc32"]:
            f.close()
            raise CheckpointError(
                f"{fpath}: the safetensors header fails its checksum (the file is corrupt; it holds tensor '{key}')"
            )
        self.files[fname] = f
        return f

    def _spans(self, key: str, lo: int, hi: int):
        """(entry, a, b, x0, x1, r0, r1) for each entry of ``key`` overlapping elements
        lo..hi: elements a..b of the tensor are bytes x0..x1 of the entry, read as the
        whole blocks r0..r1."""
        item = parse_dtype(self.man["tensors"][key]["dtype"]).itemsize
        entries = self.man["tensors"][key]["entries"]  # not overlapping; sorted by start (the save sorts them)
        starts = self._starts.get(key)
        if starts is None:
            entries.sort(key=lambda e: e[2])
            starts = self._starts[key] = [e[2] for e in entries]
        for e in entries[max(0, bisect.bisect_right(starts, lo) - 1) : bisect.bisect_left(starts, hi)]:
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
        dtype, hi, done = parse_dtype(self.man["tensors"][key]["dtype"]), lo + dest.numel(), 0
        item = dtype.itemsize
        # whole blocks straight into dest when they are exactly its elements (no staging copy)
        direct = dest.dtype == dtype and dest.device.type == "cpu" and dest.is_contiguous()
        for (fname, byte0, start, numel, crcs), a, b, x0, x1, r0, r1 in self._spans(key, lo, hi):
            f = self._file(fname, key)
            into = direct and (x0, x1) == (r0, r1)
            if not into and self._staging.numel() < r1 - r0:
                self._staging = torch.empty(0, dtype=torch.uint8)
                self._staging = torch.empty(r1 - r0, dtype=torch.uint8)
            buf = dest[a - lo : b - lo] if into else self._staging[: r1 - r0]
            mv = memory(buf)
            f.seek(byte0 + r0)
            if f.readinto(mv) != r1 - r0:
                raise CheckpointError(f"{os.path.join(self.path, fname)} ends early inside tensor '{key}'")
            stats["bytes_read"] += r1 - r0
            for k in range(r0 // self.block, -(-r1 // self.block)):
                s_, e_ = k * self.block - r0, min((k + 1) * self.block, numel * item) - r0
                if crc32(mv[s_:e_]) != crcs[k]:
                    raise CheckpointError(
                        f"{os.path.join(self.path, fname)}: tensor '{key}' fails its checksum in elements "
                        f"{start + (s_ + r0) // item}..{start + (e_ + r0) // item} (the file is corrupt); "
                        "load another checkpoint"
                    )
            if not into:
                dest[a - lo : b - lo].copy_(buf[x0 - r0 : x1 - r0].view(dtype))
            done += b - a
        if done != hi - lo:
            raise CheckpointError(
                f"{os.path.join(self.path, MANIFEST)}: tensor '{key}' elements {lo}..{hi} are "
                f"not all in the checkpoint's files ({done} found); the manifest is corrupt"
            )

    def full(self, key: str) -> torch.Tensor:
        t = self.man["tensors"][key]
        out = torch.empty(int(torch.Size(t["shape"]).numel()), dtype=parse_dtype(t["dtype"]))
        self.read(key, 0, out)
        return out.view(t["shape"])
