"""ShardedOptimizer: AdamW over sharded state, a drop-in for DDP + AdamW.

The update engine of every stage: hyperparameters, step, clipping, state
dicts. It has no stage branches: the shards it updates come from a shard
source (see [Note: shard sources] in core/source.py): ``zero12.reducer.FlatReducer``
for ZeRO-1/2 (its own flat buffers, reduced by backward hooks; see [Note:
sharded optimizer policy] in zero12/reducer.py) or ``zero3.source.UnitSource`` for the
parameters of zeroshard.FullyShard models (ZeRO-3). Whatever the source, the
update runs over *segments* and the state dict over *regions*, so step,
clipping and checkpoints are shared.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable

from ..comm.mesh import Sharding
from ..offload import Offload
from ..core.policies import sharding_of
from .binding import Binding, Bound, build_bound, offload_policy
from .state_view import StateView
from .state_dict import StateDicts
from .. import comm
from ..core.claims import check_unclaimed, claim
from . import hand_grads
from .join import JoinSide
from .regroup import Regrouping, refuse_unaveraged
from ..zero12.buffers import modules_given, sync_buffers
from .rules import TorchElementwise, check_class, probe_defaults
from .whole import WholeTensor
from ..core.regions import Region
from ..core.source import SUPPORTED, Rebind, ShardSource
from . import torch_state  # noqa: F401 (registers torch's optimizer step pre-hook: its Note)


_ADAMW_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _check_arguments(stage, bucket_mb, reduce_dtype):
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage!r} (ZeRO-3 is zeroshard.FullyShard)")
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    if reduce_dtype is not None and reduce_dtype not in SUPPORTED:
        raise ValueError(f"reduce_dtype must be one of {SUPPORTED}, got {reduce_dtype}")


# torch.optim.AdamW's implementation switches: zeroshard's AdamW is always one fused
# kernel over every shard, so they select nothing here (differentiable=True excepted)
_IMPLEMENTATION_ONLY = ("fused", "foreach", "capturable", "differentiable")


def _resolve_class(optimizer_class, kwargs: dict):
    """(optimizer_class, its kwargs, fused) for what the user asked: torch AdamW's
    implementation switches are accepted by the fused AdamW; ``amsgrad=True`` or
    ``maximize=True`` (which the kernel lacks) select torch's AdamW over this rank's
    pieces, as ``optimizer_class=torch.optim.AdamW`` would."""
    kwargs = dict(kwargs)
    if optimizer_class in (None, torch.optim.AdamW):
        if kwargs.get("differentiable"):
            raise NotImplementedError(
                "ShardedOptimizer(differentiable=True): the sharded step is not "
                "differentiable through autograd; drop differentiable=True"
            )
        for k in _IMPLEMENTATION_ONLY:
            kwargs.pop(k, None)
        for k in ("amsgrad", "maximize"):
            if k in kwargs and not kwargs[k]:
                del kwargs[k]  # AdamW's default: the fused kernel does the same
        if kwargs.keys() & {"amsgrad", "maximize"}:
            optimizer_class = torch.optim.AdamW
    fused = optimizer_class is None or (optimizer_class is torch.optim.AdamW and not kwargs)
    return optimizer_class, kwargs, fused


def _adamw_defaults(given: dict, extra: dict) -> dict:
    """The fused AdamW's param-group defaults from the arguments given (checked)."""
    if extra:
        raise TypeError(
            f"unexpected keyword argument(s) {sorted(extra)} for the fused AdamW; to use another "
            "optimizer pass optimizer_class=... (its keyword arguments go to it)"
        )
    h = dict(_ADAMW_DEFAULTS, **given)
    lr, betas, eps, weight_decay = h["lr"], tuple(h["betas"]), h["eps"], h["weight_decay"]
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
        raise ValueError(f"betas must be in [0, 1), got {betas}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    return dict(
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=False,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
    )


def _rebind(ref: "weakref.ref[ShardedOptimizer]") -> Rebind:
    """The optimizer's answers when FullyShard lays its units out again for another party
    (while the optimizer ``ref`` lives): refused once it has stepped, else it binds anew."""

    def blocker() -> Optional[str]:
        opt = ref()
        if opt is not None and any(opt.param_steps):
            return "another ShardedOptimizer over it has already stepped (or loaded a state)"
        return None

    def relaid() -> None:
        opt = ref()
        if opt is not None:
            opt.regrouping.units_relaid()

    return Rebind(blocker, relaid)


