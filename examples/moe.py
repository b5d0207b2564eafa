"""Mixture of experts with expert parallelism, at ZeRO-1/2: each rank holds its expert-parallel
rank's experts, and the experts' param group is sharded over the ranks holding the same
experts (the expert-data-parallel group), the rest over every rank.

    torchrun --nproc-per-node 4 examples/moe.py

On 4 ranks the mesh is (edp 2, ep 2): ranks {0, 1} and {2, 3} are expert-parallel groups
(rank 0 holds experts 0 and 2, rank 1 experts 1 and 3, and so do ranks 2 and 3), and
{0, 2}, {1, 3} the expert-data-parallel groups. The model routes each token to its top-2
experts; each ep group's tokens are gathered on its ranks, each rank runs its own experts
on those routed to them, and the outputs are summed back (an all-gather dispatcher: the
model owns its token exchange, zeroshard the sharding). An expert's gradient is summed
over its edp group and divided by the whole data-parallel size: its ep peers' tokens
reached it already. The script trains it at ZeRO-2 (the experts' param group over the edp
group) and at ZeRO-3 (FullyShard with expert_modules: each expert a unit over
the edp group) and checks both against one process training the whole model
(every expert) on every rank's tokens with torch.optim.AdamW. Its checkpoint keeps
every expert under its name in the whole model (``expert_names``): the export is the
one process's state dict.
"""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import _device  # examples/_device.py: NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo
import zeroshard
from safetensors.torch import load_file

IN, OUT, D, H, E, TOKENS, STEPS, EP = 5, 3, 6, 10, 4, 7, 6, 2  # E experts, TOKENS per rank, EP ranks per group


