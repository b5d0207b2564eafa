"""FSDP2's module API: ``zeroshard.fully_shard(module, ...)`` changes modules in place,
over FullyShard's machinery.

[Note: fully_shard in place]
* A call marks its module (a list of modules: one group, one unit) and swaps its class
  for ``FSDP<Class>``, a subclass of ``FSDPModule`` and of the module's own class, so
  ``isinstance(block, Block)`` holds and FSDP2's methods are there. Nothing else changes
  on the module: its ``Call`` (the call's modules, its options and, once built, the
  FullyShard) is kept in the instance's own ``__dict__`` (not a submodule, not a
  parameter attribute).
* A call on a module holding modules marked before (FSDP2's order: the blocks, then the
  root) completes the model at once: one FullyShard is built over it, each marked module
  (or group) a unit, the rest the root unit, with the root call's mesh, mixed precision and
  offload (the other calls must say the same) and each call's ``reshard_after_forward``
  for its own unit. A call on a module holding none (the only call, on the whole model, or
  the first block) completes at the first use of the model: its forward, ``parameters()``,
  ``state_dict()``, ``to_empty()``, any FSDPModule method; until then the module computes
  as before, so values set on it meanwhile are the ones sharded (rank 0's, as FullyShard).
  As FSDP2's, a marked module no call holds completes as a model of its own (two models,
  a call each: an RL actor and its reference); blocks called without a root call so leave
  the rest of the model unsharded, and a ShardedOptimizer over all of it is refused naming
  ``fully_shard(model)``.
* The root's class answers the calls FullyShard answers as a wrapper (its forward gathers
  the root unit around the model's own forward, ``named_parameters`` yields the sharded
  parameters, ``state_dict``/``load_state_dict`` are the full ones, ``to``/``to_empty``/
  ``zero_grad`` as FullyShard's), so a model completed in place checkpoints, steps and
  loads as one wrapped: ``save_checkpoint``, ``load_pretrained`` and the rest find the
  FullyShard through ``core.regions.sharded_model_of``.
* FSDP2's per-module settings are a unit's ``settings`` (zero3/records.py's
  UnitSettings): reshard after forward or backward, gradient sync, divide factor, explicit
  prefetch lists. ``unshard()``/``reshard()`` on a module gather and free its own unit, as
  FSDP2's: a gather its next forward takes over (and frees after, as usual), in flight with
  ``async_op=True`` until the handle's ``wait()`` or that forward; FullyShard's wrapper form
  holds every unit gathered until ``reshard()``. FullyShard's own ``gathered()``,
  ``no_sync()`` and ``memory_report()`` are there too, and a class with a ``generate``
  (Hugging Face's) gathers the model once per call, as FullyShard's ([Note: generation in
  one gather]).
"""

from __future__ import annotations

__all__ = ["FSDPModule", "fully_shard", "register_fsdp_forward_method"]

import functools
import itertools
import weakref
from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import torch.nn as nn

from ..core.regions import register_sharded_model
from .fully_shard import FullyShard
from .gather import reshard_setting
from .gathered import UnshardHandle
from .generation import gathered_generate
from .module_options import CallOptions, call_options, check_agree
from .records import InPlace, UnitGroups

_KEY = "_zeroshard_fully_shard"  # where a marked module keeps its Call (in its __dict__)
_calls = itertools.count()
_marked: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # marked, the model not yet complete
_building: List[nn.Module] = []  # the models whose FullyShard is being built (their own methods answer)


@dataclass
class Call:
    """One ``fully_shard`` call: its modules (a group when several) and its options."""

    seq: int
    modules: List[nn.Module]
    options: CallOptions
    engine: Optional[FullyShard] = None  # the FullyShard once the model is complete


def state_of(module: nn.Module) -> Optional[Call]:
    return vars(module).get(_KEY)


def own_class(module: nn.Module) -> type:
    """The module's class before fully_shard swapped it."""
    return next(c for c in type(module).__mro__ if not issubclass(c, InPlace))


