"""torch.distributed.checkpoint (DCP) state dicts of zeroshard models and optimizers:
``dcp_state_dict`` and ``load_dcp_state_dict``.

[Note: DCP adapter] DCP describes a shard as a rectangular chunk of a tensor; a
zeroshard shard is a flat element range ([Note: shard sources]). A flat range of a
row-major tensor is a few rectangles (``rectangles``: a partial first row, whole
rows, a partial last row, recursively; at most 2 x dims - 1 of them), each a
contiguous run of the range. Each becomes one local shard of a ``ShardedTensor``
whose data is the rank's own shard memory (on the CPU given a storage of exactly
its bytes, ``_own_storage``, so DCP's writer does not copy it as it copies views),
so ``dcp.save`` writes straight from the shards and ``dcp.load`` reads straight
into them, resharding
from whatever wrote the checkpoint (FSDP2's row chunks, another world size or
stage): no rank builds a whole tensor. What every rank holds whole (stage-1/2
parameters without a master, buffers, step counts) is a plain tensor, which DCP
writes once. The optimizer's half has torch's format under the model's names
(``{"state": {name: {"step", "exp_avg", "exp_avg_sq", ...}}, "param_groups":
[{..., "params": [names]}]}``), as ``torch.distributed.checkpoint.state_dict.
get_state_dict`` gives for FSDP2; torch's helpers read module and optimizer
internals zeroshard does not have, hence this pair beside them.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from .. import comm
from .dcp_tensor import flat_sharded_tensor
from .files import CheckpointError
from .holdings import Holdings
from .pieces import Piece


def rectangles(shape: tuple, start: int, numel: int) -> List[Tuple[tuple, tuple, int]]:
    """(offsets, sizes, position in the range) of the rectangular chunks that make up the
    elements ``start .. start + numel`` of a row-major tensor of ``shape``, in order."""
    if numel == 0:
        return []
    if len(shape) <= 1:
        return [((start,) if shape else (), (numel,) if shape else (), 0)]
    row = math.prod(shape[1:])
    out, a, b, pos = [], start, start + numel, 0

    def part_row(a: int, end: int, pos: int):
        i = a // row
        for off, size, p in rectangles(tuple(shape[1:]), a - i * row, end - a):
            out.append(((i,) + off, (1,) + size, pos + p))

    if a % row:  # a partial first row
        end = min(b, (a // row + 1) * row)
        part_row(a, end, pos)
        pos, a = pos + end - a, end
    if b - a >= row:  # whole rows
        r0, r1 = a // row, b // row
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:]), pos))
        pos, a = pos + (r1 - r0) * row, r1 * row
    if a < b:  # a partial last row
        part_row(a, b, pos)
    return out


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (1-D, contiguous) on the CPU as a tensor whose storage is exactly its bytes and
    is ``t``'s memory (no copy). DCP's FileSystemWriter copies every tensor whose storage is
    larger than it (a view of a shard is) and holds the copies until the file is written: a
    second copy of all this rank writes. A tensor that already owns its storage, or is on a
    GPU (the writer copies it to the host either way), is returned as it is."""
    t = t.detach()
    if t.device.type != "cpu" or t.numel() == 0 or t.untyped_storage().nbytes() == t.nbytes:
        return t
    # (through bytes: numpy has no bfloat16; the array keeps ``t``, so the shard, alive)
    return torch.from_numpy(t.view(torch.uint8).numpy()).view(t.dtype)


