"""Published weights read straight into a sharded model: ``load_pretrained``.

[Note: pretrained weights] A safetensors file is an 8-byte header length, a JSON
header naming each tensor's dtype, shape and byte range, then the tensors, each
one contiguous run of bytes in row-major order. A rank's ZeRO-3 piece of a
parameter is a contiguous range of its elements (``Region.owned``: the same
pieces a checkpoint load fills), so it is a contiguous range of bytes in the
file: each rank reads exactly those bytes (``os.preadv``, at most
``READ_BYTES`` at a time into one reused buffer), converts them into its fp32
shard, and nothing else. No rank reads another's bytes, no collective runs,
and no rank ever holds a whole model: the extra memory is one read buffer. A
plain model (stages 1 and 2, where every rank holds the full parameters
anyway) reads its parameters whole, each into its own memory; parameters and
buffers still on meta are first made real on ``device``.

Tied parameters are one parameter of the model: the first of its names the
files hold is read. Missing and unexpected keys are reported as
``load_state_dict`` reports them, before any byte is read. Non-persistent
buffers (rotary frequencies) are in no file: a model built with its buffers on
meta gets them from its own code, ``_init_weights`` of a Hugging Face model
(for modules without parameters of their own), after FullyShard has run the
modules' ``reset_parameters()``; any left are named in a warning.
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn

from ..core.regions import persistent_buffers, sharded_model_of
from .holdings import Holdings

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# the largest read: one buffer of this many bytes is the loader's whole transient memory
READ_BYTES = 64 << 20

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "C64": torch.complex64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are."""

    file: str
    dtype: torch.dtype
    shape: tuple
    offset: int  # of its first byte in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str) -> Dict[str, Entry]:
    """The tensors of one safetensors file, by name."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise ValueError(f"{path}: not a safetensors file (a header of {n} bytes)")
        header = json.loads(f.read(n))
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t["dtype"] not in DTYPES:
            raise ValueError(
                f"{path}: tensor '{name}' has dtype {t['dtype']}, which the loader does not read "
                f"(it reads {sorted(DTYPES)})"
            )
        out[name] = Entry(path, DTYPES[t["dtype"]], tuple(t["shape"]), 8 + n + t["data_offsets"][0])
    return out


def weight_files(path: Union[str, Sequence[str]]) -> List[str]:
    """The safetensors files of ``path``: a folder with ``model.safetensors.index.json``
    (the files its weight map names), a folder with ``model.safetensors`` or other
    ``*.safetensors`` files, one file, or a list of files."""
    if not isinstance(path, (str, os.PathLike)):
        return [os.fspath(p) for p in path]
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_pretrained: {path} is neither a safetensors file nor a folder")
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, name) for name in files]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"load_pretrained: {path} holds no safetensors file ({INDEX_NAME}, {SINGLE_NAME} "
            "or *.safetensors); save the model with save_pretrained(..., safe_serialization=True)"
        )
    return files


def index(files: List[str]) -> Dict[str, Entry]:
    """Every tensor of the files, by name; a name in two files is an error."""
    out: Dict[str, Entry] = {}
    for path in files:
        for name, e in read_header(path).items():
            if name in out:
                raise ValueError(f"load_pretrained: tensor '{name}' is in both {out[name].file} and {path}")
            out[name] = e
    return out


class SafetensorsReader:
    """Element ranges of the files' tensors, read into tensors of any dtype and device."""

    def __init__(self):
        self._fds: Dict[str, int] = {}
        self._buf: Optional[torch.Tensor] = None

    def read(self, e: Entry, start: int, out: torch.Tensor) -> None:
        """Elements ``start .. start + out.numel()`` of ``e`` (row-major), converted into ``out`` (1-D)."""
        item = e.dtype.itemsize
        per = max(1, READ_BYTES // item)
        fd = self._fds.get(e.file)
        if fd is None:
            fd = self._fds[e.file] = os.open(e.file, os.O_RDONLY)
        if self._buf is None or self._buf.numel() < per * item:
            self._buf = torch.empty(per * item, dtype=torch.uint8)
        done, n = 0, out.numel()
        while done < n:
            k = min(per, n - done)
            view = self._buf[: k * item]
            got, want, pos = 0, k * item, e.offset + (start + done) * item
            while got < want:
                r = os.preadv(fd, [view[got:].numpy()], pos + got)
                if r <= 0:
                    raise OSError(f"load_pretrained: {e.file} ends inside its tensor data (truncated file?)")
                got += r
            out[done : done + k].copy_(view.view(e.dtype))
            done += k

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@torch.no_grad()
def materialize_meta(module: nn.Module, device: torch.device) -> List[str]:
    """Parameters and buffers on meta made real (uninitialised) on ``device``, each
    tied parameter once; returns the names of the buffers made real."""
    made: Dict[int, torch.Tensor] = {}
    buffers = []
    for mname, mod in module.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                mod._parameters[name] = made[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                mod._buffers[name] = torch.zeros_like(b, device=device)
                buffers.append(f"{mname}.{name}".lstrip("."))
    return buffers


def _by_owner(root: nn.Module, names: List[str]) -> Dict[str, List[str]]:
    """The non-persistent buffers among ``names``, by the name of the module holding them."""
    saved = {n for n, _ in persistent_buffers(root)}
    out: Dict[str, List[str]] = {}
    for n in names:
        if n not in saved:
            out.setdefault(n.rpartition(".")[0], []).append(n)
    return out


@torch.no_grad()
def reset_owners(root: nn.Module, names: List[str]) -> List[str]:
    """Run ``reset_parameters()`` of the modules holding the non-persistent buffers
    ``names`` (as FullyShard does on meta; before the weights are read, which then
    overwrite their parameters); returns the names no such method set."""
    mods, left = dict(root.named_modules()), []
    for owner, held in sorted(_by_owner(root, names).items()):
        reset = getattr(mods[owner], "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            left += held
    return left


@torch.no_grad()
def init_buffers(root: nn.Module, names: List[str]) -> List[str]:
    """Set the non-persistent buffers ``names`` by the model's own code (a Hugging Face
    model's ``_init_weights`` of the modules holding them that own no parameter);
    returns the names left unset."""
    init = getattr(root, "_init_weights", None)
    mods, left = dict(root.named_modules()), []
    for owner, held in sorted(_by_owner(root, names).items()):
        if callable(init) and next(mods[owner].parameters(recurse=False), None) is None:
            init(mods[owner])
        else:
            left += held
    return left


def default_device() -> torch.device:
    """The current CUDA device, else the CPU: where a plain model's meta tensors are made."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_pretrained(
    model: nn.Module,
    path: Union[str, Sequence[str]],
    *,
    strict: bool = True,
    device: Union[torch.device, str, None] = None,
    key_map: Union[Mapping[str, str], Callable[[str], str], None] = None,
):
    """Pretrained weights from safetensors files into ``model`` ([Note: pretrained weights]).

    model: a ``FullyShard`` (of a model built on meta, or on CPU/CUDA) or a plain model
        for ``ShardedOptimizer`` (stages 1/2), built on meta or not. Call it before
        building the optimizer; on every rank (no collective runs).
    path: a folder ``save_pretrained`` wrote (``model.safetensors.index.json`` and its
        files, or ``model.safetensors``), one ``.safetensors`` file, or a list of them.
    strict: missing or unexpected keys raise (nothing read), as ``load_state_dict``.
    device: where a plain model's meta parameters and buffers are made
        (default: the current CUDA device, else CPU).
    key_map: the files' name for a model name (a dict, or a function), where they
        differ (a model wrapped by an adapter library); names it lacks are the same.

    Each rank reads only the bytes of the elements it holds, converting them to the
    model's dtype. Returns ``(missing_keys, unexpected_keys)`` as ``load_state_dict``."""
    fs = sharded_model_of(model)
    inner = fs.module if fs is not None else model
    entries = index(weight_files(path))
    unset = list(fs.uninitialised_buffers) if fs is not None else []
    if fs is None:
        made = materialize_meta(inner, torch.device(device) if device is not None else default_device())
        unset += reset_owners(inner, made)
        if device is not None:
            inner.to(device)  # whatever was made elsewhere (an adapter on CPU) joins it
    holdings = Holdings(model, None, for_load=True)
    names: Dict[str, List[str]] = {}  # canonical name -> its other names (tied)
    for alias, canonical in holdings.aliases.items():
        names.setdefault(canonical, []).append(alias)
    source, missing, unexpected = _match(holdings, entries, names, _file_names(key_map))
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"load_pretrained: error(s) loading {type(inner).__name__} from {path}: missing key(s) "
            f"{missing}, unexpected key(s) {unexpected}; pass strict=False to load what matches"
        )
    reader = SafetensorsReader()
    try:
        for piece in holdings.pieces:
            if piece.key in source:
                reader.read(source[piece.key], piece.start, piece.data)
    finally:
        reader.close()
    holdings.finish_load({"tensors": {}, "param_groups": None})
    left = init_buffers(inner, unset)
    if left:
        warnings.warn(
            f"load_pretrained: the non-persistent buffers {left} are in no file and the model has no "
            "code zeroshard can run to set them (a Hugging Face _init_weights, a module's "
            "reset_parameters()); set them as the module's __init__ computes them, or build the "
            "model with its buffers off meta"
        )
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _file_names(key_map) -> Callable[[str], str]:
    if key_map is None:
        return str
    if callable(key_map):
        return key_map
    return lambda n: key_map.get(n, n)


def _match(holdings: Holdings, entries: Dict[str, Entry], names: Dict[str, List[str]], file_name: Callable[[str], str]):
    """(the file entry of each checkpoint key found, the model's names missing from the
    files, the files' names the model lacks); a size mismatch raises."""
    source: Dict[str, Entry] = {}
    missing, known = [], set()
    for key, spec in holdings.specs.items():
        _, _, name = key.partition(":")
        every = [file_name(n) for n in [name] + names.get(name, [])]
        known.update(every)
        found = next((n for n in every if n in entries), None)
        if found is None:
            missing.append(name)
            continue
        e = entries[found]
        if e.numel != math.prod(spec.shape):
            raise RuntimeError(
                f"load_pretrained: size mismatch for {found}: the file {e.file} has shape "
                f"{list(e.shape)}, the model's parameter has shape {list(spec.shape)}"
            )
        source[key] = e
    return source, missing, sorted(k for k in entries if k not in known)
