"""A DDP training loop in the idioms of the most-copied training scripts, and
the same loop converted to zeroshard. Every line that differs between the
two is marked ``# zeroshard:``; see docs/converting-ddp.md.

    torchrun --nproc-per-node 2 examples/ddp_idioms.py --mode ddp --out ddp.pt
    torchrun --nproc-per-node 2 examples/ddp_idioms.py --mode 2 --out zs2.pt   # stage 1, 2 or 3

Idioms: bf16 autocast, torch.amp.GradScaler (unscale_, clip, step, update),
gradient accumulation with nanoGPT's ``require_backward_grad_sync``,
torch.nn.utils.clip_grad_norm_, a checkpoint written by rank 0 alone, and a
resume from it. The run trains STEPS steps, saving at step SAVE_AT; then it
builds everything again, resumes from the file and trains to STEPS again.
Rank 0 writes both final parameter sets to ``--out``.
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zeroshard

STEPS, SAVE_AT, ACCUM, BATCH = 8, 4, 2, 12


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, vocab=37, d=24, layers=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.blocks(self.emb(idx)))


def build(mode, device):
    torch.manual_seed(0)
    model = Net().to(device)
    if mode == "ddp":
        ids = [device.index] if device.type == "cuda" else None  # device_ids=[LOCAL_RANK] on a GPU
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
        return model, model.module, opt
    if mode == "3":
        model = zeroshard.FullyShard(model, wrap={Block})  # zeroshard: ZeRO-3
    opt = zeroshard.ShardedOptimizer(
        model.parameters(), lr=3e-3, weight_decay=0.1, stage=2 if mode == "3" else int(mode)
    )  # zeroshard
    return model, model, opt


def batch(step, micro, device):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randint(0, 37, (BATCH, 9), generator=g)
    n = BATCH // dist.get_world_size()
    x = x[dist.get_rank() * n : (dist.get_rank() + 1) * n].to(device)
    return x[:, :-1], x[:, 1:]


def train(mode, model, raw, opt, scaler, start, stop, ckpt, device):
    for step in range(start, stop):
        for micro in range(ACCUM):
            if mode == "ddp":  # nanoGPT's idiom; a no-op attribute on a zeroshard model (it reduces every time)
                model.require_backward_grad_sync = micro == ACCUM - 1
            x, y = batch(step, micro, device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) / ACCUM
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if step + 1 == SAVE_AT and ckpt:
            if mode != "ddp":
                opt.consolidate_state_dict(to=0)  # zeroshard
            model_sd = raw.state_dict(to=0) if mode == "3" else raw.state_dict()  # zeroshard: ZeRO-3
            if dist.get_rank() == 0:
                torch.save(
                    {"model": model_sd, "opt": opt.state_dict(), "scaler": scaler.state_dict(), "step": step + 1}, ckpt
                )
            dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "1", "2", "3"], required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import _device  # examples/_device.py (imported here: the tests load this file as a module, off sys.path)

    device = _device.setup()  # NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo on the CPU
    torch.set_num_threads(1)
    ckpt = args.out + ".ckpt"
    model, raw, opt = build(args.mode, device)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    train(args.mode, model, raw, opt, scaler, 0, STEPS, ckpt, device)
    straight = raw.state_dict(to=0) if args.mode == "3" else raw.state_dict()  # zeroshard: ZeRO-3

    model, raw, opt = build(args.mode, device)  # resume from the rank-0 checkpoint
    saved = torch.load(ckpt, weights_only=False, map_location=device)  # onto this rank's device, not rank 0's
    raw.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    scaler.load_state_dict(saved["scaler"])
    train(args.mode, model, raw, opt, scaler, saved["step"], STEPS, None, device)
    resumed = raw.state_dict(to=0) if args.mode == "3" else raw.state_dict()  # zeroshard: ZeRO-3
    if dist.get_rank() == 0:
        torch.save(
            {
                run: {k: v.cpu() for k, v in sd.items()}  # on CPU, as FullyShard's
                for run, sd in (("straight", straight), ("resumed", resumed))
            },
            args.out,
        )
        os.remove(ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
