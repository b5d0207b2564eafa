"""Initialising a FullyShard model's parameters after wrapping, FSDP2's idiom.

[Note: initialising sharded parameters] FSDP2 scripts build the model on meta,
shard it, call ``model.to_empty(device=...)`` and then the model's own
``init_weights()``: nn.init's functions on the sharded parameters. Wrapping
already allocated the shards (and ran ``reset_parameters()``: [Note: partly on
meta] in zero3/wrap.py); ``FullyShard.to_empty`` keeps them and the buffers. A
``ShardedParameter`` ([Note: sharded parameters] in zero3/param.py) then takes
in-place writes, under ``torch.no_grad()`` as nn.init runs them, on this rank's
piece:

* Overwrites: random fills (``uniform_``, ``normal_``, ``bernoulli_``,
  ``exponential_``, ``random_``, ...), ``fill_``, ``zero_``, ``copy_`` from a
  tensor of (or broadcast to) the full shape, and an op writing it as ``out=``
  (``nn.init.eye_``) run on a transient fp32 tensor of the full shape on the
  piece's device, and the piece takes its range. A random fill thus draws the
  whole tensor's values from the generator (the default one of that device, or
  the one passed), as one process would: the values are those of the
  unwrapped model initialised in one process with the same seed, whatever the
  world size, and every rank's generator advances alike. That needs the ranks'
  generators to agree: the first random fill on a model's parameters compares
  them (one all-gather of a digest over every rank, replicas too) and refuses
  a per-rank seed, which would give each piece another stream (DTensor
  broadcasts rank 0's state instead, with a deprecation warning; on CPU it
  draws each shard from the local generator, so its values depend on the
  world size). Cost: each rank draws the whole tensor (time and one transient
  full-size fp32 tensor per fill), where DTensor's offset-based generator on
  CUDA draws only the local shard.
* After an overwrite the parameter's whole value is known to every rank: the
  transient tensor is kept for the parameter last overwritten, and reads and
  in-place ops on that parameter under ``torch.no_grad()`` run on it, the piece
  taking its range after each write (``trunc_normal_``'s rejection loop
  compares, masks and resamples). It is dropped when another parameter is
  overwritten, when values are loaded into the model, when the piece moves
  (a relayout) and at the model's next forward (an optimizer step follows
  one); a write to ``p.to_local()`` in between is not seen.
* Elementwise in-place ops (torch's pointwise ops: ``mul_`` by a number,
  ``clamp_``, ``add_`` of a tensor of the full shape) on a parameter whose whole
  value is not known apply to the piece (the other tensor's range).
* Ops that read only the shape (``empty_like``, ``new_empty``, ``zeros_like``, ...)
  give plain tensors of the full shape (trunc_normal_'s buffers), except with
  ``device=`` and no whole value known: an inner module's ``to_empty()``, which
  would put plain tensors in the parameters' place, is refused.
* Anything else raises naming the parameter, its module and the fix: a view or
  an index of the parameter (``p[0]``, ``p.data``, ``view_as``: nn.init's
  ``orthogonal_``, ``dirac_`` and ``sparse_``), or a read of one whose whole
  value is not known. The fix: initialise a full tensor and copy it in
  (``p.copy_(w)`` under ``torch.no_grad()``, every rank with the same seed), or
  give the module its values before wrapping (a model partly on meta keeps
  them). A tensor-parallel or an expert parameter's pieces are no ranges of
  one full tensor: only elementwise ops with numbers work on it.

A model built on meta whose classes define their own initialisation
(``init_weights``, ``_init_weights``, ...) and whose parameters nothing wrote
after wrapping (no init op, no load) warns at its first forward, naming those
methods: its parameters hold torch's ``reset_parameters()`` defaults.
"""

from __future__ import annotations

import hashlib
import re
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from .. import comm
from .piecewise import written_arguments
from .records import owner_of

aten = torch.ops.aten

_RANDOM = {
    aten.uniform_.default,
    aten.normal_.default,
    aten.bernoulli_.float,
    aten.bernoulli_.Tensor,
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.geometric_.default,
    aten.random_.default,
    aten.random_.to,
    getattr(aten.random_, "from"),
}
_OVERWRITES = _RANDOM | {aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default, aten.copy_.default}
_SHAPE_ONLY = {
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.new_empty_strided.default,
}
# method names of a model's own initialisation (torchtitan's init_weights, HF's _init_weights)
_INIT_METHOD = re.compile(r"^_?(init_weights?|initiali[sz]e_weights|init_param(eter)?s|initiali[sz]e_param(eter)?s)$")


@dataclass
class _Whole:
    """The whole value of the parameter last overwritten ([Note: initialising sharded parameters])."""

    param: Any  # weakref to the ShardedParameter
    value: torch.Tensor  # fp32, its full shape


_last: Optional[_Whole] = None


def forget() -> None:
    """Drop the kept whole value (the model runs, values are loaded, a piece moved)."""
    global _last
    _last = None


