"""The engines' lifetimes: which live engine holds a parameter, which FullyShard
wrapped a model, and what an engine lends the user beyond training (``destroy``,
``empty_partition_cache``, the module's attributes).

DeepSpeed marks each parameter it manages (``ds_id``, ``_hp_mapping``) and its
helpers (``GatheredParameters``, ``deepspeed.utils``' ``safe_*``) read those
marks. zeroshard leaves the parameters alone and keeps weak records instead:
the engines ``initialize`` made (until collected or destroyed), and the
FullyShard each stage-3 engine wrapped its model in (alive as long as the
model: its hooks hold it), which a second ``initialize`` over the same model
reuses.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn

_ENGINES: "weakref.WeakSet" = weakref.WeakSet()
# model -> a weak reference to the FullyShard that wrapped it (its hooks keep that alive)
_WRAPPED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
_SERIAL = itertools.count()


class Tracked:
    """DeepSpeedEngine's lifetime: recorded while alive and not destroyed (``track`` in its
    constructor); ``module``, ``runner`` (FullyShard at stage 3, else the module) and
    ``optimizer`` are the engine's."""

    def track(self) -> None:
        self.destroyed = False  # destroy(), or a later initialize over the same model
        self.serial = next(_SERIAL)
        self.param_index: Dict[int, int] = {}  # parameter id -> index in optimizer.params (index_of)
        _ENGINES.add(self)

    def __getattr__(self, name: str):
        """As DeepSpeed's engine: an attribute the engine lacks is the module's (``engine.id``
        for ``model.id``, its methods, its submodules)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name == "module":
                raise
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(
                    f"'{type(self).__name__}' object has no attribute '{name}' (nor has its module, "
                    f"a {type(module).__name__})"
                ) from None

    def destroy(self) -> None:
        """DeepSpeed's ``engine.destroy()``: the optimizer lets go of the parameters (its hooks
        removed, its claim on them dropped), so a later ``initialize`` may train the model
        (at stage 3 it reuses the FullyShard the model is wrapped in); this engine refuses
        training calls from then on. A second ``initialize`` over the same model calls it."""
        if self.destroyed:
            return
        if self.optimizer is not None:
            self.optimizer.release()
        self.destroyed = True

    def empty_partition_cache(self) -> None:
        """DeepSpeed's ``engine.empty_partition_cache()``: stage 3 reshards every unit still
        gathered (a ``gathered()`` block's excepted) and the allocator's cache is emptied;
        nothing is gathered at other stages."""
        if self.runner is not self.module:
            self.runner.invalidate()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def param_ids(self) -> set:
        """The ids of the parameters this engine trains or holds (the user's model's, and at
        stage 3 its FullyShard's, the same objects between uses)."""
        return {id(p) for p in self.module.parameters()} | {id(p) for p in self.runner.parameters()}

    def _check_alive(self, what: str) -> None:
        if self.destroyed:
            raise RuntimeError(
                f"{what} on a destroyed engine: engine.destroy() ran, or a later zeroshard.initialize "
                "over the same model took the model over (as DeepSpeed's does); train with the "
                "engine that initialize returned last"
            )


def engines() -> list:
    """The live engines not destroyed, oldest first."""
    return sorted((e for e in list(_ENGINES) if not e.destroyed), key=lambda e: e.serial)


def holding(t: torch.Tensor):
    """The live engine whose model holds parameter ``t`` (a parameter of the user's model or,
    at stage 3, of the FullyShard it trains), else None."""
    for e in engines():
        if id(t) in e.param_ids():
            return e
    return None


def over(model: nn.Module):
    """The live engine built over ``model``, else None."""
    return next((e for e in engines() if e.module is model), None)


def wrapped(model: nn.Module, fs: Optional[nn.Module] = None):
    """Record (``fs``) or look up the FullyShard a stage-3 engine wrapped ``model`` in."""
    if fs is not None:
        _WRAPPED[model] = weakref.ref(fs)
        return fs
    ref = _WRAPPED.get(model)
    fs = ref() if ref is not None else None
    return fs if fs is not None and fs.module is model else None


def index_of(engine, t: torch.Tensor) -> Optional[Tuple[object, int]]:
    """(the engine's ShardedOptimizer, the index of ``t`` in its ``params``), or None where the
    optimizer does not step ``t`` (the engine's ``param_index``, rebuilt when stale)."""
    opt, cache = engine.optimizer, engine.param_index
    if opt is None:
        return None
    i = cache.get(id(t))
    if i is None or i >= len(opt.params) or opt.params[i] is not t:
        cache.clear()
        cache.update((id(p), k) for k, p in enumerate(opt.params))
        i = cache.get(id(t))
    return None if i is None else (opt, i)
