"""ZeRO-3: FullyShard, a module wrapper that shards parameters, gradients and
(with ShardedOptimizer) optimizer states across the ranks of a process group.

[Note: fully shard policy]
* Units. Every module the ``wrap`` policy selects becomes a sharding unit; the
  parameters of the other modules form the root unit. A parameter belongs to
  the unit of the nearest wrapped module that registers it; a parameter
  registered in two units (a tie across units) is an error. Each unit is laid
  out by zeroshard.compute_layout as one bucket, so each rank owns one
  contiguous, padded, 16-byte aligned fp32 shard of it (``_Unit.shard``), plus
  an fp32 gradient shard of the same length (``_Unit.grad_shard``). The
  gradient shard exists only from the unit's first reduction to
  ``zero_grad(set_to_none=True)``, which frees it, so it is not held through
  the forward and the start of backward, where the activations peak.
* Parameters. ``FullyShard.named_parameters()`` yields one 1-D parameter per
  original parameter: this rank's piece of it, a view into the unit's shard
  (possibly empty). While a unit is gathered, its modules hold "full"
  parameters instead: leaves whose data are views of the unit's gathered flat
  buffer in ``param_dtype``. Resharding frees that buffer's *storage*
  (``untyped_storage().resize_(0)``), so tensors autograd saved in forward
  stop holding memory; gathering again re-grows the same storage, so those
  saved tensors see the gathered values again in backward.
* Forward. Before a unit runs its shard is cast into its chunk of the flat
  buffer and all-gathered in place; the next ``prefetch`` units in the
  recorded forward order are gathered ahead (on their own stream on CUDA,
  in the backend's thread on CPU), with at most ``prefetch + 1`` non-root
  units gathered at once. The order is recorded by the first forward and
  re-recorded whenever a forward runs units in another order. The root unit
  is gathered for the whole forward and, when grad is enabled, kept until the
  end of backward (it is needed at both ends of both passes); inference
  (no grad) frees every unit after its forward.
* Backward. A hook on each unit's forward outputs re-gathers it (and
  prefetches the next units in reverse forward order). Autograd leaves each
  full parameter's gradient on it. When a unit's last gradient has arrived,
  the unit is resharded and the gradients are moved (added, then freed) into
  its flat gradient buffer (``reduce_dtype``), allocated only then, after
  the unit's activations are freed (once the buffer exists, e.g. while
  accumulating under ``no_sync``, gradients are added as they arrive). The
  buffer is reduce-scattered (SUM) in place; the result, divided by the
  world size, is written (or added, when accumulating) into the fp32
  gradient shard. Reduce-scatters
  are issued in one fixed order on every rank (reverse forward order, root
  last; zeroshard/_ordered.py, shared with stages 1 and 2); one is in flight
  at a time (finished ones are retired early), and at the end of backward
  every unit not yet reduced is (a gradient that never arrived counts as zero).
* ``no_sync()`` skips the reduce-scatters: the flat gradient buffers (full
  size, ``reduce_dtype``) keep accumulating until a backward outside it.
* The optimizer (zeroshard.ShardedOptimizer) updates the fp32 shards in place
  and calls ``_invalidate`` so no stale gathered copy survives a step.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from . import comm
from ._ordered import OrderedReductions
from .layout import compute_layout, fill_flat

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
_MAX_INFLIGHT = 1        # reduce-scatters in flight at once (each holds one unit's gradients)
_NO_CAP = 1 << 62        # bucket cap for unit layouts: one bucket per unit

# sharded parameter id -> (weakref to it, weakref to its FullyShard, unit index, param index)
_OWNERS: Dict[int, tuple] = {}


def owner_of(p: torch.Tensor):
    """The FullyShard that made parameter ``p``, else None."""
    e = _OWNERS.get(id(p))
    return e[1]() if e is not None and e[0]() is p else None


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of FullyShard's gathered parameters and gradient reduction.

    ``param_dtype``: dtype the parameters are all-gathered in and the forward
    and backward compute with (None: float32). ``reduce_dtype``: dtype of the
    gradient reduce-scatter (None: ``param_dtype``). Shards, gradient shards
    and optimizer states stay float32 either way.
    """
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None


@dataclass
class _Param:
    names: List[str]                    # every name it is registered under, first is canonical
    slots: List[Tuple[nn.Module, str]]  # (module, attribute) registrations
    shape: torch.Size
    dtype: torch.dtype                  # original dtype (state_dict returns it)
    requires_grad: bool
    offset: int = 0                     # in the unit's flat buffer
    full: Optional[nn.Parameter] = None     # compute parameter (view of the gathered buffer)
    sharded: Optional[nn.Parameter] = None  # this rank's piece (view of the shard)
    shard_offset: int = 0               # where the piece starts in the shard
    tensor_offset: int = 0              # where the piece starts in the flattened parameter
    arrived: bool = False               # gradient arrived in this backward

    @property
    def numel(self) -> int:
        return self.shape.numel()


