"""``fully_shard``'s arguments as FullyShard's policies: torch's ``MixedPrecisionPolicy``,
``OffloadPolicy``/``CPUOffloadPolicy`` and ``DeviceMesh`` taken as they are ([Note:
fully_shard in place] in zero3/module_api.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import torch.nn as nn

from ..comm.mesh import Sharding
from ..offload import Offload
from .records import MixedPrecision


@dataclass(frozen=True)
class CallOptions:
    """One ``fully_shard`` call's options, as FullyShard takes them."""

    mixed_precision: MixedPrecision
    offload: Offload
    sharding: Sharding
    reshard_after_forward: Optional[Union[bool, int]]
    mesh: object = None  # as given (to compare calls)


def _mixed_precision(mp) -> MixedPrecision:
    if mp is None:
        return MixedPrecision()
    if isinstance(mp, MixedPrecision):
        return mp
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if not all(hasattr(mp, f) for f in fields):
        raise TypeError(
            f"fully_shard(mp_policy=...) takes torch's MixedPrecisionPolicy or a zeroshard.MixedPrecision, "
            f"got {type(mp).__name__}"
        )
    if getattr(mp, "param_dtype_override_fn", None) is not None:
        raise NotImplementedError(
            "fully_shard: MixedPrecisionPolicy(param_dtype_override_fn=...) is not supported: one param_dtype "
            "serves the whole model"
        )
    cast = bool(mp.cast_forward_inputs)
    return MixedPrecision(
        param_dtype=mp.param_dtype,
        reduce_dtype=mp.reduce_dtype,
        cast_forward_inputs=cast,
        cast_root_forward_inputs=cast,
        output_dtype=mp.output_dtype,
    )


def _offload(policy) -> Offload:
    if policy is None:
        return Offload()
    if isinstance(policy, Offload):
        return policy
    kind = type(policy).__name__
    if kind == "CPUOffloadPolicy":
        return Offload(params="cpu")  # pinned on CUDA, as its pin_memory=True default
    if kind == "OffloadPolicy":
        return Offload()
    raise TypeError(
        f"fully_shard(offload_policy=...) takes torch's OffloadPolicy / CPUOffloadPolicy or a zeroshard.Offload, "
        f"got {kind}"
    )


def _sharding(mesh) -> Sharding:
    if mesh is None:
        return Sharding()
    if getattr(mesh, "ndim", None) not in (1, 2):
        raise ValueError(
            f"fully_shard(mesh=...) takes a 1-D DeviceMesh (the ranks to shard over) or a 2-D one, (replicate, "
            f"shard) for hybrid sharding; got {mesh!r}"
        )
    return Sharding(device_mesh=mesh)


def _check_placements(modules: List[nn.Module], fn: Optional[Callable]) -> None:
    """``shard_placement_fn``: each parameter's placement must be dim 0 (or None): FullyShard
    lays a unit out flat, which is dim-0 sharding's arithmetic."""
    if fn is None:
        return
    for m in modules:
        for name, p in m.named_parameters():
            placement = fn(p)
            dim = getattr(placement, "dim", 0) if placement is not None else 0
            if dim != 0:
                raise NotImplementedError(
                    f"fully_shard(shard_placement_fn=...) gave {placement} for '{name}': only Shard(0) (or None) "
                    "is supported; zeroshard lays a unit out flat (a whole-tensor optimizer gets whole "
                    "matrices by itself: see the Optimizers page)"
                )


def call_options(
    modules: List[nn.Module],
    *,
    mesh,
    reshard_after_forward,
    shard_placement_fn,
    mp_policy,
    offload_policy,
    ignored_params,
    dp_mesh_dims,
) -> CallOptions:
    """One call's arguments checked and converted; an error names what is not supported."""
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise TypeError(
            f"fully_shard(reshard_after_forward={reshard_after_forward!r}): pass a bool, or an int (the ranks "
            "each unit is resharded to after its forward, as FSDP2 takes it)"
        )
    if ignored_params:
        raise NotImplementedError(
            "fully_shard(ignored_params=...) is not supported yet: every floating parameter of the model is "
            "sharded; freeze the ones not to train (requires_grad=False) instead"
        )
    if dp_mesh_dims is not None:
        raise NotImplementedError("fully_shard(dp_mesh_dims=...) is not supported: pass the data-parallel mesh")
    _check_placements(modules, shard_placement_fn)
    return CallOptions(
        mixed_precision=_mixed_precision(mp_policy),
        offload=_offload(offload_policy),
        sharding=_sharding(mesh),
        reshard_after_forward=reshard_after_forward,
        mesh=mesh,
    )


def check_agree(root: CallOptions, other: CallOptions, root_name: str, other_name: str) -> None:
    """The calls of one model must give the root's mesh, mixed precision and offload."""
    for what, a, b in (
        ("mesh", root.mesh, other.mesh),
        ("mp_policy", root.mixed_precision, other.mixed_precision),
        ("offload_policy", root.offload, other.offload),
    ):
        if a != b:
            raise NotImplementedError(
                f"fully_shard: {other_name} was given {what}={b!r} and the model {root_name} {what}={a!r}; "
                "zeroshard takes one per model: pass the same to every call"
            )
