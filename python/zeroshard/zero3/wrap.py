"""FullyShard's setup: where the shards live, the sharding units, their flat
layout and shards, buffers, and initialising a model built on meta unit by
unit. Functions of a ``Setup`` (what FullyShard decided before building)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..offload import host_empty
from ..core.claims import claimant
from ..core.source import SUPPORTED
from ..core.tensor_parallel import compute_param, local_tensor, placed_of, refused
from .param import ShardedParameter
from .records import Param, Unit, UnitGroups, left_out, owner_of
from ..native.layout import compute_layout

_NO_CAP = 1 << 62  # bucket cap for unit layouts: one bucket per unit


@dataclass(kw_only=True)
class Setup:
    """What the setup functions need from the FullyShard being built."""

    module: nn.Module
    device: torch.device
    group: object  # the process group
    world: int
    rank: int
    src: int  # global rank whose values everyone takes (rank 0 of ``everyone``)
    param_dtype: torch.dtype
    err: Callable[[str], str]  # rank-prefixed error message
    everyone: object  # every rank holding a copy: ``group`` x the replicas (hybrid sharding)
    ranks: object = None  # ``group`` as a ShardGroup (comm/mesh.py): the units' ranks
    # expert_modules: module class -> the ShardGroup its instances' units shard over ([Note:
    # param groups over their own ranks] in comm/mesh.py)
    experts: dict = field(default_factory=dict)
    shard_device: torch.device  # where the fp32 shards live: ``device``, or host memory (offload_params)
    # a model built on meta: its non-persistent buffers nothing initialised (materialize)
    unset_buffers: List[str] = field(default_factory=list)
    # a model partly on meta: the parameters that had values (kept, not initialised)
    valued: set = field(default_factory=set)


def build(cfg: "Setup", wrap, nested: type) -> Tuple[List[Unit], List[Tuple[str, Param]]]:
    """Every setup step in order: units from the module tree, the same model on
    every rank, their layout and shards, buffers, meta initialisation."""
    units, named = make_units(cfg, wrap, nested)
    check_same_model(cfg, units)
    meta_init = any(p.is_meta for p in cfg.module.parameters())
    _check_experts(cfg, units, meta_init)
    build_units(cfg, units, meta_init)
    buffers_to_device(cfg)
    if meta_init and cfg.device.type != "meta":
        materialize(cfg, units)
    return units, named


def pick_device(module: nn.Module, device, group, err: Callable[[str], str]) -> torch.device:
    """Where the shards live: ``device`` if given, else the parameters' device, else the
    current CUDA device (NCCL) or CPU, for a model built on meta."""
    devs = {p.device for p in module.parameters()}
    real = {d for d in devs if d.type != "meta"}
    if len(real) > 1:
        raise ValueError(
            err(
                f"the model's parameters are on several devices {sorted(map(str, real))}; "
                "move the model to one device (or build it on meta) before FullyShard"
            )
        )
    if device is not None:
        device = torch.device(device)
        if real and device not in real and not (device.type == "cuda" and device.index is None):
            raise ValueError(
                err(
                    f"device={device} but the parameters are on {next(iter(real))}; "
                    "move the model there first or build it on meta"
                )
            )
    elif real:
        device = next(iter(real))
    elif torch.cuda.is_available() and dist.get_backend(group) not in ("gloo", "fake"):
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(err(f"device {device}: FullyShard supports cpu, cuda and meta"))
    return device


def _wrap_predicate(module: nn.Module, wrap) -> Callable[[nn.Module], bool]:
    """Which modules become units: none (None), a predicate, or instances of the given classes."""
    if wrap is None:
        return lambda m: False
    if isinstance(wrap, UnitGroups):
        return wrap
    if callable(wrap) and not isinstance(wrap, type):
        return wrap
    classes = tuple(wrap) if not isinstance(wrap, type) else (wrap,)
    for c in classes:
        if not (isinstance(c, type) and issubclass(c, nn.Module)):
            raise ValueError(f"wrap must hold nn.Module classes (or be a predicate), got {c!r}")
    present = {type(m) for m in module.modules()}
    for c in classes:
        if not any(issubclass(t, c) for t in present):
            names = ", ".join(sorted({t.__name__ for t in present}))
            raise ValueError(
                f"wrap names {c.__name__}, but no module of that class is in the model "
                f"(classes present: {names}); list the classes of the blocks to shard"
            )
    return lambda m: isinstance(m, classes)


def _check_not_sparse(mod: nn.Module, path: str, err: Callable[[str], str]):
    if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse and mod.weight.requires_grad:
        raise ValueError(
            err(
                f"'{path or type(mod).__name__}' is an {type(mod).__name__} with sparse=True: its "
                "gradients would be sparse, and FullyShard reduces dense gradients in flat "
                "buffers. Build it with sparse=False"
            )
        )


@dataclass
class Kept:
    """A parameter left out of sharding (integer or bool: it takes no gradient). It
    stays on its module, moved to the shards' device and broadcast as buffers are."""

    sharded: nn.Parameter


