"""Train a small GPT with zeroshard, launched with torchrun.

    torchrun --nproc-per-node 2 examples/train_gpt.py --stage 3            # CPU: gloo; GPUs: NCCL
    torchrun --nproc-per-node 8 examples/train_gpt.py --stage 2 --size 124m --dtype bf16
    torchrun ... examples/train_gpt.py --stage 3 --ckpt-dir ckpt --ckpt-every 100
    torchrun ... examples/train_gpt.py --stage 3 --ckpt-dir ckpt --resume   # at any world size or stage

--stage 0 is the baseline: DistributedDataParallel + torch.optim.AdamW.
--stage 1/2: zeroshard.ShardedOptimizer(stage=1/2) on the plain model.
--stage 3: zeroshard.FullyShard(wrap={Block}) + zeroshard.ShardedOptimizer.

--dtype bf16 means mixed precision the way each alternative does it: stage 0
keeps fp32 parameters and runs the forward under torch.autocast; stages 1 and
2 keep bf16 parameters with an fp32 master shard; stage 3 gathers bf16
parameters from fp32 shards and reduces gradients in fp32.

The corpus is generated (a few hundred KB of sentences from a small grammar,
the same on every rank); the model reads characters. At the end rank 0 prints
every rank's memory by category next to the seeds' formula for the chosen
stage and next to what DDP would need, and writes a PNG of per-rank memory by
stage as stacked bands (parameters, gradients, optimizer states).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------- the model
@dataclass
class GPTConfig:
    vocab: int = 64
    seq: int = 64
    layers: int = 4
    dim: int = 128
    heads: int = 4


SIZES = {  # --size presets; "tiny" is what the CPU demo trains
    "tiny": dict(layers=4, dim=128, heads=4, seq=64),
    "small": dict(layers=6, dim=384, heads=6, seq=128),
    "124m": dict(layers=12, dim=768, heads=12, seq=1024),
    "350m": dict(layers=24, dim=1024, heads=16, seq=1024),
}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP. The sharding unit of --stage 3."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
        self.ln1 = nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)
        self.ln2 = nn.LayerNorm(c.dim)
        self.fc = nn.Linear(c.dim, 4 * c.dim)
        self.out = nn.Linear(4 * c.dim, c.dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, blocks, a final layernorm and an output head tied to the embedding."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.seq, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        self.head.weight = self.tok.weight
        self.reset_parameters()

    def reset_parameters(self):
        for m in self.modules():  # GPT-2 style
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.LayerNorm):
                m.reset_parameters()

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_model(size: str = "tiny", vocab: int = 64, **overrides) -> GPT:
    """The example's model (the memory planner builds it too: ``--model examples/train_gpt.py:build_model``)."""
    return GPT(GPTConfig(vocab=vocab, **{**SIZES[size], **overrides}))


def example_batch(size: str = "tiny", vocab: int = 64, batch: int = 16, **overrides):
    """One per-rank micro-batch of inputs for ``build_model`` (what the planner traces for activations)."""
    seq = {**SIZES[size], **overrides}["seq"]
    idx = torch.zeros(batch, seq, dtype=torch.long)
    return (idx, idx)


# ---------------------------------------------------------------- the data
_WORDS = dict(
    det=["the", "a", "one", "every", "that", "this", "some"],
    adj=["quick", "lazy", "small", "bright", "old", "quiet", "brave", "green", "tall", "cold", "clever", "gentle"],
    noun=[
        "fox",
        "dog",
        "bird",
        "river",
        "king",
        "farmer",
        "ship",
        "garden",
        "child",
        "mountain",
        "clock",
        "lantern",
        "teacher",
        "horse",
        "baker",
        "city",
    ],
    verb=["sees", "follows", "finds", "carries", "watches", "helps", "paints", "remembers", "builds", "greets"],
    prep=["near", "under", "beside", "behind", "above", "across"],
    adv=["slowly", "today", "again", "at dawn", "in the rain", "without a word", "before noon"],
)