def _local_shards(shape: tuple, dtype: torch.dtype, pieces: List[Piece], rank: int) -> List[Shard]:
    """This rank's flat pieces of one tensor of ``shape`` as rectangular shards, views of the pieces."""
    shards = []
    for piece in pieces:
        for off, size, pos in rectangles(shape, piece.start, piece.data.numel()):
            n = math.prod(size)
            meta = ShardMetadata(
                shard_offsets=list(off), shard_sizes=list(size), placement=f"rank:{rank}/{piece.data.device}"
            )
            shards.append(Shard(_own_storage(piece.data[pos : pos + n]).view(size), meta))
    if not shards and shape:
        # none of it here: an empty shard keeps the key in this rank's plans (DCP drops a
        # ShardedTensor with no local shard), placed past the end so that no chunk shares its
        # offset; a save writes nothing of it (FlatShardedTensor.__create_write_items__)
        dev = pieces[0].data.device if pieces else torch.device("cpu")
        empty = torch.empty([0] * len(shape), dtype=dtype, device=dev)
        at = [shape[0]] + [0] * (len(shape) - 1)
        shards.append(
            Shard(empty, ShardMetadata(shard_offsets=at, shard_sizes=[0] * len(shape), placement=f"rank:{rank}/{dev}"))
        )
    return shards


def _sharded_tensors(local: Dict[str, Tuple[tuple, torch.dtype, List[Shard]]], group) -> Dict[str, ShardedTensor]:
    """Every key's ShardedTensor from each rank's local shards: one exchange of the shards'
    metadata for all of them (torch's ``init_from_local_shards`` makes one per tensor)."""
    mine = {key: [sh.metadata for sh in shards] for key, (_, _, shards) in local.items()}
    everyone = comm.all_gather_object(mine, group=group, what="dcp_state_dict: the shards' layout")
    out = {}
    for key, (shape, dtype, shards) in local.items():
        props = TensorProperties(
            dtype=dtype,
            layout=torch.strided,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=False,
        )
        meta = ShardedTensorMetadata(
            shards_metadata=[m for theirs in everyone for m in theirs[key]],
            size=torch.Size(shape),
            tensor_properties=props,
        )
        out[key] = flat_sharded_tensor(shards, meta, group)
    return out


def dcp_state_dict(model: nn.Module, optimizer=None, *, options=None) -> Tuple[dict, dict]:
    """``(model_state_dict, optim_state_dict)`` for ``dcp.save`` / ``dcp.load`` (see
    [Note: DCP adapter]): the model's parameters and persistent buffers under its own
    names, the optimizer's state in torch's format. Sharded values are ``ShardedTensor``s
    whose local shards are views of this rank's shards: ``dcp.load`` into them loads
    the model and optimizer in place (then call ``load_dcp_state_dict``). Collective.

    ``options``: torch's ``StateDictOptions``. ``full_state_dict=True`` gives full tensors
    (each gathered in turn) on every rank, or with ``cpu_offload=True`` on rank 0 alone
    (the other ranks' dicts are empty), as ``get_state_dict`` does for FSDP2."""
    fresh = _fresh(model, optimizer)  # no state yet: what a load fills, from the class
    holdings = Holdings(model, optimizer, for_load=fresh is not None)
    _refuse_experts(holdings, "dcp_state_dict()")
    if fresh is not None:
        holdings.adopt(fresh)
    rank = dist.get_rank(holdings.group) if holdings.group is not None else 0
    by_key: Dict[str, List[Piece]] = {}
    for piece in holdings.pieces:
        by_key.setdefault(piece.key, []).append(piece)
    shapes = {k: tuple(s.shape) for k, s in holdings.specs.items()}
    if any(o.whole_tensor_rule is not None for o in _optimizers(optimizer)):
        shapes.update(_owner_scalars(holdings, by_key, holdings.group))
    for key, t in (fresh or {"tensors": {}})["tensors"].items():
        shapes.setdefault(key, tuple(t["shape"]))
    local = {}
    for key, shape in shapes.items():  # (a scalar is whole wherever it is: a plain tensor)
        pieces = by_key.get(key, [])
        if shape and not (pieces and pieces[0].replicated):
            dtype = pieces[0].data.dtype if pieces else torch.float32
            local[key] = (shape, dtype, _local_shards(shape, dtype, pieces, rank))
    sharded = _sharded_tensors(local, holdings.group)
    model_sd, state = {}, {}
    for key in sorted(shapes):
        kind, _, name = key.partition(":")
        if key in sharded:
            value = sharded[key]
        else:  # every rank plans every key: a scalar of a parameter held elsewhere is a stand-in here
            value = by_key[key][0].data.view(shapes[key]) if key in by_key else torch.zeros(shapes[key])
        if kind in ("param", "buffer"):
            model_sd[name] = value
        else:
            entry = state.setdefault(name, {})
            entry[kind] = value
            if kind == "exp_avg" and "step" not in entry:  # the fused AdamW's count (a class's own: its key)
                entry["step"] = torch.tensor(float(holdings.specs[key].step or 0) if key in holdings.specs else 0.0)
    saved = iter(holdings.groups or [])  # each optimizer's groups in turn, with its class's keys
    groups = [
        dict(_torch_group_keys(opt), **g["hyper"], params=list(g["params"]))
        for opt in _optimizers(optimizer)
        for g in (next(saved) for _ in opt.param_groups)
    ]
    if options is not None and options.full_state_dict:
        return _gathered(model_sd, state, groups, holdings.group, options.cpu_offload)
    return model_sd, {"state": state, "param_groups": groups}


