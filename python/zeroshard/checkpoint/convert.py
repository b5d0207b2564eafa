"""Offline conversion between zeroshard's checkpoint format and torch.distributed.checkpoint
(DCP), one tensor in memory at a time, no process group:

    python -m zeroshard.checkpoint.convert --to dcp SRC DST          # zeroshard -> DCP
    python -m zeroshard.checkpoint.convert --to zeroshard SRC DST    # DCP -> zeroshard

The DCP side has the layout ``dcp_state_dict`` and torch's ``get_state_dict`` give:
``model.<name>`` for parameters and buffers, ``optim.state.<name>.<key>`` for the
optimizer's state (``step`` a scalar), ``optim.param_groups``. A DCP checkpoint made
here loads with ``dcp.load`` into FSDP2 or into zeroshard at any world size; a
zeroshard checkpoint made here loads with ``load_checkpoint`` at any world size
and stage (it is written as one rank's, whole tensors).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from typing import Dict, List, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, load, save
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from . import files
from .api import find_checkpoint
from .dcp import torch_group_keys

_MODEL, _STATE = "model.", "optim.state."


class _Streaming(DefaultSavePlanner):
    """A save planner whose tensors are read from the zeroshard checkpoint when DCP writes
    them (the state dict it plans holds meta tensors: nothing is read before)."""

    def __init__(self, read):
        super().__init__()
        self.read = read

    def resolve_data(self, write_item):
        fqn = write_item.index.fqn
        return self.read(fqn) if fqn in self.read.keys else super().resolve_data(write_item)


class _Keys:
    """DCP name -> the zeroshard checkpoint's tensor, read on demand."""

    def __init__(self, reader: files.CheckpointReader, keys: Dict[str, str]):
        self.reader, self.keys = reader, keys

    def __call__(self, fqn: str) -> torch.Tensor:
        return self.reader.full(self.keys[fqn])


def to_dcp(src: str, dst: str) -> None:
    """A zeroshard checkpoint ``src`` written as the DCP checkpoint ``dst``."""
    path = find_checkpoint(os.path.abspath(src))
    man = files.read_manifest(path)
    model, state, keys = {}, {}, {}
    for key, t in man["tensors"].items():
        kind, _, name = key.partition(":")
        meta = torch.empty(t["shape"], dtype=files.parse_dtype(t["dtype"]), device="meta")
        if kind in ("param", "buffer"):
            model[name], keys[_MODEL + name] = meta, key
        elif t["shape"] or kind != "step":
            entry = state.setdefault(name, {"step": torch.tensor(float(t.get("step") or 0))})
            entry[kind] = meta
            keys[f"{_STATE}{name}.{kind}"] = key
    groups = [
        dict(_adamw_keys(g["hyper"]), **g["hyper"], params=list(g["params"])) for g in man.get("param_groups") or []
    ]
    reader = files.CheckpointReader(path, man)
    try:
        save(
            {"model": model, "optim": {"state": state, "param_groups": groups}},
            storage_writer=FileSystemWriter(dst, thread_count=1),
            planner=_Streaming(_Keys(reader, keys)),
            no_dist=True,
        )
    finally:
        reader.close()


def _adamw_keys(hyper: dict) -> dict:
    """torch.optim.AdamW's param-group keys with their defaults, for an AdamW's group (DCP
    matches keys exactly: torch's AdamW loading the checkpoint asks for every one)."""
    return torch_group_keys(torch.optim.AdamW) if "betas" in hyper else {}


