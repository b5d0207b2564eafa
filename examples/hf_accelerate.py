"""An ``accelerate launch`` training script with zeroshard: the recipe of
docs/huggingface.md. The lines marked ``# zeroshard:`` are the only ones that
differ from Accelerate's own DDP script (``--stage 0`` runs that script).

    accelerate launch --num_processes 2 examples/hf_accelerate.py --stage 2
    torchrun --nproc-per-node 2 examples/hf_accelerate.py --stage 3

A tiny GPT-2 built from its config learns random token sequences with
accumulation, clipping, a warmup schedule, a checkpoint (``save_state``) that a
second run resumes from, and a ``save_pretrained`` folder at the end.
"""

import argparse
import os

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

from zeroshard.integrations import hf  # zeroshard:

VOCAB, SEQ = 101, 16


def build_model(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def data(n: int = 96, seed: int = 1):
    """Sequences counting up by a random stride from a random start: learnable."""
    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB
    return torch.utils.data.TensorDataset(ids)


def train(
    stage: int, steps: int, out_dir: str, resume: bool = False, save_at: int = 0, mixed_precision: str = "no"
) -> dict:
    """Train to ``steps`` optimizer steps (``resume``: from ``out_dir/state``, saved at
    step ``save_at``). Returns the per-step losses, gradient norms and the final parameters."""
    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision=mixed_precision)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    loader = torch.utils.data.DataLoader(data(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=steps)
    if stage == 0:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    else:
        model, optimizer, loader, scheduler = hf.prepare(  # zeroshard:
            accelerator, model, optimizer, loader, scheduler, stage=stage
        )
    done, skip = 0, 0
    if resume:
        accelerator.load_state(os.path.join(out_dir, "state"))
        done, skip = save_at, save_at * accelerator.gradient_accumulation_steps
    losses, norms = [], []
    for epoch in range(100):
        batches = accelerator.skip_first_batches(loader, skip) if epoch == 0 and skip else loader
        for (ids,) in batches:
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            if accelerator.sync_gradients:
                done += 1
                if done == save_at and not resume:
                    accelerator.save_state(os.path.join(out_dir, "state"))
                if done == steps:
                    break
        if done == steps:
            break
    final = os.path.join(out_dir, "final")
    state = accelerator.get_state_dict(model)  # every rank (stage 3 gathers it); the full model's
    params = {k: v.detach().cpu().clone() for k, v in state.items()}  # (save_pretrained empties `state`)
    if stage == 3:
        hf.save_pretrained(model, final, is_main_process=accelerator.is_main_process)  # zeroshard:
    else:
        accelerator.wait_for_everyone()
        accelerator.unwrap_model(model).save_pretrained(
            final, is_main_process=accelerator.is_main_process, state_dict=state
        )
    return dict(losses=losses, norms=norms, params=params, final=final)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2, help="0: Accelerate's DDP; 1-3: zeroshard's stages")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="examples/out/hf_accelerate")
    args = parser.parse_args()
    first = train(args.stage, args.steps, args.out, save_at=args.steps // 2)
    resumed = train(args.stage, args.steps, args.out, resume=True, save_at=args.steps // 2)
    same = all(torch.equal(first["params"][k], resumed["params"][k]) for k in first["params"])
    if int(os.environ.get("RANK", 0)) == 0:
        print(
            f"stage {args.stage}: loss {first['losses'][0]:.4f} -> {first['losses'][-1]:.4f}; resumed run "
            f"{'equals' if same else 'DIFFERS from'} the uninterrupted one; weights in {first['final']}"
        )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
