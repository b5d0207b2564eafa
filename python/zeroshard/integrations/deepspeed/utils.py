"""``deepspeed.utils``' ``safe_*`` helpers over zeroshard's engines: the fp32
master value, the gradient and the optimizer state of one parameter, whole
("full") or this rank's part of it ("local"), read and written.

The parameter is any parameter of a live engine's model (at stage 3 the
model's modules hold the FullyShard's parameters between uses: those). Its
values live in the regions of the engine's ``ShardedOptimizer`` (this rank's
fp32 master or unit shard and, for the fused AdamW, ``exp_avg`` and
``exp_avg_sq``; an elementwise optimizer class keeps its state per piece);
its gradient after ``engine.backward`` is ``p.grad``'s placeholder over the
reduced shards ([Note: sharded gradients] in optim/grads.py).

* ``full`` getters gather the whole tensor (fp32, on the engine's device) with
  one all-reduce: every rank calls them, in the same order, as DeepSpeed's.
* ``full`` setters take the whole value, the same on every rank. A parameter's
  new value reaches the model at once (stages 1/2 gather the parameters again:
  collective; DeepSpeed's model copy changes at the next step); a gradient is
  assigned to ``p.grad``, which the step uses as the parameter's averaged
  gradient ([Note: gradients set by the script] in optim/hand_grads.py).
* ``local``: the elements of the parameter this rank holds, in zeroshard's
  layout (a unit's or bucket's chunk, not DeepSpeed's per-parameter split):
  what the getter returns, the setter takes back. They work at every stage
  (DeepSpeed's only at stage 3). Local gradients go through the full one, so
  both are collective; local values and states are not, except that setting a
  value at stages 1/2 gathers the parameters again.
* As DeepSpeed's, a parameter the optimizer does not train (frozen, or of no
  live engine) reads as None and ignores writes; gradients are there from
  ``engine.backward`` to the step (the fp16 loss scale still in them).
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from zeroshard import comm

from . import live

__all__ = [
    "safe_get_full_fp32_param",
    "safe_set_full_fp32_param",
    "safe_get_full_grad",
    "safe_set_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_set_local_fp32_param",
    "safe_get_local_grad",
    "safe_set_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]


def _locate(param):
    """(the ShardedOptimizer training ``param``, its index there), or None."""
    e = live.holding(param)
    found = live.index_of(e, param) if e is not None else None
    return found if found is not None and found[1] in found[0].trainable else None


def _spans(opt, i: int) -> List[tuple]:
    """(region, offset in the flattened parameter, slice of this rank's shard) of each piece
    of parameter ``i`` this rank holds, in the parameter's order."""
    return sorted(
        ((reg, t_off, sl) for reg in opt.regions for j, t_off, sl in reg.owned(opt.rank) if j == i), key=lambda s: s[1]
    )


def _state_of(opt, key: Optional[str]):
    """A function (region, offset in the parameter) -> this rank's tensor of ``key`` there
    (None: the fp32 value), one element per element of the shard's slice."""
    if key is None:
        return lambda reg, t_off: reg.values
    if opt.fused:
        if key not in ("exp_avg", "exp_avg_sq"):
            raise ValueError(f"optimizer state {key!r}: the fused AdamW keeps 'exp_avg' and 'exp_avg_sq' per element")
        return lambda reg, t_off: getattr(reg, key)
    rule = opt.elementwise_rule
    if rule is None:
        raise NotImplementedError(
            f"optimizer state of a whole-tensor optimizer ({opt.optimizer_class.__name__}): "
            "each parameter's state is on its owner rank; read it with opt.state_dict()"
        )
    if key not in rule.elementwise_keys:
        raise ValueError(
            f"optimizer state {key!r}: {opt.optimizer_class.__name__} keeps {sorted(rule.elementwise_keys)} per element"
        )
    return lambda reg, t_off: rule.region_state(reg, key, opt.rank, opt.device)


def _piece_state(opt, i: int, t_off: int, key: str) -> torch.Tensor:
    """The elementwise class's ``key`` tensor of parameter ``i``'s piece at ``t_off`` (to write)."""
    st = opt.elementwise_rule.piece_state(i, t_off)
    if st is None or key not in st:
        raise ValueError(
            f"parameter {i} has no optimizer state {key!r} yet: {opt.optimizer_class.__name__} "
            "makes it at its first step"
        )
    return st[key]


def _full(opt, i: int, key: Optional[str]) -> torch.Tensor:
    shape, read = opt.full_shape(i), _state_of(opt, key)
    out = torch.zeros(shape.numel(), dtype=torch.float32, device=opt.device)
    for reg, t_off, sl in _spans(opt, i):
        out[t_off : t_off + sl.stop - sl.start] = read(reg, t_off)[sl].to(out.device, torch.float32)
    if opt.world_size > 1:
        comm.all_reduce(
            out, group=opt.process_group, what=f"safe_get_full ({key or 'fp32 value'}): parameter {i}"
        ).wait()
    return out.view(shape)


def _local(opt, i: int, key: Optional[str]) -> torch.Tensor:
    read = _state_of(opt, key)
    pieces = [read(reg, t_off)[sl].to(torch.float32) for reg, t_off, sl in _spans(opt, i)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float32, device=opt.device)


@torch.no_grad()
def _write(opt, i: int, key: Optional[str], value: torch.Tensor, local: bool) -> None:
    """This rank's pieces of ``value`` (the whole tensor, or with ``local`` this rank's
    part) into the values or the state ``key``; new values reach the parameters."""
    _state_of(opt, key)  # (checks the key)
    spans = _spans(opt, i)
    flat = value.detach().reshape(-1)
    want = sum(sl.stop - sl.start for _, _, sl in spans) if local else opt.full_shape(i).numel()
    if flat.numel() != want:
        raise ValueError(
            f"parameter {i}: the value has {flat.numel()} elements, but "
            f"{'this rank holds' if local else 'the parameter has'} {want}"
        )
    at = 0
    for reg, t_off, sl in spans:
        n = sl.stop - sl.start
        piece = flat[at : at + n] if local else flat[t_off : t_off + n]
        at += n
        dest = (
            reg.values[sl] if key is None else getattr(reg, key)[sl] if opt.fused else _piece_state(opt, i, t_off, key)
        )
        dest.copy_(piece.to(dest.device, dest.dtype).view_as(dest))
    if key is None:
        opt.shards_loaded(opt.param_steps)  # the model's parameters follow (stages 1/2: gathered)


def _get(param, key: Optional[str], local: bool) -> Optional[torch.Tensor]:
    at = _locate(param)
    return None if at is None else (_local if local else _full)(*at, key)


def _set(param, value: torch.Tensor, key: Optional[str], local: bool) -> None:
    at = _locate(param)
    if at is not None:
        _write(*at, key, value, local=local)


# ---------------------------------------------------------------- full
def safe_get_full_fp32_param(param) -> Optional[torch.Tensor]:
    """The whole fp32 master value of ``param`` (collective); None if no engine trains it."""
    return _get(param, None, local=False)


def safe_set_full_fp32_param(param, value: torch.Tensor) -> None:
    """Set the fp32 master value of ``param`` (and the model's parameter) to ``value``."""
    _set(param, value, None, local=False)


def safe_get_full_optimizer_state(param, optim_state_key: str) -> Optional[torch.Tensor]:
    """The whole optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param`` (collective)."""
    return _get(param, optim_state_key, local=False)


def safe_set_full_optimizer_state(param, value: torch.Tensor, optim_state_key: str) -> None:
    _set(param, value, optim_state_key, local=False)


def safe_get_full_grad(param) -> Optional[torch.Tensor]:
    """The averaged gradient of ``param`` after ``engine.backward`` (fp32; collective), or what
    the script assigned to ``p.grad``; None without one."""
    if _locate(param) is None:
        return param.grad
    g = param.grad
    if g is None or not hasattr(g, "full_tensor"):
        return g
    return g.float().full_tensor()


def safe_set_full_grad(param, value: torch.Tensor) -> None:
    """Make ``value`` (the same on every rank) the averaged gradient of ``param`` that the
    next step uses: assigned to ``p.grad`` (in the parameter's dtype)."""
    if _locate(param) is not None or param.grad is not None:
        param.grad = value.detach().to(param.device, param.dtype).reshape(param.shape).clone()


def safe_update_full_grad_vectorized(param_list, update_func: Callable) -> None:
    """Each parameter's gradient becomes ``update_func(its full gradient, the parameter)``."""
    for p in param_list:
        g = safe_get_full_grad(p)
        if g is not None:
            safe_set_full_grad(p, update_func(g, p))


# --------------------------------------------------------------- local
def safe_get_local_fp32_param(param) -> Optional[torch.Tensor]:
    """This rank's elements of the fp32 master value of ``param`` (a copy; see the module docstring)."""
    return _get(param, None, local=True)


def safe_set_local_fp32_param(param, value: torch.Tensor) -> None:
    _set(param, value, None, local=True)


def safe_get_local_optimizer_state(param, optim_state_key: str) -> Optional[torch.Tensor]:
    return _get(param, optim_state_key, local=True)


def safe_set_local_optimizer_state(param, value: torch.Tensor, optim_state_key: str) -> None:
    _set(param, value, optim_state_key, local=True)


def safe_get_local_grad(param) -> Optional[torch.Tensor]:
    """This rank's elements of the averaged gradient of ``param`` (collective: read from the full one)."""
    at = _locate(param)
    full = safe_get_full_grad(param) if at is not None else None
    if full is None:
        return None
    flat = full.reshape(-1)
    return torch.cat([flat[t_off : t_off + sl.stop - sl.start] for _, t_off, sl in _spans(*at)] or [flat[:0]])


def safe_set_local_grad(param, value: torch.Tensor) -> None:
    """Every rank gives its elements of the new gradient of ``param``; together they are its
    averaged gradient (collective: one all-reduce, then ``safe_set_full_grad``)."""
    at = _locate(param)
    if at is None:
        return
    opt, i = at
    full = torch.zeros(opt.full_shape(i).numel(), dtype=torch.float32, device=opt.device)
    flat, pos = value.detach().reshape(-1), 0
    for _, t_off, sl in _spans(opt, i):
        n = sl.stop - sl.start
        full[t_off : t_off + n] = flat[pos : pos + n].to(full.device, torch.float32)
        pos += n
    if pos != flat.numel():
        raise ValueError(f"safe_set_local_grad: the value has {flat.numel()} elements, this rank holds {pos}")
    if dist.get_world_size(opt.process_group) > 1:
        comm.all_reduce(full, group=opt.process_group, what=f"safe_set_local_grad: parameter {i}").wait()
    safe_set_full_grad(param, full.view(opt.full_shape(i)))