def to_zeroshard(src: str, dst: str) -> None:
    """The DCP checkpoint ``src`` (``model.*`` and ``optim.*`` as ``get_state_dict`` names
    them) written as the zeroshard checkpoint ``dst``: one file, whole tensors."""
    md = FileSystemReader(src).read_metadata()
    tensors = {fqn: m for fqn, m in md.state_dict_metadata.items() if hasattr(m, "chunks")}
    steps = {}
    for fqn in tensors:
        if fqn.startswith(_STATE) and fqn.endswith(".step"):
            steps[fqn[len(_STATE) : -len(".step")]] = int(float(_read(src, fqn, tensors[fqn]).item()))
    specs = {}
    for fqn, m in tensors.items():
        if fqn.startswith(_MODEL):
            kind, name = "buffer" if not m.properties.dtype.is_floating_point else "param", fqn[len(_MODEL) :]
        elif fqn.startswith(_STATE) and not fqn.endswith(".step"):
            name, _, kind = fqn[len(_STATE) :].rpartition(".")
        else:
            continue
        specs[f"{kind}:{name}"] = (fqn, m, steps.get(name) if kind not in ("param", "buffer") else None)
    groups = _param_groups(src, md)
    _write(dst, specs, groups, lambda fqn, m: _read(src, fqn, m))


def _read(src: str, fqn: str, m) -> torch.Tensor:
    """One tensor of a DCP checkpoint, whole."""
    out = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    load({fqn: out}, checkpoint_id=src, no_dist=True)
    return out


def _param_groups(src: str, md) -> List[dict]:
    """``optim.param_groups`` of a DCP checkpoint as zeroshard's manifest records them."""
    flat = {fqn: m for fqn, m in md.state_dict_metadata.items() if fqn.startswith("optim.param_groups.")}
    if not flat:
        return []
    got: Dict[str, object] = {fqn: None for fqn in flat}
    load(got, checkpoint_id=src, no_dist=True)
    groups: Dict[int, dict] = {}
    for fqn, v in got.items():
        idx, _, key = fqn[len("optim.param_groups.") :].partition(".")
        groups.setdefault(int(idx), {})[key] = v
    out = []
    for _, g in sorted(groups.items()):
        hyper = {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in g.items()
            if k != "params" and isinstance(v, (int, float, bool, str, list, tuple, type(None)))
        }
        out.append({"params": list(g.get("params") or []), "hyper": hyper})
    return out


def _write(dst: str, specs: dict, groups: List[dict], read) -> None:
    """A one-rank zeroshard checkpoint at ``dst`` from whole tensors ``read(fqn, m)``, one at a time."""
    parent, name = os.path.split(os.path.abspath(dst))
    tmp = os.path.join(parent, f".{name}.partial-{uuid.uuid4().hex[:12]}")
    os.makedirs(tmp)
    keys = sorted(specs)
    items = [
        (
            f"{key}@0",
            specs[key][1].properties.dtype,
            (int(torch.Size(specs[key][1].size).numel()),),
            lambda key=key: read(specs[key][0], specs[key][1]).reshape(-1),
        )
        for key in keys
    ]
    crc, size, placed = files.write_safetensors(os.path.join(tmp, "rank0.safetensors"), items)
    tensors = {}
    for key, (off, crcs) in zip(keys, placed):
        fqn, m, step = specs[key]
        n = int(torch.Size(m.size).numel())
        dt = files.dtype_name(m.properties.dtype)
        tensors[key] = {
            "shape": list(m.size),
            "dtype": dt,
            "model_dtype": dt,
            "step": step,
            "entries": [["rank0.safetensors", off, 0, n, crcs]],
        }
    body = {
        "world_size": 1,
        "stage": 0,
        "block_bytes": files.BLOCK,
        "tensors": tensors,
        "aliases": {},
        "param_groups": groups,
        "files": {"rank0.safetensors": {"size": size, "crc32": crc}},
        "extra": False,
        "torch_version": torch.__version__,
    }
    files.write_bytes(os.path.join(tmp, files.MANIFEST), files.manifest_bytes(body), True)
    files.fsync_dir(tmp, True)
    os.rename(tmp, dst)
    files.fsync_dir(parent, True)


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m zeroshard.checkpoint.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--to", choices=("dcp", "zeroshard"), required=True)
    ap.add_argument("src")
    ap.add_argument("dst")
    args = ap.parse_args(argv)
    if os.path.exists(args.dst):
        print(f"convert: {args.dst} exists; give a new path", file=sys.stderr)
        return 2
    (to_dcp if args.to == "dcp" else to_zeroshard)(args.src, args.dst)
    print(f"convert: {args.src} -> {args.dst} ({args.to})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
