"""Fine-tune a pretrained model at ZeRO-3 with the Hugging Face Trainer: LoRA and full fine-tuning.

    torchrun --nproc-per-node 2 examples/finetune.py                       # a tiny Llama saved here first
    torchrun --nproc-per-node 8 examples/finetune.py --model /path/to/llama

What it does (docs/fine-tuning.md):
* ``from_pretrained`` builds the model on meta, shards it and has every rank read only
  its own bytes of the ``save_pretrained`` files: no rank holds the whole model;
* LoRA: ``peft_config=`` adds the adapter before sharding; only the adapter trains,
  and ``save_model`` writes what ``PeftModel.from_pretrained`` loads;
* full fine-tuning: the same load, every parameter trained, ``save_model`` writes
  what ``AutoModelForCausalLM.from_pretrained`` loads;
* ``bf16=True`` gathers the units in bf16 (where the hardware has it), as FSDP does.
Each result is loaded back in one process and checked against the trained model.
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

import _device  # examples/_device.py: where the examples run
import zeroshard
from zeroshard.integrations.hf import ZeroShardTrainer, from_pretrained

OPTIONS = dict(stage=3)


def tiny_llama(path: str) -> None:
    """A small random Llama saved as a pretrained folder in several safetensors files."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path, max_shard_size="100KB")


def dataset(vocab: int, n: int = 64, seq: int = 24):
    """Sequences counting up from a random start: a pattern the model can learn."""
    g = torch.Generator().manual_seed(1)
    ids = (torch.randint(0, vocab, (n, 1), generator=g) + torch.arange(seq)) % vocab
    return [{"input_ids": x, "labels": x} for x in ids]


def train(model, out: str, steps: int, device: torch.device, options: dict) -> ZeroShardTrainer:
    """The Trainer over the loaded model, with the options it was loaded with."""
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        max_steps=steps,
        learning_rate=2e-3,
        logging_steps=steps,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=device.type == "cpu",
        bf16="mixed_precision" in options,
        gradient_checkpointing=True,
    )
    trainer = ZeroShardTrainer(
        model=model, args=args, train_dataset=dataset(model.module.config.vocab_size), zeroshard=options
    )
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))  # every rank: collective at stage 3
    return trainer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="a save_pretrained folder (default: a tiny Llama saved here first)")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    device = _device.setup()
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    options = dict(OPTIONS, mixed_precision="bf16") if bf16 else OPTIONS
    work = zeroshard.all_gather_object(tempfile.mkdtemp() if dist.get_rank() == 0 else None)[0]  # rank 0's
    path = args.model
    if path is None:
        path = os.path.join(work, "tiny-llama")
        if dist.get_rank() == 0:
            tiny_llama(path)
        dist.barrier()
    ids = torch.arange(16).view(2, 8)

    # LoRA: the adapter made before sharding (seed first: peft initialises it), the base frozen
    torch.manual_seed(0)
    lora = from_pretrained(
        AutoModelForCausalLM,
        path,
        zeroshard=options,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    )
    t = train(lora, os.path.join(work, "lora"), args.steps, device, options)
    with torch.no_grad():
        lora_logits = t.zeroshard_model(input_ids=ids.to(device)).logits.float().cpu()
    trained = sum(p.numel() for p in lora.parameters() if p.requires_grad)

    # full fine-tuning from the same weights
    full = from_pretrained(AutoModelForCausalLM, path, zeroshard=options)
    t = train(full, os.path.join(work, "full"), args.steps, device, options)
    with torch.no_grad():
        full_logits = t.zeroshard_model(input_ids=ids.to(device)).logits.float().cpu()

    if dist.get_rank() == 0:  # what a user does next, in one process: load what was saved
        base = AutoModelForCausalLM.from_pretrained(path)
        adapter = PeftModel.from_pretrained(base, os.path.join(work, "lora", "final"))
        reloaded = AutoModelForCausalLM.from_pretrained(os.path.join(work, "full", "final"))
        with torch.no_grad():
            got_lora, got_full = adapter(input_ids=ids).logits, reloaded(input_ids=ids).logits
        tol = 5e-2 if bf16 else 1e-5  # bf16 gathers: the trained runs computed in bf16
        assert (got_lora - lora_logits).abs().max() <= tol, "the saved adapter differs from the trained one"
        assert (got_full - full_logits).abs().max() <= tol, "the saved model differs from the trained one"
        print(
            f"finetune: LoRA trained {trained} parameters and full fine-tuning every one, at ZeRO-3 on "
            f"{dist.get_world_size()} ranks ({device.type}); both saved and loaded back"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
