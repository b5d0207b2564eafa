"""FullyShard's records: MixedPrecision, a parameter (Param), a sharding unit
(Unit) with its state, and the parties stepping its shards (Steppers)."""

from __future__ import annotations

import enum
import functools
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Tuple, Union

import torch
import torch.nn as nn

from .. import comm
from ..core.reduction import Reduction
from ..core.source import SUPPORTED
from ..native.layout import chunk_span
from ..offload import Placement


def left_out(p: torch.Tensor) -> bool:
    """An integer or bool parameter (a step counter, a mask): FullyShard leaves it out of
    sharding, on its module, as a buffer (it takes no gradient)."""
    return not (p.is_floating_point() or p.is_complex())


class InPlace:
    """The base of the classes ``fully_shard`` swaps into a module's (zero3/module_api.py)."""


def own_method(module: nn.Module, name: str):
    """``module.<name>`` as the model's own class defines it, past a class fully_shard swapped in."""
    return getattr(super(InPlace, module), name) if isinstance(module, InPlace) else getattr(module, name)


def owner_of(p: torch.Tensor):
    """The FullyShard that made parameter ``p`` (a ShardedParameter's ``owner_ref``), else None."""
    ref = getattr(p, "owner_ref", None)
    return ref() if isinstance(ref, weakref.ref) else None


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of FullyShard's gathered parameters and gradient reduction.

    ``param_dtype``: dtype the parameters are all-gathered in and the forward
    and backward compute with (None: float32). ``reduce_dtype``: dtype of the
    gradient reduce-scatter (None: ``param_dtype``). Shards, gradient shards
    and optimizer states stay float32 either way.

    ``cast_forward_inputs``: each unit casts the floating tensors among its
    inputs to ``param_dtype`` (FSDP2's ``MixedPrecisionPolicy`` default);
    ``cast_root_forward_inputs``: the wrapped model's forward does (FSDP's).
    Both default to True when ``param_dtype`` is set (None: that default);
    integer inputs (token ids) are never cast. ``output_dtype``: each unit's
    and the model's floating outputs are cast to it (FSDP2's; None: not cast).

    ``gather_dtype``: ``"int8"`` or ``"fp8"`` (e4m3): the all-gathers move
    block-quantized codes with a scale per ``gather_block_size`` elements of
    each rank's shard, decoded into ``param_dtype`` for compute ([Note:
    quantized gathers] in csrc/quant.h); None: ``param_dtype`` on the wire.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: Optional[bool] = None
    cast_root_forward_inputs: Optional[bool] = None
    output_dtype: Optional[torch.dtype] = None
    gather_dtype: Optional[str] = None
    gather_block_size: int = 256

    def __post_init__(self):
        for what in ("param_dtype", "reduce_dtype", "output_dtype"):
            dt = getattr(self, what)
            if dt is not None and dt not in SUPPORTED:
                raise ValueError(f"mixed_precision.{what} must be one of {SUPPORTED} or None, got {dt!r}")
        if self.gather_dtype not in (None, "int8", "fp8"):
            raise ValueError(
                f"MixedPrecision(gather_dtype={self.gather_dtype!r}): the quantized gathers take 'int8' or 'fp8' "
                "(e4m3), or None (the gathers move param_dtype)"
            )
        size = self.gather_block_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 32 or size > 4096 or size % 32:
            raise ValueError(
                f"MixedPrecision(gather_block_size={size!r}): give a multiple of 32 between 32 and 4096 elements "
                "(each block of a rank's shard gets its own scale; 128 or 256 are usual)"
            )

    def casts_inputs(self, root: bool) -> bool:
        """Whether the root's (``root``) or a unit's forward casts its floating inputs."""
        if self.param_dtype is None:
            return False
        flag = self.cast_root_forward_inputs if root else self.cast_forward_inputs
        return True if flag is None else bool(flag)


