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
  an fp32 gradient shard of the same length (``Unit.reduction.grad``). The
  gradient shard exists only from the unit's first reduction to
  ``zero_grad(set_to_none=True)``, which frees it, so it is not held through
  the forward and the start of backward, where the activations peak.
* Parameters. ``FullyShard.named_parameters()`` yields one parameter per
  original parameter, with the full tensor's shape; its data is this rank's
  piece of it (``p.to_local()``: a 1-D view into the unit's fp32 shard,
  possibly empty; see zero3/param.py). While a unit is gathered, its modules hold "full"
  parameters instead: leaves whose data are views of the unit's gathered flat
  buffer in ``param_dtype``. Resharding frees that buffer's *storage*
  (``untyped_storage().resize_(0)``), so tensors autograd saved in forward
  stop holding memory; gathering again re-grows the same storage, so those
  saved tensors see the gathered values again in backward.
* Forward. Before a unit runs (however it is called: zero3/forward.py) its
  shard is cast into its chunk of the flat buffer and all-gathered in place; the next ``prefetch`` units in the
  recorded forward order are gathered ahead (on their own stream on CUDA,
  in the backend's thread on CPU), with at most ``prefetch + 1`` non-root
  units gathered at once. The order is recorded by the first forward and
  re-recorded whenever a forward runs units in another order. The root unit
  is gathered for the whole forward and, when grad is enabled, kept until the
  end of backward (it is needed at both ends of both passes); inference
  (no grad) frees every unit after its forward.
* Backward. A hook on the tensors of each unit's forward outputs
  ([Note: unit outputs] in zero3/outputs.py) re-gathers it (and prefetches
  the next units in reverse call order). Autograd leaves each
  full parameter's gradient on it. When a unit's last gradient has arrived,
  the unit is resharded and the gradients are moved (added, then freed) into
  its flat gradient buffer (``reduce_dtype``), allocated only then, after
  the unit's activations are freed (once the buffer exists, e.g. while
  accumulating under ``no_sync``, gradients are added as they arrive). The
  buffer (which ends with the last trainable parameter: [Note: frozen
  parameters] in zero3/wrap.py) is reduce-scattered (SUM) in place; the
  result, divided by the world size (or by ``set_gradient_divide_factor``'s
  factor, as FSDP2's), is written (or added, when
  accumulating) into the fp32 gradient shard. Reduce-scatters are issued in
  one fixed order on every rank (the reverse order of the units' first calls
  since the last backward, root last: [Note: units called directly] in
  zero3/forward.py; the one reduction pipeline of every stage: [Note: reduction
  pipeline] in core/reduction.py, with zero3/fold.py's fold); one is in flight
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

__all__ = ["FullyShard", "MixedPrecision", "UnitState", "register_forward_method"]

from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import mesh
from .wrap import Setup, build, claimed, hand_over, pick_device, shard_device
from .state_dict import full_state_dict, held_regions, load_full_state_dict, memory_report
from .generation import gathered_generate
from . import relayout
from .. import comm
from .gather import Gatherer, reshard_setting
from .gathered import UnshardHandle, gathered_block, reshard, unshard
from ..core.policies import offload_of, sharding_of
from ..core.regions import HeldParam, Region, ShardedModel
from ..core.source import GradState
from ..comm.mesh import Sharding
from ..offload import Offload
from ..core.tensor_parallel import check_model
from .records import MixedPrecision, Steppers, Unit, UnitState, register_owner
from .param_init import InitWatch, check_to_empty, convert_buffers
from .backward import BackwardContext, UnitBackward
from .forward import UnitForward


def _check_arguments(module, mixed_precision, prefetch) -> MixedPrecision:
    """FullyShard's arguments, checked before anything is built; returns the mixed precision policy."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"FullyShard wraps an nn.Module, got {type(module).__name__}")
    if isinstance(module, FullyShard):
        raise ValueError("this module is already a FullyShard; wrap the inner model once")
    if not dist.is_initialized():
        raise RuntimeError(
            "FullyShard needs torch.distributed: call "
            "torch.distributed.init_process_group() first (torchrun sets it up)"
        )
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    mp = mixed_precision or MixedPrecision()
    if not isinstance(mp, MixedPrecision):
        raise TypeError(f"mixed_precision must be a zeroshard.MixedPrecision, got {type(mp).__name__}")
    return mp


def _check_expert_names(fn):
    if fn is not None and not callable(fn):
        raise TypeError(f"expert_names must be a function of a parameter's name, got {type(fn).__name__}")
    return fn


def _check_in_evaluation(fs):
    """A forward without gradients is where evaluation under ``if rank == 0:`` reaches
    the units' all-gathers: check in first ([Note: rank-0 code] in comm/collectives.py)."""
    comm.check_in(
        "a FullyShard forward without gradients (evaluation)",
        fs,
        fs.process_group,
        "Run evaluation on every rank (each on its own batches), or evaluate on one rank a plain "
        "copy of the model loaded from model.state_dict(to=0), called on every rank",
    )


# longer: FSDP2's module API over nn.Module's, each method documented here and answered by a part
class FullyShard(nn.Module, ShardedModel):
    """ZeRO-3: shard ``module``'s parameters over ``process_group`` unit by unit
    ([Note: fully shard policy]); train with ``ShardedOptimizer(model.parameters())``,
    which updates the shards in place. Each parameter keeps its full shape, and
    holds this rank's fp32 piece of it between steps (``p.to_local()``); a unit is
    all-gathered just before its forward and its backward.

    Args:
        module: the model, built on CPU, CUDA or ``meta``.
        wrap: module classes (or a predicate on a module) that become units;
            the rest forms the root unit. None: one unit.
        mixed_precision: dtypes of the gathered parameters and of the
            reduce-scatter (``MixedPrecision``); None: fp32.
        reshard_after_forward: free each unit after its forward and gather it
            again in backward (True); False keeps it to its backward (ZeRO-2's memory
            for it); an int k: a piece over k ranks ([Note: post-forward shards]).
        prefetch: units all-gathered ahead of the one computing (0: none).
        process_group: the ranks to shard over (default: the world).
        device: where the shards live (default: the parameters' device, or
            CUDA/CPU for a model on meta); ``"meta"`` plans without data.
        sharding: a ``zeroshard.Sharding``: which ranks shard and which replicate
            ([Note: hybrid sharding]), and ``expert_modules``: ``{ExpertClass:
            mesh["edp"]}``, each module of such a class a unit of its own sharded,
            gathered and reduced over that 1-D mesh's ranks (expert parallelism:
            docs/experts.md, [Note: param groups over their own ranks]).
        offload: a ``zeroshard.Offload``; ``Offload(params="cpu")`` keeps the fp32
            shards and gradient shards in host memory (pinned on CUDA), as FSDP2's
            CPUOffloadPolicy ([Note: offload params]).
        forward_methods: names of methods other than ``forward`` (e.g.
            ``"forward_features"``) that gather their unit wherever a unit's (or
            the root module's) class has one; see ``register_forward_method``.
        expert_names: for checkpoints of such a model: given an expert parameter's
            name in ``module`` (``"moe.experts.1.up.weight"``), its name in the whole
            non-parallel model (``"moe.experts.3.up.weight"`` where this rank's second
            expert is the fourth): checkpoints keep every expert under its whole-model
            name, so they load at another expert-parallel degree and export as the
            non-parallel model's state dict.
        shard_size, device_mesh, offload_params, expert_modules: the loose forms of
            the policies; they work for this release and warn ([Note: options as policies]).
    """

    # model.generate(...) gathers every unit once per call; False: per token, as forwards do
    # ([Note: generation in one gather] in zero3/generation.py)
    generate_gathered: bool = True

    def __init__(
        self,
        module: nn.Module,
        wrap: Union[Iterable[type], Callable[[nn.Module], bool], None] = None,
        mixed_precision: Optional[MixedPrecision] = None,
        reshard_after_forward: Union[bool, int] = True,
        prefetch: int = 1,
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        device: Union[torch.device, str, None] = None,
        sharding: Optional[Sharding] = None,
        offload: Optional[Offload] = None,
        forward_methods: Iterable[str] = (),
        expert_names: Optional[Callable[[str], str]] = None,
        shard_size: Optional[int] = None,
        device_mesh=None,
        offload_params: bool = False,
        expert_modules: Optional[Dict[type, object]] = None,
    ):
        super().__init__()
        mp = _check_arguments(module, mixed_precision, prefetch)
        self.module = module
        self.param_dtype = mp.param_dtype or torch.float32
        self.reduce_dtype = mp.reduce_dtype or self.param_dtype
        self.mixed_precision = mp
        self.prefetch = prefetch
        self.sharding = sharding_of(
            "FullyShard",
            sharding,
            process_group,
            shard_size=shard_size,
            device_mesh=device_mesh,
            expert_modules=expert_modules,
        )
        self.offload = offload_of("FullyShard", offload, offload_params=offload_params)
        self.groups = self.sharding.groups("FullyShard")
        self.process_group = self.groups.shard
        self.world_size, self.rank = dist.get_world_size(self.process_group), dist.get_rank(self.process_group)
        self.reshard_after_forward = reshard_setting(reshard_after_forward, self.world_size, "FullyShard")
        self._src = dist.get_global_rank(self.groups.every, 0)
        self.comm_elements = {"all_gather": 0, "reduce_scatter": 0, "replica_all_reduce": 0}
        self._steppers = Steppers()  # the sources stepping the shards (weakly), their state shards by unit
        self._device = pick_device(module, device, self.process_group, self._err)
        self.offload_params = self.offload.params is not None
        host, taken = shard_device(self._device, self.offload_params), claimed(module)
        experts = dict(self.sharding.expert_modules or {})
        check_model(module, self.groups.every, bool(experts), self._err)  # DTensor parameters: tensor parallel
        self._expert_names = _check_expert_names(expert_names)
        own = mesh.mesh_shards(
            list(experts.values()), self.groups, "FullyShard", [f"expert_modules[{c.__name__}]" for c in experts]
        )
        self._setup = Setup(
            module=module,
            device=self._device,
            group=self.process_group,
            world=self.world_size,
            rank=self.rank,
            src=self._src,
            param_dtype=self.param_dtype,
            err=self._err,
            everyone=self.groups.every,
            shard_device=host,
            ranks=mesh.shard_group(self.process_group),
            experts=dict(zip(experts, own)),
        )
        self.init_watch = InitWatch(module, self._device)  # [Note: initialising sharded parameters]
        self._units, self._named = build(self._setup, wrap, FullyShard)
        # built on meta: the non-persistent buffers nothing initialised (load_pretrained sets an HF model's)
        self.uninitialised_buffers: List[str] = list(self._setup.unset_buffers)
        self._gatherer, self._backward, self._forward = self._passes(module, mp)
        register_owner(self, self._units)
        # called with the model's (args, kwargs) as each forward of the model begins, before
        # any gather (an optimizer under torch's Join: [Note: uneven inputs] in optim/join.py)
        self.forward_listeners: List[Callable[[tuple, dict], None]] = []
        # every parameter record: one whose requires_grad changed is laid out by the next forward
        self._records = [q for u in self._units for q in u.params]
        for name in forward_methods:
            for mod in [u.module for u in self._units]:
                if callable(getattr(mod, name, None)):
                    self.register_forward_method(mod, name)
        hand_over(taken, self._named, self._err)  # [Note: construction order]

    def _passes(self, module: nn.Module, mp: MixedPrecision):
        """The units' gatherer and their backward and forward passes."""
        gatherer = Gatherer(
            self._units, device=self._device, prefetch=self.prefetch, comm_elements=self.comm_elements, err=self._err
        )
        gatherer.quantized = (mp.gather_dtype, mp.gather_block_size) if mp.gather_dtype else None
        backward = UnitBackward(
            self._units,
            gatherer,
            BackwardContext(
                device=self._device,
                world=self.world_size,
                replicate=self.groups.replicate,
                reduce_dtype=self.reduce_dtype,
                comm_elements=self.comm_elements,
                calls=lambda: self._forward.take_calls(),
                every=self.groups.every,
                stepped_here=lambda: bool(self._steppers.live()),
                err=self._err,
            ),
        )
        forward = UnitForward(
            self._units,
            gatherer,
            backward,
            root=module,
            mixed_precision=mp,
            param_dtype=self.param_dtype,
            reshard_after_forward=self.reshard_after_forward,
            err=self._err,
            check_in=lambda: _check_in_evaluation(self),
        )
        return gatherer, backward, forward

    # ------------------------------------------------------------------ setup
    def _err(self, msg: str) -> str:
        return comm.on_rank(self, msg)

    def register_forward_method(self, module: nn.Module, name: str):
        """Make ``module.<name>(...)`` gather its unit as ``forward`` does (FSDP2's
        ``register_fsdp_forward_method``): ``module`` is a unit's module or the wrapped
        model; the method is replaced on that instance only ([Note: units called directly])."""
        self._forward.register_method(module, name)

    # -------------------------------------------------------------- nn.Module
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            found = getattr(self._modules["module"], name)
            return gathered_generate(self, found) if name == "generate" else found

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The sharded parameters (the full shapes; their data this rank's pieces), under
        their original names, in the unwrapped model's order."""
        seen = set()
        for n, q in self._named:
            if remove_duplicate and id(q.sharded) in seen:
                continue
            seen.add(id(q.sharded))
            yield (f"{prefix}.{n}" if prefix else n), q.sharded

    def _apply(self, fn, recurse: bool = True):
        return self.convert(fn)

    def convert(self, fn):
        """``model.to(...)``, ``.float()``, ``.cuda()`` and the like after wrapping: the fp32
        shards stay where and what they are (FullyShard's master weights), so a conversion
        that keeps float32 on the shards' device applies to the buffers and the parameters
        left out of sharding, as torch's does; any other is refused naming what to use."""
        convert_buffers(self.module, fn, self._device, self._err)
        return self

    def to_empty(self, *, device: Union[torch.device, str], recurse: bool = True):
        """FSDP2's after wrapping: shards and buffers kept ([Note: initialising sharded parameters])."""
        check_to_empty(device, self._device, self._err)
        return self

    def _fqn_modifiers(self) -> Dict[str, str]:
        """torch's distributed-checkpoint helpers' contract: the wrapped model's names leave out
        ``module.``, as this model's state dicts do (``set_model_state_dict`` and the rest)."""
        return {"module": "module"}

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The wrapped model's buffers under their own names (``recurse=False``: none, this
        wrapper's own, as nn.Module's)."""
        if recurse:
            yield from self.module.named_buffers(prefix=prefix, recurse=True, remove_duplicate=remove_duplicate)

    # ---------------------------------------------------------------- gather
    def forward(self, *args, **kwargs):
        return self.run_forward(self.module, args, kwargs)

    def run_forward(self, fn: Callable, args: tuple, kwargs: dict):
        """``fn(*args, **kwargs)`` as the model's forward (the root unit gathered around it):
        ``self.module`` for the wrapper, the model's own forward in place ([Note: fully_shard
        in place] in zero3/module_api.py)."""
        self._settle_pieces()
        if any(q.requires_grad != q.sharded.requires_grad for q in self._records):  # (un)frozen since
            self.lay_out_trainable(by=None)
        for fn_ in self.forward_listeners:  # before the root's gather (torch's Join counts first)
            fn_(args, kwargs)
        return self._forward.around_root(fn, args, kwargs)

    def _settle_pieces(self):
        """A torch optimizer stepped the pieces since the last gather: its step consumed the gradients."""
        if self.init_watch.before_forward() and self.grads_ready():
            self.step_done()

    def unit_for(self, module: nn.Module) -> Unit:
        """The unit ``module`` makes (a unit's module or one of its group's; the wrapped model:
        the root unit), whose ``settings`` FSDP2's module API sets; an error otherwise."""
        if module is self.module:
            return self._units[0]
        for u in self._units[1:]:
            if any(m is module for m in u.modules):
                return u
        raise ValueError(self._err(f"{type(module).__name__} is not a sharding unit of this model"))

    def invalidate(self):
        """Drop every gathered copy (the shards changed); the units a ``gathered()`` block
        holds are gathered again from the shards."""
        self._gatherer.reshard_all()
        self._gatherer.refresh_held()

    def gathered(self, dtype: Optional[torch.dtype] = None, units=None, *, modifier_rank: Optional[int] = None):
        """``with model.gathered():`` keeps the units (all, or those holding the parameters of
        ``units``: modules and parameters of the model) gathered until the block ends, in
        ``dtype`` if given (a copy; the fp32 shards untouched) or the gather dtype (training
        inside works as outside); resharded on exit, also on an exception. Refused before
        gathering if the device has no room for them. ``modifier_rank=r``: on exit, rank r's
        values become every rank's fp32 shards (gathered in float32). Collective. See
        [Note: gathered blocks] in zero3/gathered.py."""
        return gathered_block(
            self._units,
            self._gatherer,
            dtype=dtype,
            gather_dtype=self.param_dtype,
            chosen=units,
            every=self.groups.every,
            modifier_rank=modifier_rank,
            who=self,
            err=self._err,
        )

    def unshard(self, async_op: bool = False, *, unit: Optional[nn.Module] = None) -> UnshardHandle:
        """FSDP2's ``unshard``. Every unit gathered and kept so until ``reshard()``, as in a
        ``gathered()`` block (forwards, backwards and ``generate`` gather nothing meanwhile);
        ``async_op=True`` returns with the all-gathers in flight, finished by the handle's
        ``wait()`` or the first use of each unit. See [Note: gathered blocks]. Or, ``unit``: the one unit that module makes, gathered as a
        prefetch its next forward takes over (freed after it as usual); ``async_op=True`` returns
        with the all-gather in flight and the handle's ``wait()`` (or the forward) finishes it.
        Collective."""
        if unit is None:
            return unshard(self._gatherer, self.gathered, async_op)
        u = self.unit_for(unit)
        self._settle_pieces()
        with torch.no_grad():
            self._gatherer.gather(u, wait=not async_op)
        return UnshardHandle(lambda: self._gatherer.gather(u))

    def reshard(self, *, unit: Optional[nn.Module] = None) -> None:
        """FSDP2's ``reshard``: the units ``unshard()`` gathered back to their shards (a no-op
        without one), or the unit module ``unit`` makes. Collective."""
        if unit is None:
            reshard(self._gatherer)
        else:
            self._gatherer.reshard(self.unit_for(unit))

    def shards_loaded(self):
        self.init_watch.values_given()
        self.invalidate()

    def held_regions(self) -> Tuple[List[HeldParam], List[Region]]:
        """Every sharded parameter and this rank's regions of them, one per unit (what
        checkpoints read: [Note: shard sources] in core/source.py)."""
        return held_regions(self._units, self._expert_names)

    def no_sync(self):
        """Accumulate gradients locally (full size, in reduce_dtype) without
        communication; the next backward outside this context reduces them all."""
        return self._backward.no_sync()

    def set_gradient_divide_factor(self, factor: float, *, unit: Optional[nn.Module] = None):
        """FSDP2's: each gradient (of every unit, or of the one ``unit`` makes) is the sum over
        every rank (replicas too) over ``factor`` (1.0: the sum)."""
        self._backward.set_divide_factor(factor, None if unit is None else [self.unit_for(unit)])

    # --------------------------------------------------------------- forward
    # -------------------------------------------------------------- backward
    def zero_grad(self, set_to_none: bool = True, by: Optional[object] = None):
        """``set_to_none=True`` (the default) frees the gradient shards (the next backward
        allocates them); ``False`` zeroes them in place (None stays None, as in torch).
        ``by``: the stepper asking (see ``Steppers.defer_zero``)."""
        if self._backward.active:
            raise RuntimeError(self._err("zero_grad() called during backward"))
        if not self._steppers.defer_zero(by, set_to_none, self.grads_ready()):
            self._backward.zero_grad(set_to_none)
            self._steppers.clear_steps()

    # ---------------------------------------------------------------- memory
    def memory_report(self, reset_peak: bool = False) -> Dict[str, int]:
        """Bytes held on this rank, by category and by location (device, host,
        disk); see zero3/state_dict.py's memory_report for each key."""
        return memory_report(
            self._units,
            self._steppers,
            self.param_dtype,
            self._gatherer,
            self._backward,
            reset_peak,
            self.offload_params,
        )

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
        """The shards were stepped (``updated``) or skipped by stepper ``by``: drop gathered
        copies; consume the gradients once every stepper over the model has stepped."""
        self.invalidate()
        if self._steppers.all_stepped(by):
            self._backward.step_done(updated)
            deferred = self._steppers.take_deferred_zero()
            if deferred is not None:
                self._backward.zero_grad(deferred)

    def add_grads_ready_listener(self, fn):
        """Call ``fn()`` whenever a backward outside no_sync() has finished and the
        gradient shards hold their reduced values."""
        self._backward.listeners.append(fn)

    @property
    def steppers(self) -> Steppers:
        """The sources stepping this model's shards and their state shards, by unit."""
        return self._steppers

    def lay_out_for_owners(self, costs: Dict[int, int], load: List[int], by: object):
        """Each tensor of ``costs`` (sharded parameter id -> cost) inside one rank's chunk, for
        the whole-tensor update of stepper ``by`` ([Note: uneven chunks])."""
        relayout.lay_out(self._setup, self._units, costs, load, self._backward, self._steppers, by)

    @torch.compiler.disable
    def lay_out_trainable(self, by: object):
        """Lay out again the units whose parameters were unfrozen (they take gradients) or frozen
        (they leave the reduction) since they were laid out, for stepper ``by`` (collective):
        relayout.retrain."""
        for u, q in relayout.retrain(self._setup, self._units, self._backward, self._steppers, by):
            self._forward.watch_grad(u, q)

    # ------------------------------------------------------------ state dict
    def state_dict(
        self,
        *,
        to: Optional[int] = None,
        prefix: str = "",
        keep_vars: bool = False,
        destination=None,
        keys: Optional[Iterable[str]] = None,
    ):
        """The full, unsharded state dict of the wrapped model (original names,
        dtypes and shapes, on CPU), loadable into the unwrapped model.

        Collective: every rank must call it. Units are gathered one at a time
        and copied to CPU, so the transient extra memory is one unit. With
        ``to=r`` only global rank ``r`` builds and returns it; the others return None.
        ``keys``: only these entries (a LoRA adapter's), and only the units holding
        them gathered.
        """
        return full_state_dict(self, to=to, prefix=prefix, destination=destination, keys=keys)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full state dict (of the unwrapped model, from any world size):
        each rank copies its own pieces; no communication."""
        self.init_watch.values_given()
        return load_full_state_dict(self, state_dict, strict)


def register_forward_method(model: FullyShard, module: nn.Module, name: str) -> None:
    """``module.<name>(...)`` gathers its unit as ``forward`` does, for ``module`` a sharding
    unit of the FullyShard ``model`` (or the model it wraps); FSDP2's
    ``register_fsdp_forward_method``. See FullyShard.register_forward_method."""
    if not isinstance(model, FullyShard):
        raise TypeError(f"register_forward_method takes the FullyShard model first, got {type(model).__name__}")
    model.register_forward_method(module, name)
