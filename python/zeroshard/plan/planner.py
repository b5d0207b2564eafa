"""Planning a real model: it is built on the meta device and each stage's wrapping
is run over a fake process group, so the bytes are the ones ``memory_report()``
gives in a real run ([Note: model plan]); ``format_model_plan`` prints the result.
The command line is ``plan/cli.py``; the formulas from a parameter count are
``plan/formula.py``."""

from __future__ import annotations

import contextlib
import functools
import tempfile
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..offload import Offload, planning_for_host
from .trace import Gather, PlannedReduction, Policy, activation_bytes, torch_dtype
from .formula import _BYTES, CARDS_GB, STAGES, _check, format_table, model_state_bytes, offloaded_bytes, slow_link_bytes
from ..core.reduction import MAX_INFLIGHT_BUCKETS, MAX_INFLIGHT_UNITS
from ..core.regions import LOCATIONS, PERSISTENT
from ..zero3.fully_shard import FullyShard, MixedPrecision
from ..optim.sharded import ShardedOptimizer

__all__ = [
    "model_state_bytes",
    "offloaded_bytes",
    "slow_link_bytes",
    "format_table",
    "plan_model",
    "format_model_plan",
    "activation_bytes",
]

_PERSISTENT = PERSISTENT + ("total",)
# memory_report()'s persistent categories, and another optimizer_class's own state (a
# whole-tensor one's: on its owner)
_OWN = ("optimizer_state",)


# ------------------------------------------------------------ --model mode
# [Note: model plan]
# ``plan_model`` builds the user's model on the meta device and asks the
# library itself what each rank would hold: for every stage and rank it sets
# up a fake process group of the requested world size (no communication, no
# data), wraps the meta model exactly as a run would (ShardedOptimizer for
# stages 1/2, FullyShard + ShardedOptimizer for stage 3) and reads
# memory_report(). The model-state bytes, padding included, are therefore the
# ones a real run reports, by construction. On top come the transient buffers
# ("buffers" in the table), from the library's rules:
#   DDP      its gradient buckets: one more copy of the gradients;
#   ZeRO-1   none (gradients are reduced in place in the flat gradient buffer;
#            a reduce_dtype other than the parameters' adds one bucket);
#   ZeRO-2   a bucket buffer of the largest size;
#   ZeRO-3   the root unit gathered for the whole step, prefetch + 1 gathered
#            non-root units of the largest size, and the root's and one
#            non-root unit's gradient buffers.
# With an example batch (--input) the planner also runs one forward and
# backward of the unwrapped model on fake tensors (FakeTensorMode: shapes and
# dtypes, no data, on the CPU kernels' choices) and counts the live bytes of
# every tensor it creates. For DDP and ZeRO-1 each gradient is dropped as soon
# as it is accumulated (its memory is counted in the state or the buckets),
# and the peak is state + buffers + that activation peak. ZeRO-2 and ZeRO-3
# hold gradients longer and allocate their buffers and gradient shards during
# backward, so for them the trace replays the stage's policy, read from the
# library's own objects (plan/trace.py's Policy: the buckets or units in launch
# order, their buffer and shard bytes, how many are in flight; ZeRO-2's buffer
# pool, the reducer's own BufferPool, which a CPU plan starts as one backward
# leaves it: [Note: bucket buffers between steps]): a gradient stays on its
# parameter until its bucket / unit is complete; then the flat buffer is
# allocated and the gradients freed; retiring a reduction frees the buffer
# and (ZeRO-3) allocates the unit's gradient shard; ZeRO-2's whole gradient
# shard is allocated at the first launch. ZeRO-3's non-root units are gathered
# and resharded in the trace as FullyShard does it (plan/trace.py's _GatherReplay:
# before each unit's forward and backward, prefetch ahead, resharded after its
# forward and once its gradients have all arrived), so the root's gradient
# buffer at the end of backward is not counted on top of gathered blocks that
# are long gone. The peak is then the state without the gradient shards, plus
# ZeRO-3's root unit (gathered for the whole step), plus the replay's peak.
# What it leaves out: a reduction that finishes late on one rank holds its
# buffer a little longer, so a measured peak can read a little over the prediction.


@contextlib.contextmanager
def _fake_world(rank: int, world_size: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "plan_model sets up its own (fake) process group: call it where "
            "torch.distributed is not initialized (or use python -m zeroshard.plan)"
        )
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _default_wrap(model) -> tuple:
    """The class of the blocks of the model's longest ModuleList/Sequential (the usual transformer layout)."""
    best = None
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1:
            kinds = {type(c) for c in m}
            if len(kinds) == 1 and (best is None or len(m) > len(best)):
                best = m
    return (type(best[0]),) if best is not None else ()