def fully_shard(
    module: Union[nn.Module, List[nn.Module]],
    *,
    mesh=None,
    reshard_after_forward: Optional[Union[bool, int]] = None,
    shard_placement_fn: Optional[Callable] = None,
    mp_policy=None,
    offload_policy=None,
    ignored_params=None,
    dp_mesh_dims=None,
):
    """FSDP2's ``fully_shard``, in place ([Note: fully_shard in place]): call it on each
    block (or list of modules: one unit), then on the model; returns ``module``, its class
    now ``FSDP<Class>``. Takes torch's ``MixedPrecisionPolicy``, ``OffloadPolicy`` /
    ``CPUOffloadPolicy`` and ``DeviceMesh`` (1-D, or 2-D (replicate, shard) for hybrid
    sharding) as they are, or zeroshard's ``MixedPrecision`` and ``Offload``."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"fully_shard takes an nn.Module or a non-empty list of them, got {module!r}")
    for m in modules:
        if state_of(m) is not None:
            raise ValueError(f"fully_shard was already called on this {own_class(m).__name__}; call it once a module")
    options = call_options(
        modules,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        dp_mesh_dims=dp_mesh_dims,
    )
    call = Call(seq=next(_calls), modules=modules, options=options)
    root = modules[0] if len(modules) == 1 else None
    holds = root is not None and any(m is not root and _pending(m) for m in root.modules())
    for m in modules:
        vars(m)[_KEY] = call
        m.__class__ = _swapped(type(m))
        _marked.add(m)
    if holds:
        complete(root)
    return module


def _pending(m: nn.Module) -> bool:
    st = state_of(m)
    return st is not None and st.engine is None


def complete(root: nn.Module) -> FullyShard:
    """Build the FullyShard over ``root`` and the calls marked inside it ([Note: fully_shard in place])."""
    own = state_of(root)
    if len(own.modules) > 1:
        raise ValueError(
            "fully_shard([...]) makes a group inside a model; call zeroshard.fully_shard(model) on the model "
            "that holds it (FSDP2's root call)"
        )
    calls = {}
    for m in root.modules():
        if m is not root and _pending(m):
            calls.setdefault(state_of(m).seq, state_of(m))
    inner = [calls[k] for k in sorted(calls)]
    for c in inner:
        check_agree(own.options, c.options, own_class(root).__name__, own_class(c.modules[0]).__name__)
    inside = {id(m) for m in root.modules()}
    for c in inner:  # a group's modules must all lie inside the model
        outside = [own_class(m).__name__ for m in c.modules if id(m) not in inside]
        if outside:
            raise ValueError(f"fully_shard([...]): the group's modules {outside} are not inside the model")
    opts = own.options
    _building.append(root)
    try:
        engine = FullyShard(
            root,
            wrap=UnitGroups([c.modules for c in inner]),
            mixed_precision=opts.mixed_precision,
            sharding=opts.sharding,
            offload=opts.offload,
        )
    finally:
        _building.pop()
    for c in inner + [own]:
        c.engine = engine
        for m in c.modules:
            _marked.discard(m)
            if c.options.reshard_after_forward is not None and c is not own:
                after = reshard_setting(c.options.reshard_after_forward, engine.world_size, "fully_shard")
                engine.unit_for(m).settings.reshard_after_forward = after
    register_sharded_model(root, engine)
    return engine


def engine_of(module: nn.Module) -> FullyShard:
    """The FullyShard ``module`` belongs to, completing the model first if it is not yet."""
    st = state_of(module)
    if st is None:
        raise ValueError(f"{type(module).__name__} was not passed to zeroshard.fully_shard")
    if st.engine is None:
        complete(_root_of_pending(module))
    return st.engine


def _root_of_pending(module: nn.Module) -> nn.Module:
    """The one marked module no other marked module holds: the model to complete."""
    holders = [t for t in _marked_tops() if any(module is x for x in t.modules())]
    if len(holders) == 1:
        return holders[0]
    raise ValueError(
        f"{own_class(module).__name__} was passed to fully_shard, but no call on a model holds it: call "
        "zeroshard.fully_shard(model) on the model that holds it (FSDP2's root call), after the blocks"
    )


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """FSDP2's ``register_fsdp_forward_method``: ``module.<method_name>(...)`` gathers as its
    forward does (``module`` a fully_shard-ed module: a unit's, or the model's)."""
    engine_of(module).register_forward_method(module, method_name)


_SWAPPED: dict = {}


def _swapped(cls: type) -> type:
    """``FSDP<cls>``: FSDPModule's methods over ``cls``'s, made once per class (a class with a
    ``generate``, Hugging Face's: the model's gathers once per call, as FullyShard's does)."""
    if cls not in _SWAPPED:
        body = {"__module__": cls.__module__}
        if callable(getattr(cls, "generate", None)):
            body["generate"] = _generate_of(cls)
        _SWAPPED[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), body)
    return _SWAPPED[cls]


