"""Memory planner: per-rank model-state bytes for DDP and ZeRO-1/2/3.

    python -m zeroshard.plan --params 7e9 --world-size 8 --dtype bf16
    python -m zeroshard.plan --params 7e9 --world-size 32 --shard-size 8   # hybrid: 4 nodes x 8 GPUs

Conventions (the seeds use both; say which one you mean):
* ``--dtype bf16`` / ``fp16`` (mixed precision, seed 004 and seed 003's table):
  2 bytes of parameters, 2 of gradients and 12 of optimizer state (fp32
  master, exp_avg, exp_avg_sq) per parameter, 16 in all. 7B on 4 GPUs:
  112 / 49 / 38.5 / 28 GB.
* ``--dtype fp32`` (seed 000): 4 bytes of parameters, 4 of gradients, 8 of
  optimizer state (exp_avg, exp_avg_sq; the fp32 parameter is its own
  master), 16 in all. 7B on 8 GPUs: 112 / 63 / 38.5 / 14 GB.
* GB is 10^9 bytes, as in the seeds. Each stage shards, over N ranks: ZeRO-1
  the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the parameters.

This is the model state only (what ``memory_report()`` calls persistent,
without layout padding); activations, communication buckets and gathered
units come on top.

    python -m zeroshard.plan --model examples/train_gpt.py:build_model --world-size 8 \
        [--input examples/train_gpt.py:example_batch --batch 16] [--wrap Block] [--dtype bf16]

builds a real model on the meta device and plans it exactly: padding, the
largest sharding unit, communication buckets, gathered units and (with an
example batch) activations; see [Note: model plan].
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys
import tempfile
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..offload import Offload, planning_for_host
from .trace import Gather, PlannedReduction, Policy, activation_bytes, torch_dtype
from .formula import (
    _BYTES, CARDS_GB, STAGES, _check, format_table, model_state_bytes, offloaded_bytes, slow_link_bytes)
from ..core.reduction import MAX_INFLIGHT_BUCKETS, MAX_INFLIGHT_UNITS
from ..core.regions import LOCATIONS, PERSISTENT
from ..zero3.fully_shard import FullyShard, MixedPrecision
from ..optim.sharded import ShardedOptimizer

__all__ = ["model_state_bytes", "offloaded_bytes", "slow_link_bytes", "format_table", "plan_model",
           "format_model_plan", "activation_bytes", "main"]

_PERSISTENT = PERSISTENT + ("total",)
_OWN = ("optimizer_state",)   # another optimizer_class's own state (a whole-tensor one: on its owner)   # memory_report()'s persistent categories


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


def _load(spec: str):
    """'pkg.module:function' or 'path/to/file.py:function' -> the function."""
    mod_name, sep, fn = spec.rpartition(":")
    if not sep or not mod_name or not fn:
        raise ValueError(f"{spec!r}: expected module:function or path/to/file.py:function")
    if mod_name.endswith(".py") or os.sep in mod_name:
        if not os.path.exists(mod_name):
            raise ValueError(f"{spec!r}: no such file {mod_name!r}")
        name = "_zeroshard_plan_" + os.path.splitext(os.path.basename(mod_name))[0]
        spec_ = importlib.util.spec_from_file_location(name, mod_name)
        module = importlib.util.module_from_spec(spec_)
        sys.modules[name] = module          # so dataclasses and pickling see it
        spec_.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            raise ValueError(f"{spec!r}: cannot import {mod_name!r} ({e}); give module:function importable from "
                             "here, or path/to/file.py:function") from e
    if not hasattr(module, fn):
        raise ValueError(f"{spec!r}: {mod_name} has no attribute {fn!r}")
    return getattr(module, fn)


@contextlib.contextmanager
def _fake_world(rank: int, world_size: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("plan_model sets up its own (fake) process group: call it where "
                           "torch.distributed is not initialized (or use python -m zeroshard.plan)")
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
        raise ValueError("--optimizer muon takes the 2-D matrices inside the blocks (--wrap), and the model "
                         f"has none inside {[c.__name__ for c in wrap] or 'any block'}; name the blocks with --wrap")
    rest = [p for p in model.parameters() if id(p) not in {id(q) for q in hidden}]
    own = {k: v for k, v in kw.items() if not k.startswith("offload")}    # offload is AdamW's
    return [ShardedOptimizer(hidden, optimizer_class=torch.optim.Muon, lr=0.02, **own)] + \
        ([ShardedOptimizer(rest, lr=1e-3, **kw)] if rest else [])


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
    return comm.reduce_scatter_scratch_bytes(numel // world_size, itemsize, world_size, in_place,
                                             input_is_scratch=True)


def _meta_run(build: Callable, world_size: int, rank: int, stage: int, dtype: str, wrap: tuple,
              bucket_mb: float, prefetch: int, offload: dict, gloo: bool = False,
              optimizer: str = "adamw") -> Dict[str, object]:
    """``offload``: ShardedOptimizer's offload keywords (on meta, offloaded state is
    counted where it would live, and nothing is allocated or written); ``gloo``: count
    the scratch zeroshard's point-to-point reduce-scatter takes on gloo
    (comm.reduce_scatter_scratch_bytes), which NCCL does not need, and plan CPU
    processes (meta stands for host memory: planning_for_host)."""
    def scratch(numel: int, itemsize: int, in_place: bool, uneven_chunk: int = -1) -> int:
        return _rs_scratch(numel, itemsize, world_size, in_place, uneven_chunk) if gloo else 0

    pdt = torch_dtype(dtype)
    with _fake_world(rank, world_size), (planning_for_host() if gloo else contextlib.nullcontext()):
        with torch.device("meta"):
            model = build()
        if not isinstance(model, nn.Module):
            raise TypeError(f"the --model function returned {type(model).__name__}, not an nn.Module")
        if stage == 3:
            mp = MixedPrecision(param_dtype=pdt, reduce_dtype=torch.float32) if pdt != torch.float32 else None
            fs = FullyShard(model, wrap=set(wrap) or None, mixed_precision=mp, prefetch=prefetch, device="meta")
            opts = _optimizers(fs, optimizer, wrap, **offload)
            rep = _report(opts, 3)
            units = [u for u in fs.units if u.trainable]
            ri = fs.reduce_dtype.itemsize
            biggest = max(fs.units[1:], key=lambda u: u.numel, default=None)
            gathered = rep["root_gathered"] + (prefetch + 1) * rep["max_unit"]
            order = [u for u in units[::-1] if not u.is_root] + [u for u in units if u.is_root]  # backward's
            out = dict(report=rep, max_unit=(biggest.name, biggest.numel) if biggest else ("", 0),
                       transient=gathered + ri * (fs.units[0].grad_numel +
                                                  max([u.grad_numel for u in fs.units[1:]], default=0)),
                       fixed=rep["root_gathered"], policy=Policy(
                           [PlannedReduction([q.names[0] for q in u.trainable], ri * u.grad_numel, 4 * _grad_len(u, rank),
                                       scratch(u.grad_numel, ri, True,
                                               -1 if u.reduce_bounds() is None else _grad_len(u, rank)))
                            for u in order],
                           inflight=MAX_INFLIGHT_UNITS, first=0, prefetch=prefetch,
                           gathers=[Gather(u.name, u.numel * pdt.itemsize, [q.names[0] for q in u.trainable])
                                    for u in fs.units[1:]]))
        else:
            model.to(pdt)
            opts = _optimizers(model, optimizer, wrap, stage=stage, bucket_mb=bucket_mb, **offload)
            rep = _report(opts, stage)
            out = dict(report=rep, transient=0, fixed=0, policy=None)   # stage 1 reduces in place
            if stage == 2:
                index = {id(p): n for n, p in model.named_parameters()}
                reds = [(red, [index[id(p)] for p in o.params]) for o in opts for red in (o.source,)]
                item = {id(b): red.reduce_dtype_of(b.buffer.dtype).itemsize for red, _ in reds for b in red.buckets}
                out["transient"] = max(b.numel * item[id(b)] for red, _ in reds for b in red.buckets)
                out["policy"] = Policy(
                    [PlannedReduction([nm[i] for i in b.params], b.numel * item[id(b)], 0,
                                scratch(b.numel, item[id(b)], False))
                     for red, nm in reds for b in (red.buckets[k] for k in red.launch_order)],
                    inflight=MAX_INFLIGHT_BUCKETS, first=sum(b.shard_numel * item[id(b)] for red, _ in reds
                                                     for b in red.buckets),
                    keep=MAX_INFLIGHT_BUCKETS + 1, pooled=gloo)
        whole = [o.whole_tensor_rule for o in opts if o.whole_tensor_rule is not None]
        out["transient"] = max([out["transient"]] + [w.transient_bytes() for w in whole])
        out["grad_shards"] = (0 if out["policy"] is None else
                              out["policy"].first + sum(r.shard for r in out["policy"].reductions))
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


def plan_model(build: Callable, world_size: int, dtype: str = "fp32", *, wrap=None, bucket_mb: float = 25,
               prefetch: int = 1, example: Optional[Callable] = None, ranks: Optional[List[int]] = None,
               offload: Optional[str] = None, offload_fraction: float = 1.0, transport: str = "nccl",
               optimizer: str = "adamw") -> dict:
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
    off = dict(offload=Offload(optimizer=offload, fraction=offload_fraction,     # (no file is made on meta)
                               directory=tempfile.gettempdir() if offload == "nvme" else None)) if offload else {}
    with torch.device("meta"):
        model = build()
    n = sum(p.numel() for p in model.parameters())   # parameters() lists a tied weight once
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    wrap_classes = _resolve_wrap(model, wrap)
    del model
    if ranks is None:   # only the ends of the rank range differ in padding
        ranks = sorted({0, 1, world_size - 2, world_size - 1} & set(range(world_size)))
    acts = activation_bytes(build, example, dtype) if example is not None else None
    pb, gb, ob = _BYTES[dtype]
    ddp_state = pb * n + (gb + ob) * trainable
    stages = {"DDP": dict(ranks={r: dict(params=pb * n, grads=gb * trainable, master=(4 if pb < 4 else 0) * trainable,
                                          exp_avg=4 * trainable, exp_avg_sq=4 * trainable, padding=0,
                                          total=ddp_state, device=ddp_state, host=0, disk=0) for r in ranks},
                          model_state=ddp_state, device_state=ddp_state, transient=gb * trainable)}
    max_unit = ("", 0)
    stages["DDP"]["peak"] = None if acts is None else ddp_state + gb * trainable + acts
    for stage in (1, 2, 3):
        runs = {r: _meta_run(build, world_size, r, stage, dtype, wrap_classes, bucket_mb, prefetch, off,
                             transport == "gloo", optimizer)
                for r in ranks}
        state = max(v["report"]["total"] for v in runs.values())
        dev = max(v["report"]["device"] for v in runs.values())
        run = runs[ranks[0]]      # the policy: every rank's shards have one length
        peak = None
        if acts is not None:
            traced = acts if run["policy"] is None else activation_bytes(build, example, dtype, run["policy"])
            peak = max(dev, dev - run["grad_shards"] + run["fixed"] + traced)
        stages[f"ZeRO-{stage}"] = dict(ranks={r: {k: v["report"][k] for k in _PERSISTENT + LOCATIONS + _OWN
                                                  if k in v["report"]} for r, v in runs.items()},
                                       model_state=state, device_state=dev,
                                       transient=max(v["transient"] for v in runs.values()), peak=peak)
        if stage == 3:
            max_unit = run["max_unit"]
    return dict(params=n, trainable=trainable, world_size=world_size, dtype=dtype, offload=offload, optimizer=optimizer,
                offload_fraction=offload_fraction if offload else 0.0,
                wrap=[c.__name__ for c in wrap_classes], max_unit=max_unit, activations=acts, stages=stages)


def format_model_plan(plan: dict) -> str:
    gb = 1e9
    mib = 2**20
    unit = mib if plan["stages"]["DDP"]["model_state"] < 10 * gb else gb
    uname = "MiB" if unit == mib else "GB"
    name, numel = plan["max_unit"]
    lines = [f"model: {plan['params']:,} parameters ({plan['trainable']:,} trainable), {plan['world_size']} ranks, "
             f"{plan['dtype']}; ZeRO-3 units: {', '.join(plan['wrap']) or 'none (root only)'}; largest unit "
             f"'{name}' {numel:,} elements (padded)",
             f"{'stage':<8}{'params':>10}{'grads':>10}{'optimizer':>11}{'padding':>10}{'state':>10}"
             f"{'buffers':>10}{'activ.':>10}{'peak':>10}  " + "".join(f"{c:>5}GB" for c in CARDS_GB)]
    for s in STAGES:
        st = plan["stages"][s]
        r = max(st["ranks"].values(), key=lambda rep: rep["total"])
        opt = r["master"] + r["exp_avg"] + r["exp_avg_sq"] + r.get("optimizer_state", 0)
        acts = plan["activations"]
        need = st["peak"] if st["peak"] is not None else st["device_state"] + st["transient"]
        fits = "".join(f"{'yes' if need <= c * gb else 'no':>7}" for c in CARDS_GB)
        lines.append(f"{s:<8}{r['params'] / unit:>10.3f}{r['grads'] / unit:>10.3f}{opt / unit:>11.3f}"
                     f"{r['padding'] / unit:>10.3f}{st['model_state'] / unit:>10.3f}{st['transient'] / unit:>10.3f}"
                     f"{'-' if acts is None else format(acts / unit, '.3f'):>10}"
                     f"{'-' if st['peak'] is None else format(st['peak'] / unit, '.3f'):>10}  {fits}"
                     + (f"{r['device'] / unit:>10.3f}{r['host'] / unit:>10.3f}{r['disk'] / unit:>10.3f}"
                        if plan["offload"] else ""))
    lines.append(f"({uname} per rank, the rank with the most; state = params + grads + optimizer + padding, "
                 "exactly what memory_report() will say; buffers = buckets / gathered units and gradient "
                 "buffers; activ. = one forward + backward's tensors; peak = the most alive at once, with "
                 "each stage's gradients, buffers and gradient shards alive when that stage holds them)")
    if plan["offload"]:
        lines[1] += f"{'device':>10}{'host':>10}{'disk':>10}"
        lines.append(f"(offload={plan['offload']}, fraction {plan['offload_fraction']:g}: state splits into device, "
                     "host and disk bytes as memory_report() will say; peak and 'fits' count the device only)")
    if plan["activations"] is None:
        lines.append("activations not counted: pass --input module:function (one micro-batch) to include them; "
                     "'fits' then compares state + buffers only")
    return "\n".join(lines)


def _formula(ap: argparse.ArgumentParser, args) -> None:
    """``--params``: the formulas' table."""
    if not args.params > 0:
        ap.error("--params must be > 0")
    try:
        print(format_table(args.params, args.world_size, args.dtype, args.shard_size, args.offload,
                           args.offload_fraction, args.ep, args.experts, args.tp, args.replicated))
    except ValueError as e:
        ap.error(str(e))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m zeroshard.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, help="number of parameters, e.g. 7e9")
    ap.add_argument("--model", help="module:function or file.py:function returning the model (built on meta)")
    ap.add_argument("--input", help="module:function returning one micro-batch of inputs (for activations)")
    ap.add_argument("--batch", type=int, help="passed to the --input function as batch=")
    ap.add_argument("--wrap", help="ZeRO-3 unit classes, comma-separated names (default: the blocks of the "
                                   "longest ModuleList)")
    ap.add_argument("--bucket-mb", type=float, default=25, help="ShardedOptimizer bucket_mb (default 25)")
    ap.add_argument("--prefetch", type=int, default=1, help="FullyShard prefetch (default 1)")
    ap.add_argument("--world-size", type=int, required=True, help="data-parallel ranks N")
    ap.add_argument("--shard-size", type=int, help="hybrid sharding: shard over S ranks (a node), replicate "
                                                   "across the N/S groups (default: shard over all N)")
    ap.add_argument("--dtype", choices=sorted(_BYTES), default="bf16",
                    help="bf16/fp16: mixed precision with fp32 master (default); fp32: plain fp32")
    ap.add_argument("--offload", choices=("cpu", "nvme"), help="ShardedOptimizer offload: the offloaded "
                                                               "state's bytes go to host memory or disk")
    ap.add_argument("--offload-fraction", type=float, default=1.0, help="share of the optimizer state "
                                                                        "offloaded (default 1)")
    ap.add_argument("--optimizer", choices=("adamw", "adafactor", "muon"), default="adamw",
                    help="with --model: the fused AdamW (default), torch's Adafactor, or Muon over the "
                         "blocks' 2-D matrices with AdamW over the rest; whole-tensor state counts on its owner")
    ap.add_argument("--ep", type=int, default=1,
                    help="with --params: expert-parallel degree (dividing --world-size): a rank holds 1/ep of "
                         "the experts, each expert's state sharded over its N/ep edp ranks (default 1)")
    ap.add_argument("--experts", type=float, default=0.0,
                    help="with --params: how many of the parameters are experts' (every expert once), e.g. 4.5e10")
    ap.add_argument("--tp", type=int, default=1,
                    help="with --params: tensor-parallel degree (dividing --world-size = dp x tp): a rank holds "
                         "1/tp of the tp-sharded parameters, its piece's state sharded over its N/tp dp ranks")
    ap.add_argument("--replicated", type=float, default=0.0,
                    help="with --tp: how many of the parameters every tp rank holds whole (norms, row-parallel "
                         "biases; default 0)")
    ap.add_argument("--transport", choices=("nccl", "gloo"), default="nccl",
                    help="with --model: nccl (GPUs, default) or gloo (CPU processes, whose reduce-scatter "
                         "takes scratch chunks)")
    return ap