def _resolve_wrap(model, wrap) -> tuple:
    if wrap is None:
        return _default_wrap(model)
    if isinstance(wrap, str):
        wrap = [w for w in wrap.split(",") if w]
    classes = []
    for w in wrap:
        if isinstance(w, type):
            classes.append(w)
            continue
        found = {type(m) for m in model.modules() if type(m).__name__ == w}
        if not found:
            names = ", ".join(sorted({type(m).__name__ for m in model.modules()}))
            raise ValueError(f"--wrap names {w!r}, but the model has no module of that class (classes: {names})")
        classes.extend(found)
    return tuple(classes)


def _optimizers(model: nn.Module, optimizer: str, wrap: tuple, **kw) -> List[ShardedOptimizer]:
    """The ShardedOptimizers a script with ``optimizer`` builds over ``model``: "adamw"
    (the fused AdamW), "adafactor" (torch's, over every parameter) or "muon"
    (torch.optim.Muon over the 2-D matrices inside the ``wrap`` blocks, the fused
    AdamW over the rest, as in the docs' Muon conversion)."""
    if optimizer == "adamw":
        return [ShardedOptimizer(model.parameters(), lr=1e-3, **kw)]
    if optimizer == "adafactor":
        return [ShardedOptimizer(model.parameters(), optimizer_class=torch.optim.Adafactor, lr=1e-2, **kw)]
    inside = {id(p) for m in model.modules() if isinstance(m, wrap) for p in m.parameters()}
    hidden = [p for p in model.parameters() if p.dim() == 2 and id(p) in inside]
    if not hidden:
        raise ValueError(
            "--optimizer muon takes the 2-D matrices inside the blocks (--wrap), and the model "
            f"has none inside {[c.__name__ for c in wrap] or 'any block'}; name the blocks with --wrap"
        )
    rest = [p for p in model.parameters() if id(p) not in {id(q) for q in hidden}]
    own = {k: v for k, v in kw.items() if not k.startswith("offload")}  # offload is AdamW's
    return [ShardedOptimizer(hidden, optimizer_class=torch.optim.Muon, lr=0.02, **own)] + (
        [ShardedOptimizer(rest, lr=1e-3, **kw)] if rest else []
    )


def _report(opts: List[ShardedOptimizer], stage: int) -> Dict[str, int]:
    """One memory report over several optimizers: ZeRO-1/2 each holds its own buffers
    (their reports add up); ZeRO-3's reports are the FullyShard model's (counting every
    optimizer's state shards) plus each optimizer's own ``optimizer_state``."""
    reps = [o.memory_report() for o in opts]
    if stage == 3:
        out = dict(reps[0])
        for r in reps[1:]:
            extra = r.get("optimizer_state", 0)
            out["optimizer_state"] = out.get("optimizer_state", 0) + extra
            out["total"] += extra
            out["device"] += extra
        return out
    return {k: sum(r.get(k, 0) for r in reps) for k in set().union(*reps)}


