"""Compressed communication at ZeRO-3: quantized weight all-gathers (``MixedPrecision(
gather_dtype="int8" | "fp8")``, [Note: quantized gathers] in csrc/quant.h). Every rank
computes with the weights the reference decodes (each rank's chunk, cut at the parameters'
ends, quantized segment by segment in blocks), in the forward and the backward, and in a
gathered() block, also after a step inside it; the bytes on the wire are the codes and scales
exactly; training follows the unquantized run closely."""

import copy

import pytest
import time

import torch
import torch.distributed as dist

import zeroshard as zs
from support.models import Residual, ResidualNet
from support.quantized import decoded_segments
from zeroshard.native import quant

BLOCK = 32


def _cuts(u, world):
    """Where ``u``'s flat buffer is cut: each rank's chunk bounds, each parameter's ends."""
    bounds = [u.span(r)[0] for r in range(world)] + [u.numel]
    return sorted(set(bounds) | {c for q in u.params for c in (q.offset, q.offset + q.numel)})


def _decoded(model, sd, kind):
    """Each parameter as every rank decodes it: its unit's flat buffer, segment by segment."""
    want = {}
    for u in model.units:
        flat = torch.zeros(u.numel)
        for q in u.params:
            flat[q.offset : q.offset + q.numel] = sd[q.names[0]].flatten()
        dec = decoded_segments(flat, _cuts(u, dist.get_world_size()), BLOCK, kind)
        for q in u.params:
            want[q.names[0]] = dec[q.offset : q.offset + q.numel].view(q.shape)
    return want


def _train(model, steps=4):
    opt = zs.ShardedOptimizer(model.parameters(), lr=3e-2)
    g, losses = torch.Generator().manual_seed(2), []
    for _ in range(steps):
        x, y = torch.randn(12, 11, generator=g), torch.randn(12, 3, generator=g)
        k = 12 // dist.get_world_size()
        mine = slice(dist.get_rank() * k, (dist.get_rank() + 1) * k)
        loss = (model(x[mine]) - y[mine]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _quantized(kind):
    torch.manual_seed(0)
    plain = ResidualNet(2)
    sd = plain.state_dict()
    mp = zs.MixedPrecision(gather_dtype=kind, gather_block_size=BLOCK)
    model = zs.FullyShard(copy.deepcopy(plain), wrap={Residual}, mixed_precision=mp)
    want = _decoded(model, sd, kind)
    with model.gathered(), torch.no_grad():
        got = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    out = {"decoded": sorted(n for n in want if not torch.equal(got[n], want[n]))}
    ref = copy.deepcopy(plain)
    ref.load_state_dict(want)
    x = torch.randn(5, 11, generator=torch.Generator().manual_seed(1))
    start = time.time()  # (the flight record keeps its last records: select by start time)
    loss = model(x).square().sum()
    loss.backward()  # (the backward gathers quantized too: the same weights)
    ref_loss = ref(x).square().sum()
    ref_loss.backward()
    out["forward"] = abs(loss.item() - ref_loss.item())
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    out["grads"] = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
    sent = [r for r in zs.flight_record() if r["start"] >= start and f"all-gather in {kind}" in r["what"]]
    wire = {
        u.name: sum(quant.wire_bytes(b - a, BLOCK) for a, b in zip(c[:-1], c[1:]))
        for u in model.units
        for c in [_cuts(u, dist.get_world_size())]
    }
    # the forward gathers every unit, the backward every unit but the root (kept between them)
    twice = [wire[u.name] for u in model.units] + [wire[u.name] for u in model.units[1:]]
    out["bytes"] = (sorted(4 * r["numel"] for r in sent), sorted(twice))
    # inside a gathered() block a step's new values are gathered again as the forward would
    held = zs.FullyShard(copy.deepcopy(plain), wrap={Residual}, mixed_precision=mp)
    opt = zs.ShardedOptimizer(held.parameters(), lr=1e-2)
    with held.gathered():
        held(x).square().sum().backward()
        opt.step()
        got = {n: p.detach().clone() for n, p in held.module.named_parameters()}
    want = _decoded(held, held.state_dict(), kind)
    out["refreshed"] = sorted(n for n in want if not torch.equal(got[n], want[n]))
    out["stepped"] = not torch.equal(got["head.weight"], _decoded(held, sd, kind)["head.weight"])
    model.zero_grad()
    torch.manual_seed(0)
    out["losses"] = (_train(model), _train(zs.FullyShard(ResidualNet(2), wrap={Residual})))
    return out


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_gathers_compute_with_the_decoded_weights(dist_pool, kind):
    """Uneven chunks at 3 ranks (a chunk's last block short): the gathered weights are bit for
    bit the reference's decoding; the loss and every gradient equal one process's on those
    weights; each unit's forward and backward all-gathers move exactly its chunks' wire
    records; four steps of training stay within 2% of the unquantized run's losses."""
    for r in dist_pool.run(_quantized, kind):
        assert r["decoded"] == [] and r["refreshed"] == [] and r["stepped"], r
        assert r["forward"] <= 1e-5 and r["grads"] <= 1e-6, r
        assert r["bytes"][0] == r["bytes"][1], r["bytes"]
        ours, full = r["losses"]
        assert max(abs(a - b) / b for a, b in zip(ours, full)) < 0.02, r["losses"]


def _deepspeed_qwz():
    """A DeepSpeed config's ZeRO++ qwZ and hpZ through zeroshard.initialize."""
    torch.manual_seed(0)
    world = dist.get_world_size()
    zero = {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": world}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": zero}
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, *_ = zs.initialize(model=ResidualNet(2), config=config)
    start = time.time()  # (the flight record keeps its last records: select by start time)
    loss = engine(torch.randn(2, 11)).square().mean()
    engine.backward(loss)
    engine.step()
    units = [r["what"] for r in zs.flight_record() if r["start"] >= start and r["kind"] == "all_gather"]
    return sum("all-gather in int8" in w for w in units), len(units)


def test_a_deepspeed_configs_quantized_weights_gather_in_int8(dist_pool):
    for int8, gathers in dist_pool.run(_deepspeed_qwz):
        assert int8 == gathers >= 1, (int8, gathers)  # (every unit's weight all-gather)
