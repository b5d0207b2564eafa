"""The integrations' ShardedOptimizer and FullyShard options as zeroshard's policies.

The tools' own options (the DeepSpeed config's ``offload_optimizer``, the Trainer's
and the Lightning strategy's ``offload`` / ``offload_dir`` / ``offload_fraction`` /
``shard_size``) are kept as they are; each call into zeroshard passes them as the
``Offload`` and ``Sharding`` policies ([Note: options as policies]), so no
integration meets the loose keyword arguments' warning.
"""

from __future__ import annotations

import zeroshard

OFFLOAD_KEYS = ("offload", "offload_dir", "offload_fraction")
SHARDING_KEYS = ("process_group", "shard_size", "device_mesh")


def as_policies(options: dict) -> dict:
    """``options`` (ShardedOptimizer keywords) with the loose offload and sharding ones made policies."""
    out = {k: v for k, v in options.items() if k not in OFFLOAD_KEYS + SHARDING_KEYS}
    off = {k: options.get(k) for k in OFFLOAD_KEYS}
    if off["offload"] is not None or off["offload_dir"] is not None:
        out["offload"] = zeroshard.Offload(
            optimizer=off["offload"],
            directory=off["offload_dir"],
            fraction=1.0 if off["offload_fraction"] is None else off["offload_fraction"],
        )
    sharding = {k: options[k] for k in SHARDING_KEYS if options.get(k) is not None}
    if sharding:
        out["sharding"] = zeroshard.Sharding(**sharding)
    return out


def fully_shard_policies(offload_params: bool, shard_size=None, device_mesh=None) -> dict:
    """FullyShard's ``offload`` and ``sharding`` keywords from a tool's options."""
    out = {}
    if offload_params:
        out["offload"] = zeroshard.Offload(params="cpu")
    sharding = {k: v for k, v in dict(shard_size=shard_size, device_mesh=device_mesh).items() if v is not None}
    if sharding:
        out["sharding"] = zeroshard.Sharding(**sharding)
    return out