def _whole_of(p) -> Optional[torch.Tensor]:
    if _last is not None and _last.param() is p:
        return _last.value
    return None


def _keep(p, value: torch.Tensor) -> None:
    """``value`` is ``p``'s whole value now: its range into the piece, kept for later reads."""
    global _last
    n = p.piece.numel()
    p.piece.copy_(value.reshape(-1)[p.start : p.start + n])
    _last = _Whole(weakref.ref(p), value)
    _mark_written(p)


def _watch(p) -> Optional["InitWatch"]:
    return getattr(owner_of(p), "init_watch", None)


def _mark_written(p) -> None:
    watch = _watch(p)
    if watch is not None:
        watch.written = watch.changed = True


def note_write(p) -> None:
    """A torch optimizer's op wrote ``p``'s piece ([Note: torch optimizers over sharded
    parameters]): a kept whole value of it is stale, and its FullyShard learns the shards changed."""
    if _whole_of(p) is not None:
        forget()
    watch = _watch(p)
    if watch is not None:
        watch.changed = True


def _written_args(func, args, kwargs, is_param) -> list:
    """The ShardedParameters ``func`` writes (in place or as ``out=``)."""
    return [(v, a.is_out) for a, v in written_arguments(func, args, kwargs) if is_param(v)]


def apply(func, args: tuple, kwargs: dict, is_param: Callable[[Any], bool]):
    """``func`` on ShardedParameters as [Note: initialising sharded parameters] says, or
    NotImplemented where it would need data no rank holds (the caller refuses it)."""
    params = [a for a in tree_flatten((args, kwargs))[0] if is_param(a)]
    if func in _SHAPE_ONLY and ("device" not in kwargs or all(_whole_of(p) is not None for p in params)):
        # (with device=, an inner module's to_empty(): it would swap plain tensors in, refused)
        a2, k2 = tree_map(lambda a: _stand_in(a) if is_param(a) else a, (args, kwargs))
        return func(*a2, **k2)
    if torch.is_grad_enabled() or any(
        r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns
    ):
        return NotImplemented  # (a view, or an op autograd records: refused)
    written = _written_args(func, args, kwargs, is_param)
    if len(written) > 1:
        return NotImplemented
    target, is_out = written[0] if written else (None, False)
    others = [p for p in params if p is not target]
    if any(_whole_of(p) is None for p in others):
        return NotImplemented
    if target is None:  # a read of parameters whose whole values are known
        return _run(func, args, kwargs, is_param, {})
    whole = _whole_of(target)
    if whole is None and (is_out or func in _OVERWRITES) and target.whole:
        if func in _RANDOM:
            check_generators(target, kwargs.get("generator"))
        whole = torch.empty(target.shape, dtype=torch.float32, device=target.piece.device)
    if whole is not None:
        _run(func, args, kwargs, is_param, {id(target): whole})
        _keep(target, whole)
        return target
    # (a tensor-parallel or expert piece is no range of the one full tensor: with numbers only)
    if (
        torch.Tag.pointwise in func.tags
        and not others
        and (
            target.whole
            or not any(
                isinstance(a, torch.Tensor) and a.dim() > 0 and not is_param(a) for a in tree_flatten((args, kwargs))[0]
            )
        )
    ):
        _run(func, args, kwargs, is_param, {id(target): target.piece}, piece_of=target)
        _mark_written(target)
        return target
    return NotImplemented


def _run(func, args, kwargs, is_param, values: dict, piece_of=None):
    """``func`` with each ShardedParameter replaced by ``values[id]`` or its whole value;
    with ``piece_of``, every other tensor of the full shape by its range of the piece's."""

    def swap(a):
        if is_param(a):
            return values[id(a)] if id(a) in values else _whole_of(a)
        if piece_of is not None and isinstance(a, torch.Tensor) and a.dim() > 0:
            full = a.expand(piece_of.shape).reshape(-1)
            return full[piece_of.start : piece_of.start + piece_of.piece.numel()]
        return a

    a2, k2 = tree_map(swap, (args, kwargs))
    return func(*a2, **k2)


def _stand_in(p) -> torch.Tensor:
    """A tensor of ``p``'s shape, dtype and device that holds one element (for shape-only ops)."""
    return torch.zeros((), dtype=p.dtype, device=p.piece.device).expand(p.shape)


