"""Loading a published model into a ZeRO-3 run: each rank's peak host memory, and the time.

    python -m benchmarks pretrained_load [--worlds 2 4] [--layers 16] [--hidden 1280] [--files bf16 fp32]

A Llama-architecture model (501M parameters with the defaults: 2.0 GB in fp32) is
saved with ``save_pretrained`` (files of at most 300 MB) in bf16, as models are
published (1.0 GB of files), and in fp32; it is trained in fp32. Each way of loading it
then runs in its own torchrun launch, so that each rank's peak resident memory is
its own, and each ends with one forward of a batch of 2 x 128 tokens:

  from_pretrained   every rank: ``AutoModelForCausalLM.from_pretrained``, then
                    ``FullyShard`` keeps its shard (what a ZeRO-3 script did before
                    ``zeroshard.integrations.hf.from_pretrained``)
  rank-0 broadcast  the model built on meta and wrapped; rank 0 reads the files whole
                    (safetensors ``load_file``) and broadcasts one tensor at a time; every
                    rank keeps its pieces (Accelerate's ``cpu_ram_efficient_loading``)
  zeroshard         ``zeroshard.integrations.hf.from_pretrained(..., zeroshard=dict(stage=3))``:
                    each rank reads only its own shards' bytes

"growth": a rank's peak resident set (``ru_maxrss``) minus its resident set just
before loading (after the imports and the process group), the largest over the
ranks, in MB and as a multiple of the model's fp32 size, after loading ("load") and
after the forward ("+ forward"); "load s": the slowest rank's
time to a loaded model. "bound" is what zeroshard's growth is checked against: the
rank's fp32 shard + the loader's read buffer (64 MB) + a fixed margin of the root
unit's full fp32 size (embeddings and head: initialised whole on meta before the
weights are read) + 200 MB (the forward's activations and one gathered unit, the
allocator's slack). Writes benchmarks/out/pretrained_load.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import tempfile
import time
from datetime import date

from benchmarks.harness import git_commit, machine_info, opt, run_env, torchrun, write_json

METHODS = ("from_pretrained", "rank-0 broadcast", "zeroshard")
READ_BUFFER = 64 << 20
MARGIN = 200 << 20


def config(layers: int, hidden: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def save(folder: str, layers: int, hidden: int, dtype: str) -> int:
    """The model saved with its weights in ``dtype``; returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(layers, hidden)).to(getattr(torch, dtype))
    model.save_pretrained(folder, max_shard_size="300MB")
    return sum(p.numel() for p in model.parameters())


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load(method: str, folder: str):
    import safetensors.torch
    import torch
    import torch.distributed as dist
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import zeroshard
    from zeroshard.integrations.hf import from_pretrained

    if method == "zeroshard":
        return from_pretrained(
            AutoModelForCausalLM, folder, dtype=torch.float32, zeroshard=dict(stage=3, wrap={LlamaDecoderLayer})
        )
    if method == "from_pretrained":
        return zeroshard.FullyShard(
            AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), wrap={LlamaDecoderLayer}
        )
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    fs = zeroshard.FullyShard(model, wrap={LlamaDecoderLayer})
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    whole = {}
    if dist.get_rank() == 0:
        for file in sorted(set(weight_map.values())):
            whole.update(safetensors.torch.load_file(os.path.join(folder, file)))
    shapes = zeroshard.all_gather_object({k: (tuple(v.shape), v.dtype) for k, v in whole.items()})[0]
    for name in sorted(weight_map):
        t = whole.pop(name) if dist.get_rank() == 0 else torch.empty(shapes[name][0], dtype=shapes[name][1])
        dist.broadcast(t, 0)
        fs.load_state_dict({name: t}, strict=False)
    return fs


def child(method: str, folder: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo")
    # every import load() makes, before the baseline
    import accelerate  # noqa: F401
    import safetensors.torch  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: F401

    import zeroshard.integrations.hf  # noqa: F401

    before = rss()
    t0 = time.perf_counter()
    model = load(method, folder)
    dist.barrier()
    seconds = time.perf_counter() - t0
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ids = torch.randint(0, 32000, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shard = sum(u.shard.numel() * 4 for u in model.units)
    root = model.units[0].numel * 4
    rows = zeroshard.all_gather_object(
        dict(growth=peak - before, load_growth=loaded - before, seconds=seconds, shard=shard, root=root)
    )
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


OPTIONS = [
    opt("--worlds", type=int, nargs="+", default=[2, 4]),
    opt("--layers", type=int, default=16),
    opt("--hidden", type=int, default=1280),
    opt("--files", nargs="+", default=["bf16", "fp32"], help="the saved weights' dtypes"),
    opt("--child", nargs=3, help=argparse.SUPPRESS),
]


def run(args):
    if args.child:
        child(*args.child)
        return 0
    work = tempfile.mkdtemp()
    results = []
    for files in args.files:
        folder = os.path.join(work, f"model-{files}")
        params = save(folder, args.layers, args.hidden, {"bf16": "bfloat16", "fp32": "float32"}[files])
        size = 4 * params
        for world in args.worlds:
            for method in METHODS:
                results.append(measure(method, world, folder, work, size))
                results[-1]["files"] = files
    record = dict(
        date=str(date.today()),
        commit=git_commit(),
        machine=machine_info("cpu"),
        params=params,
        model_mb=size / 2**20,
        rows=results,
    )
    ok = all(r["growth_mb"] <= r["bound_mb"] for r in results if r["method"] == "zeroshard")
    print(f"model {size / 2**20:.0f} MB fp32; zeroshard within its bound everywhere: {ok}")
    write_json(args.json, record)
    return 0 if ok else 1


def measure(method: str, world: int, folder: str, work: str, size: int) -> dict:
    """One torchrun launch of ``method`` at ``world`` ranks: its row."""
    out = os.path.join(work, f"{method}-{world}.json".replace(" ", "_"))
    subprocess.run(
        torchrun(world, "pretrained_load", "--child", method, folder, out),
        check=True,
        env=run_env(OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with open(out) as f:
        ranks = json.load(f)
    r = dict(
        world=world,
        method=method,
        growth_mb=max(x["growth"] for x in ranks) / 2**20,
        load_growth_mb=max(x["load_growth"] for x in ranks) / 2**20,
        seconds=max(x["seconds"] for x in ranks),
        shard_mb=max(x["shard"] for x in ranks) / 2**20,
        bound_mb=max(x["shard"] + READ_BUFFER + x["root"] + MARGIN for x in ranks) / 2**20,
    )
    r["growth_x"] = r["growth_mb"] * 2**20 / size
    print(
        f"{os.path.basename(folder)} world {world} {method:17s} growth: load {r['load_growth_mb']:6.0f} MB, "
        f"+ forward {r['growth_mb']:6.0f} MB ({r['growth_x']:.2f}x the model); load {r['seconds']:5.1f} s; "
        f"shard {r['shard_mb']:5.0f} MB, bound {r['bound_mb']:5.0f} MB",
        flush=True,
    )
    return r
