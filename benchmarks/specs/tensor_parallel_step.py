"""Tensor parallelism with ZeRO over dp: a training step of a tensor-parallel GPT, paired.

Variants, all in the same processes (world size 4, CPU + gloo: dp 2 x tp 2), on the model
of examples/tensor_parallel.py made larger (--dim, --layers, --vocab, --tokens, --batch),
every matrix split over mesh["tp"] by torch's parallel styles with sequence parallelism:
  zeroshard-3+tp  FullyShard(model, wrap={Block}, device_mesh=mesh["dp"]) + ShardedOptimizer
  fsdp2-3+tp      FSDP2 as torchtitan applies it beside TP: fully_shard on each block, then
                  on the model, over mesh["dp"]; torch's AdamW
  ddp+tp          TP alone, DistributedDataParallel over mesh["dp"] (DDP's device_mesh)
  zeroshard-3     FullyShard over every rank without TP (pure data parallelism: its
                  bytes per step are the "dp-axis bytes" reference)
Each repeat runs one step of every variant in turn, in an order rotated per repeat; the
ratios are medians of the per-repeat ratios against fsdp2-3+tp (the times: medians).
"state B/rank" is rank 0's exact bytes of model state (zeroshard's memory_report: fp32
shards, gradient shards, exp_avg, exp_avg_sq) against 16 (Psi_s / (dp tp) + Psi_r / dp),
Psi_s the tp-sharded parameters and Psi_r the replicated ones (norms, row-parallel
biases), elements rounded to the shards' padding; "sent" is what rank 0 sends in one
step, by process group, under the ring model (benchmarks/comm_count.py's c10d count).

    python -m benchmarks tensor_parallel_step [--repeats 9] [--dim 256 --layers 4 --vocab 2048 --tokens 128]
"""

from __future__ import annotations

from datetime import date

import torch
import torch.distributed as dist

from benchmarks.harness import init_dist, print_rows, sized_options, spawn, time_variants
import tensor_parallel as tpx  # (examples/tensor_parallel.py's model, on the path the harness sets)

VARIANTS = ("fsdp2-3+tp", "zeroshard-3+tp", "ddp+tp", "zeroshard-3")
TP = 2


def _sized(args) -> None:
    """examples/tensor_parallel.py's model at the benchmark's sizes."""
    tpx.D, tpx.LAYERS, tpx.V, tpx.T, tpx.B, tpx.HD = args.dim, args.layers, args.vocab, args.tokens, args.batch, 64


def build(variant: str, mesh):
    import zeroshard as zs

    torch.manual_seed(0)
    model = tpx.GPT()
    if variant == "zeroshard-3":
        model = zs.FullyShard(model, wrap={tpx.Block})
        return model, zs.ShardedOptimizer(model.parameters(), lr=1e-3)
    tpx.parallelize(model, mesh["tp"])
    if variant == "zeroshard-3+tp":
        model = zs.FullyShard(model, wrap={tpx.Block}, device_mesh=mesh["dp"])
        return model, zs.ShardedOptimizer(model.parameters(), lr=1e-3)
    if variant == "ddp+tp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_mesh=mesh["dp"])
        return ddp, torch.optim.AdamW(model.parameters(), lr=1e-3)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    for m in [model, *model.blocks]:
        m.set_force_sum_reduction_for_comms(True)  # (gloo has no averaging reduce-scatter)
        m.set_gradient_divide_factor(float(mesh["dp"].size()))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model, opt, x, y):
    tpx.loss_of(model, x, y).backward()
    opt.step()
    opt.zero_grad()


def _split(model) -> tuple:
    """(tp-sharded, replicated) parameter elements of the whole model."""
    from torch.distributed.tensor import DTensor, Shard

    sharded = sum(
        p.numel()
        for p in model.parameters()
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)
    )
    return sharded, sum(p.numel() for p in model.parameters()) - sharded


def worker(rank, world, port, out, args):
    init_dist(rank, world, port)
    _sized(args)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
    x, y = tpx.batch(0, mesh["dp"].get_local_rank(), "cpu")
    built = {v: build(v, mesh) for v in VARIANTS}
    times, sent = time_variants(built, args.repeats, lambda model, opt: step(model, opt, x, y), world)
    rep = built["zeroshard-3+tp"][1].memory_report()
    elements = {}  # what one step all-gathers and reduce-scatters (zeroshard's own count)
    for v in ("zeroshard-3+tp", "zeroshard-3"):
        before = dict(built[v][0].comm_elements)
        step(*built[v], x, y)
        elements[v] = sum(built[v][0].comm_elements[k] - before[k] for k in ("all_gather", "reduce_scatter"))
    split = _split(tpx.parallelize(tpx.GPT(), mesh["tp"]))  # (collective over tp: every rank)
    if rank == 0:
        out.put(dict(times_s=times, sent=sent, split=split, memory_report=rep, elements=elements))
    dist.barrier()
    dist.destroy_process_group()


JSON = "tensor_parallel.json"
OPTIONS = sized_options(dim=256, layers=4, vocab=2048, tokens=128, batch=4)


def run(args):
    res = spawn(worker, args.world_size, args)
    n, tp = args.world_size, TP
    dp = n // tp
    print(
        f"TP step, world size {n} (dp {dp} x tp {tp}), GPT of width {args.dim}, {args.layers} layers, "
        f"vocabulary {args.vocab}, {args.batch}x{args.tokens} tokens per dp rank, CPU + gloo, {date.today()}; "
        f"{args.repeats} paired repeats"
    )
    print_rows(res["times_s"], res["sent"], "fsdp2-3+tp")
    rep, (psi_s, psi_r) = res["memory_report"], res["split"]
    state = rep["total"] - rep["padding"]
    print(
        f"zeroshard-3+tp model state on rank 0: {state:,} B; 16 (Psi_s / (dp tp) + Psi_r / dp) = "
        f"{16 * (psi_s // (dp * tp) + psi_r // dp):,} B (Psi_s = {psi_s:,}, Psi_r = {psi_r:,}); padding "
        f"{rep['padding']:,} B"
    )
    el = res["elements"]
    print(
        f"dp-axis elements all-gathered and reduce-scattered per step: {el['zeroshard-3+tp']:,} with tp {tp}, "
        f"{el['zeroshard-3']:,} under pure data parallelism (zeroshard-3): {el['zeroshard-3+tp'] / el['zeroshard-3']:.3f} "
        f"(1/tp = {1 / tp:.3f})"
    )
    return dict(world_size=args.world_size, tp=tp, config={k: v for k, v in vars(args).items() if k != "json"}, **res)