def _generate_of(cls: type):
    def generate(self, *args, **kwargs):
        own = functools.partial(cls.generate, self)
        engine = _as_root(self)
        return own(*args, **kwargs) if engine is None else gathered_generate(engine, own)(*args, **kwargs)

    generate.__doc__ = cls.generate.__doc__
    return generate


def _as_root(module: nn.Module) -> Optional[FullyShard]:
    """The FullyShard whose model ``module`` is (completing it first), else None."""
    if _building:  # FullyShard is reading the modules: their own methods answer
        return None
    engine = engine_of(module)
    return engine if engine.module is module else None


def _flag(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} takes a bool, got {value!r}")
    return value


def _not_here(name: str, why: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"FSDP2's {name} is not in zeroshard's fully_shard: {why}")

    method.__name__ = name
    return method


class FSDPModule(InPlace):
    """What ``fully_shard`` adds to a module's class ([Note: fully_shard in place]); as
    FSDP2's, ``isinstance(m, zeroshard.FSDPModule)`` says a module was passed to it."""

    # ------------------------------------------- the model's own calls (on the root)
    def forward(self, *args, **kwargs):
        own = super().forward
        st = state_of(self)
        if st.engine is None and not any(self is m for m in _marked_tops()):
            raise RuntimeError(
                f"{own_class(self).__name__} was called before the model it belongs to: call the model "
                "(or fully_shard(model), the root call) first, so its units are set up"
            )
        engine = _as_root(self)
        return own(*args, **kwargs) if engine is None else engine.run_forward(own, args, kwargs)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        engine = _as_root(self)
        if engine is None:
            return super().named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)
        return engine.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self, *args, **kwargs):
        engine = _as_root(self)
        return super().state_dict(*args, **kwargs) if engine is None else engine.state_dict(**kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        engine = _as_root(self)
        if engine is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        return engine.load_state_dict(state_dict, strict=strict, assign=assign)

    def _apply(self, fn, recurse: bool = True):
        engine = _as_root(self)
        if engine is None:
            return super()._apply(fn, recurse)
        engine.convert(fn)
        return self

    def to_empty(self, *, device, recurse: bool = True):
        engine = _as_root(self)
        if engine is None:
            return super().to_empty(device=device, recurse=recurse)
        engine.to_empty(device=device, recurse=recurse)
        return self

    def zero_grad(self, set_to_none: bool = True):
        engine = _as_root(self)
        if engine is None:
            raise RuntimeError(
                f"zero_grad() on {own_class(self).__name__}, a unit of a fully_shard-ed model: its gradient "
                "shards belong to the model; call optimizer.zero_grad() or model.zero_grad()"
            )
        engine.zero_grad(set_to_none)

    # --------------------------------------------------------- FSDP2's own calls
    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """This module's unit gathered (collective) until ``reshard()``; the handle when ``async_op``."""
        handle = engine_of(self).unshard(async_op, unit=self)
        return handle if async_op else None

    def reshard(self) -> None:
        engine_of(self).reshard(unit=self)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        flag = _flag(reshard_after_forward, "set_reshard_after_forward")
        for u in self._units(recurse):
            u.settings.reshard_after_forward = flag

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        flag = _flag(reshard_after_backward, "set_reshard_after_backward")
        for u in self._units(recurse):
            u.settings.reshard_after_backward = flag

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: this module's units (and those inside it, ``recurse``) add their gradients up
        locally, unreduced, until a backward with True (FullyShard's ``no_sync()``, per unit)."""
        flag = _flag(requires_gradient_sync, "set_requires_gradient_sync")
        for u in self._units(recurse):
            u.settings.requires_gradient_sync = flag

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """False (hybrid sharding): the units reduce-scatter within their replica but put off the
        all-reduce across replicas, keeping the sum for the next backward that runs it (FSDP2's,
        for accumulation); no replicas: nothing changes."""
        flag = _flag(requires_all_reduce, "set_requires_all_reduce")
        for u in self._units(recurse):
            u.settings.requires_all_reduce = flag

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This module's unit's gradients are the sum over every rank divided by ``factor``."""
        engine_of(self).set_gradient_divide_factor(factor, unit=self)

    def set_modules_to_forward_prefetch(self, modules: List["FSDPModule"]) -> None:
        engine = engine_of(self)
        engine.unit_for(self).settings.forward_prefetch = self._indices(engine, modules)

    def set_modules_to_backward_prefetch(self, modules: List["FSDPModule"]) -> None:
        engine = engine_of(self)
        engine.unit_for(self).settings.backward_prefetch = self._indices(engine, modules)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted: each backward finishes its reductions (FSDP2's skip is a speed setting)."""
        _flag(is_last_backward, "set_is_last_backward")

    def set_post_optim_event(self, event) -> None:
        """Accepted: the next forward's gathers follow the optimizer's step on the same stream."""

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: the reduce-scatter always sums, and the sum is divided after it."""
        _flag(enable, "set_force_sum_reduction_for_comms")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Accepted: a unit is gathered in backward when its gradients need it."""
        _flag(unshard_in_backward, "set_unshard_in_backward")

    # ------------------------------------------------- FullyShard's, on the model
    def gathered(self, dtype=None, units=None, *, modifier_rank=None):
        """FullyShard's ``gathered()`` block ([Note: gathered blocks]): every unit of the model,
        or ``units``; on a block's module, its own unit by default."""
        engine = engine_of(self)
        if units is None and engine.module is not self:
            units = [self]
        return engine.gathered(dtype, units, modifier_rank=modifier_rank)

    def no_sync(self):
        """FullyShard's ``no_sync()``: every unit accumulates locally for the block."""
        return engine_of(self).no_sync()

    def memory_report(self, reset_peak: bool = False):
        """FullyShard's ``memory_report()`` for the whole model."""
        return engine_of(self).memory_report(reset_peak)

    # ---------------------------------------------------------------- helpers
    def _units(self, recurse: bool):
        engine = engine_of(self)
        mods = [m for m in self.modules() if isinstance(m, FSDPModule)] if recurse else [self]
        return list({id(u): u for u in (engine.unit_for(m) for m in mods)}.values())

    @staticmethod
    def _indices(engine: FullyShard, modules) -> List[int]:
        out = []
        for m in modules:
            if not isinstance(m, FSDPModule) or engine_of(m) is not engine:
                raise ValueError(
                    f"prefetch lists take modules fully_shard-ed in the same model, got {type(m).__name__}"
                )
            out.append(engine.unit_for(m).index)
        return out


for _name, _why in {
    "set_all_reduce_hook": "the replicas' all-reduce is zeroshard's own (hybrid sharding)",
    "set_custom_all_gather": "gathers go through torch.distributed's all_gather",
    "set_custom_reduce_scatter": "reductions go through torch.distributed's reduce_scatter",
    "set_reduce_scatter_divide_factor": "use set_gradient_divide_factor",
    "set_allocate_memory_from_process_group_for_comm": "buffers come from torch's allocator",
    "set_keep_unsharded_storage": "use unshard() / reshard(), or set_reshard_after_forward(False)",
    "set_symm_mem_for_comm": "buffers come from torch's allocator",
    "set_manual_backward_finalization": "each backward finalizes its reductions",
    "finalize_backward": "each backward finalizes its reductions",
    "reset_iter_state": "each forward starts its own state",
    "set_separate_reduce_scatter_group": "reductions use the model's process group",
    "set_reduce_scatter_unused_params": "a unit's parameters without gradients reduce as zeros",
    "set_reduce_scatter_max_input_buffers": "one reduction is in flight at a time",
}.items():
    setattr(FSDPModule, _name, _not_here(_name, _why))


def _marked_tops() -> List[nn.Module]:
    marked = list(_marked)
    inside = {id(x) for m in marked for x in m.modules() if x is not m}
    return [m for m in marked if id(m) not in inside]