def _gathered(model_sd: dict, state: dict, groups: list, group, rank0_only: bool) -> Tuple[dict, dict]:
    """The state dicts with every ShardedTensor gathered whole, one at a time (on rank 0 alone
    with ``rank0_only``: the others' dicts are then empty)."""
    keep = not rank0_only or dist.get_rank(group) == 0
    dst = dist.get_global_rank(group, 0) if group is not None else 0

    def whole(v):
        if not isinstance(v, ShardedTensor):
            return v.detach().clone().cpu()
        shape = tuple(v.size())
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        flat = torch.zeros(math.prod(shape), dtype=v.dtype)
        for shard in v.local_shards():
            start, _ = _flat_range(shard, strides)
            t = shard.tensor.reshape(-1)
            flat[start : start + t.numel()] = t.cpu()
        if rank0_only:  # (the pieces are disjoint: their sum is the tensor)
            dist.reduce(flat, dst, group=group)
        else:
            dist.all_reduce(flat, group=group)
        return flat.view(shape)

    model_out = {k: whole(v) for k, v in model_sd.items()}
    state_out = {n: {k: whole(v) for k, v in e.items()} for n, e in state.items()}
    if not keep:
        return {}, {"state": {}, "param_groups": groups}
    return model_out, {"state": state_out, "param_groups": groups}


def _refuse_experts(holdings: Holdings, what: str) -> None:
    """Expert and tensor parallelism go through zeroshard's own checkpoints for now ([Note:
    expert checkpoints], [Note: tensor-parallel checkpoints] in checkpoint/parallel.py); the
    same outcome on every rank."""
    if holdings.has_experts or holdings.placed:
        raise CheckpointError(
            f"{what} of an expert- or tensor-parallel model is not supported yet: save and "
            "load it with zeroshard.save_checkpoint / load_checkpoint, which keep every "
            "expert and tensor under its whole-model name"
        )


def _optimizers(optimizer) -> list:
    return [o for o in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]) if o is not None]


def _fresh(model: nn.Module, optimizer) -> Optional[dict]:
    """For optimizer classes whose state is made at their first step (an elementwise or
    whole-tensor ``optimizer_class``) where no rank has any yet: a manifest of the state
    the class keeps, so that its tensors exist for ``dcp.load``; None where every
    optimizer is fused or has state (read as it is). Collective where such a class runs."""
    opts = [o for o in _optimizers(optimizer) if o.elementwise_rule is not None or o.whole_tensor_rule is not None]
    if not opts:
        return None
    mine = any(
        bool(o.whole_tensor_rule.owned_states())
        if o.whole_tensor_rule is not None
        else any(o.elementwise_rule.piece_state(i, t) for (i, t) in o.elementwise_rule.piece_leaves())
        for o in opts
    )
    if any(comm.all_gather_object(mine, group=opts[0].process_group, what="dcp_state_dict: optimizer state")):
        return None
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    tensors = {}
    for opt in opts:
        rule = opt.elementwise_rule or opt.whole_tensor_rule
        for i in opt.trainable:
            for kind, shape in _class_state(rule.cls, rule.kwargs, tuple(opt.full_shape(i))).items():
                tensors[f"{kind}:{names[id(opt.params[i])]}"] = {"shape": list(shape), "dtype": "float32", "step": 0}
    return {"tensors": tensors, "param_groups": None}


