"""The Hugging Face Trainer with zeroshard: one changed line (docs/huggingface.md).

    torchrun --nproc-per-node 2 examples/hf_trainer.py --stage 3

A tiny GPT-2 built from its config learns to continue counting sequences,
with evaluation, clipping, warmup, accumulation and checkpoints; then the
saved folder is loaded back with ``from_pretrained`` and checked against the
trained weights. ``--stage 0`` runs the plain Trainer (its own DDP).
"""

import argparse
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from zeroshard.integrations.hf import ZeroShardTrainer

VOCAB, SEQ = 101, 16


def rows(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB
    return [{"input_ids": x, "labels": x} for x in ids]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2, help="0: the plain Trainer; 1-3: zeroshard's stages")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default="examples/out/hf_trainer")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    )
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=2,
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=4,
        eval_strategy="steps",
        eval_steps=args.steps // 2,
        save_steps=args.steps // 2,
        save_total_limit=2,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        seed=0,
    )
    if args.stage == 0:
        trainer = Trainer(model=model, args=training, train_dataset=rows(512, 1), eval_dataset=rows(64, 2))
    else:
        trainer = ZeroShardTrainer(
            model=model,
            args=training,
            train_dataset=rows(512, 1),
            eval_dataset=rows(64, 2),
            zeroshard=dict(stage=args.stage),
        )  # the one changed line
    result = trainer.train()
    final = os.path.join(args.out, "final")
    trainer.save_model(final)  # every rank

    if trainer.is_world_process_zero():
        # any machine, one process: the saved folder is an ordinary Hugging Face model
        loaded = AutoModelForCausalLM.from_pretrained(final)
        ids = torch.tensor([rows(1, 3)[0]["input_ids"].tolist()])
        with torch.no_grad():
            loss = loaded(input_ids=ids, labels=ids).loss.item()
        first = trainer.state.log_history[0]["loss"]
        print(
            f"stage {args.stage}: training loss {first:.3f} -> {result.training_loss:.3f} (mean); "
            f"the saved model's loss on a new sequence {loss:.3f}; saved in {final}"
        )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