def _check_param(cfg: "Setup", name: str, p: torch.Tensor) -> None:
    if p.dtype not in SUPPORTED:
        raise ValueError(
            cfg.err(
                f"parameter '{name}' has dtype {p.dtype}; FullyShard supports float32, bfloat16 and float16 parameters"
            )
        )
    why = refused(p)
    if why:
        raise ValueError(cfg.err(f"parameter '{name}' is a DTensor {why}"))


def make_units(cfg: "Setup", wrap, nested: type) -> Tuple[List[Unit], List[Tuple[str, Param]]]:
    """The sharding units (root first) and every parameter registration in
    named_parameters() order; ``nested`` is the FullyShard class (refused inside)."""
    pred = _wrap_predicate(cfg.module, wrap)
    units = [Unit(index=0, name="", module=cfg.module, params=[], ranks=cfg.ranks)]
    owner: Dict[int, Tuple[int, Param]] = {}
    named: List[Tuple[str, Param]] = []  # every registration, in named_parameters() order
    grouped: Dict[int, Unit] = {}  # fully_shard's groups: their one unit each

    def visit(mod: nn.Module, path: str, unit: Unit):
        _check_not_sparse(mod, path, cfg.err)
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            name = f"{path}.{attr}" if path else attr
            if left_out(p):
                named.append((name, Kept(p)))
                continue
            seen = owner.get(id(p))
            if seen is None or seen[0] == unit.index:
                named.append((name, seen[1] if seen else None))
            if seen is None:
                q = _param_of(name, mod, attr, p)
                owner[id(p)] = (unit.index, q)
                unit.params.append(q)
                named[-1] = (name, q)
                _check_param(cfg, name, p)
            elif seen[0] != unit.index:
                raise _shared_across_units(cfg, seen[1].names[0], name, units[seen[0]].name, unit.name)
            else:
                seen[1].names.append(name)
                seen[1].slots.append((mod, attr))
        for cname, child in mod._modules.items():
            if child is None:
                continue
            cpath = f"{path}.{cname}" if path else cname
            if pred(child) or isinstance(child, tuple(cfg.experts)):
                if isinstance(child, nested):
                    raise ValueError(f"'{cpath}' is already a FullyShard; wrap the inner model once")
                key = pred.key(child) if isinstance(pred, UnitGroups) else None
                u = grouped.get(key) if key is not None else None
                if u is not None:  # another module of a group: the same unit
                    u.group.append(child)
                else:
                    u = Unit(
                        index=len(units),
                        name=cpath,
                        module=child,
                        params=[],
                        ranks=next((sg for c, sg in cfg.experts.items() if isinstance(child, c)), cfg.ranks),
                    )
                    units.append(u)
                    if key is not None:
                        grouped[key] = u
                visit(child, cpath, u)
            else:
                visit(child, cpath, unit)

    visit(cfg.module, "", units[0])
    for u in units:
        for q in u.params:
            p = q.slots[0][0]._parameters[q.slots[0][1]]
            if owner_of(p) is not None:
                raise ValueError(f"parameter '{q.names[0]}' already belongs to a FullyShard")
    return units, named


def _param_of(name: str, mod: nn.Module, attr: str, p: torch.Tensor) -> Param:
    """The record of parameter ``p``, registered as ``mod.<attr>`` (its path ``name``)."""
    return Param(
        names=[name],
        slots=[(mod, attr)],
        shape=local_tensor(p.detach()).shape,
        dtype=p.dtype,
        requires_grad=p.requires_grad,
        placed=placed_of(p),
    )