def make_corpus(n_chars: int = 400_000, seed: int = 1234) -> str:
    """Sentences from a small grammar: structured enough that the loss falls fast, varied enough that it keeps falling."""
    rng = random.Random(seed)

    def phrase():
        s = f"{rng.choice(_WORDS['det'])} "
        if rng.random() < 0.6:
            s += f"{rng.choice(_WORDS['adj'])} "
        return s + rng.choice(_WORDS["noun"])

    out, size = [], 0
    while size < n_chars:
        s = f"{phrase()} {rng.choice(_WORDS['verb'])} {phrase()}"
        if rng.random() < 0.5:
            s += f" {rng.choice(_WORDS['prep'])} {phrase()}"
        if rng.random() < 0.4:
            s += f" {rng.choice(_WORDS['adv'])}"
        s = s[0].upper() + s[1:] + rng.choice([".", ".", ".", "!", "?"]) + ("\n" if rng.random() < 0.2 else " ")
        out.append(s)
        size += len(s)
    return "".join(out)[:n_chars]


class CharData:
    def __init__(self, text: str, vocab: int):
        chars = sorted(set(text))
        if len(chars) > vocab:
            raise ValueError(f"the corpus has {len(chars)} distinct characters but the model's vocab is {vocab}")
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def batch(self, batch: int, seq: int, step: int, rank: int, micro: int, seed: int):
        """A micro-batch that depends only on (seed, step, rank, micro): a resumed run sees the same data."""
        g = torch.Generator().manual_seed(hash((seed, step, rank, micro)) & (2**62 - 1))
        starts = torch.randint(0, len(self.data) - seq - 1, (batch,), generator=g)
        x = torch.stack([self.data[s : s + seq + 1] for s in starts.tolist()])
        return x[:, :-1], x[:, 1:]