_SHARDED, _GATHERING, _GATHERED = 0, 1, 2


@dataclass
class _Unit:
    index: int
    name: str                     # module path, '' for the root
    module: nn.Module
    params: List[_Param]
    numel: int = 0                # padded flat size (world_size * shard_numel)
    shard_numel: int = 0
    shard: Optional[torch.Tensor] = None        # fp32, this rank's shard
    grad_shard: Optional[torch.Tensor] = None   # fp32, averaged gradient shard (None until reduced)
    full: Optional[torch.Tensor] = None         # param_dtype flat buffer; storage freed when sharded
    state: int = _SHARDED
    gather: Optional[comm.CommHandle] = None
    grad_flat: Optional[torch.Tensor] = None    # reduce_dtype flat gradients during backward
    reduce: Optional[comm.CommHandle] = None
    fresh: bool = True            # the reduction overwrites the gradient shard (no accumulation)
    pending: int = 0              # trainable params whose gradient has not arrived this backward
    hooks: list = field(default_factory=list)

    @property
    def is_root(self) -> bool:
        return self.index == 0

    @functools.cached_property
    def trainable(self) -> List[_Param]:   # read once the units are built (every backward)
        return [p for p in self.params if p.requires_grad]

    def own(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        return flat[rank * self.shard_numel:(rank + 1) * self.shard_numel]


def _check_dtype(dt, what):
    if dt is not None and dt not in _SUPPORTED:
        raise ValueError(f"{what} must be one of {_SUPPORTED} or None, got {dt!r}")


class FullyShard(nn.Module):
    """ZeRO-3: shard ``module``'s parameters over ``process_group`` unit by unit.

    ``wrap`` names the module classes (a set of classes, or a predicate on a
    module) that become sharding units; everything else belongs to the root
    unit. See [Note: fully shard policy] in zeroshard/fully_shard.py. Use with
    ``zeroshard.ShardedOptimizer(model.parameters(), ...)``, which updates the
    shards in place. ``device`` (default: the parameters' device, or the
    current CUDA device / CPU for a model on ``meta``) holds the shards;
    ``device="meta"`` keeps them on meta, for planning and memory reports.
    """

    def __init__(self, module: nn.Module, wrap: Union[Iterable[type], Callable[[nn.Module], bool], None] = None,
                 mixed_precision: Optional[MixedPrecision] = None, reshard_after_forward: bool = True,
                 prefetch: int = 1, process_group: Optional[dist.ProcessGroup] = None, *,
                 device: Union[torch.device, str, None] = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShard wraps an nn.Module, got {type(module).__name__}")
        if isinstance(module, FullyShard):
            raise ValueError("this module is already a FullyShard; wrap the inner model once")
        if not dist.is_initialized():
            raise RuntimeError("FullyShard needs torch.distributed: call "
                               "torch.distributed.init_process_group() first (torchrun sets it up)")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        mp = mixed_precision or MixedPrecision()
        if not isinstance(mp, MixedPrecision):
            raise TypeError(f"mixed_precision must be a zeroshard.MixedPrecision, got {type(mp).__name__}")
        _check_dtype(mp.param_dtype, "mixed_precision.param_dtype")
        _check_dtype(mp.reduce_dtype, "mixed_precision.reduce_dtype")
        self.module = module
        self.param_dtype = mp.param_dtype or torch.float32
        self.reduce_dtype = mp.reduce_dtype or self.param_dtype
        self.mixed_precision = mp
        self.reshard_after_forward = bool(reshard_after_forward)
        self.prefetch = prefetch
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self._src = dist.get_global_rank(self.process_group, 0) if process_group is not None else 0
        self.comm_elements = {"all_gather": 0, "reduce_scatter": 0}
        # (what, unit name) of recent gathers, forwards, reshards and reductions, in
        # order; bounded so a long run does not grow it (the tests read it)
        self.events: collections.deque = collections.deque(maxlen=4096)
        self._sync = True
        self._in_forward = False
        self._bwd_active = False
        self._grads_ready = False
        self._fwd_order: List[int] = []      # recorded forward order of non-root units
        self._fwd_seen: List[int] = []
        self._bwd_order: List[int] = []      # reverse forward order, fixed at backward start
        self._reductions = OrderedReductions(self._launch, self._retire, _MAX_INFLIGHT)
        self._optimizers: List[weakref.ref] = []
        self._gathered_bytes = 0             # non-root units
        self._gathered_peak = 0
        self._alive_peak = 0
        self._grad_bytes = 0
        self._grad_bytes_peak = 0

        self._device = self._pick_device(device)
        self._units = self._make_units(wrap)
        self._check_same_model_across_ranks()
        meta_init = any(p.is_meta for p in module.parameters())
        self._build(meta_init)
        self._buffers_to_device()
        if meta_init and self._device.type != "meta":
            self._materialize()
        fs_ref = weakref.ref(self)
        for u in self._units:
            for q in u.params:
                _OWNERS[id(q.sharded)] = (weakref.ref(q.sharded), fs_ref)
        weakref.finalize(self, _forget, [id(q.sharded) for u in self._units for q in u.params])
        self._install_hooks()

    # ------------------------------------------------------------------ setup
    def _err(self, msg: str) -> str:
        return f"[rank {self.rank}/{self.world_size}] {msg}"

    def _pick_device(self, device) -> torch.device:
        devs = {p.device for p in self.module.parameters()}
        real = {d for d in devs if d.type != "meta"}
        if len(real) > 1:
            raise ValueError(self._err(f"the model's parameters are on several devices {sorted(map(str, real))}; "
                                       "move the model to one device (or build it on meta) before FullyShard"))
        if device is not None:
            device = torch.device(device)
            if real and device not in real and not (device.type == "cuda" and device.index is None):
                raise ValueError(self._err(f"device={device} but the parameters are on {next(iter(real))}; "
                                           "move the model there first or build it on meta"))
        elif real:
            device = next(iter(real))
        elif torch.cuda.is_available() and dist.get_backend(self.process_group) not in ("gloo", "fake"):
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda", "meta"):
            raise ValueError(self._err(f"device {device}: FullyShard supports cpu, cuda and meta"))
        return device

    def _make_units(self, wrap) -> List[_Unit]:
        if wrap is None:
            pred = lambda m: False  # noqa: E731
        elif callable(wrap) and not isinstance(wrap, type):
            pred = wrap
        else:
            classes = tuple(wrap) if not isinstance(wrap, type) else (wrap,)
            for c in classes:
                if not (isinstance(c, type) and issubclass(c, nn.Module)):
                    raise ValueError(f"wrap must hold nn.Module classes (or be a predicate), got {c!r}")
            present = {type(m) for m in self.module.modules()}
            for c in classes:
                if not any(issubclass(t, c) for t in present):
                    names = ", ".join(sorted({t.__name__ for t in present}))
                    raise ValueError(f"wrap names {c.__name__}, but no module of that class is in the model "
                                     f"(classes present: {names}); list the classes of the blocks to shard")
            pred = lambda m: isinstance(m, classes)  # noqa: E731
        units = [_Unit(index=0, name="", module=self.module, params=[])]
        owner: Dict[int, Tuple[int, _Param]] = {}
        self._named: List[Tuple[str, _Param]] = []   # every registration, in named_parameters() order

        def visit(mod: nn.Module, path: str, unit: _Unit):
            for attr, p in mod._parameters.items():
                if p is None:
                    continue
                name = f"{path}.{attr}" if path else attr
                seen = owner.get(id(p))
                if seen is None or seen[0] == unit.index:
                    self._named.append((name, seen[1] if seen else None))
                if seen is None:
                    q = _Param(names=[name], slots=[(mod, attr)], shape=p.shape, dtype=p.dtype,
                               requires_grad=p.requires_grad)
                    owner[id(p)] = (unit.index, q)
                    unit.params.append(q)
                    self._named[-1] = (name, q)
                    if p.dtype not in _SUPPORTED:
                        raise ValueError(self._err(f"parameter '{name}' has dtype {p.dtype}; FullyShard "
                                                   "supports float32, bfloat16 and float16 parameters"))
                elif seen[0] != unit.index:
                    other = units[seen[0]].name or "<root>"
                    here = unit.name or "<root>"
                    raise ValueError(self._err(
                        f"parameter '{seen[1].names[0]}' is shared with '{name}', but they are in different "
                        f"sharding units ('{other}' and '{here}'); a shared parameter must live in one unit: "
                        "wrap a module that contains both users, or leave both to the root unit"))
                else:
                    seen[1].names.append(name)
                    seen[1].slots.append((mod, attr))
            for cname, child in mod._modules.items():
                if child is None:
                    continue
                cpath = f"{path}.{cname}" if path else cname
                if pred(child):
                    if isinstance(child, FullyShard):
                        raise ValueError(f"'{cpath}' is already a FullyShard; wrap the inner model once")
                    u = _Unit(index=len(units), name=cpath, module=child, params=[])
                    units.append(u)
                    visit(child, cpath, u)
                else:
                    visit(child, cpath, unit)

        visit(self.module, "", units[0])
        for u in units:
            for q in u.params:
                p = q.slots[0][0]._parameters[q.slots[0][1]]
                if owner_of(p) is not None:
                    raise ValueError(f"parameter '{q.names[0]}' already belongs to a FullyShard")
        return units

    def _check_same_model_across_ranks(self):
        mine = [(u.name, [(q.names[0], tuple(q.shape), str(q.dtype), q.requires_grad) for q in u.params])
                for u in self._units]
        everyone = comm.all_gather_object(mine, group=self.process_group)
        for r, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                raise ValueError(self._err(f"rank {r} and rank 0 built different models "
                                           f"({_first_difference(theirs, everyone[0])}); every rank "
                                           "must build the same model"))

    def _layout_dtype(self):
        # elements aligned for both the fp32 shard and the param_dtype buffer
        return self.param_dtype if self.param_dtype.itemsize < 4 else torch.float32

    @torch.no_grad()
    def _build(self, meta_init: bool):
        dev, r, W = self._device, self.rank, self.world_size
        for u in self._units:
            if not u.params:
                continue
            L = compute_layout([q.numel for q in u.params], [self._layout_dtype()] * len(u.params),
                               _NO_CAP, W)
            assert len(L.buckets) == 1
            u.numel, u.shard_numel = L.buckets[0].numel, L.buckets[0].shard_numel
            for q, place in zip(u.params, L.tensors):
                q.offset = place.offset
            u.shard = torch.zeros(u.shard_numel, dtype=torch.float32, device=dev)
            if not meta_init and dev.type != "meta":
                # rank 0's values everywhere (like DDP), one unit at a time
                flat = torch.zeros(u.numel, dtype=torch.float32, device=dev)
                for q in u.params:
                    src = q.slots[0][0]._parameters[q.slots[0][1]]
                    flat[q.offset:q.offset + q.numel].copy_(src.detach().reshape(-1))
                if W > 1:
                    dist.broadcast(flat, src=self._src, group=self.process_group)
                u.shard.copy_(u.own(flat, r))
                del flat
            lo, hi = r * u.shard_numel, (r + 1) * u.shard_numel
            u.full = torch.empty(u.numel, dtype=self.param_dtype, device=dev)
            for q in u.params:
                a, b = max(lo, q.offset), min(hi, q.offset + q.numel)
                if a >= b:                   # this rank owns none of it: an empty piece
                    a = b = lo
                q.shard_offset, q.tensor_offset = a - lo, max(0, a - q.offset)
                q.sharded = nn.Parameter(u.shard[a - lo:b - lo], requires_grad=q.requires_grad)
                q.full = nn.Parameter(torch.empty(0, dtype=self.param_dtype, device=dev),
                                      requires_grad=q.requires_grad)
                q.full.data = u.full[q.offset:q.offset + q.numel].view(q.shape)
                for mod, attr in q.slots:
                    mod._parameters[attr] = q.sharded
            if dev.type != "meta":
                u.full.untyped_storage().resize_(0)

    @torch.no_grad()
    def _buffers_to_device(self):
        for mod in self.module.modules():
            for name, b in mod._buffers.items():
                if b is None:
                    continue
                if b.is_meta and self._device.type != "meta":
                    b = torch.zeros(b.shape, dtype=b.dtype, device=self._device)
                elif b.device != self._device and self._device.type != "meta":
                    b = b.to(self._device)
                if self.world_size > 1 and not b.is_meta:
                    dist.broadcast(b, src=self._src, group=self.process_group)
                mod._buffers[name] = b

    @torch.no_grad()
    def _materialize(self):
        """Initialise a model built on meta unit by unit: run the reset_parameters()
        of every module that registers parameters or buffers, in module order (the
        order construction would initialise them, so a seeded run reproduces a
        model built normally), on fp32 full-size copies of its unit; then keep
        this rank's shard. At most the root unit and one other are full at once."""
        unit_of: Dict[tuple, Tuple[_Unit, _Param]] = {}
        for u in self._units:
            for q in u.params:
                for mod, attr in q.slots:
                    unit_of[id(mod), attr] = (u, q)
        mods = list(self.module.modules())
        last_use: Dict[int, int] = {}
        for k, mod in enumerate(mods):
            for attr in mod._parameters:
                if (id(mod), attr) in unit_of:
                    last_use[unit_of[id(mod), attr][0].index] = k
        temp: Dict[int, torch.Tensor] = {}
        initialised, uninitialised_buffers = set(), []
        for k, mod in enumerate(mods):
            owned = [unit_of[id(mod), attr] for attr in mod._parameters if (id(mod), attr) in unit_of]
            has_buffers = any(b is not None for b in mod._buffers.values())
            if callable(getattr(mod, "reset_parameters", None)) and (owned or has_buffers):
                for u, q in owned:
                    if u.index not in temp:
                        temp[u.index] = self._full_fp32_views(u)
                    initialised.add(id(q))
                mod.reset_parameters()
            elif has_buffers:
                uninitialised_buffers += [n for n, b in mod._buffers.items() if b is not None]
            for ui in [ui for ui, last in last_use.items() if last == k and ui in temp]:
                u = self._units[ui]
                u.shard.copy_(u.own(temp.pop(ui), self.rank))
                for q in u.params:
                    for m2, a2 in q.slots:
                        m2._parameters[a2] = q.sharded
        missing = [q.names[0] for u in self._units for q in u.params if id(q) not in initialised]
        if missing or uninitialised_buffers:
            warnings.warn(
                "FullyShard: the model was built on meta; these parameters/buffers have no module "
                f"reset_parameters() to initialise them, so they start at zero: {missing + uninitialised_buffers}. "
                "Load a state dict (model.load_state_dict) or give their modules reset_parameters().")

    def _full_fp32_views(self, u: _Unit) -> torch.Tensor:
        """An fp32 full-size buffer for unit u, its parameters' modules pointing at views of it."""
        flat = torch.zeros(u.numel, dtype=torch.float32, device=self._device)
        for q in u.params:
            view = nn.Parameter(flat[q.offset:q.offset + q.numel].view(q.shape), requires_grad=q.requires_grad)
            for mod, attr in q.slots:
                mod._parameters[attr] = view
        return flat

    def _install_hooks(self):
        for u in self._units[1:]:
            u.hooks.append(u.module.register_forward_pre_hook(
                lambda m, args, u=u: self._pre_forward(u)))
            u.hooks.append(u.module.register_forward_hook(
                lambda m, args, out, u=u: self._post_forward(u, out)))
        # root-unit modules called directly (not through this wrapper) get a clear error
        root_mods = {id(mod): mod for q in self._units[0].params for mod, _ in q.slots}
        for mod in root_mods.values():
            if mod is not self.module:
                self._units[0].hooks.append(mod.register_forward_pre_hook(
                    lambda m, args: self._check_called_inside(self._units[0], m)))
        for u in self._units:
            for q in u.params:
                if q.requires_grad:
                    u.hooks.append(q.full.register_post_accumulate_grad_hook(
                        lambda p, u=u, q=q: self._on_grad(u, q)))

    # -------------------------------------------------------------- nn.Module
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self._modules["module"], name)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's sharded parameters (1-D pieces), under their original names,
        in the unwrapped model's order."""
        seen = set()
        for n, q in self._named:
            if remove_duplicate and id(q) in seen:
                continue
            seen.add(id(q))
            yield (f"{prefix}.{n}" if prefix else n), q.sharded

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    # ---------------------------------------------------------------- gather
    def _check_called_inside(self, u: _Unit, mod: nn.Module):
        if not (self._in_forward or self._bwd_active) or u.state == _SHARDED:
            what = f"unit '{u.name}'" if u.name else f"root-unit module {type(mod).__name__}"
            raise RuntimeError(self._err(
                f"{what} was called directly, outside the FullyShard-wrapped model's forward; its "
                "parameters are sharded. Call the wrapped model (model(...)), or wrap the module you "
                "call in a FullyShard of its own"))

    def _gather(self, u: _Unit, wait: bool = True):
        if u.state == _SHARDED and u.params:
            if self._device.type == "meta":
                raise RuntimeError(self._err("this FullyShard keeps its shards on meta (device='meta'); "
                                             "it can report memory but not run"))
            u.full.untyped_storage().resize_(u.full.numel() * u.full.element_size())
            own = u.own(u.full, self.rank)
            own.copy_(u.shard)
            u.gather = comm.all_gather(own, u.full, group=self.process_group)
            self.comm_elements["all_gather"] += u.numel
            self.events.append(("all_gather", u.name))
            u.state = _GATHERING
            if not u.is_root:
                self._gathered_bytes += u.full.numel() * u.full.element_size()
                self._gathered_peak = max(self._gathered_peak, self._gathered_bytes)
                self._alive_peak = max(self._alive_peak, self._alive())
        if wait and u.state == _GATHERING:
            u.gather.wait()
            u.gather = None
            u.state = _GATHERED
            for q in u.params:
                for mod, attr in q.slots:
                    mod._parameters[attr] = q.full

    def _reshard(self, u: _Unit):
        if u.state == _SHARDED:
            return
        if u.state == _GATHERING:
            u.gather.wait()
            u.gather = None
        u.full.untyped_storage().resize_(0)
        self.events.append(("reshard", u.name))
        for q in u.params:
            for mod, attr in q.slots:
                mod._parameters[attr] = q.sharded
        u.state = _SHARDED
        if not u.is_root:
            self._gathered_bytes -= u.full.numel() * u.full.element_size()

    def _alive(self) -> int:
        return sum(1 for u in self._units[1:] if u.state != _SHARDED)

    def _prefetch(self, order: List[int], pos: int):
        """Start gathering the units after position ``pos`` of ``order``."""
        for ui in order[pos + 1:pos + 1 + self.prefetch]:
            u = self._units[ui]
            if u.state != _SHARDED:
                continue
            if self._alive() >= self.prefetch + 1:
                break
            self._gather(u, wait=False)

    @torch.no_grad()
    def _invalidate(self):
        """Drop every gathered copy (the shards changed)."""
        for u in self._units:
            self._reshard(u)

    # --------------------------------------------------------------- forward
    def forward(self, *args, **kwargs):
        if self._bwd_active:
            if torch._C._current_graph_task_id() != -1:
                raise RuntimeError(self._err("the FullyShard model was called during its own backward"))
            self._abandon_backward()     # the last backward raised before it finished
        root = self._units[0]
        self._in_forward = True
        self._fwd_seen = []
        try:
            with torch.no_grad():
                self._gather(root, wait=False)
                self._prefetch(self._fwd_order, -1)
                self._gather(root)
            out = self.module(*args, **kwargs)
        except BaseException:
            self._in_forward = False
            self._invalidate()
            raise
        self._in_forward = False
        grad = torch.is_grad_enabled()
        if self._fwd_seen != self._fwd_order:
            self._fwd_order = list(self._fwd_seen)     # (re-)record the order
        with torch.no_grad():
            for u in self._units[1:]:                  # prefetched but not run
                if u.state == _GATHERING or (u.state == _GATHERED and self.reshard_after_forward
                                              and u.index not in self._fwd_seen):
                    self._reshard(u)
            if not grad:
                self._invalidate()
                return out
        self._hook_outputs(out, lambda: self._pre_backward(None))
        return out

    def _hook_outputs(self, out, fn):
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, lambda grads: fn(), mode="any")

    def _pre_forward(self, u: _Unit):
        if not (self._in_forward or self._bwd_active):
            self._check_called_inside(u, u.module)   # raises
        with torch.no_grad():
            if self._bwd_active:            # recomputation (activation checkpointing)
                self._gather(u)
                return
            self._fwd_seen.append(u.index)
            self.events.append(("forward", u.name))
            pos = len(self._fwd_seen) - 1
            self._gather(u)
            if pos < len(self._fwd_order) and self._fwd_order[pos] == u.index:
                self._prefetch(self._fwd_order, pos)

    def _post_forward(self, u: _Unit, out):
        if self._bwd_active:
            return None
        grad = torch.is_grad_enabled()
        if self.reshard_after_forward or not grad:
            with torch.no_grad():
                self._reshard(u)
        if grad:
            self._hook_outputs(out, lambda u=u: self._pre_backward(u))
        return None

    # -------------------------------------------------------------- backward
    def _start_backward(self):
        if self._bwd_active:
            return
        self._bwd_active = True
        self._grads_ready = False
        self._bwd_order = list(reversed(self._fwd_order))
        seen = set(self._fwd_order)
        rest = [u.index for u in self._units[1:] if u.index not in seen]
        self._reductions.start([self._units[ui] for ui in self._bwd_order + rest + [0]
                                if self._units[ui].trainable])
        for u in self._units:
            u.pending = len(u.trainable)
            for q in u.params:
                q.arrived = False
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    @torch.no_grad()
    def _pre_backward(self, u: Optional[_Unit]):
        self._start_backward()
        bwd = self._bwd_order
        if u is None:              # root: its outputs' gradient is the first of the backward
            self._gather(self._units[0])
            self._prefetch(bwd, -1)
            return
        self._retire_completed()
        self._gather(u)
        if u.index in bwd:
            self._prefetch(bwd, bwd.index(u.index))

    @torch.no_grad()
    def _on_grad(self, u: _Unit, q: _Param):
        self._start_backward()
        if u.grad_flat is not None:   # accumulating into an existing flat buffer: add as they come
            self._move_grad(u, q)
        self.events.append(("grad", u.name))
        if not q.arrived:
            q.arrived = True
            u.pending -= 1
            if u.pending == 0:
                if not u.is_root:
                    self._reshard(u)
                self._flatten_grads(u)
                if self._sync:
                    self._reductions.advance()

    def _move_grad(self, u: _Unit, q: _Param):
        u.grad_flat[q.offset:q.offset + q.numel].add_(q.full.grad.reshape(-1))
        q.full.grad = None

    def _flatten_grads(self, u: _Unit):
        """Move the gradients autograd left on the unit's full parameters into its
        flat gradient buffer, allocated now: not at the unit's first gradient,
        while the unit's activations are still alive (the peak of backward)."""
        if u.grad_flat is not None:       # accumulating: add what arrived since
            for q in u.trainable:
                if q.full.grad is not None:
                    self._move_grad(u, q)
            return
        self._retire_completed()          # free finished reductions' buffers before taking another
        u.grad_flat = torch.empty(u.numel, dtype=self.reduce_dtype, device=self._device)
        self._grad_bytes += u.grad_flat.numel() * u.grad_flat.element_size()
        self._grad_bytes_peak = max(self._grad_bytes_peak, self._grad_bytes)
        # one pass: gradients copied in; padding and gradients that never arrived are zero
        fill_flat(u.grad_flat, [(q.offset, q.full.grad.reshape(-1))
                                for q in u.trainable if q.full.grad is not None])
        for q in u.trainable:
            q.full.grad = None

    def _launch(self, u: _Unit):
        self._flatten_grads(u)        # a unit some gradient never reached: the rest count as zero
        # overwrite the shard unless the user kept gradients from an earlier backward
        u.fresh = any(q.sharded.grad is None for q in u.trainable)
        u.reduce = comm.reduce_scatter(u.grad_flat, u.own(u.grad_flat, self.rank), group=self.process_group,
                                       average=False, input_is_scratch=True)
        self.comm_elements["reduce_scatter"] += u.numel
        self.events.append(("reduce_scatter", u.name))

    def _retire_completed(self):
        self._reductions.retire_done(lambda u: u.reduce.completed())

    def _retire(self, u: _Unit):
        u.reduce.wait()
        u.reduce = None
        chunk = u.own(u.grad_flat, self.rank)
        if u.grad_shard is None:     # first reduction since zero_grad(set_to_none=True)
            u.grad_shard = torch.empty(u.shard_numel, dtype=torch.float32, device=self._device)
            u.fresh = True
        if u.fresh and chunk.dtype == torch.float32:
            torch.div(chunk, self.world_size, out=u.grad_shard)     # one pass
        elif u.fresh:
            u.grad_shard.copy_(chunk).div_(self.world_size)          # divide in fp32
        else:
            u.grad_shard.add_(chunk.float().div_(self.world_size))
        for q in u.trainable:
            q.sharded.grad = u.grad_shard[q.shard_offset:q.shard_offset + q.sharded.numel()]
        self._grad_bytes -= u.grad_flat.numel() * u.grad_flat.element_size()
        u.grad_flat = None

    @torch.no_grad()
    def _finish_backward(self):
        if self._sync:
            self._reductions.advance(flush=True)
            self._reductions.drain()
            self._grads_ready = True
        self._invalidate()
        self._bwd_active = False

    @torch.no_grad()
    def _abandon_backward(self):
        """Forget a backward that stopped half-way (it raised): its gradients are dropped."""
        for u in self._reductions.inflight:
            u.reduce.wait()
        self._reductions.reset()
        for u in self._units:
            u.reduce, u.grad_flat = None, None
            for q in u.trainable:
                q.full.grad = None
        self._grad_bytes = 0
        self._invalidate()
        self._bwd_active = False
        warnings.warn("FullyShard: the previous backward did not finish (it raised); its partial "
                      "gradients were dropped")

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (full size, in reduce_dtype) without
        communication; the next backward outside this context reduces them all."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def zero_grad(self, set_to_none: bool = True):
        """``set_to_none=True`` (the default) frees the gradient shards; the next
        backward allocates them as its reductions finish. ``False`` zeroes them
        in place (gradients that were None stay None, as in torch)."""
        if self._bwd_active:
            raise RuntimeError(self._err("zero_grad() called during backward"))
        for u in self._units:
            if set_to_none or u.grad_shard is None:
                u.grad_shard = None
                for q in u.trainable:
                    q.sharded.grad = None
                continue
            u.grad_shard.zero_()
            for q in u.trainable:
                q.sharded.grad = u.grad_shard[q.shard_offset:q.shard_offset + q.sharded.numel()]
        self._grads_ready = False

    # ---------------------------------------------------------------- memory
    def memory_report(self, reset_peak: bool = False) -> Dict[str, int]:
        """Bytes held on this rank.

        Persistent: ``params`` (fp32 shards), ``grads`` (fp32 gradient shards,
        held from backward's reductions to ``zero_grad(set_to_none=True)`` and
        counted whether held at the moment or not),
        ``master`` (always 0: the fp32 shard is the master), ``exp_avg`` and
        ``exp_avg_sq`` (fp32, from the ShardedOptimizer over these parameters;
        0 without one): each counts only elements of real parameters (grads
        and states: trainable ones); ``padding`` is every other byte of those
        tensors; ``total`` their sum: 16 bytes per owned element with an
        optimizer. Transient: ``gathered`` / ``gathered_peak`` (full parameters
        of non-root units), ``gathered_units_peak`` (most non-root units
        gathered at once), ``root_gathered`` (the root unit's full size),
        ``max_unit`` (largest non-root unit's full bytes), ``grad_buffers`` /
        ``grad_buffers_peak`` (flat gradient buffers of backward). Peaks count
        since construction or the last call with ``reset_peak=True``.
        """
        rep = dict(params=0, grads=0, master=0, exp_avg=0, exp_avg_sq=0, padding=0)
        states = self._optimizer_states()
        for u in self._units:
            if not u.params:
                continue
            own = sum(q.sharded.numel() for q in u.params)
            own_t = sum(q.sharded.numel() for q in u.trainable)
            rep["params"] += 4 * own
            rep["grads"] += 4 * own_t
            rep["padding"] += 4 * (u.shard_numel - own) + (4 * (u.shard_numel - own_t) if u.trainable else 0)
            for name, t in states.get(u.index, {}).items():
                rep[name] += 4 * own_t
                rep["padding"] += t.numel() * t.element_size() - 4 * own_t
        rep["total"] = sum(rep.values())
        item = self.param_dtype.itemsize
        rep.update(gathered=self._gathered_bytes, gathered_peak=self._gathered_peak,
                   gathered_units_peak=self._alive_peak,
                   root_gathered=self._units[0].numel * item,
                   max_unit=max([u.numel * item for u in self._units[1:]], default=0),
                   grad_buffers=self._grad_bytes, grad_buffers_peak=self._grad_bytes_peak)
        if reset_peak:
            self._gathered_peak, self._alive_peak = self._gathered_bytes, self._alive()
            self._grad_bytes_peak = self._grad_bytes
        return rep

    def _optimizer_states(self) -> Dict[int, Dict[str, torch.Tensor]]:
        out: Dict[int, Dict[str, torch.Tensor]] = {}
        for ref in self._optimizers:
            opt = ref()
            if opt is not None:
                for (fs, ui), st in opt._unit_states.items():
                    if fs is self:
                        out[ui] = st
        return out

    # ------------------------------------------------------------ state dict
    @torch.no_grad()
    def state_dict(self, *, to: Optional[int] = None, prefix: str = "", keep_vars: bool = False,
                   destination=None):
        """The full, unsharded state dict of the wrapped model (original names,
        dtypes and shapes, on CPU), loadable into the unwrapped model.

        Collective: every rank must call it. Units are gathered one at a time
        and copied to CPU, so the transient extra memory is one unit. With
        ``to=r`` only global rank ``r`` builds and returns it; the others return None.
        """
        keep = to is None or dist.get_rank() == to
        template = self.module.state_dict(keep_vars=True)
        values: Dict[str, torch.Tensor] = {}
        for u in self._units:
            if not u.params:
                continue
            flat = torch.empty(u.numel, dtype=torch.float32, device=self._device)
            comm.all_gather(u.shard, flat, group=self.process_group).wait()
            if not keep:
                continue
            flat = flat.cpu()
            for q in u.params:
                t = flat[q.offset:q.offset + q.numel].view(q.shape).to(q.dtype).clone()
                for n in q.names:
                    values[n] = t
        if not keep:
            return None
        out = destination if destination is not None else {}
        for k, v in template.items():
            out[prefix + k] = values[k] if k in values else v.detach().cpu().clone()
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full state dict (of the unwrapped model, from any world size):
        each rank copies its own pieces; no communication."""
        template = self.module.state_dict(keep_vars=True)
        missing = [k for k in template if k not in state_dict]
        unexpected = [k for k in state_dict if k not in template]
        if strict and (missing or unexpected):
            raise RuntimeError(self._err(f"state dict mismatch: missing keys {missing}, unexpected keys "
                                         f"{unexpected}; it must be the unwrapped model's state dict"))
        self._invalidate()
        param_names = set()
        for u in self._units:
            for q in u.params:
                param_names.update(q.names)
                src = next((state_dict[n] for n in q.names if n in state_dict), None)
                if src is None:
                    continue
                if src.numel() != q.numel:
                    raise ValueError(self._err(f"state dict entry '{q.names[0]}' has shape {tuple(src.shape)} "
                                               f"but the parameter has shape {tuple(q.shape)}"))
                n = q.sharded.numel()
                piece = src.reshape(-1)[q.tensor_offset:q.tensor_offset + n]
                u.shard[q.shard_offset:q.shard_offset + n].copy_(piece)
        for k, v in template.items():
            if k in param_names or k not in state_dict:
                continue
            if isinstance(v, torch.Tensor):
                v.copy_(state_dict[k])
        return nn.modules.module._IncompatibleKeys(missing, unexpected)


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


def _forget(ids):
    for i in ids:
        _OWNERS.pop(i, None)