def _shared_across_units(cfg: "Setup", first: str, name: str, other: str, here: str) -> ValueError:
    """A parameter registered as ``first`` in unit ``other`` and as ``name`` in unit ``here``."""
    return ValueError(
        cfg.err(
            f"parameter '{first}' is shared with '{name}', but they are in different sharding units "
            f"('{other or '<root>'}' and '{here or '<root>'}'); a shared parameter must live in one unit: "
            "wrap a module that contains both users, or leave both to the root unit"
        )
    )


def _check_experts(cfg: "Setup", units: List[Unit], meta_init: bool):
    """What expert units ([Note: param groups over their own ranks]) do not do yet: refused."""
    for u in units:
        if not u.ranks.own:
            continue
        if meta_init or any(True for _ in u.module.buffers()) or any(left_out(p) for p in u.module.parameters()):
            what = "was built on meta" if meta_init else "holds buffers or integer parameters"
            raise ValueError(
                cfg.err(
                    f"expert module '{u.name}' {what}: expert_modules does not initialise a "
                    "model built on meta nor keep per-expert buffers yet; build the model with "
                    "values and keep buffers out of the experts"
                )
            )


def check_same_model(cfg: "Setup", units: List[Unit]):
    mine = [(u.name, [(q.names[0], tuple(q.shape), str(q.dtype), q.requires_grad) for q in u.params]) for u in units]
    everyone = comm.all_gather_object(mine, group=cfg.everyone, what="setup: same model on every rank")
    for r, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise ValueError(
                cfg.err(
                    f"rank {r} and rank 0 built different models "
                    f"({_first_difference(theirs, everyone[0])}); every rank "
                    "must build the same model"
                )
            )


def _layout_dtype(param_dtype: torch.dtype) -> torch.dtype:
    # elements aligned for both the fp32 shard and the param_dtype buffer
    return param_dtype if param_dtype.itemsize < 4 else torch.float32


def layout_align(param_dtype: torch.dtype) -> int:
    """Elements every parameter and chunk of a unit starts at a multiple of (16 bytes of both dtypes)."""
    return 16 // _layout_dtype(param_dtype).itemsize


@torch.no_grad()
def build_units(cfg: "Setup", units: List[Unit], meta_init: bool):
    """Each unit's layout, fp32 shard (rank 0's values everywhere) and full buffer;
    the modules then hold the sharded parameters."""
    dev = cfg.device
    # the root last: by then the other units' full parameters are freed, so its full
    # buffer (allocated below, then released) never sits beside the whole model
    for u in units[1:] + units[:1]:
        if not u.params:
            continue
        r, W = u.ranks.rank, u.ranks.world
        offsets, u.shard_numel = unit_layout(cfg, u)
        u.numel = u.shard_numel * W
        for q, off in zip(u.params, offsets):
            q.offset = off
        set_grad_extent(u, W)
        u.shard = host_or_device_zeros(u.shard_numel, cfg.shard_device, dev)
        lo, hi = r * u.shard_numel, (r + 1) * u.shard_numel
        if dev.type != "meta":
            _fill_shard(cfg, u, lo, hi)
        u.full = torch.empty(u.numel, dtype=cfg.param_dtype, device=dev)
        for q in u.params:
            place_piece(u, q, lo, hi)
            q.sharded = ShardedParameter(
                q.local,
                q.full_shape,
                q.names[0],
                requires_grad=q.requires_grad,
                start=q.tensor_offset,
                whole=q.placed is None and not u.ranks.own,
                group=u.ranks.group,
            )
            q.full = compute_param(u.full[q.offset : q.offset + q.numel].view(q.shape), q.placed, q.requires_grad)
            for mod, attr in q.slots:
                mod._parameters[attr] = q.sharded
        if dev.type != "meta":
            u.full.untyped_storage().resize_(0)


def unit_layout(cfg: "Setup", u: Unit) -> Tuple[List[int], int]:
    """(each parameter's offset, the chunk length) of ``u``'s flat buffer in equal chunks,
    its trainable parameters first ([Note: frozen parameters])."""
    order = sorted(range(len(u.params)), key=lambda k: not u.params[k].requires_grad)
    L = compute_layout(
        [u.params[k].numel for k in order], [_layout_dtype(cfg.param_dtype)] * len(u.params), _NO_CAP, u.ranks.world
    )
    assert len(L.buckets) == 1
    offsets = [0] * len(u.params)
    for k, place in zip(order, L.tensors):
        offsets[k] = place.offset
    return offsets, L.buckets[0].shard_numel


