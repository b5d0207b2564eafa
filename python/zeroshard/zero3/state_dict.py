"""FullyShard's memory accounting and full state dicts, through its public API
(``units``, ``module``, ``device``, ``process_group``, ``invalidate``)."""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..core.regions import HeldParam, Piece, Region, add_locations, empty_report
from .records import Steppers, Unit, own_method
from ..core.tensor_parallel import local_piece


def held_regions(
    units: List[Unit], expert_names: Optional[Callable[[str], str]] = None
) -> Tuple[List[HeldParam], List[Region]]:
    """FullyShard.held_regions: each unit's fp32 shard is a region over its parameters; an
    expert unit's ([Note: param groups over their own ranks] in comm/mesh.py) over its own
    ranks, its parameters under their names in the whole model where ``expert_names`` says."""
    params, regions = [], []
    for u in units:
        frags = []
        for q in u.params:
            frags.append(Piece(len(params), 0, q.offset, q.numel))
            whole = expert_names(q.names[0]) if u.ranks.own and expert_names is not None else None
            params.append(HeldParam(q.sharded, q.full_shape, q.dtype, whole, q.placed))
        if frags:
            regions.append(
                Region(
                    shard_numel=u.shard_numel,
                    frags=frags,
                    values=u.shard,
                    model_owned=True,
                    bounds=u.bounds,
                    place=u.ranks.rank if u.ranks.own else None,
                )
            )
    return params, regions


def memory_report(
    units: List[Unit],
    steppers: Steppers,
    param_dtype: torch.dtype,
    gatherer,
    backward,
    reset_peak: bool,
    shards_on_host: bool = False,
) -> Dict[str, int]:
    """FullyShard.memory_report. ``states``: an optimizer's state shards by unit index;
    ``shards_on_host``: offload_params (the shards and gradient shards are host bytes);
    a unit's gradient shard kept in host memory (``grad_to_host``) is host bytes too.

    Persistent: ``params`` (fp32 shards), ``grads`` (fp32 gradient shards, held
    from backward's reductions to ``zero_grad(set_to_none=True)`` and counted
    whether held at the moment or not), ``master`` (always 0: the fp32 shard is
    the master), ``exp_avg`` and ``exp_avg_sq`` (fp32, from the ShardedOptimizer
    over these parameters; 0 without one): each counts only elements of real
    parameters (grads and states: trainable ones); ``padding`` is every other
    byte of those tensors; ``total`` their sum: 16 bytes per owned element with
    an optimizer; ``device`` / ``host`` / ``disk`` split ``total`` by where it
    lives. Transient: ``gathered`` / ``gathered_peak`` (full parameters of
    non-root units), ``gathered_units_peak`` (most non-root units gathered at
    once), ``root_gathered`` (the root unit's full size), ``max_unit`` (largest
    non-root unit's full bytes), ``grad_buffers`` / ``grad_buffers_peak`` (flat
    gradient buffers of backward). Peaks count since construction or the last
    call with ``reset_peak=True``."""
    rep, states = empty_report(), steppers.states_by_unit()
    grads_on_host = 0  # gradient shards kept in host memory ([Note: offloaded gradients])
    for u in units:
        if not u.params:
            continue
        lo, hi = u.grad_span(u.ranks.rank)  # (frozen parameters past the last trainable: no gradient)
        grads_on_host += 4 * (hi - lo) if u.grad_to_host and u.trainable else 0
        own = sum(q.local.numel() for q in u.params)
        own_t = sum(q.local.numel() for q in u.trainable)
        rep["params"] += 4 * own
        rep["grads"] += 4 * own_t
        rep["padding"] += 4 * (u.shard_numel - own) + (4 * (hi - lo - own_t) if u.trainable else 0)
        for name, t in states.get(u.index, {}).items():
            rep[name] += 4 * own_t
            rep["padding"] += t.numel() * t.element_size() - 4 * own_t
    rep["total"] = sum(rep.values())
    add_locations(rep, steppers.placed())
    if shards_on_host:  # the states of offloaded shards are never on the device ([Note: offload params])
        rep["host"], rep["device"] = rep["host"] + rep["device"], 0
    else:
        rep["host"], rep["device"] = rep["host"] + grads_on_host, rep["device"] - grads_on_host
    item = param_dtype.itemsize
    rep.update(
        gathered=gatherer.gathered_bytes,
        gathered_peak=gatherer.gathered_peak,
        gathered_units_peak=gatherer.alive_peak,
        root_gathered=units[0].numel * item,
        max_unit=max([u.numel * item for u in units[1:]], default=0),
        grad_buffers=backward.fold.grad_bytes,
        grad_buffers_peak=backward.fold.grad_bytes_peak,
    )
    if reset_peak:
        gatherer.reset_peaks()
        backward.fold.grad_bytes_peak = backward.fold.grad_bytes
    return rep