def _class_state(cls, kwargs: dict, shape: tuple) -> Dict[str, tuple]:
    """The state ``cls`` keeps for a parameter of ``shape``, each key's shape, from one step
    on a dummy whose dimensions are distinct primes (a state dimension of 1 stays 1)."""
    primes = (3, 5, 7, 11, 13, 17)[: len(shape)]
    p = nn.Parameter(torch.zeros(primes))
    opt = cls([p], **kwargs)
    p.grad = torch.ones(primes)
    opt.step()
    out = {}
    for kind, v in opt.state[p].items():
        dims = tuple(torch.as_tensor(v).shape)
        if any(d != 1 and d not in primes for d in dims):
            raise NotImplementedError(
                f"dcp_state_dict: {cls.__name__} keeps '{kind}' of a shape zeroshard cannot "
                "tell from the parameter's; save_checkpoint holds its state"
            )
        out[kind] = tuple(1 if d == 1 else shape[primes.index(d)] for d in dims)
    return out


def _owner_scalars(holdings: Holdings, by_key: Dict[str, List[Piece]], group) -> Dict[str, tuple]:
    """The shapes of the state tensors only their owners hold (a whole-tensor optimizer's),
    for every rank, and each owner's scalars given to every rank (a plain tensor DCP writes
    from whichever rank: all must hold its value)."""
    mine = {
        k: (tuple(sp.shape), by_key[k][0].data.item() if not sp.shape else None)
        for k, sp in holdings.local_specs.items()
    }
    shapes = {}
    for theirs in comm.all_gather_object(mine, group=group, what="dcp_state_dict: owners' state"):
        for key, (shape, value) in theirs.items():
            shapes[key] = shape
            if value is not None and key not in by_key:
                by_key[key] = [Piece(key, 0, torch.tensor([value]), True)]
    return shapes


def _torch_group_keys(optimizer) -> dict:
    cls = getattr(optimizer, "optimizer_class", None)
    return torch_group_keys(cls) if cls is not None else {}


def torch_group_keys(cls) -> dict:
    """Every key of a param group of the torch class ``cls``, with its default: DCP matches
    keys exactly, and a checkpoint torch's optimizer wrote has them all."""
    group = dict(cls([nn.Parameter(torch.zeros(1, 1))]).param_groups[0])
    group.pop("params")
    return group


def _flat_range(shard, strides: List[int]) -> Tuple[int, int]:
    """(flat index of the first element, of one past the last) of a local shard's rectangle."""
    off, size = shard.metadata.shard_offsets, shard.metadata.shard_sizes
    first = sum(o * st for o, st in zip(off, strides))
    return first, sum((o + z - 1) * st for o, z, st in zip(off, size, strides)) + 1