# ---------------------------------------------------------------- progress
class Progress:
    """A progress bar on a terminal (loss, tokens/s, step time); plain lines in a log."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.total, self.start, self.enabled = total, start, enabled
        self.tty = sys.stdout.isatty()
        self.t0 = time.perf_counter()
        self.every = max(1, (total - start) // 20)

    def update(self, step: int, loss: float, tok_s: float, ms: float):
        if not self.enabled:
            return
        done = step + 1
        frac = done / self.total
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(1, done - self.start) * (self.total - done)
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        line = (
            f"step {done:>5}/{self.total} |{bar}| {100 * frac:3.0f}% loss {loss:.4f} "
            f"{tok_s / 1e3:8.1f}k tok/s {ms:7.1f} ms/step  eta {eta:4.0f}s"
        )
        if self.tty:
            print("\r" + line, end="\n" if done == self.total else "", flush=True)
        elif done == self.total or (done - self.start) % self.every == 0 or done == self.start + 1:
            print(line, flush=True)


# ---------------------------------------------------------------- memory
def measured_bytes(stage: int, model: nn.Module, opt) -> dict:
    """This rank's model-state bytes by category (zeroshard's memory_report; for DDP counted from the tensors)."""
    if stage > 0:
        rep = opt.memory_report()
        return dict(
            params=rep["params"],
            grads=rep["grads"],
            optimizer=rep["master"] + rep["exp_avg"] + rep["exp_avg_sq"],
            padding=rep["padding"],
        )
    params = list(model.parameters())  # a tied weight once
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    state = sum(nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return dict(
        params=sum(nbytes(p) for p in params),
        grads=sum(nbytes(p) for p in params if p.requires_grad),  # DDP keeps a full gradient per parameter
        optimizer=state,
        padding=0,
    )


def memory_table(reports: list, stage: int, n_params: int, dtype: str, world: int) -> str:
    from zeroshard.plan import model_state_bytes

    conv = "fp32" if stage == 0 else dtype  # DDP + autocast keeps fp32 parameters, gradients and states
    rows = model_state_bytes(n_params, world, conv)
    name = "DDP" if stage == 0 else f"ZeRO-{stage}"
    f, ddp = rows[name], rows["DDP"]
    mb = 2**20
    lines = [
        f"\nmodel-state memory per rank ({n_params:,} parameters, {dtype}, world size {world}, MiB)",
        f"{'rank':<6}{'params':>10}{'grads':>10}{'optimizer':>11}{'padding':>10}{'total':>10}"
        f"{'formula':>10}{'DDP':>10}",
    ]
    for r, rep in enumerate(reports):
        total = sum(rep.values())
        lines.append(
            f"{r:<6}{rep['params'] / mb:>10.3f}{rep['grads'] / mb:>10.3f}{rep['optimizer'] / mb:>11.3f}"
            f"{rep['padding'] / mb:>10.3f}{total / mb:>10.3f}{f['total'] / mb:>10.3f}"
            f"{ddp['total'] / mb:>10.3f}"
        )
    lines.append(
        f"formula ({name}, seeds' {conv} convention): params {f['params'] / mb:.3f} + grads "
        f"{f['grads'] / mb:.3f} + optimizer {f['optimizer'] / mb:.3f} MiB; padding is the flat "
        "layout's, shown apart"
    )
    return "\n".join(lines)


def plot_memory(path: str, reports_by_stage: dict, n_params: int, dtype: str, world: int) -> None:
    """Per-rank memory by stage as stacked bands: the formula for every stage, and what was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from zeroshard.plan import STAGES, model_state_bytes

    rows = model_state_bytes(n_params, world, dtype)
    mb = 2**20
    bands = [
        ("params", "parameters", "#4C72B0"),
        ("grads", "gradients", "#DD8452"),
        ("optimizer", "optimizer states", "#55A868"),
    ]
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=100)
    labels, x = [], 0
    for si, s in enumerate(STAGES):
        bars = [("formula", rows[s])]
        if si in reports_by_stage:  # measured on rank 0 (the largest shard with padding)
            rep = reports_by_stage[si]
            bars.append(
                (
                    "measured",
                    {k: rep[k] + (rep["padding"] if k == "optimizer" else 0) for k in ("params", "grads", "optimizer")},
                )
            )
        for kind, vals in bars:
            bottom = 0.0
            for key, label, color in bands:
                h = vals[key] / mb
                ax.bar(
                    x,
                    h,
                    bottom=bottom,
                    color=color,
                    width=0.8,
                    hatch="//" if kind == "measured" else None,
                    edgecolor="white",
                    label=label if x == 0 else None,
                )
                bottom += h
            labels.append((x, f"{s}\n{kind}"))
            x += 1
        x += 0.5
    ax.set_xticks([p for p, _ in labels], [t for _, t in labels], fontsize=8)
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"Per-rank model-state memory by stage: {n_params / 1e6:.2f}M params, {dtype}, {world} ranks")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------- training
def setup():
    if "RANK" not in os.environ:  # plain `python train_gpt.py`: a world of one
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", "29511"),
        )
    # examples/_device.py, imported here, not at the top: the planner and the benchmarks load this
    # file for its model, from where examples/ need not be on sys.path
    import _device

    # NCCL on cuda:LOCAL_RANK where the node has a GPU for every rank, else gloo on the CPU; the
    # group comes up again under torchrun --max-restarts (zeroshard.init_distributed)
    device = _device.setup()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    return device


def wrap(args, model, device):
    import zeroshard as zs

    lr = args.lr
    if args.stage == 0:
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        return ddp, model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    if args.stage == 3:
        mp = zs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.dtype == "bf16" else None
        fs = zs.FullyShard(model, wrap={Block}, mixed_precision=mp)
        return fs, fs, zs.ShardedOptimizer(fs.parameters(), lr=lr, weight_decay=args.weight_decay)
    if args.dtype == "bf16":
        model.to(torch.bfloat16)
    return (
        model,
        model,
        zs.ShardedOptimizer(
            model.parameters(), lr=lr, weight_decay=args.weight_decay, stage=args.stage, bucket_mb=args.bucket_mb
        ),
    )


