"""The front doors' options as policies, and today's loose keyword arguments mapped onto them.

[Note: options as policies] ShardedOptimizer and FullyShard take their
distribution options whole, as documented, validated dataclasses (FSDP2's
``MixedPrecisionPolicy``/``OffloadPolicy``, Megatron's config): where the
state lives is an ``Offload`` (offload/policy.py), which ranks shard and which
replicate a ``Sharding`` (comm/mesh.py), the dtypes a ``MixedPrecision``
(zero3/records.py). The loose keyword arguments they replace (``shard_size``,
``device_mesh``, ``expert_modules``, ``offload="cpu"``, ``offload_dir``,
``offload_fraction``, ``offload_params``) keep working for one release: each
is mapped onto its policy and warns once (a FutureWarning naming the policy to
pass). ``process_group`` stays a keyword of its own too (torch's DDP and
ZeroRedundancyOptimizer take it): the same as ``Sharding(process_group=...)``.
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any, Dict, Optional

from ..comm.mesh import Sharding
from ..offload import Offload


def _warn(who: str, loose: Dict[str, Any], policy: str) -> None:
    given = ", ".join(f"{k}={v!r}" for k, v in loose.items())
    warnings.warn(
        f"{who}({given}): these keyword arguments are replaced by a policy and will be removed in the "
        f"next release; pass {policy}",
        FutureWarning,
        stacklevel=_caller_level(),
    )


def _caller_level() -> int:
    """The stacklevel of the first frame outside the package: the user's call."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = inspect.currentframe(), 0
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def sharding_of(who: str, sharding: Optional[Sharding], process_group=None, **loose) -> Sharding:
    """The Sharding a front door runs over: ``sharding``, or one made from ``process_group`` and
    the loose ``shard_size`` / ``device_mesh`` / ``expert_modules`` (those warn, naming it)."""
    loose = {k: v for k, v in loose.items() if v is not None}
    if sharding is None:
        if loose:
            fields = ", ".join(f"{k}=..." for k in loose)
            _warn(who, loose, f"sharding=zeroshard.Sharding({fields})")
        return Sharding(process_group=process_group, **loose)
    if not isinstance(sharding, Sharding):
        raise TypeError(f"{who}: sharding must be a zeroshard.Sharding, got {type(sharding).__name__}")
    if loose or process_group is not None:
        extra = sorted(loose) + (["process_group"] if process_group is not None else [])
        raise ValueError(f"{who}: pass {', '.join(extra)} inside sharding=zeroshard.Sharding(...), not beside it")
    return sharding


def offload_of(who: str, offload: Optional[Offload], **loose) -> Offload:
    """FullyShard's Offload: ``offload``, or one made from the loose ``offload_params`` (which
    warns, naming it); only ``params`` is the model's to place."""
    params = loose.get("offload_params")
    if offload is None:
        if params:
            _warn(who, {"offload_params": params}, "offload=zeroshard.Offload(params='cpu')")
            return Offload(params="cpu" if params is True else params)
        return Offload()
    if not isinstance(offload, Offload):
        raise TypeError(f"{who}: offload must be a zeroshard.Offload, got {type(offload).__name__}")
    if params:
        raise ValueError(f"{who}: pass offload_params inside offload=zeroshard.Offload(params='cpu'), not beside it")
    if offload.optimizer is not None:
        raise ValueError(
            f"{who}: Offload(optimizer={offload.optimizer!r}) places the optimizer's state: pass it "
            "to ShardedOptimizer(offload=...), which steps it; FullyShard takes Offload(params='cpu')"
        )
    return offload


def optimizer_offload_of(who: str, offload, offload_dir, offload_fraction) -> tuple:
    """(ShardedOptimizer's ``offload`` argument, ``offload_dir``, ``offload_fraction``) with a
    warning, naming the policy, where the loose form was used."""
    if offload is None or isinstance(offload, Offload):
        if offload_dir is not None or offload_fraction is not None:
            loose = {
                k: v
                for k, v in dict(offload_dir=offload_dir, offload_fraction=offload_fraction).items()
                if v is not None
            }
            if isinstance(offload, Offload):
                raise ValueError(f"{who}: pass {', '.join(loose)} inside offload=zeroshard.Offload(...), not beside it")
            _warn(who, loose, "offload=zeroshard.Offload(optimizer=..., directory=..., fraction=...)")
        return offload, offload_dir, offload_fraction
    loose = {
        k: v
        for k, v in dict(offload=offload, offload_dir=offload_dir, offload_fraction=offload_fraction).items()
        if v is not None
    }
    _warn(
        who,
        loose,
        f"offload=zeroshard.Offload(optimizer={offload!r}"
        + (", directory=..." if offload_dir is not None else "")
        + (", fraction=..." if offload_fraction is not None else "")
        + ")",
    )
    return offload, offload_dir, offload_fraction
