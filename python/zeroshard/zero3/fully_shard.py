"""ZeRO-3: FullyShard, a module wrapper that shards parameters, gradients and
(with ShardedOptimizer) optimizer states across the ranks of a process group.

[Note: fully shard policy]
* Units. Every module the ``wrap`` policy selects becomes a sharding unit; the
  parameters of the other modules form the root unit. A parameter belongs to
  the unit of the nearest wrapped module that registers it; a parameter
  registered in two units (a tie across units) is an error. Each unit is laid
  out by zeroshard.compute_layout as one bucket, so each rank owns one
  contiguous, padded, 16-byte aligned fp32 shard of it (``Unit.shard``; a
  whole-tensor optimizer lays the units holding its matrices out again, in
  chunks of different lengths: [Note: uneven chunks] in zero3/relayout.py), plus
  an fp32 gradient shard of the same length (``Unit.grad_shard``). The
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
  last; common/order.py, shared with stages 1 and 2); one is in flight
  at a time (finished ones are retired early), and at the end of backward
  every unit not yet reduced is (a gradient that never arrived counts as zero).
* ``no_sync()`` skips the reduce-scatters: the flat gradient buffers (full
  size, ``reduce_dtype``) keep accumulating until a backward outside it.
* The optimizer (zeroshard.ShardedOptimizer) updates the fp32 shards in place
  and calls ``invalidate`` so no stale gathered copy survives a step.
* torch.compile. Every hook and every gather/reshard runs eagerly
  (``torch.compiler.disable``): dynamo does not trace the collectives, and a
  compiled block (``block.compile()`` before wrapping, as torchtitan does
  with FSDP2) graph-breaks around its hooks and runs its own forward
  compiled. Every unit shares the *same* hook objects (the unit is looked up
  from the module), so dynamo's guards do not differ from block to block and
  one compiled graph serves every block of a class, instead of one recompile
  per unit until the recompile limit. ``torch.compile(model)`` of the whole
  FullyShard model works the same way: compiled between the hooks.
"""
from __future__ import annotations

__all__ = ["FullyShard", "MixedPrecision", "UnitState", "MAX_INFLIGHT"]

import collections
from typing import Callable, Dict, Iterable, List, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from ..comm import mesh as _mesh
from . import wrap as setup
from . import state_dict as unit_state
from . import relayout
from .. import comm
from .gather import Gatherer
from ..common.source import SUPPORTED, GradState
from .records import MixedPrecision, Optimizers, Unit, UnitState, register_owner
from .backward import MAX_INFLIGHT, UnitBackward


def _check_arguments(module, mixed_precision, prefetch) -> MixedPrecision:
    """FullyShard's arguments, checked before anything is built; returns the mixed precision policy."""
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
    return mp


def _check_dtype(dt, what):
    if dt is not None and dt not in SUPPORTED:
        raise ValueError(f"{what} must be one of {SUPPORTED} or None, got {dt!r}")


def _hook_outputs(out, fn):
    """``fn()`` when the gradient of any of ``out``'s tensors is first computed."""
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors:
        register_multi_grad_hook(tensors, lambda grads: fn(), mode="any")


def _check_in_evaluation(fs):
    """A forward without gradients is where evaluation under ``if rank == 0:`` reaches
    the units' all-gathers: check in first ([Note: rank-0 code] in comm/collectives.py)."""
    comm.check_in("a FullyShard forward without gradients (evaluation)", fs, fs.process_group,
                  "Run evaluation on every rank (each on its own batches), or evaluate on one rank a plain "
                  "copy of the model loaded from model.state_dict(to=0), called on every rank")