def _rs_scratch(numel: int, itemsize: int, world_size: int, in_place: bool, uneven_chunk: int) -> int:
    """Scratch bytes of a reduce-scatter of ``numel`` elements on gloo; ``uneven_chunk`` >= 0:
    over chunks of different lengths, this rank's of that many elements (the peers' parts
    of it land in scratch: [Note: uneven collectives] in csrc/comm.h)."""
    if uneven_chunk >= 0:
        return (world_size - 1) * uneven_chunk * itemsize
    return comm.reduce_scatter_scratch_bytes(numel // world_size, itemsize, world_size, in_place, input_is_scratch=True)


def _meta_run(
    build: Callable,
    world_size: int,
    rank: int,
    stage: int,
    dtype: str,
    wrap: tuple,
    bucket_mb: float,
    prefetch: int,
    offload: dict,
    gloo: bool = False,
    optimizer: str = "adamw",
) -> Dict[str, object]:
    """``offload``: ShardedOptimizer's offload keywords (on meta, offloaded state is
    counted where it would live, and nothing is allocated or written); ``gloo``: count
    the scratch zeroshard's point-to-point reduce-scatter takes on gloo
    (comm.reduce_scatter_scratch_bytes), which NCCL does not need, and plan CPU
    processes (meta stands for host memory: planning_for_host)."""

    def scratch(numel: int, itemsize: int, in_place: bool, uneven_chunk: int = -1) -> int:
        return _rs_scratch(numel, itemsize, world_size, in_place, uneven_chunk) if gloo else 0

    pdt = torch_dtype(dtype)
    with _fake_world(rank, world_size), planning_for_host() if gloo else contextlib.nullcontext():
        with torch.device("meta"):
            model = build()
        if not isinstance(model, nn.Module):
            raise TypeError(f"the --model function returned {type(model).__name__}, not an nn.Module")
        if stage == 3:
            fs = FullyShard(
                model,
                wrap=set(wrap) or None,
                mixed_precision=MixedPrecision(param_dtype=pdt, reduce_dtype=torch.float32)
                if pdt != torch.float32
                else None,
                prefetch=prefetch,
                device="meta",
            )
            opts = _optimizers(fs, optimizer, wrap, **offload)
            out = _units_run(fs, _report(opts, 3), rank, prefetch, pdt, scratch)
        else:
            model.to(pdt)
            opts = _optimizers(model, optimizer, wrap, stage=stage, bucket_mb=bucket_mb, **offload)
            out = _buckets_run(model, opts, _report(opts, stage), stage, gloo, scratch)
        whole = [o.whole_tensor_rule for o in opts if o.whole_tensor_rule is not None]
        out["transient"] = max([out["transient"]] + [w.transient_bytes() for w in whole])
        out["grad_shards"] = (
            0 if out["policy"] is None else out["policy"].first + sum(r.shard for r in out["policy"].reductions)
        )
    return out


def _units_run(fs: FullyShard, rep: dict, rank: int, prefetch: int, pdt: torch.dtype, scratch: Callable) -> dict:
    """ZeRO-3's plan of ``fs`` on ``rank``: its report ``rep``, the largest unit, the
    transient bytes and the policy the trace replays (units in backward's order)."""
    units = [u for u in fs.units if u.trainable]
    ri = fs.reduce_dtype.itemsize
    biggest = max(fs.units[1:], key=lambda u: u.numel, default=None)
    gathered = rep["root_gathered"] + (prefetch + 1) * rep["max_unit"]
    order = [u for u in units[::-1] if not u.is_root] + [u for u in units if u.is_root]  # backward's
    return dict(
        report=rep,
        max_unit=(biggest.name, biggest.numel) if biggest else ("", 0),
        transient=gathered + ri * (fs.units[0].grad_numel + max([u.grad_numel for u in fs.units[1:]], default=0)),
        fixed=rep["root_gathered"],
        policy=Policy(
            [
                PlannedReduction(
                    [q.names[0] for q in u.trainable],
                    ri * u.grad_numel,
                    4 * _grad_len(u, rank),
                    scratch(u.grad_numel, ri, True, -1 if u.reduce_bounds() is None else _grad_len(u, rank)),
                )
                for u in order
            ],
            inflight=MAX_INFLIGHT_UNITS,
            first=0,
            prefetch=prefetch,
            gathers=[Gather(u.name, u.numel * pdt.itemsize, [q.names[0] for q in u.trainable]) for u in fs.units[1:]],
        ),
    )


def _buckets_run(model: nn.Module, opts: list, rep: dict, stage: int, gloo: bool, scratch: Callable) -> dict:
    """ZeRO-1/2's plan: the report ``rep``; stage 2 adds its bucket buffer and the policy
    the trace replays (buckets in launch order). Stage 1 reduces in place: nothing transient."""
    out = dict(report=rep, transient=0, fixed=0, policy=None)
    if stage == 1:
        return out
    index = {id(p): n for n, p in model.named_parameters()}
    reds = [(red, [index[id(p)] for p in o.params]) for o in opts for red in (o.source,)]
    item = {id(b): red.reduce_dtype_of(b.buffer.dtype).itemsize for red, _ in reds for b in red.buckets}
    out["transient"] = max(b.numel * item[id(b)] for red, _ in reds for b in red.buckets)
    out["policy"] = Policy(
        [
            PlannedReduction([nm[i] for i in b.params], b.numel * item[id(b)], 0, scratch(b.numel, item[id(b)], False))
            for red, nm in reds
            for b in (red.buckets[k] for k in red.launch_order)
        ],
        inflight=MAX_INFLIGHT_BUCKETS,
        first=sum(b.shard_numel * item[id(b)] for red, _ in reds for b in red.buckets),
        keep=MAX_INFLIGHT_BUCKETS + 1,
        pooled=gloo,
    )
    return out


def _grad_len(u, rank: int) -> int:
    """This rank's chunk of a unit's gradients (frozen parameters have none: [Note: frozen parameters])."""
    lo, hi = u.grad_span(rank)
    return hi - lo


def _check_choices(dtype: str, world_size: int, transport: str, optimizer: str) -> None:
    _check(dtype, world_size)
    if transport not in ("nccl", "gloo"):
        raise ValueError(f"transport must be 'nccl' or 'gloo', got {transport!r}")
    if optimizer not in ("adamw", "adafactor", "muon"):
        raise ValueError(f"optimizer must be 'adamw', 'adafactor' or 'muon', got {optimizer!r}")


def plan_model(
    build: Callable,
    world_size: int,
    dtype: str = "fp32",
    *,
    wrap=None,
    bucket_mb: float = 25,
    prefetch: int = 1,
    example: Optional[Callable] = None,
    ranks: Optional[List[int]] = None,
    offload: Optional[str] = None,
    offload_fraction: float = 1.0,
    transport: str = "nccl",
    optimizer: str = "adamw",
) -> dict:
    """Per-rank memory of ``build()`` (a function returning the model) at each stage.

    Returns ``{"params", "wrap", "max_unit", "activations", "stages": {name: {"ranks": {r: report},
    "model_state", "transient", "peak"}}}`` where ``report`` is memory_report()'s persistent
    categories for rank r, ``model_state`` the largest total over the ranks, ``transient`` the
    buffers of [Note: model plan], and ``peak`` the most alive at once in a training step with
    one micro-batch (None without ``example``, a function returning that micro-batch's inputs).
    ``offload`` / ``offload_fraction``: ShardedOptimizer's; each report then splits its total
    into "device", "host" and "disk", ``device_state`` is the most device bytes of any rank,
    and ``peak`` counts the device only. ``transport``: "nccl" (GPUs) or "gloo" (CPU
    processes: zeroshard's reduce-scatter then takes scratch chunks). ``optimizer``: "adamw",
    "adafactor" or "muon" (Muon over the blocks' matrices, AdamW over the rest); a
    whole-tensor optimizer's state is counted on its owner rank as ``optimizer_state``
    (DDP's row keeps AdamW's 12 bytes). See [Note: model plan].
    """
    _check_choices(dtype, world_size, transport, optimizer)
    off = (
        dict(
            offload=Offload(
                optimizer=offload,
                fraction=offload_fraction,  # (no file is made on meta)
                directory=tempfile.gettempdir() if offload == "nvme" else None,
            )
        )
        if offload
        else {}
    )
    with torch.device("meta"):
        model = build()
    n = sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    wrap_classes = _resolve_wrap(model, wrap)
    del model
    if ranks is None:  # only the ends of the rank range differ in padding
        ranks = sorted({0, 1, world_size - 2, world_size - 1} & set(range(world_size)))
    acts = activation_bytes(build, example, dtype) if example is not None else None
    stages = {"DDP": _ddp_row(dtype, n, trainable, ranks, acts)}
    max_unit = ("", 0)
    meta_run = functools.partial(
        _meta_run,
        build,
        world_size,
        dtype=dtype,
        wrap=wrap_classes,
        bucket_mb=bucket_mb,
        prefetch=prefetch,
        offload=off,
        gloo=transport == "gloo",
        optimizer=optimizer,
    )
    for stage in (1, 2, 3):
        runs = {r: meta_run(r, stage) for r in ranks}
        run = runs[ranks[0]]  # the policy: every rank's shards have one length
        traced = None
        if acts is not None:
            traced = acts if run["policy"] is None else activation_bytes(build, example, dtype, run["policy"])
        stages[f"ZeRO-{stage}"] = _stage_row(runs, traced)
        if stage == 3:
            max_unit = run["max_unit"]
    return dict(
        params=n,
        trainable=trainable,
        world_size=world_size,
        dtype=dtype,
        offload=offload,
        optimizer=optimizer,
        offload_fraction=offload_fraction if offload else 0.0,
        wrap=[c.__name__ for c in wrap_classes],
        max_unit=max_unit,
        activations=acts,
        stages=stages,
    )


def _ddp_row(dtype: str, n: int, trainable: int, ranks: List[int], acts: Optional[int]) -> dict:
    """DDP's row: every rank holds the whole model state, and its buckets one more copy
    of the gradients."""
    pb, gb, ob = _BYTES[dtype]
    state = pb * n + (gb + ob) * trainable
    per_rank = dict(
        params=pb * n,
        grads=gb * trainable,
        master=(4 if pb < 4 else 0) * trainable,
        exp_avg=4 * trainable,
        exp_avg_sq=4 * trainable,
        padding=0,
        total=state,
        device=state,
        host=0,
        disk=0,
    )
    return dict(
        ranks={r: dict(per_rank) for r in ranks},
        model_state=state,
        device_state=state,
        transient=gb * trainable,
        peak=None if acts is None else state + gb * trainable + acts,
    )


def _stage_row(runs: dict, traced: Optional[int]) -> dict:
    """A stage's row from its runs on the planned ranks; ``traced``: the trace's peak of
    one micro-batch's step (None without an example)."""
    state = max(v["report"]["total"] for v in runs.values())
    dev = max(v["report"]["device"] for v in runs.values())
    run = next(iter(runs.values()))
    return dict(
        ranks={
            r: {k: v["report"][k] for k in _PERSISTENT + LOCATIONS + _OWN if k in v["report"]} for r, v in runs.items()
        },
        model_state=state,
        device_state=dev,
        transient=max(v["transient"] for v in runs.values()),
        peak=None if traced is None else max(dev, dev - run["grad_shards"] + run["fixed"] + traced),
    )


def format_model_plan(plan: dict) -> str:
    gb = 1e9
    mib = 2**20
    unit = mib if plan["stages"]["DDP"]["model_state"] < 10 * gb else gb
    uname = "MiB" if unit == mib else "GB"
    name, numel = plan["max_unit"]
    lines = [
        f"model: {plan['params']:,} parameters ({plan['trainable']:,} trainable), {plan['world_size']} ranks, "
        f"{plan['dtype']}; ZeRO-3 units: {', '.join(plan['wrap']) or 'none (root only)'}; largest unit "
        f"'{name}' {numel:,} elements (padded)",
        f"{'stage':<8}{'params':>10}{'grads':>10}{'optimizer':>11}{'padding':>10}{'state':>10}"
        f"{'buffers':>10}{'activ.':>10}{'peak':>10}  " + "".join(f"{c:>5}GB" for c in CARDS_GB),
    ]
    for s in STAGES:
        st = plan["stages"][s]
        r = max(st["ranks"].values(), key=lambda rep: rep["total"])
        opt = r["master"] + r["exp_avg"] + r["exp_avg_sq"] + r.get("optimizer_state", 0)
        acts = plan["activations"]
        need = st["peak"] if st["peak"] is not None else st["device_state"] + st["transient"]
        fits = "".join(f"{'yes' if need <= c * gb else 'no':>7}" for c in CARDS_GB)
        lines.append(
            f"{s:<8}{r['params'] / unit:>10.3f}{r['grads'] / unit:>10.3f}{opt / unit:>11.3f}"
            f"{r['padding'] / unit:>10.3f}{st['model_state'] / unit:>10.3f}{st['transient'] / unit:>10.3f}"
            f"{'-' if acts is None else format(acts / unit, '.3f'):>10}"
            f"{'-' if st['peak'] is None else format(st['peak'] / unit, '.3f'):>10}  {fits}"
            + (
                f"{r['device'] / unit:>10.3f}{r['host'] / unit:>10.3f}{r['disk'] / unit:>10.3f}"
                if plan["offload"]
                else ""
            )
        )
    lines.append(
        f"({uname} per rank, the rank with the most; state = params + grads + optimizer + padding, "
        "exactly what memory_report() will say; buffers = buckets / gathered units and gradient "
        "buffers; activ. = one forward + backward's tensors; peak = the most alive at once, with "
        "each stage's gradients, buffers and gradient shards alive when that stage holds them)"
    )
    if plan["offload"]:
        lines[1] += f"{'device':>10}{'host':>10}{'disk':>10}"
        lines.append(
            f"(offload={plan['offload']}, fraction {plan['offload_fraction']:g}: state splits into device, "
            "host and disk bytes as memory_report() will say; peak and 'fits' count the device only)"
        )
    if plan["activations"] is None:
        lines.append(
            "activations not counted: pass --input module:function (one micro-batch) to include them; "
            "'fits' then compares state + buffers only"
        )
    return "\n".join(lines)
