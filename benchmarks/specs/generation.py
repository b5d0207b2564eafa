"""Generation at ZeRO-3 against the unsharded model, in one run (docs/generation.md).

    python -m benchmarks generation [--tokens 64] [--layers 4] [--dim 256] [--rounds 5]

Two gloo ranks on this machine. Each rank holds an unsharded copy of a Llama-shaped
model and the same model under FullyShard (one unit per decoder layer); every
round times, in turn, ``generate`` of ``--tokens`` new tokens (greedy, batch 4,
KV cache) on the unsharded copy, on the FullyShard model (one gather per call,
the default) and on the FullyShard model with ``generate_gathered = False`` (a
gather of every unit for every token). Printed: the median time of each over the
rounds and its ratio to the unsharded model's, the all-gathers each call issued
(from the flight record), whether the tokens equal the unsharded model's, and the
bytes held gathered during the call against the model's parameters counted in
the gather dtype. Writes benchmarks/out/generation.json.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.harness import opt, spawn


def _worker(rank: int, world: int, port: int, out, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import zeroshard as zs
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=args.dim,
        intermediate_size=4 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.tokens + 32,
    )
    torch.manual_seed(0)
    plain = LlamaForCausalLM(cfg).eval()
    torch.manual_seed(0)
    model = zs.FullyShard(LlamaForCausalLM(cfg).eval(), wrap={LlamaDecoderLayer})
    prompt = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    ref = plain.generate(prompt, **kw)

    def sharded(gathered: bool):
        model.generate_gathered = gathered
        return model.generate(prompt, **kw)

    variants = {
        "unsharded": lambda: plain.generate(prompt, **kw),
        "zero3": lambda: sharded(True),
        "zero3 per token": lambda: sharded(False),
    }
    times = {k: [] for k in variants}
    gathers, same = {}, {}
    for r in range(args.rounds + 1):  # the first round warms up
        for name, fn in variants.items():
            dist.barrier()
            t0 = time.time()
            t = time.perf_counter()
            tokens = fn()
            dt = time.perf_counter() - t
            if r:
                times[name].append(dt)
            gathers[name] = sum(rec["kind"] == "all_gather" and rec["start"] >= t0 for rec in zs.flight_record())
            same[name] = bool(torch.equal(tokens, ref))
    model.memory_report(reset_peak=True)
    sharded(True)
    rep = model.memory_report()
    dtype_bytes = model.param_dtype.itemsize
    params = sum(p.numel() for p in plain.parameters())
    if rank == 0:
        out.put(
            dict(
                world=world,
                tokens=args.tokens,
                layers=args.layers,
                dim=args.dim,
                params=params,
                units=len(model.units),
                rounds=args.rounds,
                ms={k: 1e3 * statistics.median(v) for k, v in times.items()},
                all_gathers=gathers,
                same_tokens=same,
                gathered_bytes=rep["gathered_peak"] + rep["root_gathered"],
                model_bytes_in_gather_dtype=params * dtype_bytes,
            )
        )
    dist.destroy_process_group()


OPTIONS = [
    opt("--tokens", type=int, default=64),
    opt("--layers", type=int, default=4),
    opt("--dim", type=int, default=256),
    opt("--rounds", type=int, default=5),
]


def run(args):
    res = spawn(_worker, 2, args)
    base = res["ms"]["unsharded"]
    print(
        f"{res['params'] / 1e6:.2f}M parameters, {res['units']} units, {res['tokens']} new tokens, batch 4, "
        f"{res['world']} ranks, median of {res['rounds']} rounds"
    )
    print("| generate | ms | vs unsharded | all-gathers per call | tokens equal |")
    print("|---|---:|---:|---:|---|")
    for name, ms in res["ms"].items():
        print(f"| {name} | {ms:.1f} | {ms / base:.2f}x | {res['all_gathers'][name]} | {res['same_tokens'][name]} |")
    print(
        f"held gathered during the call: {res['gathered_bytes']} bytes; the model's parameters in the gather "
        f"dtype: {res['model_bytes_in_gather_dtype']} bytes"
    )
    return res
