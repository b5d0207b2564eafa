"""What an FSDP2 script ported to FullyShard relies on and would otherwise get different
without a word: ``set_gradient_divide_factor`` (torchtitan sums the gradients
and normalises by global tokens), against FSDP2 on gloo at 2 and 3 ranks and hybrid
sharding at 4; and FSDP2's initialisation idiom (build on meta, wrap, ``to_empty``, the
model's own ``init_weights()``), against the same model initialised in one process."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard as zs
from conftest import get_pool

D = 13          # no unit divides evenly over 2, 3 or 4 ranks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def _batches(steps, n=12):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(n, D, generator=g) for _ in range(steps)]


def _mine(x):
    k = x.shape[0] // dist.get_world_size()
    return x[dist.get_rank() * k:(dist.get_rank() + 1) * k]


def _train(model, opt, steps=3):
    """Loss, backward, torch's clip_grad_norm_ (clipping the summed gradients, not the mean), step: the norms."""
    norms = []
    for x in _batches(steps):
        model(_mine(x)).square().mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad()
    return norms


def _ours(factor, shard_size):
    torch.manual_seed(0)
    model = zs.FullyShard(Net(), wrap={Block}, shard_size=shard_size)
    if factor is not None:
        model.set_gradient_divide_factor(factor)
    opt = zs.ShardedOptimizer(model.parameters(), lr=0.1, optimizer_class=torch.optim.SGD)
    return _train(model, opt), model.state_dict()


def _fsdp2(factor, shard_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard")) \
        if shard_size else init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    net = Net()
    for b in net.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(net, mesh=mesh)
    for m in net.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)      # gloo: no AVG, no PREMUL_SUM
            if factor is not None:
                m.set_gradient_divide_factor(factor)
    norms = _train(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return norms, {k: v.full_tensor() for k, v in net.state_dict().items()}


def _divide_factors(shard_size=None):
    out = {}
    for factor in (None, 1.0, 5.0):
        (norms, sd), (ref_norms, ref_sd) = _ours(factor, shard_size), _fsdp2(factor, shard_size)
        out[factor] = dict(norms=norms, ref_norms=ref_norms,
                           err=max((sd[k] - v).abs().max().item() for k, v in ref_sd.items()))
    out["refused"] = _bad_factors()
    return out


@pytest.mark.parametrize("world,shard_size", [(2, None), (3, None), (4, 2)], ids=["world2", "world3", "world4-hsdp2"])
def test_gradient_divide_factor_equals_fsdp2s(world, shard_size):
    """FullyShard had no set_gradient_divide_factor: a torchtitan script ported without it
    got gradients and grad norms N times smaller. With factor F the gradient is the sum over
    every rank (replicas too) over F, as FSDP2's: the parameters after steps (clipped or not) and
    torch's clip_grad_norm_ equal FSDP2's."""
    for r in get_pool(world).run(_divide_factors, shard_size):
        said = r.pop("refused")          # (not a factor: 0, -1, inf, "2", True)
        assert len(said) == 5 and all("positive, finite number" in s for s in said), said
        for factor, got in r.items():
            assert got["err"] < 1e-6, (factor, got)
            for n, ref in zip(got["norms"], got["ref_norms"]):
                assert abs(n - ref) <= 1e-5 * ref, (factor, got)
        # the factor matters: the first step's gradient is the mean times world / F
        mean = r[None]["norms"][0]
        assert math.isclose(r[1.0]["norms"][0], world * mean, rel_tol=1e-5)
        assert math.isclose(r[5.0]["norms"][0], world * mean / 5.0, rel_tol=1e-5)


def _bad_factors():
    model = zs.FullyShard(Net())
    said = []
    for bad in (0, -1.0, float("inf"), "2", True):
        try:
            model.set_gradient_divide_factor(bad)
        except ValueError as e:
            said.append(str(e))
    return said