def main(argv: List[str] = None) -> None:
    ap = _parser()
    args = ap.parse_args(argv)
    if not 0 <= args.offload_fraction <= 1:
        ap.error(f"--offload-fraction must be in [0, 1], got {args.offload_fraction}")
    if args.world_size < 1:
        ap.error("--world-size must be >= 1")
    if (args.params is None) == (args.model is None):
        ap.error("give exactly one of --params and --model")
    if args.shard_size is not None and (args.shard_size < 1 or args.world_size % args.shard_size):
        ap.error(f"--shard-size must divide --world-size ({args.world_size}), got {args.shard_size}")
    if args.model is None:
        return _formula(ap, args)
    if args.ep != 1 or args.experts or args.tp != 1 or args.replicated:
        ap.error("--ep, --experts, --tp and --replicated plan with --params (the formulas); --model plans a "
                 "model without expert or tensor parallelism for now")
    try:
        build = _load(args.model)
        example = None
        if args.input:
            fn = _load(args.input)
            example = (lambda: fn(batch=args.batch)) if args.batch else fn
        # hybrid sharding holds per rank exactly what sharding over S ranks does
        plan = plan_model(build, args.shard_size or args.world_size, args.dtype, wrap=args.wrap,
                          bucket_mb=args.bucket_mb, prefetch=args.prefetch, example=example,
                          offload=args.offload, offload_fraction=args.offload_fraction,
                          transport=args.transport, optimizer=args.optimizer)
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    if args.shard_size is not None:
        print(f"hybrid sharding: {args.world_size} ranks = {args.world_size // args.shard_size} replicas x "
              f"{args.shard_size} shards; per rank as when sharding over {args.shard_size} ranks:")
    print(format_model_plan(plan))