def _check_dense(params: List[torch.Tensor], err) -> None:
    """Sparse (or other non-strided) parameters have no place in a flat buffer: refused, named."""
    for i, p in enumerate(params):
        if p.layout != torch.strided:
            raise ValueError(
                err(
                    f"parameter {i} (shape {tuple(p.shape)}) is a {p.layout} tensor: ShardedOptimizer shards "
                    "dense parameters laid out in flat buffers. Make it dense (e.g. nn.Embedding without "
                    "sparse=True), or keep it out of the optimizer"
                )
            )


def _check_ready(device: torch.device, source: ShardSource, what: str, err, by_hand: bool = False) -> None:
    if device.type == "meta":
        raise RuntimeError(
            err(
                f"{what} on parameters on the meta device: they have no data (an optimizer over meta "
                "parameters is for planning, as zeroshard.plan does); build or materialize the model "
                "on CPU or CUDA to train"
            )
        )
    if not (source.grads_ready() or by_hand):
        raise RuntimeError(
            err(
                f"{what} called before any backward() since the last step (or only under no_sync()); "
                "run loss.backward() outside no_sync() first"
            )
        )


def _run_closure(closure, kwargs: dict, fused: bool, err):
    """(the loss, the closure ``optimizer_class``'s step gets): a callable closure runs here,
    first, as torch's optimizers run it, and the class is given one returning its loss (its
    step may call it: no second backward); one that is not callable goes to the class
    untouched, as torch's ZeroRedundancyOptimizer passes it, as do ``kwargs``."""
    if fused and kwargs:
        raise TypeError(
            err(
                f"step() got keyword arguments {sorted(kwargs)}: the fused AdamW's step takes only "
                "a closure (they go to optimizer_class's step when one is set)"
            )
        )
    if callable(closure):
        with torch.enable_grad():
            loss = closure()
        return loss, (lambda: loss)
    if closure is not None and fused:
        raise TypeError(err(f"step(closure={closure!r}): the closure must be callable (it re-evaluates the loss)"))
    return None, closure


