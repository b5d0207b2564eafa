"""The memory planner's formulas: per-rank model-state bytes for DDP and
ZeRO-1/2/3 (over N ranks, or S with hybrid sharding) and the bytes hybrid
sharding keeps off the inter-node link. See plan/planner.py for the
conventions."""

from __future__ import annotations

from typing import Dict, Optional

CARDS_GB = (24, 40, 80, 141)
_BYTES = {"bf16": (2, 2, 12), "fp16": (2, 2, 12), "fp32": (4, 4, 8)}  # params, grads, optimizer
STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


def _check(dtype: str, world_size: int) -> None:
    if dtype not in _BYTES:
        raise ValueError(f"dtype must be one of {sorted(_BYTES)}, got {dtype!r}")
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")


def _shards(world_size: int, shard_size: Optional[int]) -> int:
    """The ranks one copy of the state is sharded over: shard_size (hybrid sharding), else N."""
    if shard_size is None:
        return world_size
    if not (isinstance(shard_size, int) and shard_size >= 1 and world_size % shard_size == 0):
        raise ValueError(f"shard_size must be an int >= 1 dividing the world size ({world_size}), got {shard_size!r}")
    return shard_size


def _check_experts(params: float, world_size: int, shard_size: Optional[int], ep: int, experts: float) -> None:
    if not (isinstance(ep, int) and ep >= 1 and world_size % ep == 0):
        raise ValueError(f"ep must be an int >= 1 dividing the world size ({world_size}), got {ep!r}")
    if not 0 <= experts <= params:
        raise ValueError(
            f"experts (the expert parameters, every expert once) must be in [0, params = {params:g}], got {experts:g}"
        )
    if ep > 1 and shard_size is not None and shard_size < world_size:
        raise ValueError("expert parallelism (ep > 1) with hybrid sharding (shard_size) is not supported yet")


def _check_tensor_parallel(
    params: float, world_size: int, shard_size: Optional[int], ep: int, tp: int, replicated: float
) -> None:
    if not (isinstance(tp, int) and tp >= 1 and world_size % tp == 0):
        raise ValueError(f"tp must be an int >= 1 dividing the world size ({world_size}), got {tp!r}")
    if not 0 <= replicated <= params:
        raise ValueError(
            f"replicated (the parameters every tp rank holds whole) must be in [0, params = "
            f"{params:g}], got {replicated:g}"
        )
    if tp > 1 and (ep > 1 or (shard_size is not None and shard_size < world_size)):
        raise ValueError("tensor parallelism (tp > 1) with expert parallelism or hybrid sharding is not supported yet")


def held_and_sharded(
    params: float,
    world_size: int,
    shard_size: Optional[int] = None,
    ep: int = 1,
    experts: float = 0.0,
    tp: int = 1,
    replicated: float = 0.0,
) -> tuple:
    """(elements a rank holds whole, elements a stage shards over the ranks, those ranks)."""
    if tp > 1:  # each tp rank its piece of the tp-sharded parameters, sharded over its dp ranks
        held = (params - replicated) / tp + replicated
        return held, held, world_size // tp
    return params - experts + experts / ep, params, _shards(world_size, shard_size)


def model_state_bytes(
    params: float,
    world_size: int,
    dtype: str = "bf16",
    shard_size: Optional[int] = None,
    ep: int = 1,
    experts: float = 0.0,
    tp: int = 1,
    replicated: float = 0.0,
) -> Dict[str, Dict[str, float]]:
    """Per-rank bytes of parameters, gradients and optimizer states for each stage
    (with hybrid sharding: over ``shard_size`` ranks instead of N).

    Expert parallelism ([Mixture of experts](experts.md)): ``experts`` of the
    ``params`` are experts' (each expert counted once), spread over ``ep`` ranks, so a
    rank holds the dense ``params - experts`` and ``experts / ep`` of them; the dense
    state shards over the N ranks and each expert's over its N/ep expert-data-parallel
    ranks. What a stage keeps whole is a rank's own: (dense + experts/ep) elements;
    what it shards is dense/N + (experts/ep)/(N/ep) = params/N elements.

    Tensor parallelism ([Tensor parallelism](tensor-parallel.md)): the N ranks are dp x
    ``tp``; each holds 1/tp of the parameters tp shards and all ``replicated`` ones (norms,
    row-parallel biases), and a stage shards what it holds over its N/tp dp ranks: at
    ZeRO-3, 16 (params - replicated) / N + 16 replicated / (N / tp) bytes with AdamW."""
    _check(dtype, world_size)
    if not params > 0:
        raise ValueError(f"params must be > 0, got {params}")
    _check_experts(params, world_size, shard_size, ep, experts)
    _check_tensor_parallel(params, world_size, shard_size, ep, tp, replicated)
    held, spread, n = held_and_sharded(params, world_size, shard_size, ep, experts, tp, replicated)
    p, g, o = (b * held for b in _BYTES[dtype])
    sp, sg, so = (b * spread for b in _BYTES[dtype])
    rows = {
        "DDP": (p, g, o),
        "ZeRO-1": (p, g, so / n),
        "ZeRO-2": (p, sg / n, so / n),
        "ZeRO-3": (sp / n, sg / n, so / n),
    }
    return {s: {"params": a, "grads": b, "optimizer": c, "total": a + b + c} for s, (a, b, c) in rows.items()}