@dataclass
class Param:
    names: List[str]  # every name it is registered under, first is canonical
    slots: List[Tuple[nn.Module, str]]  # (module, attribute) registrations
    shape: torch.Size
    dtype: torch.dtype  # original dtype (state_dict returns it)
    requires_grad: bool
    offset: int = 0  # in the unit's flat buffer
    full: Optional[nn.Parameter] = None  # compute parameter (view of the gathered buffer)
    local: Optional[torch.Tensor] = None  # this rank's piece (1-D view of the shard)
    sharded: Optional[nn.Parameter] = None  # what the modules hold between uses: a ShardedParameter
    # over ``local`` ([Note: sharded parameters] in zero3/param.py)
    shard_offset: int = 0  # where the piece starts in the shard
    tensor_offset: int = 0  # where the piece starts in the flattened parameter
    arrived: bool = False  # gradient arrived in this backward
    watched: bool = False  # its full parameter's gradient hook is registered (once)
    got_grad: bool = False  # a gradient arrived since zero_grad(set_to_none=True)
    exposed: Optional[torch.Tensor] = None  # the ShardedTensor expose_grads put in ``sharded.grad``
    # a DTensor parameter's placements over its tp mesh (``shape`` is then its local piece's:
    # [Note: tensor-parallel parameters] in core/tensor_parallel.py); None otherwise
    placed: Optional[object] = None

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def full_shape(self) -> torch.Size:
        """The parameter's shape as the model sees it (a DTensor's: global)."""
        return self.shape if self.placed is None else self.placed.shape


class UnitGroups:
    """``wrap=`` for the modules fully_shard was called on: each module a unit, each list
    of modules one unit (a group); a predicate on a module ([Note: fully_shard in place])."""

    def __init__(self, groups: List[List[nn.Module]]):
        self.groups = groups
        self._key = {id(m): k for k, g in enumerate(groups) for m in g}

    def __call__(self, module: nn.Module) -> bool:
        return id(module) in self._key

    def key(self, module: nn.Module) -> Optional[int]:
        """The group ``module`` belongs to (None: not one of them)."""
        return self._key.get(id(module))


@dataclass
class UnitSettings:
    """A unit's own settings (FSDP2's ``set_*`` calls on its module); None: the model's."""

    reshard_after_forward: Optional[Union[bool, int]] = None  # (an int: [Note: post-forward shards])
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    divide_factor: Optional[float] = None
    forward_prefetch: Optional[List[int]] = None
    backward_prefetch: Optional[List[int]] = None


class UnitState(enum.Enum):
    """Where a unit's full parameters are."""

    SHARDED = "sharded"  # only this rank's shard exists; the full buffer's storage is freed
    GATHERING = "gathering"  # an all-gather into the full buffer is in flight (prefetch)
    GATHERED = "gathered"  # the full buffer holds every rank's shard; the module computes on it