# longer: torch.optim.Optimizer's and Joinable's API, each method documented here and answered by a part
class ShardedOptimizer(torch.optim.Optimizer, Joinable):
    """AdamW with ZeRO stage 1 (sharded optimizer states) or 2 (also sharded
    gradients); over a FullyShard model's parameters, the ZeRO-3 optimizer.
    Replaces ``DistributedDataParallel`` + ``torch.optim.AdamW`` (do not wrap the
    model in DDP): backward reduce-scatters bucket by bucket, ``step()`` updates
    this rank's shard and all-gathers the parameters ([Note: sharded optimizer policy]).
    Every rank starts from rank 0's parameters: the constructor broadcasts them, as DDP's does.
    Its parts: ``bound`` (the layout and what is built over it), ``state_dicts``,
    ``regrouping`` (new layouts) and ``joining`` (torch's Join).

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr: learning rate (AdamW's default 1e-3).
        betas: AdamW's (0.9, 0.999) by default.
        eps: AdamW's 1e-8 by default.
        weight_decay: decoupled, as AdamW's (0.01 by default).
        stage: 1 (optimizer states sharded) or 2 (also gradients; the default).
        bucket_mb: the reduce-scatter bucket size, in MiB.
        process_group: the data-parallel ranks (default: the world).
        reduce_dtype: dtype of the gradient reduction (default: the gradients').
        optimizer_class: another torch optimizer: an elementwise one runs over
            this rank's pieces ([Note: update rules]), a whole-tensor one
            (``torch.optim.Muon``, ``torch.optim.Adafactor``) on each parameter's
            owner rank ([Note: whole-tensor optimizers]); its arguments go in kwargs.
        elementwise: vouch that ``optimizer_class`` is elementwise.
        whole_tensor: vouch that ``optimizer_class`` needs each parameter whole.
        sharding: a ``zeroshard.Sharding``: which ranks shard and which replicate ([Note: hybrid
            sharding]). (A param group's own ``"device_mesh"``, a 1-D mesh, shards that group
            over those ranks only: expert parallelism at stages 1/2, see docs/experts.md.)
        offload: a ``zeroshard.Offload``: where the optimizer state lives, host
            memory or a file per rank, and which share of it ([Note: offload]).
        overlap_param_gather: overlap the parameter all-gather with the next
            forward ([Note: overlapped parameter gather]).
        broadcast_buffers: stages 1/2: broadcast the model's buffers from rank 0
            before each training forward, as DDP's argument ([Note: module buffers]).
        shard_size, device_mesh, offload (a string), offload_dir, offload_fraction: the loose
            forms of the policies, for this release, with a warning ([Note: options as policies]).
        **optimizer_kwargs: ``optimizer_class``'s other arguments.
    """

    def __init__(
        self,
        params,
        lr: Optional[float] = None,
        betas=None,
        eps: Optional[float] = None,
        weight_decay: Optional[float] = None,
        *,
        stage: int = 2,
        bucket_mb: float = 25,
        process_group: Optional[dist.ProcessGroup] = None,
        reduce_dtype: Optional[torch.dtype] = None,
        optimizer_class=None,
        elementwise: bool = False,
        whole_tensor: bool = False,
        sharding: Optional[Sharding] = None,
        offload: Union[Offload, str, None] = None,
        overlap_param_gather: bool = False,
        broadcast_buffers: bool = True,
        shard_size: Optional[int] = None,
        device_mesh=None,
        offload_dir=None,
        offload_fraction: Optional[float] = None,
        **optimizer_kwargs,
    ):
        _check_arguments(stage, bucket_mb, reduce_dtype)
        sharding = sharding_of(
            "ShardedOptimizer", sharding, process_group, shard_size=shard_size, device_mesh=device_mesh
        )  # [Note: options as policies]
        given = {k: v for k, v in dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay).items() if v is not None}
        # the fused AdamW unless another optimizer (or AdamW with options the kernel lacks) is asked for
        optimizer_class, optimizer_kwargs, fused = _resolve_class(optimizer_class, optimizer_kwargs)
        placement = offload_policy(offload, offload_dir, offload_fraction, None if fused else optimizer_class)
        whole, class_kwargs = False, {}
        if fused:
            defaults = _adamw_defaults(given, optimizer_kwargs)
        else:
            whole = check_class(optimizer_class, elementwise, whole_tensor)
            class_kwargs = dict(given, **optimizer_kwargs)
            defaults = probe_defaults(optimizer_class, class_kwargs)
        self.optimizer_class, self.fused_requested = optimizer_class or torch.optim.AdamW, fused
        modules = modules_given(params)  # (before torch reads the generators)
        super().__init__(params, defaults)
        # each parameter's name where the optimizer was given a module's parameters (or
        # torch's named parameters): the ranks must hold the same parameter at each place
        names = {id(p): n for m in modules for n, p in m.named_parameters(remove_duplicate=False)}
        names.update((id(p), n) for g in self.param_groups for n, p in zip(g.get("param_names", ()), g["params"]))
        if not dist.is_initialized():
            raise RuntimeError(
                "ShardedOptimizer needs torch.distributed: call "
                "torch.distributed.init_process_group() first (torchrun sets it up)"
            )
        self.reduce_dtype, self.bucket_bytes = reduce_dtype, max(1, int(bucket_mb * 2**20))
        pg = sharding.process_group if sharding.process_group is not None else dist.group.WORLD
        self.world_size, self.rank = dist.get_world_size(pg), dist.get_rank(pg)
        self.last_step_skipped, self.broadcast_buffers = False, bool(broadcast_buffers)
        self.state_dicts, self.regrouping, self.joining = StateDicts(self), Regrouping(self), JoinSide(self)
        check_unclaimed(self.regrouping, [p for g in self.param_groups for p in g["params"]], self._err)
        _check_dense([p for g in self.param_groups for p in g["params"]], self._err)
        self._binding = Binding(
            sharding=sharding,
            stage=stage,
            adam=fused,
            bucket_bytes=self.bucket_bytes,
            reduce_dtype=reduce_dtype,
            offload=placement,
            names=names,
            overlap_param_gather=overlap_param_gather,
            whole=whole,
            optimizer_class=self.optimizer_class,
            optimizer_kwargs=class_kwargs,
            broadcast_buffers=self.broadcast_buffers,
        )
        self.bind()
        if self._bound.buffers is not None:  # equal from here on, as DDP's constructor makes them
            sync_buffers(modules, self.source.groups.every, self._bound.buffers.src)
        claim(self.regrouping)  # FullyShard, wrapping these later, hands over its own
        Joinable.__init__(self)  # torch's Join ([Note: uneven inputs] in optim/join.py)

    def bind(self) -> None:
        """Lay out and hook the parameters of the param groups: a new ``bound`` (the shard
        source, the gradient statistics, the update rule over it), again for each new layout."""
        self._bound = build_bound(
            self.param_groups,
            self._binding,
            self._err,
            _rebind(weakref.ref(self)),
            self.joining,
            getattr(self, "_bound", None),
        )
        source = self._bound.source
        self.process_group, self.device = source.process_group, source.device
        self.stage, self.world_size, self.rank = source.stage, source.world_size, source.rank
        self.comm_elements = source.comm_elements

    # ------------------------------------------------- what checkpoints read
    @property
    def bound(self) -> Bound:
        """The current layout of the parameters and what is built over it (its parts read it)."""
        return self._bound

    @property
    def source(self) -> ShardSource:
        """The shard source this optimizer steps over (see [Note: shard sources])."""
        return self._bound.source

    @property
    def layout(self):
        """ZeRO-1/2: the flat layout (zeroshard.compute_layout's) of the trainable
        parameters (with param groups over their own ranks: of the first group of ranks
        in backward order; the source's ``layouts`` has each); None for FullyShard parameters."""
        return getattr(self._bound.source, "layout", None)

    @property
    def regions(self) -> List[Region]:
        return self._bound.source.regions

    @property
    def params(self) -> List[torch.Tensor]:
        """Every parameter, in state-dict index order."""
        return self._bound.params

    @property
    def trainable(self) -> List[int]:
        """Indices (into ``params``) of the parameters that require grad."""
        return self._bound.trainable

    def group_of(self, i: int) -> int:
        return self._bound.group_of[i]

    def full_shape(self, i: int) -> torch.Size:
        return self._bound.source.full_shapes[i]

    @property
    def state(self) -> StateView:
        """torch's per-parameter state map, as a read-only view: ``{p: {"step": tensor}}`` for
        each parameter with a step; the moments are in ``state_dict()`` ([Note: the state view])."""
        return StateView(lambda: (self.params, self.param_steps) if hasattr(self, "_bound") else ([], []))

    @state.setter
    def state(self, value) -> None:  # torch.optim.Optimizer.__init__ sets it empty: the view stands instead
        if value:
            raise AttributeError("ShardedOptimizer.state is a view of the shards; load state with load_state_dict")

    @property
    def param_steps(self) -> List[int]:
        """Each parameter's step count (state-dict index order; 0 for frozen ones): the
        steps in which some rank gave it a gradient, as torch's AdamW counts them."""
        return list(self._bound.param_steps)

    def _err(self, msg: str) -> str:
        return comm.on_rank(self, msg)

    def wait_params(self):
        """With ``overlap_param_gather=True``: wait for the parameter all-gathers of the last
        step (needed before reading parameters outside their modules' forward, e.g.
        ``model.state_dict()``); a no-op otherwise. See [Note: overlapped parameter gather]."""
        self._bound.source.settle()

    def no_sync(self):
        """Accumulate gradients locally, without communication; the next backward
        outside this context reduces everything accumulated since the last step."""
        return self._bound.source.no_sync()

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm of the averaged gradient, over every shard of
        every rank; returns that norm (the same on all ranks). The scale is
        applied inside the fused step."""
        hand_grads.take(self._bound.grads)
        _check_ready(self.device, self._bound.source, "clip_grad_norm_", self._err, self._bound.grads.by_hand)
        return self._bound.grads.clip_(max_norm, norm_type)  # the coefficient lives with these gradients

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """One optimizer step over this rank's shards. ``closure`` re-evaluates the loss
        (``_run_closure``); keyword arguments go to ``optimizer_class``'s ``step``. A step with
        no gradient anywhere does nothing, as torch's optimizers skip parameters without a
        gradient; ``p.grad`` set to None or assigned by the script is what it uses ([Note:
        gradients set by the script] in optim/hand_grads.py)."""
        loss, given = _run_closure(closure, kwargs, self._bound.rule.fused, self._err)
        self.joining.next_iteration()  # the next collective begins another iteration
        if self._bound.no_gradient_anywhere():
            return loss
        _check_ready(self.device, self._bound.source, "step()", self._err, self._bound.grads.by_hand)
        refuse_unaveraged(self._bound.params, self._bound.frozen, self._err)
        self.last_step_skipped = False
        if self._bound.source.check_finite:  # every rank agrees: the statistics are summed over the ranks
            self.last_step_skipped = bool(self._bound.grads.nonfinite().item())  # the fp16 path syncs here
        if not self.last_step_skipped:
            self._bound.update(self.param_groups, kwargs, given)
        self._bound.grads.settle()  # (its all-reduce ran during the update: see ReducedGrads.backward_done)
        self._bound.source.step_done(updated=not self.last_step_skipped)
        if not self.last_step_skipped:
            self.state_dicts.forget()
        return loss

    @torch.no_grad()
    def shards_loaded(self, steps: List[int]):
        """After a checkpoint wrote this rank's region values and states: set the
        step counts (one per parameter, as ``param_steps``) and rebuild
        everything derived from the shards (ZeRO-1/2: the low-precision chunks
        and the full parameters; ZeRO-3: drop the units' gathered copies)."""
        self._bound.param_steps = list(steps)
        self._bound.source.shards_loaded()
        self.state_dicts.forget()

    def zero_grad(self, set_to_none: bool = True):
        """Zero the gradients (and this rank's reduced shards); lay out the parameters
        unfrozen since the optimizer was built ([Note: new parameters] in optim/regroup.py)."""
        if self._bound.source.in_backward():
            raise RuntimeError(self._err("zero_grad() called during backward"))
        self._bound.grads.clear()
        self._bound.source.zero_grad(set_to_none)
        for i in self._bound.frozen:  # (not laid out: their own gradients, as torch's)
            p = self._bound.params[i]
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()
        self.regrouping.lay_out_unfrozen()

    # ---------------------------------------------------------------- memory
    def memory_report(self, reset_peak: bool = False) -> Dict[str, int]:
        """Bytes held on this rank, by category: ``params``, ``grads``, ``master``,
        ``exp_avg``, ``exp_avg_sq`` (only elements of real parameters), ``padding``
        (what the layout adds), ``total`` (their sum), split by where it lives into
        ``device`` / ``host`` / ``disk`` ([Note: offload]); ``comm_buffers`` and
        ``comm_buffers_peak`` (reduction buckets now and at most since construction or
        ``reset_peak=True``); with ``optimizer_class``, ``optimizer_state``. Over
        FullyShard parameters: the models' reports. The docs' planner page says
        exactly when each is held."""
        rep = self._bound.source.memory_report(reset_peak)
        if not self._bound.rule.fused:
            rep["optimizer_state"] = self._bound.rule.state_bytes()
            rep["total"] += rep["optimizer_state"]
        return rep

    @property
    def whole_tensor_rule(self) -> Optional[WholeTensor]:
        """With a whole-tensor ``optimizer_class``: its rule (the owners and their state,
        [Note: whole-tensor optimizers]); None otherwise."""
        return self._bound.rule if isinstance(self._bound.rule, WholeTensor) else None

    @property
    def elementwise_rule(self) -> Optional[TorchElementwise]:
        """With an elementwise ``optimizer_class``: its rule (its state, one entry per piece of
        this rank's shard, [Note: update rules]); None otherwise."""
        return self._bound.rule if isinstance(self._bound.rule, TorchElementwise) else None

    @property
    def sharded_state(self) -> bool:
        """Whether sharded state dicts hold this optimizer's state: the fused AdamW's and a
        whole-tensor class's (an elementwise class's state dict is in its own format, through
        ``consolidate_state_dict``; zeroshard checkpoints hold every rule's)."""
        return self.fused or self.whole_tensor_rule is not None

    @property
    def fused(self) -> bool:
        """Whether the step is zeroshard's fused AdamW (else ``optimizer_class``'s own)."""
        return self._bound.rule.fused

    # ------------------------------------------- state dicts (optim/state_dict.py: StateDicts)
    def state_dict(self, to: Optional[int] = None):
        """The full state in torch.optim.AdamW's format (with ``optimizer_class``:
        that class's), loadable by that torch optimizer over the unwrapped
        model's parameters, in the same order.

        After ``consolidate_state_dict(to=r)`` on every rank, rank ``r`` gets it
        here without communication (a checkpoint under ``if rank == 0:``).
        Otherwise it is collective: every rank must call it; a rank that waits
        for the others longer than the watchdog's timeout raises
        ``CollectiveTimeout``, naming them. Gathers one region (bucket, or unit for FullyShard parameters) at a
        time, so the transient extra memory is one region; the result is on CPU.
        With ``to=r`` only global rank ``r`` builds and returns the dict; the
        others return None.
        """
        return self.state_dicts.state_dict(to)

    def load_state_dict(self, state_dict: dict):
        """Load a full AdamW state dict (ours or torch.optim.AdamW's, from any world
        size), keeping only this rank's shard. Parameters come from the model:
        load the model's state dict first; bf16/fp16 master weights are re-made
        from the parameters."""
        self.state_dicts.load_state_dict(state_dict)

    def consolidate_state_dict(self, to: Optional[int] = 0):
        """Gather the full state onto global rank ``to`` (every rank with ``to=None``),
        where ``state_dict()`` then returns it without communication, as with
        torch's ZeroRedundancyOptimizer. Collective: every rank must call it. The
        copy is on CPU and is dropped by the next step."""
        self.state_dicts.consolidate(to)

    def sharded_state_dict(self) -> dict:
        """This rank's shard of the optimizer state, without communication: fast
        to save (e.g. ``torch.save`` per rank) and exact (stages 1/2 include the
        fp32 master of bf16/fp16 parameters). It loads back only with
        ``load_sharded_state_dict`` into the same layout (same model, world size,
        rank, stage and bucket_mb); to change any of those use ``state_dict()``
        or ``zeroshard.save_checkpoint``. The tensors are views of the live
        state (stages 1/2: ``values`` is this rank's chunk of the fp32 master or
        of the fp32 parameters) on its device: copy them (or save) before the
        next step."""
        return self.state_dicts.sharded_state_dict()

    def load_sharded_state_dict(self, sharded: dict):
        """Load what ``sharded_state_dict()`` returned on this rank, into the same
        layout. Collective: every rank calls it with its own dict; if any rank's
        does not match its layout, every rank raises, naming the rank and what
        differs. Stages 1/2 restore the parameters too (each rank's chunk, then
        an all-gather); stage 3's are the model's: load the model's state first."""
        self.state_dicts.load_sharded_state_dict(sharded)

    # ------------------------------------------------ new layouts (optim/regroup.py: Regrouping)
    def add_param_group(self, param_group: dict):
        """torch's ``add_param_group``: the group's parameters join the shards (collective:
        call it on every rank) and are stepped from the next step; see [Note: new parameters]."""
        if getattr(self, "_bound", None) is None:  # torch's __init__ adding the constructor's groups
            return super().add_param_group(param_group)
        self.regrouping.add(param_group)

    def release(self) -> None:
        """Let go of the parameters: their gradients cleared, every hook removed (the source's,
        the placeholders', the module buffers' broadcast) and the claim on them dropped, so
        another ShardedOptimizer (or FullyShard) may take them: DeepSpeed's ``engine.destroy()``
        and a second ``zeroshard.initialize`` over the same model. Do not step it afterwards."""
        self.regrouping.release()

    # ----------------------------------------------------- torch's Join (optim/join.py: JoinSide)
    def join_hook(self, **kwargs):
        return self.joining.hook()

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.source.groups.every  # every rank holding a copy takes part in the count