def offloaded_bytes(
    rows: Dict[str, Dict[str, float]],
    params: float,
    world_size: int,
    dtype: str = "bf16",
    shard_size: Optional[int] = None,
    offload: Optional[str] = None,
    fraction: float = 1.0,
) -> Dict[str, Dict[str, float]]:
    """``rows`` (model_state_bytes's) with where each stage's bytes live: "device",
    "host", "disk". ``offload`` "cpu"/"nvme" moves ``fraction`` of the optimizer state
    (ShardedOptimizer's offload_fraction) to host memory or disk: at ZeRO-1/2 the fp32
    master, exp_avg and exp_avg_sq, and with fp32 parameters a host fp32 master for
    the offloaded share too (the device parameter takes the host's result), 4 more
    bytes per offloaded element, counted in "total"; at ZeRO-3 exp_avg and
    exp_avg_sq (the fp32 shard is FullyShard's and stays on the device). DDP has no
    sharded state to offload."""
    if offload not in (None, "cpu", "nvme"):
        raise ValueError(f"offload must be None, 'cpu' or 'nvme', got {offload!r}")
    if not 0 <= fraction <= 1:
        raise ValueError(f"offload fraction must be in [0, 1], got {fraction}")
    n = _shards(world_size, shard_size)
    out = {}
    for stage, r in rows.items():
        moved = (
            0.0
            if offload is None or stage == "DDP"
            else fraction * (8 * params / n if stage == "ZeRO-3" else r["optimizer"])
        )
        extra = fraction * 4 * params / n if moved and dtype == "fp32" and stage != "ZeRO-3" else 0.0
        out[stage] = dict(r, total=r["total"] + extra, device=r["total"] - moved, host=0.0, disk=0.0)
        out[stage]["host" if offload == "cpu" else "disk"] = moved + extra
    return out


def slow_link_bytes(
    params: float, world_size: int, shard_size: int, dtype: str = "bf16"
) -> Dict[str, Dict[str, float]]:
    """Bytes each rank sends per step in collectives whose group spans shard groups
    (nodes, when shard_size is the GPUs per node), ring algorithms, gradients reduced
    in the parameter dtype: flat sharding over all N ranks against hybrid sharding.

    Flat, every collective spans nodes: ZeRO-1/2 reduce-scatter Ψ + all-gather Ψ,
    ZeRO-3 also a second all-gather (before backward), each (N-1)/N of the
    elements per rank. Hybrid: those stay inside the shard group; across it only
    the all-reduce of this rank's shard (Ψ/S elements) among the N/S replicas,
    2 (R-1)/R of it."""
    _check(dtype, world_size)
    s = _shards(world_size, shard_size)
    n, r, item = world_size, world_size // s, _BYTES[dtype][0]
    ring = (n - 1) / n * params * item
    replica = 2 * (r - 1) / r * params / s * item
    return {"ZeRO-1/2": {"flat": 2 * ring, "hybrid": replica}, "ZeRO-3": {"flat": 3 * ring, "hybrid": replica}}


def format_table(
    params: float,
    world_size: int,
    dtype: str = "bf16",
    shard_size: Optional[int] = None,
    offload: Optional[str] = None,
    fraction: float = 1.0,
    ep: int = 1,
    experts: float = 0.0,
    tp: int = 1,
    replicated: float = 0.0,
) -> str:
    _, spread, n = held_and_sharded(params, world_size, shard_size, ep, experts, tp, replicated)
    over_ranks = (params, world_size) if tp == 1 else (spread, n)  # (tp: a rank's piece over its dp ranks)
    rows = offloaded_bytes(
        model_state_bytes(params, world_size, dtype, shard_size, ep, experts, tp, replicated),
        *over_ranks,
        dtype,
        shard_size,
        offload,
        fraction,
    )
    gb = 1e9
    over = "" if shard_size is None else f", sharded over {shard_size} (x{world_size // shard_size} replicas)"
    if experts:
        over += (
            f", {experts / 1e9:g}B of them experts over ep {ep} (a rank holds {1 / ep:.3g} of them; "
            f"each expert's state sharded over its {world_size // ep} edp ranks)"
        )
    if tp > 1:
        over += (
            f", tensor-parallel over tp {tp} ({replicated / 1e9:g}B of them replicated over tp; each rank's "
            f"piece sharded over its {world_size // tp} dp ranks)"
        )
    off = "" if offload is None else f", {fraction:g} of the optimizer state offloaded ({offload})"
    where = "" if offload is None else f"{'device':>9}{'host':>9}{'disk':>9}"
    lines = [
        f"model state per rank: {params / 1e9:g}B parameters, {world_size} ranks{over}, {dtype}{off} "
        f"(GB = 10^9 bytes; activations and buffers not included; fits: the device's bytes)",
        f"{'stage':<8}{'params':>9}{'grads':>9}{'optimizer':>11}{'total':>9}{where}  "
        + "".join(f"{c:>6}GB" for c in CARDS_GB),
    ]
    for s in STAGES:
        r = rows[s]
        fits = "".join(f"{'yes' if r['device'] <= c * gb else 'no':>8}" for c in CARDS_GB)
        places = "" if offload is None else "".join(f"{r[k] / gb:>9.2f}" for k in ("device", "host", "disk"))
        lines.append(
            f"{s:<8}{r['params'] / gb:>9.2f}{r['grads'] / gb:>9.2f}{r['optimizer'] / gb:>11.2f}"
            f"{r['total'] / gb:>9.2f}{places}  {fits}"
        )
    if shard_size is not None and shard_size < world_size:
        link = slow_link_bytes(params, world_size, shard_size, dtype)
        lines.append(
            f"sent per rank per step across shard groups (the inter-node link when {shard_size} = "
            "GPUs per node; ring algorithms):"
        )
        for stage, v in link.items():
            lines.append(
                f"  {stage:<9} flat over {world_size}: {v['flat'] / gb:8.2f} GB   hybrid: "
                f"{v['hybrid'] / gb:8.2f} GB   ({v['flat'] / v['hybrid']:.0f}x less)"
            )
    return "\n".join(lines)