# [Note: state-dict hooks]
# A model's state-dict hooks (``register_state_dict_pre_hook``, ``_register_state_dict_hook``,
# ``register_state_dict_post_hook``: torchtitan's fused QKV linear splits its weight in one)
# run on a FullyShard model's full state dict as on the unwrapped model's, by torch's own
# ``Module.state_dict``: while it runs, every parameter's module slots hold its full value
# (``slots_holding``), so a hook's views and splits read real data. The keys are learnt the
# same way first with each slot holding a meta tensor of the parameter's shape (the hooks then
# run on meta: no data, no memory), so a renaming hook's keys are the ones ``keys=`` names.
# Loading runs torch's ``Module.load_state_dict`` when the model has load hooks: its
# pre-hooks rewrite the incoming dict, and each parameter's ``copy_`` writes this rank's
# piece ([Note: initialising sharded parameters] in zero3/param_init.py). Sharded
# checkpoints (``save_checkpoint``, ``dcp_state_dict``) hold the parameters as the model
# registers them, read back into the same model: the hooks are for full state dicts.


@contextlib.contextmanager
def slots_holding(fs, values: Dict[str, torch.Tensor]):
    """While inside, each parameter's module slots hold ``values[its first name]``, or a meta
    tensor of its full shape and dtype where it has none ([Note: state-dict hooks]); what they
    held before is put back on the way out."""
    before = []
    try:
        for u in fs.units:
            for q in u.params:
                t = values.get(q.names[0])
                if t is None:
                    t = torch.empty(q.full_shape, dtype=q.dtype, device="meta")
                for mod, attr in q.slots:
                    before.append((mod, attr, mod._parameters[attr]))
                    mod._parameters[attr] = t
        yield
    finally:
        for mod, attr, held in reversed(before):
            mod._parameters[attr] = held


def entries(fs) -> Dict[str, torch.Tensor]:
    """The model's state-dict entries as its hooks name them, parameters as meta tensors and
    buffers as they are (nothing gathered)."""
    with slots_holding(fs, {}):
        return own_method(fs.module, "state_dict")(keep_vars=True)


@torch.no_grad()
def full_state_dict(fs, *, to: Optional[int], prefix: str, destination, keys=None) -> Optional[dict]:
    """See FullyShard.state_dict: units gathered one at a time and copied to CPU
    (``keys``: only these entries; a unit holding none of them is not gathered), then the
    model's own state_dict run over them, its hooks included ([Note: state-dict hooks])."""
    comm.check_in(
        "FullyShard.state_dict()",
        fs,
        fs.process_group,
        "For a checkpoint written by rank 0 alone, call model.state_dict(to=0) on every rank "
        "(it returns None elsewhere), or use zeroshard.save_checkpoint",
    )
    keep = to is None or dist.get_rank() == to
    template = entries(fs)
    wanted = set(template) if keys is None else set(keys)
    unknown = sorted(wanted - set(template))
    if unknown:
        raise KeyError(comm.on_rank(fs, f"FullyShard.state_dict(keys=...): the model has no entries {unknown}"))
    # entries with data (buffers, extra state) and the parameters' own names; a key a hook
    # made from parameters (a meta entry) may come from any of them: then every unit
    known = {n for u in fs.units for q in u.params for n in q.names}
    known |= {k for k, v in template.items() if not (isinstance(v, torch.Tensor) and v.is_meta)}
    everything = not wanted <= known
    values: Dict[str, torch.Tensor] = {}
    for u in fs.units:
        if everything or any(n in wanted for q in u.params for n in q.names):
            _gather_unit(fs, u, keep, values)
    if not keep:
        return None
    with slots_holding(fs, values):
        full = own_method(fs.module, "state_dict")()
    ours = {t.untyped_storage().data_ptr() for t in values.values()}
    out = destination if destination is not None else {}
    for k, v in full.items():
        if k in wanted:  # (a buffer's, or one on a device: a copy on CPU)
            mine = isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.untyped_storage().data_ptr() in ours
            out[prefix + k] = v if mine or not isinstance(v, torch.Tensor) else v.detach().cpu().clone()
    return out