def set_grad_extent(u: Unit, world: int):
    """Which part of ``u``'s flat buffer its gradients are reduced over.

    [Note: frozen parameters] A frozen parameter is gathered for compute but takes
    no gradient, so nothing of it is reduced (LoRA and BitFit freeze most of each
    unit). The unit lays its trainable parameters out first, and its gradient
    buffer ends with the last of them (``Unit.grad_numel``): the frozen ones after
    it have neither gradient buffer, reduce-scatter nor gradient shard. Each rank's
    chunk of the gradients is then the start of its chunk of the parameters, cut
    at ``grad_numel`` (``Unit.grad_bounds``, chunks of different lengths: [Note:
    uneven collectives]); the ranks whose chunks hold only frozen parameters
    receive nothing. A unit with no frozen parameter after its last trainable one
    keeps its equal chunks. A parameter frozen after wrapping takes no gradient at
    once; the next forward lays its unit out again without it (relayout.retrain), as
    FSDP2 leaves it out, unless an optimizer over the unit holds state (it stepped or
    loaded a checkpoint): then its place is still reduced (as zeros), so that state
    stays where it is for when it is unfrozen, as torch keeps it.

    A unit is resharded after its backward once its last gradient has arrived:
    with every parameter trainable, each operation's parameter gradients and
    input gradients come from one autograd node, so that is the end. A frozen
    weight is still read after that, for the gradient of the unit's inputs
    (autograd may finish a frozen Linear's trainable bias, or an adapter, first).
    So a unit holding frozen parameters passes the inputs of each call that
    require grad through an identity autograd function (``UnitForward``), and
    its backward also waits for that function's backward: the gradients of
    its inputs, after which nothing reads its weights."""
    ends = [q.offset + q.numel for q in u.params if q.requires_grad]
    end = max(ends, default=0)
    if any(not q.requires_grad and q.offset >= end and q.numel for q in u.params):
        u.grad_numel = end
        u.grad_bounds = [min(u.span(r)[0], end) for r in range(world)] + [end]
    else:
        u.grad_numel, u.grad_bounds = u.numel, None


def place_piece(u: Unit, q: Param, lo: int, hi: int):
    """``q``'s piece in this rank's chunk ``[lo, hi)`` of ``u``'s flat buffer (at ``q.offset``)."""
    a, b = max(lo, q.offset), min(hi, q.offset + q.numel)
    if a >= b:  # this rank owns none of it: an empty piece
        a = b = lo
    q.shard_offset, q.tensor_offset = a - lo, max(0, a - q.offset)
    q.local = u.shard[a - lo : b - lo]


def _fill_shard(cfg: "Setup", u: Unit, lo: int, hi: int):
    """Rank 0's values everywhere (like DDP): each parameter with values (not on meta:
    [Note: partly on meta]) is broadcast in place, as
    DDP syncs module states, and this rank's part of it copied into the fp32 shard
    (padding stays zero). No flat copy of the unit is made: while the model is being
    wrapped its full parameters are all still alive, and a copy of the largest unit
    beside them would be the peak of the whole run (GPT-2's embedding: 154 MB)."""
    for q in u.params:
        src = local_tensor(q.slots[0][0]._parameters[q.slots[0][1]].detach())
        if src.is_meta:  # a model built on meta: materialize initialises it
            continue
        cfg.valued.add(id(q))
        if src.device != cfg.device:  # a model partly on meta (an adapter made on CPU)
            src = src.to(cfg.device)
        group, first = (
            (cfg.everyone, cfg.src) if not u.ranks.own else (u.ranks.group, dist.get_global_rank(u.ranks.group, 0))
        )  # (an expert: its edp group's)
        if dist.get_world_size(group) > 1:
            if not src.is_contiguous():
                src = src.contiguous()
            dist.broadcast(src, src=first, group=group)
        a, b = max(lo, q.offset), min(hi, q.offset + q.numel)
        if a < b:
            u.shard[a - lo : b - lo].copy_(src.reshape(-1)[a - q.offset : b - q.offset])


