"""Expert parallelism at ZeRO-3: a training step of a mixture-of-experts model, paired.

Variants, all in the same processes (world size 4, CPU + gloo: edp 2 x ep 2), on the
model of examples/moe.py made larger (--dim, --hidden, --experts, --tokens per rank):
  zeroshard-3+ep  FullyShard(model, expert_modules={Expert: mesh["edp"]}) + ShardedOptimizer:
                  each rank holds its ep rank's experts, each a unit over its edp group
  fsdp2-3+ep      FSDP2 with per-module meshes, as torchtitan shards MoE: fully_shard on
                  each expert over mesh["edp"], then on the model over every rank; its
                  experts' gradients divided by the whole world (set_gradient_divide_factor)
  zeroshard-3     FullyShard(wrap={Expert}) over every rank, every rank holding every expert
                  (ZeRO-3 without expert parallelism)
Each repeat runs one step of every variant in turn, in an order rotated per repeat; the
ratios are medians of the per-repeat ratios against fsdp2-3+ep (the times: medians).
"state B/rank" is rank 0's exact bytes of expert state (zeroshard's memory_report: fp32
shard, gradient shard, exp_avg, exp_avg_sq) against 16 Psi_e / (N / ep), Psi_e the
expert parameters a rank's ep position holds; "sent" is what rank 0 sends in one step, by
process group, under the ring model (benchmarks/comm_count.py's c10d count; the
model's own token exchange over its ep group included).

    python -m benchmarks experts [--repeats 9] [--dim 256 --hidden 1024 --experts 8 --tokens 256]
"""

from __future__ import annotations

from datetime import date

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.harness import init_dist, print_rows, sized_options, spawn, time_variants
import moe  # (examples/moe.py's model, on the path the harness sets)

VARIANTS = ("fsdp2-3+ep", "zeroshard-3+ep", "zeroshard-3")
EP = 2


def _sized(args) -> None:
    """examples/moe.py's model at the benchmark's sizes."""
    moe.D, moe.H, moe.E, moe.IN, moe.OUT = args.dim, args.hidden, args.experts, args.dim, args.dim


def build(variant: str, mesh, world_mesh):
    torch.manual_seed(0)
    ep_group = mesh["ep"].get_group() if variant.endswith("+ep") else None
    net = moe.Net(top_k=2, ep_group=ep_group)
    if variant == "zeroshard-3+ep":
        import zeroshard as zs

        model = zs.FullyShard(net, expert_modules={moe.Expert: mesh["edp"]})
        return model, zs.ShardedOptimizer(model.parameters(), lr=1e-3)
    if variant == "zeroshard-3":
        import zeroshard as zs

        model = zs.FullyShard(net, wrap={moe.Expert})
        return model, zs.ShardedOptimizer(model.parameters(), lr=1e-3)
    from torch.distributed.fsdp import fully_shard

    for expert in net.moe.experts:
        fully_shard(expert, mesh=mesh["edp"])
        expert.set_gradient_divide_factor(float(dist.get_world_size()))
    fully_shard(net, mesh=world_mesh)
    net.set_force_sum_reduction_for_comms(True)  # (gloo has no averaging reduce-scatter)
    for expert in net.moe.experts:
        expert.set_force_sum_reduction_for_comms(True)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def step(model, opt, x, y):
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def worker(rank, world, port, out, args):
    init_dist(rank, world, port)
    _sized(args)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // EP, EP), mesh_dim_names=("edp", "ep"))
    world_mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.tokens, args.dim, generator=g), torch.randn(args.tokens, args.dim, generator=g)
    built = {v: build(v, mesh, world_mesh) for v in VARIANTS}
    times, sent = time_variants(built, args.repeats, lambda model, opt: step(model, opt, x, y), world)
    model, opt = built["zeroshard-3+ep"]
    rep = opt.memory_report()
    local_experts = sum(p.numel() for n, p in model.named_parameters() if n.startswith("moe.experts."))
    mine = sum(p.to_local().numel() for n, p in model.named_parameters() if n.startswith("moe.experts."))
    if rank == 0:
        out.put(
            dict(
                times_s=times,
                sent=sent,
                expert_params_per_ep_rank=local_experts,
                expert_elements_here=mine,
                memory_report=rep,
            )
        )
    dist.barrier()
    dist.destroy_process_group()


OPTIONS = sized_options(dim=256, hidden=1024, experts=8, tokens=256)


def run(args):
    res = spawn(worker, args.world_size, args)
    n, ep = args.world_size, EP
    print(
        f"MoE step, world size {n} (edp {n // ep} x ep {ep}), {args.experts} experts of {args.dim}x{args.hidden}, "
        f"{args.tokens} tokens per rank, CPU + gloo, {date.today()}; {args.repeats} paired repeats"
    )
    print_rows(res["times_s"], res["sent"], "fsdp2-3+ep")
    rep, psi_e = res["memory_report"], res["expert_params_per_ep_rank"]
    expert_state = 16 * res["expert_elements_here"]
    print(
        f"zeroshard-3+ep expert state on rank 0: {expert_state:,} B; 16 Psi_e / (N / ep) = "
        f"{16 * psi_e // (n // ep):,} B (Psi_e = {psi_e:,} per ep rank); memory_report total {rep['total']:,} B"
    )
    return dict(world_size=args.world_size, ep=ep, config={k: v for k, v in vars(args).items() if k != "json"}, **res)
