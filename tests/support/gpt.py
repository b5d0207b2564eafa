"""The ZeRO-3 tests' model and its reference run: a small GPT (tied embedding, causal
attention, awkward widths) of GPTBlock units, its data and loss, and single-process torch
AdamW on the whole batch (optionally with bf16 compute over rank slices) to compare
FullyShard with; ``build`` makes the GPT and its optimizer under each kind of training."""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zeroshard as zs

BATCH, SEQ, VOCAB, DIM, HEADS, LAYERS = 12, 11, 61, 20, 4, 3


class GPTBlock(nn.Module):
    def __init__(self, ckpt=False):
        super().__init__()
        self.ckpt = ckpt
        self.ln1 = nn.LayerNorm(DIM)
        # no qkv bias: the key bias gets a zero gradient (softmax is shift-invariant),
        # i.e. pure round-off noise that AdamW normalises up, so no two implementations agree on it
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 37)  # awkward hidden width
        self.out = nn.Linear(37, DIM)

    def _forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    def forward(self, x):
        if self.ckpt:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class GPT(nn.Module):
    """Token + position embeddings, blocks, final norm, output head tied to the
    token embedding (the embedding takes the head's weight, so construction and
    reset_parameters() in module order initialise it alike)."""

    def __init__(self, ckpt=False):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(GPTBlock(ckpt) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.tok.weight = self.head.weight
        self.register_buffer("temperature", torch.ones(1))

    def reset_parameters(self):  # the buffer, for models built on meta
        self.temperature.fill_(1.0)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x)) / self.temperature


def make_gpt(seed=0, ckpt=False):
    torch.manual_seed(seed)
    return GPT(ckpt)


def batches(steps, micro=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(micro)
        ]
        for _ in range(steps)
    ]


def local(x, rank, world):
    n = x.shape[0] // world
    return x[rank * n : (rank + 1) * n]


def loss_fn(logits, y):
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def param_groups(named, lr=1e-2):
    named = list(named)
    return [
        {"params": [p for n, p in named if n.endswith("weight") and "ln" not in n], "weight_decay": 0.1},
        {
            "params": [p for n, p in named if not (n.endswith("weight") and "ln" not in n)],
            "weight_decay": 0.0,
            "lr": lr / 2,
        },
    ]


def reference(steps, micro=1, clip=None, param_dtype=None, world=1):
    """Single process, whole batch, torch AdamW. With param_dtype: the forward and
    backward of each of ``world`` rank slices run on a param_dtype copy of fp32
    master weights, and their gradients are summed in fp32 and divided by
    ``world`` -- the same arithmetic as mixed precision with an fp32 reduction."""
    master = make_gpt()
    opt = torch.optim.AdamW(param_groups(master.named_parameters()), lr=1e-2, foreach=False)
    compute = make_gpt() if param_dtype else master
    if param_dtype:  # parameters only: FullyShard does not cast buffers
        for p in compute.parameters():
            p.data = p.data.to(param_dtype)
    norms = []
    for mbs in batches(steps, micro):
        opt.zero_grad()
        if param_dtype:
            with torch.no_grad():
                for p, q in zip(compute.parameters(), master.parameters()):
                    p.copy_(q)
            acc = [torch.zeros_like(q) for q in master.parameters()]
            for x, y in mbs:
                for r in range(world):
                    (loss_fn(compute(local(x, r, world)), local(y, r, world)) / micro).backward()
                    for a, p in zip(acc, compute.parameters()):
                        a += p.grad.float()
                        p.grad = None
            for a, q in zip(acc, master.parameters()):
                q.grad = a / world
        else:
            for x, y in mbs:
                (loss_fn(compute(x), y) / micro).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(master.parameters(), clip).item())
        opt.step()
    return master, norms


def train(model, opt, steps, micro=1, no_sync=False, clip=None, first_step=0):
    rank, world = dist.get_rank(), dist.get_world_size()
    norms = []
    for mbs in batches(first_step + steps, micro)[first_step:]:
        opt.zero_grad()
        for j, (x, y) in enumerate(mbs):
            ctx = model.no_sync() if (no_sync and j < micro - 1) else contextlib.nullcontext()
            with ctx:
                (loss_fn(model(local(x, rank, world)), local(y, rank, world)) / micro).backward()
        if clip is not None:
            norms.append(opt.clip_grad_norm_(clip).item())
        opt.step()
    return norms


TINY_BUCKET_MB = 0.004  # buckets of ~1000 fp32 elements: parameters split across buckets


def build(kind, dtype=None, seed=0):
    """A GPT and its optimizer: kind 'plain' (torch AdamW, no process group), 'ddp'
    (DDP + torch AdamW), 1, 2 (ShardedOptimizer stages) or 3 (FullyShard)."""
    if kind == 3:
        mp_ = zs.MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else None
        model = zs.FullyShard(make_gpt(seed), wrap={GPTBlock}, mixed_precision=mp_)
        return model, zs.ShardedOptimizer(param_groups(model.named_parameters()), lr=1e-2)
    model = make_gpt(seed)
    if dtype is not None:
        model.to(dtype)
    if kind in ("plain", "ddp"):
        opt = torch.optim.AdamW(param_groups(model.named_parameters()), lr=1e-2, foreach=False)
        return (nn.parallel.DistributedDataParallel(model) if kind == "ddp" else model), opt
    return model, zs.ShardedOptimizer(
        param_groups(model.named_parameters()), lr=1e-2, stage=kind, bucket_mb=TINY_BUCKET_MB
    )


def train_plain(model, opt, steps, first_step=0):
    for ((x, y),) in batches(first_step + steps)[first_step:]:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
