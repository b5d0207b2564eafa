"""Tensor parallelism with ZeRO over the other axis: a small GPT parallelized with torch's
parallel styles over mesh["tp"] (sequence parallelism for the norms), its local pieces
sharded by zeroshard.ShardedOptimizer over mesh["dp"].

    torchrun --nproc-per-node 4 examples/tensor_parallel.py

On 4 ranks the mesh is (dp 2, tp 2): ranks {0, 1} and {2, 3} each split every matrix of
the model between them (tp), and {0, 2}, {1, 3} hold the same pieces and see different
batches (dp). Each rank's optimizer state is 16 bytes per element of its share: 1/(dp*tp)
of the model's. The script trains the model at ZeRO-2 (ShardedOptimizer over mesh["dp"]) and
at ZeRO-3 (FullyShard over mesh["dp"], each block a unit whose tp pieces are gathered over
dp for its compute) and checks both against one process training the whole model on every
dp rank's batch with torch.optim.AdamW.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

import _device  # examples/_device.py: NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo
import zeroshard

V, D, HD, LAYERS, T, B, STEPS, TP = 37, 16, 4, 2, 6, 3, 3, 2  # vocab, width, head dim, layers, tokens, batch


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        # (no bias on k: softmax ignores it, so its gradient is rounding noise that Adam would amplify)
        self.q, self.k, self.v, self.out = (
            nn.Linear(D, D),
            nn.Linear(D, D, bias=False),
            nn.Linear(D, D),
            nn.Linear(D, D),
        )

    def forward(self, x):
        # (under tensor parallelism q, k and v hold this rank's heads of every token: the shapes are theirs)
        q, k, v = (f(x) for f in (self.q, self.k, self.v))
        b, t, _ = q.shape
        q, k, v = (z.view(b, t, -1, HD).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(D), Attention(), nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, 3 * D), nn.Linear(3 * D, D)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parallelize(model: GPT, tp_mesh, loss_parallel: bool = False) -> GPT:
    """Megatron's plan with sequence parallelism: the residual stream is split over the
    tokens between the tp ranks (the norms run on their share), every matrix over its
    columns (q, k, v, up, head) or rows (out, down, embed). ``loss_parallel``: the logits
    stay split over the vocabulary (a DTensor) for torch's loss_parallel()."""
    seq = Shard(1)
    parallelize_module(
        model,
        tp_mesh,
        {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "norm": SequenceParallel(use_local_output=True),
            "head": ColwiseParallel(input_layouts=seq, use_local_output=False)
            if loss_parallel
            else ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
        },
    )
    for block in model.blocks:
        parallelize_module(
            block,
            tp_mesh,
            {
                "norm1": SequenceParallel(use_local_output=True),
                "norm2": SequenceParallel(use_local_output=True),
                **{f"attn.{n}": ColwiseParallel(input_layouts=seq) for n in ("q", "k", "v")},
                "attn.out": RowwiseParallel(output_layouts=seq),
                "up": ColwiseParallel(input_layouts=seq),
                "down": RowwiseParallel(output_layouts=seq),
            },
        )
    return model


def batch(step: int, dp_rank: int, device):
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    idx = torch.randint(0, V, (B, T + 1), generator=g)
    return idx[:, :-1].to(device), idx[:, 1:].to(device)


def loss_of(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))


def main():
    device = _device.setup()
    torch.set_num_threads(1)
    world = dist.get_world_size()
    tp = TP if world % TP == 0 and world > 1 else 1
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    torch.manual_seed(0)
    ref = GPT().to(device)  # the whole model in this process: the reference
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):  # every dp rank's batch
        xs, ys = zip(*(batch(step, d, device) for d in range(world // tp)))
        loss_of(ref, torch.cat(xs), torch.cat(ys)).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
        ref_opt.step()
        ref_opt.zero_grad()

    def train(model, opt):
        for step in range(STEPS):
            loss_of(model, *batch(step, dp_rank, device)).backward()
            norm = float(opt.clip_grad_norm_(1.0))  # over dp x tp, every element once
            opt.step()
            opt.zero_grad()
        return norm

    def error(whole):
        return max(((whole[n].to(p.device) - p).norm() / p.norm()).item() for n, p in ref.named_parameters())

    # ZeRO-2 over the dp axis: the local pieces' optimizer state and gradients sharded over mesh["dp"]
    model = GPT().to(device)
    model.load_state_dict(start)
    parallelize(model, mesh["tp"])  # DTensor parameters: each rank its tp pieces
    opt = zeroshard.ShardedOptimizer(
        model.parameters(), lr=1e-2, stage=2, sharding=zeroshard.Sharding(device_mesh=mesh["dp"])
    )
    norm2 = train(model, opt)
    err2 = error({n: p.full_tensor() for n, p in model.named_parameters()})  # (collective over tp)
    state = opt.memory_report()["exp_avg"] // 4

    # ZeRO-3 over the dp axis: each block a unit, its tp pieces sharded over mesh["dp"]
    model = GPT().to(device)
    model.load_state_dict(start)
    model = zeroshard.FullyShard(
        parallelize(model, mesh["tp"]), wrap={Block}, sharding=zeroshard.Sharding(device_mesh=mesh["dp"])
    )
    norm3 = train(model, zeroshard.ShardedOptimizer(model.parameters(), lr=1e-2))
    err3 = error(model.state_dict())  # (the whole tensors: gathered over dp and tp)

    if dist.get_rank() == 0:
        print(
            f"tensor_parallel: {world} ranks = dp {world // tp} x tp {tp}; ZeRO-2 exp_avg for {state:,} of "
            f"{sum(p.numel() for p in ref.parameters()):,} elements on rank 0; last grad norm {norm2:.4f} "
            f"(ZeRO-2), {norm3:.4f} (ZeRO-3), {ref_norm:.4f} (one process); max relative error "
            f"{max(err2, err3):.1e}"
        )
    assert max(err2, err3) < 1e-5, f"differs from one process: {err2}, {err3}"
    assert max(abs(norm2 - ref_norm), abs(norm3 - ref_norm)) < 1e-4 * ref_norm, (norm2, norm3, ref_norm)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
