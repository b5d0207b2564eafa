"""zeroshard.load_pretrained on plain PyTorch models: a FullyShard of a model built on meta and a
plain model for stages 1/2, from safetensors files (three of them, bf16 or fp32) with awkward
tensor sizes, at world sizes 2 and 3; against the model the files hold, exactly."""

import os

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard as zs
from support.launch import launch


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin, self.norm = nn.Linear(d, d), nn.LayerNorm(d)
        self.register_buffer("scale", torch.ones(d))  # persistent: in the files
        self.register_buffer("freqs", torch.arange(d) / d, persistent=False)  # in no file

    def forward(self, x):
        return self.norm(torch.tanh(self.lin(x)) * self.scale + self.freqs)

    def reset_parameters(self):  # FullyShard runs it on meta: the buffer in no file is set here
        self.freqs.copy_(torch.arange(self.freqs.numel()) / self.freqs.numel())


class Net(nn.Module):
    def __init__(self, d=13):
        super().__init__()
        self.emb = nn.Embedding(37, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(3)])
        self.head = nn.Linear(d, 37, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter, in the files once

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _reference(dtype):
    """The model the files hold (its floating tensors rounded to ``dtype``), and its state dict as saved."""
    torch.manual_seed(3)
    ref = Net()
    with torch.no_grad():
        for b in ref.blocks:
            b.scale.uniform_(0.5, 1.5)
        for t in list(ref.parameters()) + [b.scale for b in ref.blocks]:
            t.copy_(t.to(dtype))
    sd = {k: v.to(dtype) for k, v in ref.state_dict().items() if k != "head.weight"}
    return ref, sd


def _save(folder, sd, extra=None):
    keys = sorted(sd)
    for i in range(3):  # three files, as save_pretrained splits a model
        part = {k: sd[k].contiguous() for k in keys[i::3]}
        if i == 2 and extra:
            part.update(extra)
        safetensors.torch.save_file(part, os.path.join(folder, f"model-{i}.safetensors"))


def _loads(folder, dtype, stage):
    ref, sd = _reference(dtype)
    if dist.get_rank() == 0:
        _save(folder, sd)
    dist.barrier()
    with torch.device("meta"):
        model = Net()
    runner = zs.FullyShard(model, wrap={Block}) if stage == 3 else model
    result = zs.load_pretrained(runner, folder, device="cpu" if stage != 3 else None)
    ids = torch.arange(30).view(3, 10) % 37
    with torch.no_grad():
        same = torch.equal(runner(ids), ref(ids))
    if stage == 3:
        tied = True
    else:
        tied = model.head.weight is model.emb.weight
        opt = zs.ShardedOptimizer(model.parameters(), lr=0.1, stage=stage)  # built after loading: its masters
        model(ids).square().mean().backward()  # hold the loaded values
        opt.step()
    return dict(same=same, missing=result.missing_keys, unexpected=result.unexpected_keys, tied=tied)


@pytest.mark.parametrize("world", [2, 3])
def test_loads_exactly_into_shards_and_full_models(world, tmp_path):
    pool = launch("pool", world)
    for dtype, stage in ((torch.float32, 3), (torch.bfloat16, 3), (torch.float32, 2)):
        folder = tmp_path / f"{str(dtype)[6:]}-{stage}"
        folder.mkdir()
        for r in pool.run(_loads, str(folder), dtype, stage):
            assert r == dict(same=True, missing=[], unexpected=[], tied=True), (dtype, stage, r)


def _refusals(folder):
    _, sd = _reference(torch.float32)
    with torch.device("meta"):
        model = Net()
    model, out = zs.FullyShard(model, wrap={Block}), {}
    if dist.get_rank() == 0:
        _save(folder, {k: v for k, v in sd.items() if k != "blocks.1.lin.bias"}, extra={"old.rotary": torch.ones(3)})
    dist.barrier()
    for name, kw in (("strict", {}), ("lenient", dict(strict=False))):
        try:
            res = zs.load_pretrained(model, folder, **kw)
            out[name] = (res.missing_keys, res.unexpected_keys)
        except RuntimeError as e:
            out[name] = str(e)
    dist.barrier()
    if dist.get_rank() == 0:
        _save(folder, dict(sd, **{"blocks.0.lin.weight": torch.zeros(13, 12)}))
    dist.barrier()
    try:
        zs.load_pretrained(model, folder)
    except RuntimeError as e:
        out["size"] = str(e)
    return out


def test_missing_unexpected_and_mismatched_keys_are_named(tmp_path):
    for r in launch("pool", 2).run(_refusals, str(tmp_path)):
        assert "missing key(s) ['blocks.1.lin.bias']" in r["strict"] and "['old.rotary']" in r["strict"], r
        assert "strict=False" in r["strict"]
        assert r["lenient"] == (["blocks.1.lin.bias"], ["old.rotary"]), r
        assert "size mismatch for blocks.0.lin.weight" in r["size"] and "[13, 12]" in r["size"], r