def lr_at(step: int, args) -> float:
    warm = max(1, args.steps // 20)
    if step < warm:
        return args.lr * (step + 1) / warm
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, args.steps - warm))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=3)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="sequences per micro-batch per rank")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step (gradient accumulation)")
    ap.add_argument("--clip", type=float, default=1.0, help="max gradient norm; 0 disables clipping")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--bucket-mb", type=float, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-dir", default=None, help="checkpoint directory (zeroshard.save_checkpoint)")
    ap.add_argument("--ckpt-every", type=int, default=0, help="save every K steps (and at the end)")
    ap.add_argument("--resume", action="store_true", help="continue from --ckpt-dir (any world size or stage)")
    ap.add_argument("--out-dir", default="examples/out", help="where the memory PNG and JSON go")
    args = ap.parse_args(argv)
    if args.resume and not args.ckpt_dir:
        ap.error("--resume needs --ckpt-dir")

    import zeroshard as zs

    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial model everywhere (rank 0's is broadcast anyway)
    data = CharData(make_corpus(), vocab=64)
    model = build_model(args.size, vocab=64).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    engine, inner, opt = wrap(args, model, device)
    start = 0
    # the newest complete checkpoint, at this world size and stage (None: start fresh)
    extra = zs.resume(args.ckpt_dir, inner, opt) if args.resume else None
    if extra is not None:
        start = extra["step"]
        torch.set_rng_state(extra["rng"])
    seq = model.config.seq
    tokens_per_step = args.batch * seq * args.accum * world
    autocast = args.stage == 0 and args.dtype == "bf16"
    if rank == 0:
        print(
            f"GPT {n_params / 1e6:.2f}M params | stage {args.stage} | {args.dtype} | world size {world} "
            f"({dist.get_backend()}, {device.type}) | {tokens_per_step} tokens/step | steps {start}..{args.steps}",
            flush=True,
        )
    bar = Progress(args.steps, start, rank == 0)
    losses, saving = [], None  # saving: the Future of a background checkpoint save
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        total = torch.zeros((), device=device)
        for micro in range(args.accum):
            x, y = (t.to(device) for t in data.batch(args.batch, seq, step, rank, micro, args.seed))
            last = micro == args.accum - 1
            # micro-batches before the last accumulate locally; the last one communicates
            ctx = contextlib.nullcontext() if last else engine.no_sync() if args.stage in (0, 3) else opt.no_sync()
            with ctx, torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = engine(x, y) / args.accum
                loss.backward()
            total += loss.detach().float()
        if args.clip > 0:
            if args.stage == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            else:
                opt.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        loss_now = total.item() / world
        losses.append(loss_now)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        bar.update(step, loss_now, tokens_per_step / dt, 1e3 * dt)
        if args.ckpt_dir and args.ckpt_every and ((step + 1) % args.ckpt_every == 0 or step + 1 == args.steps):
            # copies the state and returns; a thread writes it while training goes on (the
            # next save waits for it)
            saving = zs.save_checkpoint(
                args.ckpt_dir, inner, opt, extra=dict(step=step + 1, rng=torch.get_rng_state()), background=True
            )
            if rank == 0 and not sys.stdout.isatty():
                print(f"checkpoint: step {step + 1} -> {args.ckpt_dir} (writing in the background)", flush=True)
    if saving is not None:
        saving.result()  # complete and durable (or raise) before the process group goes

    mine = measured_bytes(args.stage, inner, opt)
    reports = zs.all_gather_object(mine)  # (torch's can abort the process at exit on gloo)
    if rank == 0:
        if losses:
            k = max(1, len(losses) // 10)
            print(f"loss: first {k} steps {sum(losses[:k]) / k:.3f} -> last {k} steps {sum(losses[-k:]) / k:.3f}")
        print(memory_table(reports, args.stage, n_params, args.dtype, world))
        if device.type == "cuda":
            print(f"peak GPU memory on rank 0: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
        _save_memory(args, reports[0], n_params, world)
    dist.barrier()  # every rank has finished its report before the group goes
    dist.destroy_process_group()
    return losses


def _save_memory(args, report: dict, n_params: int, world: int) -> None:
    """Keep rank 0's measured bytes per stage (same model, dtype and world size) and redraw the PNG."""
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "memory_by_stage.json")
    key = dict(size=args.size, dtype=args.dtype, world=world, n_params=n_params)
    saved = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("key") == key:
            saved = old["stages"]
    saved[str(args.stage)] = report
    with open(path, "w") as f:
        json.dump(dict(key=key, stages=saved), f, indent=1)
    png = os.path.join(args.out_dir, "memory_by_stage.png")
    try:
        plot_memory(png, {int(s): r for s, r in saved.items()}, n_params, args.dtype, world)
        print(f"wrote {png} (stages measured so far: {', '.join(sorted(saved))})")
    except ImportError:
        print("matplotlib is not installed: skipped the memory PNG (pip install matplotlib)")


if __name__ == "__main__":
    main()