class FullyShard(nn.Module):
    """ZeRO-3: shard ``module``'s parameters over ``process_group`` unit by unit
    ([Note: fully shard policy]); train with ``ShardedOptimizer(model.parameters())``,
    which updates the shards in place. Each parameter becomes this rank's 1-D
    fp32 piece of it between steps; a unit is all-gathered just before its forward
    and its backward.

    Args:
        module: the model, built on CPU, CUDA or ``meta``.
        wrap: module classes (or a predicate on a module) that become units;
            the rest forms the root unit. None: one unit.
        mixed_precision: dtypes of the gathered parameters and of the
            reduce-scatter (``MixedPrecision``); None: fp32.
        reshard_after_forward: free each unit after its forward and gather it
            again in backward (True); False keeps it to its backward (ZeRO-2's
            memory for those parameters, one all-gather fewer per step).
        prefetch: units all-gathered ahead of the one computing (0: none).
        process_group: the ranks to shard over (default: the world).
        device: where the shards live (default: the parameters' device, or
            CUDA/CPU for a model on meta); ``"meta"`` plans without data.
        shard_size: hybrid sharding: shard over groups of this many ranks
            ([Note: hybrid sharding]).
        device_mesh: hybrid sharding from a 2-D DeviceMesh (replicas, shards).
        offload_params: keep the fp32 shards and gradient shards in host
            memory (pinned on CUDA), as FSDP's CPUOffload ([Note: offload params]).
    """

    def __init__(self, module: nn.Module, wrap: Union[Iterable[type], Callable[[nn.Module], bool], None] = None,
                 mixed_precision: Optional[MixedPrecision] = None, reshard_after_forward: bool = True,
                 prefetch: int = 1, process_group: Optional[dist.ProcessGroup] = None, *,
                 device: Union[torch.device, str, None] = None, shard_size: Optional[int] = None,
                 device_mesh=None, offload_params: bool = False):
        super().__init__()
        mp = _check_arguments(module, mixed_precision, prefetch)
        self.module = module
        self.param_dtype = mp.param_dtype or torch.float32
        self.reduce_dtype = mp.reduce_dtype or self.param_dtype
        self.mixed_precision = mp
        self.reshard_after_forward = bool(reshard_after_forward)
        self.prefetch = prefetch
        self.groups = _mesh.groups(process_group, shard_size, device_mesh, "FullyShard")
        self.process_group = self.groups.shard
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self._src = dist.get_global_rank(self.groups.every, 0)
        self.comm_elements = {"all_gather": 0, "reduce_scatter": 0, "replica_all_reduce": 0}
        # (what, unit name) of recent gathers, forwards, reshards, reductions (bounded; tests read it)
        self.events: collections.deque = collections.deque(maxlen=4096)
        self._in_forward = False
        self._fwd_order: List[int] = []      # recorded forward order of non-root units
        self._fwd_seen: List[int] = []
        self._optimizers = Optimizers()    # optimizers' sources (weakly) and state shards by unit

        self._device = setup.pick_device(module, device, self.process_group, self._err)
        self.offload_params = bool(offload_params)
        host, claimed = setup.shard_device(self._device, self.offload_params), setup.claimed(module)
        self._setup = setup.Setup(module, self._device, self.process_group, self.world_size, self.rank, self._src,
                                  self.param_dtype, self._err, self.groups.every, host)
        self._units, self._named = setup.build(self._setup, wrap, FullyShard)
        self._gatherer = Gatherer(self._units, device=self._device, group=self.process_group, rank=self.rank,
                                  prefetch=prefetch, events=self.events, comm_elements=self.comm_elements,
                                  err=self._err)
        self._backward = UnitBackward(self._units, self._gatherer, device=self._device, group=self.process_group,
                                      rank=self.rank, world=self.world_size, replicate=self.groups.replicate,
                                      reduce_dtype=self.reduce_dtype,
                                      events=self.events, comm_elements=self.comm_elements,
                                      fwd_order=lambda: self._fwd_order)
        register_owner(self, self._units)
        self._install_hooks()
        setup.hand_over(claimed, self._named, self._err)     # [Note: construction order]

    # ------------------------------------------------------------------ setup
    def _err(self, msg: str) -> str:
        return comm.on_rank(self, msg)

    def _install_hooks(self):
        # one hook object of each kind for every unit: see [Note: fully shard policy], torch.compile
        self._unit_of = {id(u.module): u for u in self._units[1:]}
        pre = torch.compiler.disable(self._unit_pre_forward)
        post = torch.compiler.disable(self._unit_post_forward)
        for u in self._units[1:]:
            u.hooks.append(u.module.register_forward_pre_hook(pre))
            u.hooks.append(u.module.register_forward_hook(post))
        # root-unit modules called directly (not through this wrapper) get a clear error
        root_mods = {id(mod): mod for q in self._units[0].params for mod, _ in q.slots}
        check = torch.compiler.disable(self._root_module_pre_forward)
        for mod in root_mods.values():
            if mod is not self.module:
                self._units[0].hooks.append(mod.register_forward_pre_hook(check))
        for u in self._units:
            for q in u.params:
                if q.requires_grad:
                    u.hooks.append(q.full.register_post_accumulate_grad_hook(
                        lambda p, u=u, q=q: self._backward.on_grad(u, q)))

    def _unit_pre_forward(self, module, args):
        self._pre_forward(self._unit_of[id(module)])

    def _unit_post_forward(self, module, args, out):
        self._post_forward(self._unit_of[id(module)], out)

    def _root_module_pre_forward(self, module, args):
        self._check_called_inside(self._units[0], module)

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
    def _check_called_inside(self, u: Unit, mod: nn.Module):
        if not (self._in_forward or self._backward.active) or u.state == UnitState.SHARDED:
            what = f"unit '{u.name}'" if u.name else f"root-unit module {type(mod).__name__}"
            raise RuntimeError(self._err(
                f"{what} was called directly, outside the FullyShard-wrapped model's forward; its "
                "parameters are sharded. Call the wrapped model (model(...)), or wrap the module you "
                "call in a FullyShard of its own"))

    def invalidate(self):
        """Drop every gathered copy (the shards changed)."""
        self._gatherer.reshard_all()

    def no_sync(self):
        """Accumulate gradients locally (full size, in reduce_dtype) without
        communication; the next backward outside this context reduces them all."""
        return self._backward.no_sync()

    # --------------------------------------------------------------- forward
    def forward(self, *args, **kwargs):
        self._begin_forward()
        try:
            out = self.module(*args, **kwargs)
        except BaseException:
            self._abort_forward()
            raise
        return self._end_forward(out)

    @torch.compiler.disable
    def _begin_forward(self):
        if self._backward.active:
            if torch._C._current_graph_task_id() != -1:
                raise RuntimeError(self._err("the FullyShard model was called during its own backward"))
            self._backward.abandon()     # the last backward raised before it finished
        if not torch.is_grad_enabled():       # evaluation: every rank must run it too
            _check_in_evaluation(self)
        root = self._units[0]
        self._in_forward = True
        self._fwd_seen = []
        try:
            with torch.no_grad():
                self._gatherer.gather(root, wait=False)
                self._gatherer.prefetch_after(self._fwd_order, -1)
                self._gatherer.gather(root)
        except BaseException:
            self._abort_forward()
            raise

    @torch.compiler.disable
    def _abort_forward(self):
        self._in_forward = False
        self.invalidate()

    @torch.compiler.disable
    def _end_forward(self, out):
        self._in_forward = False
        grad = torch.is_grad_enabled()
        if self._fwd_seen != self._fwd_order:
            self._fwd_order = list(self._fwd_seen)     # (re-)record the order
        with torch.no_grad():
            for u in self._units[1:]:                  # prefetched but not run
                if u.state == UnitState.GATHERING or (u.state == UnitState.GATHERED and self.reshard_after_forward
                                              and u.index not in self._fwd_seen):
                    self._gatherer.reshard(u)
            if not grad:
                self.invalidate()
                return out
        _hook_outputs(out, lambda: self._backward.pre_backward(None))
        return out

    def _pre_forward(self, u: Unit):
        if not (self._in_forward or self._backward.active):
            self._check_called_inside(u, u.module)   # raises
        with torch.no_grad():
            if self._backward.active:            # recomputation (activation checkpointing)
                self._gatherer.gather(u)
                return
            self._fwd_seen.append(u.index)
            self.events.append(("forward", u.name))
            pos = len(self._fwd_seen) - 1
            self._gatherer.gather(u)
            if pos < len(self._fwd_order) and self._fwd_order[pos] == u.index:
                self._gatherer.prefetch_after(self._fwd_order, pos)

    def _post_forward(self, u: Unit, out):
        if self._backward.active:
            return None
        grad = torch.is_grad_enabled()
        if self.reshard_after_forward or not grad:
            with torch.no_grad():
                self._gatherer.reshard(u)
        if grad:
            _hook_outputs(out, lambda u=u: self._backward.pre_backward(u))
        return None

    # -------------------------------------------------------------- backward
    def zero_grad(self, set_to_none: bool = True, by: Optional[object] = None):
        """``set_to_none=True`` (the default) frees the gradient shards (the next backward
        allocates them); ``False`` zeroes them in place (None stays None, as in torch).
        ``by``: the optimizer asking (see ``Optimizers.defer_zero``)."""
        if self._backward.active:
            raise RuntimeError(self._err("zero_grad() called during backward"))
        if not self._optimizers.defer_zero(by, set_to_none, self.grads_ready()):
            self._backward.zero_grad(set_to_none)
            self._optimizers.clear_steps()

    # ---------------------------------------------------------------- memory
    def memory_report(self, reset_peak: bool = False) -> Dict[str, int]:
        """Bytes held on this rank, by category and by location (device, host,
        disk); see zero3/state_dict.py's memory_report for each key."""
        return unit_state.memory_report(self._units, self._optimizers.states_by_unit(), self.param_dtype, self._gatherer,
                                        self._backward, reset_peak, self.offload_params)

    # ------------------------------------------- what an optimizer's source uses
    @property
    def units(self) -> List[Unit]:
        """The sharding units, root first (read-only: see Unit's fields)."""
        return self._units

    @property
    def device(self) -> torch.device:
        """Where the shards live."""
        return self._device

    def grads_ready(self) -> bool:
        """Whether a backward outside no_sync() finished since the last step or zero_grad."""
        return self._backward.state == GradState.READY

    def in_backward(self) -> bool:
        return self._backward.active

    def step_done(self, updated: bool = True, by: Optional[object] = None):
        """The shards were stepped (``updated``) or skipped by optimizer ``by``: drop gathered
        copies; consume the gradients once every optimizer over the model has stepped."""
        self.invalidate()
        if self._optimizers.all_stepped(by):
            self._backward.step_done(updated)
            deferred = self._optimizers.take_deferred_zero()
            if deferred is not None:
                self._backward.zero_grad(deferred)

    def add_grads_ready_listener(self, fn):
        """Call ``fn()`` whenever a backward outside no_sync() has finished and the
        gradient shards hold their reduced values."""
        self._backward.listeners.append(fn)

    @property
    def optimizers(self) -> Optimizers:
        """The optimizers' sources over this model and their state shards, by unit."""
        return self._optimizers

    def lay_out_for_owners(self, costs: Dict[int, int], load: List[int], by: object):
        """Each tensor of ``costs`` (sharded parameter id -> cost) inside one rank's chunk, for
        the whole-tensor optimizer whose source is ``by`` ([Note: uneven chunks])."""
        relayout.lay_out(self._setup, self._units, costs, load, self._backward, self._optimizers, by)

    # ------------------------------------------------------------ state dict
    def state_dict(self, *, to: Optional[int] = None, prefix: str = "", keep_vars: bool = False,
                   destination=None):
        """The full, unsharded state dict of the wrapped model (original names,
        dtypes and shapes, on CPU), loadable into the unwrapped model.

        Collective: every rank must call it. Units are gathered one at a time
        and copied to CPU, so the transient extra memory is one unit. With
        ``to=r`` only global rank ``r`` builds and returns it; the others return None.
        """
        return unit_state.full_state_dict(self, to=to, prefix=prefix, destination=destination)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full state dict (of the unwrapped model, from any world size):
        each rank copies its own pieces; no communication."""
        return unit_state.load_full_state_dict(self, state_dict, strict)