def shard_device(device: torch.device, offload_params: bool) -> torch.device:
    """Where the fp32 shards live: host memory with ``offload_params`` (a model on meta
    keeps them on meta: it only plans), else with the parameters."""
    return torch.device("cpu") if offload_params and device.type != "meta" else device


def host_or_device_empty(n: int, where: torch.device, device: torch.device) -> torch.Tensor:
    """fp32 memory on ``where``, uninitialised: ``device`` itself, or host memory standing
    in for it (offload_params, gradient shards bound for the host; pinned for CUDA). For
    a buffer its first writer fills whole (zeroing a pinned gradient shard first would be
    a CPU memset, host time spent for nothing)."""
    return host_empty(n, device) if where.type == "cpu" else torch.empty(n, dtype=torch.float32, device=where)


def host_or_device_zeros(n: int, where: torch.device, device: torch.device) -> torch.Tensor:
    """As host_or_device_empty, zeroed."""
    return host_or_device_empty(n, where, device).zero_()


@torch.no_grad()
def buffers_to_device(cfg: "Setup"):
    """Buffers and the parameters left out of sharding (``Kept``): on the device, rank 0's values."""
    for mod in cfg.module.modules():
        for name, p in mod._parameters.items():
            if p is not None and left_out(p):
                if p.device != cfg.device and cfg.device.type != "meta" and not p.is_meta:
                    p = mod._parameters[name] = nn.Parameter(p.to(cfg.device), requires_grad=False)
                if dist.get_world_size(cfg.everyone) > 1 and not p.is_meta:
                    comm.broadcast_bytes(p.data, cfg.src, cfg.everyone)
        for name, b in mod._buffers.items():
            if b is None:
                continue
            if b.is_meta and cfg.device.type != "meta":
                b = torch.zeros(b.shape, dtype=b.dtype, device=cfg.device)
            elif b.device != cfg.device and cfg.device.type != "meta":
                b = b.to(cfg.device)
            if dist.get_world_size(cfg.everyone) > 1 and not b.is_meta:
                comm.broadcast_bytes(b, cfg.src, cfg.everyone)
            mod._buffers[name] = b


@torch.no_grad()
def materialize(cfg: "Setup", units: List[Unit]):
    """Initialise a model built on meta unit by unit: run the reset_parameters()
    of every module that registers parameters or buffers, in module order (the
    order construction would initialise them, so a seeded run reproduces a
    model built normally), on fp32 full-size copies of its unit; then keep
    this rank's shard. At most the root unit and one other are full at once.

    [Note: partly on meta] Parameters that are not on meta (a LoRA adapter made
    by its library on CPU beside a base model on meta) keep their values: their
    shards were filled when the units were built, a module all of whose
    parameters have values is not reset, and only the pieces of the others are
    copied from the initialised copies."""
    unit_of: Dict[tuple, Tuple[Unit, Param]] = {}
    for u in units:
        for q in u.params:
            for mod, attr in q.slots:
                unit_of[id(mod), attr] = (u, q)
    names = {id(m): n for n, m in cfg.module.named_modules()}
    mods = list(cfg.module.modules())
    last_use: Dict[int, int] = {}
    for k, mod in enumerate(mods):
        for attr in mod._parameters:
            if (id(mod), attr) in unit_of:
                last_use[unit_of[id(mod), attr][0].index] = k
    temp: Dict[int, torch.Tensor] = {}
    initialised, uninitialised_buffers, unsaved = set(), [], []
    for k, mod in enumerate(mods):
        owned = [unit_of[id(mod), attr] for attr in mod._parameters if (id(mod), attr) in unit_of]
        has_buffers = any(b is not None for b in mod._buffers.values())
        if owned and all(id(q) in cfg.valued for _, q in owned) and not has_buffers:
            initialised.update(id(q) for _, q in owned)  # its values were given: kept
        elif callable(getattr(mod, "reset_parameters", None)) and (owned or has_buffers):
            for u, q in owned:
                if u.index not in temp:
                    temp[u.index] = _full_fp32_views(u, cfg.device)
                initialised.add(id(q))
            mod.reset_parameters()
        elif has_buffers:
            saved = mod.state_dict(keep_vars=True)  # (its persistent buffers only)
            for n, b in mod._buffers.items():
                if b is not None:
                    full = f"{names[id(mod)]}.{n}".lstrip(".")
                    (uninitialised_buffers if n in saved else unsaved).append(full)
        for ui in [ui for ui, last in last_use.items() if last == k and ui in temp]:
            _keep_initialised(cfg, units[ui], temp.pop(ui))
    missing = [q.names[0] for u in units for q in u.params if id(q) not in initialised]
    if missing or uninitialised_buffers:
        warnings.warn(
            "FullyShard: the model was built on meta; these parameters/buffers have no module "
            f"reset_parameters() to initialise them, so they start at zero: {missing + uninitialised_buffers}. "
            "Load their values (model.load_state_dict, zeroshard.load_pretrained) or give their modules "
            "reset_parameters()."
        )
    cfg.unset_buffers.extend(unsaved)
    if unsaved:
        warnings.warn(
            f"FullyShard: the model was built on meta; its non-persistent buffers {unsaved} have no module "
            "reset_parameters() to initialise them, so they start at zero, and no state dict or checkpoint "
            "holds them: loading one leaves them zero (a rotary embedding's inv_freq computed in __init__ is "
            "one). zeroshard.load_pretrained sets them for a Hugging Face model; otherwise set them after "
            "wrapping as the module's __init__ computes them, or build the model with its buffers off meta"
        )