class _Gather(torch.autograd.Function):
    """The ep group's tokens, in rank order (backward: each rank's share of the summed gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        n = g.shape[0] // dist.get_world_size(ctx.group)
        r = dist.get_rank(ctx.group)
        return g[r * n : (r + 1) * n], None


class _Combine(torch.autograd.Function):
    """Every ep rank's partial outputs for the group's tokens summed; this rank's tokens' rows."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        n = y.shape[0] // dist.get_world_size(group)
        r = dist.get_rank(group)
        return y[r * n : (r + 1) * n].clone()

    @staticmethod
    def backward(ctx, g):
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, g.contiguous(), group=ctx.group)
        return torch.cat(parts), None


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-k routing over E experts; this rank holds experts i with i % ep == its ep rank.
    ``call_every_expert``: each expert runs in every forward, on no token where none was
    routed to it (under FullyShard's expert_modules each expert is gathered when it runs,
    over its expert-data-parallel ranks, so all of them must run it, as FSDP2 asks too);
    False skips such an expert (its gradient is then None, as one process's would be).
    ``unrouted``: experts no token is routed to (none by default)."""

    def __init__(self, top_k: int, ep_group=None, call_every_expert: bool = True):
        super().__init__()
        self.top_k, self.group, self.call_every_expert = top_k, ep_group, call_every_expert
        ep, r = (1, 0) if ep_group is None else (dist.get_world_size(ep_group), dist.get_rank(ep_group))
        self.ids = [i for i in range(E) if i % ep == r]
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in self.ids)
        self.unrouted: list = []

    def forward(self, x):
        logits = self.router(x)
        if self.unrouted:
            logits = logits.index_fill(-1, torch.tensor(self.unrouted, device=x.device), float("-inf"))
        weights, chosen = F.softmax(logits, -1).topk(self.top_k, -1)
        if self.group is not None:
            x, weights = _Gather.apply(x, self.group), _Gather.apply(weights, self.group)
            parts = [torch.empty_like(chosen) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(parts, chosen, group=self.group)
            chosen = torch.cat(parts)
        out = torch.zeros_like(x)
        for expert, i in zip(self.experts, self.ids):
            rows, slot = (chosen == i).nonzero(as_tuple=True)
            if rows.numel() or self.call_every_expert:
                out = out.index_add(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return out if self.group is None else _Combine.apply(out, self.group)


class Net(nn.Module):
    def __init__(self, top_k: int, ep_group=None, call_every_expert: bool = True):
        super().__init__()
        self.inp, self.norm, self.head = nn.Linear(IN, D), nn.LayerNorm(D), nn.Linear(D, OUT)
        self.moe = MoE(top_k, ep_group, call_every_expert)

    def forward(self, x):
        h = self.inp(x)
        return self.head(h + self.moe(self.norm(h)))


def batch(step, rank, device):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(TOKENS, IN, generator=g).to(device), torch.randn(TOKENS, OUT, generator=g).to(device)


def global_name(model: Net, name: str) -> str:
    """The whole model's name of this rank's parameter ``name`` (its experts are numbered locally)."""
    if name.startswith("moe.experts."):
        j, rest = name[len("moe.experts.") :].split(".", 1)
        name = f"moe.experts.{model.moe.ids[int(j)]}.{rest}"
    return name


def split(model: Net):
    """(dense parameters, expert parameters)."""
    named = list(model.named_parameters())
    return [p for n, p in named if not n.startswith("moe.experts.")], [
        p for n, p in named if n.startswith("moe.experts.")
    ]


def train(model, opt, device, rank):
    """STEPS steps on this rank's tokens, clipped; the last step's gradient norm."""
    for step in range(STEPS):
        x, y = batch(step, rank, device)
        F.mse_loss(model(x), y).backward()
        norm = opt.clip_grad_norm_(1.0)  # every expert counted once, the same on every rank
        opt.step()
        opt.zero_grad()
    return float(norm)


def main():
    device = _device.setup()
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = EP if world > 1 else 1  # one rank (one GPU): its ep group of one holds every expert
    assert world % ep == 0, f"run with a multiple of {EP} ranks: torchrun --nproc-per-node 4 ..."
    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("edp", "ep"))

    torch.manual_seed(0)
    ref = Net(top_k=2).to(device)  # every expert, in this process: the reference
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    dense, experts = split(ref)
    ref_opt = torch.optim.AdamW([{"params": dense}, {"params": experts}], lr=1e-2)
    for step in range(STEPS):  # every rank's tokens
        xs, ys = zip(*(batch(step, r, device) for r in range(world)))
        F.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
        ref_opt.step()
        ref_opt.zero_grad()

    def expert_parallel_model():
        net = Net(top_k=2, ep_group=mesh["ep"].get_group()).to(device)
        with torch.no_grad():  # the same start: this rank's experts of the whole model's
            for name, p in net.named_parameters():
                p.copy_(start[global_name(net, name)])
        return net

    def error(net, state):
        # (FullyShard's state_dict() is on the CPU, as torch's full state dicts are)
        return max(
            ((v.to(device) - ref.get_parameter(global_name(net, n))).norm() / v.norm()).item() for n, v in state.items()
        )

    # ZeRO-2: the experts' param group sharded over its edp group, the rest over every rank
    net = expert_parallel_model()
    dense, experts = split(net)
    opt = zeroshard.ShardedOptimizer(
        [
            {"params": dense},  # over every rank
            {"params": experts, "device_mesh": mesh["edp"]},
        ],  # over its edp group
        lr=1e-2,
        stage=2,
    )
    norm2 = train(net, opt, device, rank)
    err2, rep = error(net, net.state_dict()), opt.memory_report()

    # ZeRO-3: each expert a unit gathered and reduced over its edp group, the rest over every rank;
    # expert_names: each expert parameter's name in the whole model, for checkpoints
    net = expert_parallel_model()
    model = zeroshard.FullyShard(
        net,
        sharding=zeroshard.Sharding(expert_modules={Expert: mesh["edp"]}),
        expert_names=lambda name: global_name(net, name),
    )
    opt3 = zeroshard.ShardedOptimizer(model.parameters(), lr=1e-2)
    norm3 = train(model, opt3, device, rank)
    err3 = error(net, model.state_dict())  # (collective: each rank gets its own experts whole)

    # a checkpoint holds every expert once, under its whole-model name: exported, the whole model's
    where = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)  # (one filesystem: the ranks of one node)
    zeroshard.save_checkpoint(os.path.join(where[0], "ckpt"), model, opt3)
    if rank == 0:
        zeroshard.export_full_state_dict(os.path.join(where[0], "ckpt"), os.path.join(where[0], "moe.safetensors"))
        whole = load_file(os.path.join(where[0], "moe.safetensors"))
        assert whole.keys() == ref.state_dict().keys(), "the export is not the whole model's state dict"
        err3 = max(err3, *(((v - ref.get_parameter(n).cpu()).norm() / v.norm()).item() for n, v in whole.items()))
        shutil.rmtree(where[0])

    if rank == 0:
        print(
            f"moe: {world} ranks = edp {world // ep} x ep {ep}; rank 0 holds experts {net.moe.ids}, and at "
            f"ZeRO-2 exp_avg for {rep['exp_avg'] // 4:,} of {sum(p.numel() for p in ref.parameters()):,} "
            f"elements; last grad norm {norm2:.4f} (ZeRO-2), {norm3:.4f} (ZeRO-3), {ref_norm:.4f} (one "
            f"process); max relative error {max(err2, err3):.1e}"
        )
    assert err2 < 1e-5 and err3 < 1e-5, f"expert parallelism differs from one process: {err2}, {err3}"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