@torch.no_grad()
def load_dcp_state_dict(
    model: nn.Module, optimizer=None, *, model_state_dict: dict, optim_state_dict: Optional[dict] = None, options=None
) -> None:
    """Finish a load: ``model_state_dict`` / ``optim_state_dict`` from ``dcp_state_dict``,
    filled by ``dcp.load`` (or full tensors of the same names: each rank copies its own
    pieces). The optimizer takes the step counts and hyperparameters loaded. Collective
    where ``dcp_state_dict`` is. ``options``: torch's ``StateDictOptions``; with
    ``broadcast_from_rank0=True`` only rank 0's dicts hold values (full tensors), each
    broadcast in turn, as ``set_state_dict`` takes them for FSDP2."""
    holdings = Holdings(model, optimizer, for_load=True)
    _refuse_experts(holdings, "load_dcp_state_dict()")
    optim_state_dict = optim_state_dict or {"state": {}, "param_groups": []}
    if options is not None and options.broadcast_from_rank0:
        model_state_dict, optim_state_dict = _from_rank0(model_state_dict, optim_state_dict, holdings.group)
    tensors = {}
    for name, entry in optim_state_dict["state"].items():  # what an elementwise class keeps
        step = int(float(entry.get("step", 0)))
        for kind, v in entry.items():
            tensors[f"{kind}:{name}"] = {"shape": list(v.shape), "dtype": "float32", "step": step}
    man = {"tensors": tensors, "param_groups": None}
    holdings.adopt(man)
    for key, spec in holdings.specs.items():
        kind, _, name = key.partition(":")
        src = (
            model_state_dict.get(name)
            if kind in ("param", "buffer")
            else optim_state_dict["state"].get(name, {}).get(kind)
        )
        if src is None:
            continue
        for piece in (p for p in holdings.pieces if p.key == key):
            _copy_in(piece, src)
    for piece in holdings.pieces:  # an elementwise class's state, known from the manifest
        kind, _, name = piece.key.partition(":")
        if piece.key not in holdings.specs and kind in optim_state_dict["state"].get(name, {}):
            _copy_in(piece, optim_state_dict["state"][name][kind])
    man["param_groups"] = [
        {"params": list(g["params"]), "hyper": {k: v for k, v in g.items() if k != "params"}}
        for g in optim_state_dict["param_groups"]
    ]
    holdings.finish_load(man)


def _from_rank0(model_sd: dict, optim_sd: dict, group) -> Tuple[dict, dict]:
    """Rank 0's full state dicts on every rank, one tensor broadcast at a time."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    layout = [None]
    if dist.get_rank(group) == 0:
        layout = [
            (
                {k: (tuple(v.shape), v.dtype) for k, v in model_sd.items()},
                {
                    n: {k: (tuple(v.shape), torch.as_tensor(v).dtype) for k, v in e.items()}
                    for n, e in optim_sd["state"].items()
                },
                optim_sd["param_groups"],
            )
        ]
    dist.broadcast_object_list(layout, src=src, group=group)
    model_meta, state_meta, groups = layout[0]
    mine = dist.get_rank(group) == 0

    def one(value, meta):
        t = torch.as_tensor(value).detach().cpu().contiguous() if mine else torch.empty(meta[0], dtype=meta[1])
        dist.broadcast(t, src=src, group=group)
        return t

    model_out = {k: one(model_sd.get(k), m) for k, m in model_meta.items()}
    state_out = {
        n: {k: one(optim_sd["state"][n][k] if mine else None, m) for k, m in e.items()} for n, e in state_meta.items()
    }
    return model_out, {"state": state_out, "param_groups": groups}


def _copy_in(piece: Piece, src) -> None:
    """This rank's piece from ``src``: a ShardedTensor (``dcp.load`` filled it: its local
    shards, unless they are the piece's own memory) or a full tensor."""
    n = piece.data.numel()
    if isinstance(src, ShardedTensor):
        shape = tuple(src.size())
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        for shard in src.local_shards():
            off, size = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            start, end = _flat_range(shard, strides)
            t = shard.tensor.reshape(-1)
            if end - start != t.numel():
                raise ValueError(
                    f"load_dcp_state_dict: a local shard at {list(off)} of size {list(size)} is not a "
                    "flat element range; pass the state dicts dcp_state_dict made, filled by dcp.load"
                )
            lo, hi = max(start, piece.start), min(start + t.numel(), piece.start + n)
            if lo < hi and t.data_ptr() != piece.data[lo - piece.start :].data_ptr():  # not loaded in place
                piece.data[lo - piece.start : hi - piece.start].copy_(t[lo - start : hi - start])
        return
    flat = src.reshape(-1)
    piece.data.copy_(flat[piece.start : piece.start + n])