def _gather_unit(fs, u: Unit, keep: bool, values: Dict[str, torch.Tensor]) -> None:
    """Gather unit ``u`` (collective over its ranks) and, where this rank keeps the state
    dict, put each of its parameters' full value, on CPU in its dtype, into ``values``."""
    flat = torch.empty(u.numel, dtype=torch.float32, device=fs.device)
    comm.all_gather(
        u.shard.to(fs.device),
        flat,
        group=u.ranks.group,
        bounds=u.bounds,  # (an expert: its own)
        what=f"state_dict gather: unit '{u.name}'",
    ).wait()
    if not keep and all(q.placed is None for q in u.params):
        return
    for q in u.params:
        t = flat[q.offset : q.offset + q.numel].view(q.shape)
        if q.placed is not None:  # a DTensor parameter: its whole tensor, gathered over tp
            t = q.placed.wrap(t).full_tensor()
        if keep:
            t = t.to("cpu", q.dtype).clone()
            for n in q.names:
                values[n] = t


@torch.no_grad()
def load_full_state_dict(fs, state_dict: dict, strict: bool):
    """See FullyShard.load_state_dict: each rank copies its own pieces; no communication.
    A model with load hooks is loaded by torch's own load_state_dict ([Note: state-dict hooks])."""
    if _has_load_hooks(fs.module):
        if any(q.placed is not None for u in fs.units for q in u.params):
            raise NotImplementedError(
                comm.on_rank(
                    fs,
                    "load_state_dict of a model with load_state_dict hooks and tensor-parallel (DTensor) "
                    "parameters is not supported yet: load it with zeroshard.load_checkpoint",
                )
            )
        with torch.no_grad():
            result = nn.Module.load_state_dict(fs.module, state_dict, strict=strict)
        fs.invalidate()
        return result
    template = entries(fs)
    # (a parameter a save hook renamed, with no load hook to name it back, is missing: not skipped)
    missing = [k for k in template if k not in state_dict] + [
        q.names[0] for u in fs.units for q in u.params if not any(n in state_dict or n in template for n in q.names)
    ]
    unexpected = [k for k in state_dict if k not in template]
    if strict and (missing or unexpected):
        raise RuntimeError(
            comm.on_rank(
                fs,
                f"state dict mismatch: missing keys {missing}, unexpected keys "
                f"{unexpected}; it must be the unwrapped model's state dict",
            )
        )
    param_names = set()
    for u in fs.units:
        for q in u.params:
            param_names.update(q.names)
            src = next((state_dict[n] for n in q.names if n in state_dict), None)
            if src is None:
                continue
            if q.placed is not None and src.shape == q.full_shape:  # the whole tensor: this rank's tp piece
                src = local_piece(src.to(fs.device), q.placed)
            if src.numel() != q.numel:
                raise ValueError(
                    comm.on_rank(
                        fs,
                        f"state dict entry '{q.names[0]}' has shape {tuple(src.shape)} "
                        f"but the parameter has shape {tuple(q.shape)}",
                    )
                )
            n = q.local.numel()
            u.shard[q.shard_offset : q.shard_offset + n].copy_(src.reshape(-1)[q.tensor_offset : q.tensor_offset + n])
    for k, v in template.items():
        if k not in param_names and k in state_dict and isinstance(v, torch.Tensor):
            v.copy_(state_dict[k])
    fs.invalidate()  # (after the copy: units a gathered() block holds are gathered from the new shards)
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _has_load_hooks(module: nn.Module) -> bool:
    """Whether a module of ``module`` has load_state_dict pre- or post-hooks."""
    return any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks for m in module.modules())