def _keep_initialised(cfg: "Setup", u: Unit, flat: torch.Tensor):
    """This rank's pieces of the initialised copy ``flat`` into ``u``'s shard (not of the
    parameters that had values: [Note: partly on meta]); the modules hold the sharded ones again."""
    mine = u.own(flat, cfg.rank)
    for q in u.params:
        if id(q) not in cfg.valued:
            n = q.local.numel()
            u.shard[q.shard_offset : q.shard_offset + n].copy_(mine[q.shard_offset : q.shard_offset + n])
        for mod, attr in q.slots:
            mod._parameters[attr] = q.sharded


def _full_fp32_views(u: Unit, device: torch.device) -> torch.Tensor:
    """An fp32 full-size buffer for unit u, its parameters' modules pointing at views of it."""
    flat = torch.zeros(u.numel, dtype=torch.float32, device=device)
    for q in u.params:
        view = nn.Parameter(flat[q.offset : q.offset + q.numel].view(q.shape), requires_grad=q.requires_grad)
        for mod, attr in q.slots:
            mod._parameters[attr] = view
    return flat


def _first_difference(a: list, b: list) -> str:
    for (ua, pa), (ub, pb) in zip(a, b):
        if ua != ub:
            return f"unit '{ua}' vs '{ub}'"
        for x, y in zip(pa, pb):
            if x != y:
                return f"parameter (name, shape, dtype, requires_grad) {x} vs {y}"
        if len(pa) != len(pb):
            return f"unit '{ua}' has {len(pa)} vs {len(pb)} parameters"
    return f"{len(a)} vs {len(b)} sharding units"


def claimed(module: nn.Module) -> List[tuple]:
    """(name, parameter, claimant) for each parameter of ``module`` a claimant (a
    ShardedOptimizer) was built over before the wrap ([Note: construction order] in
    core/claims.py)."""
    found = [(n, p, claimant(p)) for n, p in module.named_parameters(remove_duplicate=False)]
    return [c for c in found if c[2] is not None]


def hand_over(found: List[tuple], named: List[Tuple[str, Param]], err: Callable[[str], str]) -> None:
    """Tell each claimant in ``found`` which sharded parameters replaced its plain ones."""
    sharded = {n: q.sharded for n, q in named}
    claimants: list = []
    for _, _, c in found:
        if all(c is not k for k in claimants):
            claimants.append(c)
    for c in claimants:
        try:
            c.params_replaced([(p, sharded[name]) for name, p, k in found if k is c])
        except (ValueError, RuntimeError) as e:
            raise type(e)(
                err(
                    "a ShardedOptimizer was built over this model's parameters before FullyShard wrapped it "
                    f"(DDP's order), and it cannot step the sharded ones: {e} -- build it over "
                    "model.parameters() after the wrap, or over parameters all inside the wrapped model"
                )
            ) from None