@dataclass
class Unit:
    index: int
    name: str  # module path, '' for the root
    module: nn.Module
    params: List[Param]
    ranks: object = None  # its shards' ranks: a ShardGroup (comm/mesh.py), an expert's own or FullyShard's
    numel: int = 0  # padded flat size (world_size * shard_numel, or bounds[-1])
    shard_numel: int = 0  # this rank's chunk of it
    # rank r's chunk is [bounds[r], bounds[r + 1]) when the unit is laid out for a
    # whole-tensor optimizer ([Note: uneven chunks] in zero3/relayout.py); None: equal chunks
    bounds: Optional[List[int]] = None
    # the flat gradient buffer: [0, grad_numel) of the flat layout, cut at grad_bounds (None:
    # the parameters' chunks); frozen parameters laid out after the last trainable one are
    # never reduced ([Note: frozen parameters] in zero3/wrap.py)
    grad_numel: int = 0
    grad_bounds: Optional[List[int]] = None
    shard: Optional[torch.Tensor] = None  # fp32, this rank's shard
    # the gradient shard lives in (pinned) host memory: an optimizer steps this unit on the
    # CPU while it trains on a device ([Note: offloaded gradients] in offload/copies.py)
    grad_to_host: bool = False
    full: Optional[torch.Tensor] = None  # param_dtype flat buffer; storage freed when sharded
    state: UnitState = UnitState.SHARDED
    gather: Optional[comm.CommHandle] = None
    # a quantized all-gather in flight: (its wire records, each rank's element count), decoded
    # into ``full`` when it is waited for ([Note: quantized gathers] in csrc/quant.h)
    wire: Optional[tuple] = None
    # reshard_after_forward=k: (its k ranks' ShardGroup, this rank's piece of the gathered
    # unit) from its forward to its backward ([Note: post-forward shards] in zero3/gather.py)
    post_forward: Optional[tuple] = None
    # its gradients' reduction ([Note: reduction pipeline] in core/reduction.py): its
    # buffer holds the flat reduce_dtype gradients during backward; its pending count
    # what the unit's backward still waits for (trainable parameters' gradients, inputs');
    # its ``grad`` the fp32 averaged gradient shard (its tensor None until reduced)
    reduction: Optional[Reduction] = None
    fresh: bool = True  # the reduction overwrites the gradient shard (no accumulation)
    calls: int = 0  # its forwards (or registered methods) running now, nested
    # calls since the last backward began whose inputs' gradients are still to come: a unit
    # with frozen parameters is done with its backward only then ([Note: frozen parameters])
    input_waits: int = 0
    hooks: list = field(default_factory=list)
    # gathered() blocks holding it gathered ([Note: gathered blocks] in zero3/gathered.py), and
    # the copy of its full parameters one made in another dtype: (flat buffer, parameters)
    held: int = 0
    copy: Optional[tuple] = None
    # the other modules of its group (fully_shard([m1, m2]): one unit, gathered before the
    # first of them runs and resharded when each has run: [Note: fully_shard in place])
    group: List[nn.Module] = field(default_factory=list)
    # the per-unit settings of FSDP2's module API ([Note: fully_shard in place]): None
    # takes the model's; the explicit prefetch lists hold unit indices
    settings: "UnitSettings" = field(default_factory=lambda: UnitSettings())

    @property
    def modules(self) -> List[nn.Module]:
        """The modules whose calls gather it: its module and its group's others."""
        return [self.module] + self.group

    @property
    def is_root(self) -> bool:
        return self.index == 0

    @functools.cached_property
    def trainable(self) -> List[Param]:  # read once the units are built (every backward)
        return [p for p in self.params if p.requires_grad]

    def retrained(self, params: List[Param]) -> None:
        """``params`` train from now on as their sharded parameters say (relayout.retrain:
        frozen when wrapped and unfrozen since, or frozen since)."""
        for q in params:
            q.requires_grad = q.sharded.requires_grad
        self.__dict__.pop("trainable", None)

    def span(self, rank: int) -> Tuple[int, int]:
        """Rank ``rank``'s chunk of the flat buffer: [start, end)."""
        return chunk_span(self.bounds, self.shard_numel, rank)

    def own(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        lo, hi = self.span(rank)
        return flat[lo:hi]

    def grad_span(self, rank: int) -> Tuple[int, int]:
        """Rank ``rank``'s chunk of the flat gradient buffer: a prefix of its chunk of the parameters."""
        return self.span(rank) if self.grad_bounds is None else chunk_span(self.grad_bounds, 0, rank)

    def own_grad(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        lo, hi = self.grad_span(rank)
        return flat[lo:hi]

    def reduce_bounds(self) -> Optional[List[int]]:
        """The reduce-scatter's chunks of the flat gradient buffer (None: equal chunks)."""
        return self.bounds if self.grad_bounds is None else self.grad_bounds

    def holder(self, offset: int, numel: int, world_size: int) -> Optional[int]:
        """The rank whose chunk holds all of ``[offset, offset + numel)``, else None."""
        for r in range(world_size):
            lo, hi = self.span(r)
            if lo <= offset and offset + numel <= hi and hi > lo:
                return r
        return None


def register_owner(fs, units: List[Unit]):
    """Record ``fs`` (weakly) as the owner of its units' sharded parameters."""
    fs_ref = weakref.ref(fs)
    for u in units:
        for q in u.params:
            q.sharded.owner_ref = fs_ref


class Stepper(Protocol):
    """What FullyShard asks of a party stepping its shards (the ZeRO-3 source an
    optimizer binds: zero3/source.py) when a unit is laid out again."""

    def relayout_blocker(self) -> Optional[str]:
        """Why the units it steps may not be laid out again now, or None."""

    def relaid(self) -> None:
        """The units it steps were laid out again: whoever bound it binds anew."""


class Steppers:
    """The parties stepping a FullyShard model's shards (the sources optimizers bind
    over its units, held weakly): their state shards by unit index, which
    memory_report counts while each lives, and which of them have stepped since the
    backward (with several, e.g. Muon over the matrices and AdamW over the rest, the
    gradients are consumed once each has). FullyShard tells them of a relayout through
    the ``Stepper`` protocol and knows nothing else of them."""

    def __init__(self):
        self._entries: List[tuple] = []
        self._stepped: set = set()
        self._deferred_zero: Optional[bool] = None  # set_to_none of a zero_grad() held back

    def register(self, owner: object, states: Dict[int, Dict[str, torch.Tensor]], places: Dict[int, Placement]):
        """``owner``'s state shards by unit index, and where each unit's live (``places``)."""
        self._entries.append((weakref.ref(owner), states, places))

    def unregister(self, owner: object):
        self._entries = [e for e in self._entries if e[0]() is not None and e[0]() is not owner]

    def over(self, unit_indices: set) -> list:
        """The live steppers with state over any of these units."""
        return [o for ref, st, _ in self._entries if (o := ref()) is not None and unit_indices & set(st)]

    def states_by_unit(self) -> Dict[int, Dict[str, torch.Tensor]]:
        out: Dict[int, Dict[str, torch.Tensor]] = {}
        for ref, states, _ in self._entries:
            if ref() is not None:  # (an optimizer with its own state registers none)
                out.update({k: v for k, v in states.items() if v})
        return out

    def placed(self) -> List[Tuple[torch.Tensor, Placement]]:
        """Each live state shard with where it lives."""
        return [
            (t, places[k])
            for ref, states, places in self._entries
            if ref() is not None
            for k, st in states.items()
            for t in st.values()
        ]

    def live(self) -> list:
        """The live steppers, in registration order."""
        return [e[0]() for e in self._entries if e[0]() is not None]

    def all_stepped(self, by: Optional[object]) -> bool:
        """Records that ``by`` stepped; whether every live one has (then starts over)."""
        live = self.live()
        if by is not None and len(live) > 1:
            self._stepped.add(id(by))
            if not all(id(o) in self._stepped for o in live):
                return False
        self._stepped.clear()
        return True

    def clear_steps(self):
        self._stepped.clear()
        self._deferred_zero = None

    def defer_zero(self, by: Optional[object], set_to_none: bool, grads_ready: bool) -> bool:
        """Whether ``by``'s zero_grad() must wait: it has stepped on the gradients of this
        backward and another live optimizer has not yet (a loop that steps and zeroes
        each optimizer in turn). The zeroing then runs once the last one has stepped."""
        live = self.live()
        if by is None or not grads_ready or id(by) not in self._stepped or all(id(o) in self._stepped for o in live):
            return False
        self._deferred_zero = set_to_none if self._deferred_zero is None else self._deferred_zero and set_to_none
        return True

    def take_deferred_zero(self) -> Optional[bool]:
        """The set_to_none of a held-back zero_grad(), if any (then forgotten)."""
        out, self._deferred_zero = self._deferred_zero, None
        return out
