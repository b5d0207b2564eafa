"""Generation inside a ZeRO-3 training loop, and the trained weights out to an inference engine.

    torchrun --nproc-per-node 2 examples/generation.py

What an RL post-training loop (generate, score, train) does at ZeRO-3 (docs/generation.md):
* ``model.generate(...)`` on a FullyShard model gathers every unit once for the call,
  not once per generated token, and returns the tokens the unsharded model generates;
* after the update, ``zeroshard.full_tensors`` streams the whole tensors, one unit at a
  time, to whatever loads weights by name (here an unsharded copy of the model, as an
  inference engine's ``load_weights`` would take them).
"""

import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import _device  # examples/_device.py: where the examples run
import zeroshard


def main():
    device = _device.setup()
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = zeroshard.FullyShard(LlamaForCausalLM(cfg), wrap={LlamaDecoderLayer}, device=device)
    opt = zeroshard.ShardedOptimizer(model.parameters(), lr=1e-3, weight_decay=0.0)
    prompts = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1)).to(device)

    for step in range(2):
        # 1. Generate: one gather of every unit for the whole call (greedy here; a sampler
        #    seeded alike on every rank works the same way).
        model.eval()
        began = time.time()  # (the flight record: this rank's last collectives, with their start times)
        completions = model.generate(prompts, max_new_tokens=16, do_sample=False, pad_token_id=0)
        gathers = sum(r["kind"] == "all_gather" and r["start"] >= began for r in zeroshard.flight_record())
        assert gathers == len(model.units), gathers  # per call, not per token
        # 2. Score and train on the completions (a stand-in for a policy-gradient loss).
        model.train()
        loss = model(input_ids=completions, labels=completions).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(
                f"step {step}: {completions.shape[1] - prompts.shape[1]} tokens generated with {gathers} "
                f"all-gathers, loss {loss.item():.4f}"
            )

    # 3. The updated weights, whole, one unit at a time, on rank 0 only (the others take part).
    engine = LlamaForCausalLM(cfg).to(device) if dist.get_rank() == 0 else None
    for name, tensor in zeroshard.full_tensors(model, dtype=torch.float32, to=0):
        with torch.no_grad():  # (an engine's load_weights(iterable) takes them the same way)
            engine.get_parameter(name).copy_(tensor)
    model.eval()
    ours = model.generate(prompts, max_new_tokens=8, do_sample=False, pad_token_id=0)
    if dist.get_rank() == 0:
        theirs = engine.eval().generate(prompts, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(ours, theirs), "the streamed copy generates other tokens"
        print(
            f"generation: {dist.get_world_size()} ranks ({device.type}), the streamed copy generates the "
            "sharded model's tokens"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