def check_generators(p, generator: Optional[torch.Generator]) -> None:
    """Once per model: every rank's generator (``generator``, or the default one of the
    piece's device) is in the same state, or the random fills would give each piece
    another stream (collective over every rank of ``p``'s FullyShard)."""
    fs, watch = owner_of(p), _watch(p)
    if watch is None or watch.generators_checked:
        return
    watch.generators_checked = True
    dev = p.piece.device
    state = (
        generator.get_state()
        if generator is not None
        else torch.cuda.get_rng_state(dev)
        if dev.type == "cuda"
        else torch.get_rng_state()
    )
    digest = hashlib.sha1(state.cpu().numpy().tobytes()).hexdigest()
    everyone = comm.all_gather_object(digest, group=fs.groups.every, what="random init: generator states")
    if len(set(everyone)) > 1:
        differ = [r for r, d in enumerate(everyone) if d != everyone[0]]
        raise RuntimeError(
            comm.on_rank(
                fs,
                f"a random fill of sharded parameter '{p.param_name}': the ranks' random generators differ (ranks "
                f"{differ} from rank 0's), so each rank's piece would come from another stream and the values would "
                "depend on the world size. Seed every rank alike before initialising (torch.manual_seed(seed) on "
                "every rank); seed per rank after it, for dropout",
            )
        )


def check_to_empty(device, shards_on: torch.device, err: Callable[[str], str]) -> None:
    """``FullyShard.to_empty(device=...)``: the device the shards were allocated on, or refused."""
    want = torch.device(device)
    if want.type == "cuda" and want.index is None and torch.cuda.is_available():
        want = torch.device("cuda", torch.cuda.current_device())
    if want != shards_on:
        raise ValueError(
            err(
                f"to_empty(device={want}) after wrapping: this model's shards were allocated on {shards_on} when it "
                f"was wrapped, and FullyShard does not move them. Pass device={want} to FullyShard (a model built on "
                "meta is allocated where device= says); to_empty is then optional"
            )
        )


def convert_buffers(module: nn.Module, fn, shards_on: torch.device, err: Callable[[str], str]) -> None:
    """``fn`` (a ``model.to(...)``'s conversion after wrapping) applied to ``module``'s buffers
    if it keeps float32 on the shards' device; any other is refused naming what to use."""
    probe = torch.empty(1, dtype=torch.float32, device=shards_on)
    try:
        out = fn(probe)
    except Exception:  # noqa: BLE001 - e.g. .cuda() without CUDA: refused below
        out = None
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.device != probe.device:
        dtype, device = getattr(out, "dtype", "?"), getattr(out, "device", "?")
        raise ValueError(
            err(
                f"converting a FullyShard model after wrapping (to {dtype} on {device}) is not supported: its "
                f"parameters are fp32 shards on {shards_on}, the master weights. To compute in bf16 or fp16 "
                "pass mixed_precision=zeroshard.MixedPrecision(param_dtype=...) to FullyShard; to change the "
                "device, move the model (or build it on meta) before wrapping, or pass device="
            )
        )
    for mod in module.modules():
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = fn(b)


class InitWatch:
    """Whether a model built on meta had its own initialisation after wrapping, for one FullyShard
    (made before the wrap: ``module``'s parameters still on meta, ``device`` the shards')."""

    def __init__(self, module: nn.Module, device: torch.device):
        built_on_meta = device.type != "meta" and any(p.is_meta for p in module.parameters())
        self.custom: List[str] = own_init_methods(module) if built_on_meta else []
        self.written = False  # an init op or a load wrote the parameters since wrapping
        self.changed = False  # an op wrote a piece since the last forward (before_forward says)
        self.generators_checked = False  # check_generators ran

    def values_given(self) -> None:
        """Values were loaded into the shards (a state dict, a checkpoint)."""
        self.written = True
        forget()

    def before_forward(self) -> bool:
        """At each forward: whether an op wrote a parameter's piece since the last one; at the
        first, warn if the model's own initialisation never ran on its parameters."""
        forget()
        changed, self.changed = self.changed, False
        if self.custom and not self.written:
            warnings.warn(
                "FullyShard: the model was built on meta, and nothing has written its parameters since "
                "wrapping, so they hold what reset_parameters() gave them there (torch's defaults), not the "
                f"model's own initialisation ({', '.join(self.custom)}); what __init__ does to meta tensors is "
                "lost. As with FSDP2, run it after wrapping: model.to_empty(device=...), then "
                "model.init_weights() (nn.init's fills work on the sharded parameters: each rank keeps its "
                "piece, the same values at any world size); or load values (model.load_state_dict, "
                "zeroshard.load_pretrained)",
                stacklevel=3,
            )
        self.custom = []
        return changed


def own_init_methods(module: nn.Module) -> List[str]:
    """``Class.method`` for each initialisation method the model's own (not torch's) classes define."""
    found = {}
    for m in module.modules():
        cls = type(m)
        if cls.__module__.startswith("torch."):
            continue
        for name in dir(cls):
            if _INIT_METHOD.match(name) and callable(getattr(cls, name, None)):
                owner = next(c for c in cls.__mro__ if name in vars(c))
                if not owner.__module__.startswith("torch."):
                    found.setdefault(f"{owner.__name__}.{name}", None)
    return list(found)


def module_of(param_name: str) -> str:
    """The module path of parameter ``param_name`` ('<root>' for the model's own)."""
    return param_name.rpartition(".")[0] or "<root>"
