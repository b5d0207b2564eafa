"""Fine-tune a Hugging Face Llama-architecture model at ZeRO-3: the large-model recipe.

    torchrun --nproc-per-node 8 examples/llama_zero3.py --model /path/to/llama --ckpt-dir /shared/ckpt
    torchrun --nproc-per-node 2 examples/llama_zero3.py --tiny        # CPU: a tiny Llama saved here first

What a job on many GPUs does, in a few dozen lines (docs/large-models.md):
* the pretrained weights come from a ``save_pretrained`` folder, each rank reading
  only its own shards' bytes (``zeroshard.integrations.hf.from_pretrained``);
* ``FullyShard`` shards every decoder layer (``wrap={LlamaDecoderLayer}``) and
  gathers them in bf16 while the shards and the optimizer stay fp32;
* activation checkpointing (the model's own ``gradient_checkpointing_enable``)
  recomputes each layer in the backward;
* ``zeroshard.resume`` continues from the newest checkpoint, so torchrun's
  ``--max-restarts`` restarts the job where it stopped; a checkpoint is saved in
  the background every ``--ckpt-every`` steps.
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import _device  # examples/_device.py: where the examples run
import zeroshard
from zeroshard.integrations.hf import from_pretrained


def tiny_llama(path: str) -> None:
    """A small random Llama saved as a pretrained folder (what --tiny trains)."""
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
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


def build(path: str):
    """The model, sharded, and its optimizer."""
    # 1. Built on meta, wrapped at every decoder layer, then each rank reads only the bytes of its own
    #    shards from the safetensors files: no rank ever holds the whole model. Units gathered in bf16,
    #    gradients reduced in fp32; the shards and the optimizer state stay fp32.
    model = from_pretrained(
        AutoModelForCausalLM,
        path,
        dtype=torch.float32,
        zeroshard=dict(stage=3, wrap={LlamaDecoderLayer}, mixed_precision="bf16"),
    )
    # 2. Activation checkpointing: the model's own switch, on the model inside the FullyShard.
    model.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.module.config.use_cache = False
    model.train()  # from_pretrained returns it in eval mode, as Hugging Face's does
    return model, zeroshard.ShardedOptimizer(model.parameters(), lr=1e-4, weight_decay=0.0)


def batches(vocab: int, steps: int, batch: int, seq: int):
    """This rank's share of each step's batch (synthetic tokens: put your data loader here)."""
    g = torch.Generator().manual_seed(1234)
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch * world, seq), generator=g)
        yield ids[rank * batch : (rank + 1) * batch]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="a save_pretrained folder (or a hub name with network access)")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="train a tiny Llama saved here first (the default "
        "without --model; it then checks that a fresh process resumes exactly)",
    )
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--ckpt-every", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()
    args.tiny = args.tiny or args.model is None

    device = _device.setup()  # NCCL on cuda:LOCAL_RANK where there is a GPU per rank, else gloo on CPU
    work = zeroshard.all_gather_object(tempfile.mkdtemp() if dist.get_rank() == 0 else None)[0]  # rank 0's
    path = args.model
    if args.tiny:
        path = os.path.join(work, "tiny-llama")
        if dist.get_rank() == 0:
            tiny_llama(path)
        dist.barrier()
    ckpt = args.ckpt_dir or os.path.join(work, "ckpt")

    model, opt = build(path)
    # 3. Continue from the newest checkpoint, if any (torchrun --max-restarts relies on it).
    extra = zeroshard.resume(ckpt, model, opt)
    start = extra["step"] if extra else 0

    pending = None
    vocab = model.config.vocab_size
    for step, ids in enumerate(batches(vocab, args.steps, args.batch, args.seq)):
        if step < start:
            continue
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.ckpt_every == 0:
            if pending is not None:
                pending.result()
            pending = zeroshard.save_checkpoint(ckpt, model, opt, extra={"step": step + 1}, background=True)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    if pending is not None:
        pending.result()
    if args.tiny:  # what a restarted job does: a fresh process resumes exactly where this one saved
        again, again_opt = build(path)
        assert zeroshard.resume(ckpt, again, again_opt)["step"] == args.steps - args.steps % args.ckpt_every
        if args.steps % args.ckpt_every == 0:
            ours, theirs = model.state_dict(), again.state_dict()
            assert all(torch.equal(ours[k], theirs[k]) for k in ours), "the resumed model differs"
    rep = opt.memory_report()
    if dist.get_rank() == 0:
        print(
            f"llama_zero3: {args.steps} steps on {dist.get_world_size()} ranks ({device.type}), last loss "
            f"{loss.item():.4f}; model state on rank 0: {rep['total'] / 2**20:.2f} MiB"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
