"""The Offload and Sharding policies against the loose keyword arguments they replace: the
same run bit for bit, the loose form warning once per call naming the policy, the policy
form silent; both forms together refused ([Note: options as policies])."""

import warnings

import torch
import torch.distributed as dist

import zeroshard as zs
from zeroshard.core.regions import LOCATIONS, PERSISTENT
from support.models import Residual, ResidualNet


def _train(make_opt, wrap: bool):
    torch.manual_seed(0)
    model = ResidualNet(layers=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = make_opt(model)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(3):
        model(torch.randn(5, 11, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    params = model.state_dict(to=None) if wrap else {k: v.clone() for k, v in model.state_dict().items()}
    report = {k: v for k, v in opt.memory_report().items() if k in PERSISTENT + LOCATIONS}  # (not the transient peaks)
    return params, [(str(w.message), w.filename) for w in caught if w.category is FutureWarning], report


def _both_forms():
    pol, loose = (
        lambda m: (
            m,
            zs.ShardedOptimizer(
                m.parameters(),
                lr=1e-2,
                stage=2,
                sharding=zs.Sharding(shard_size=1),
                offload=zs.Offload(optimizer="cpu", fraction=0.5),
            ),
        ),
        lambda m: (
            m,
            zs.ShardedOptimizer(m.parameters(), lr=1e-2, stage=2, shard_size=1, offload="cpu", offload_fraction=0.5),
        ),
    )

    def wrapped(**kw):
        def make(m):
            fs = zs.FullyShard(m, wrap={Residual}, **kw)
            return fs, zs.ShardedOptimizer(fs.parameters(), lr=1e-2)

        return make

    out = {
        "zero2": (_train(pol, False), _train(loose, False)),
        "zero3": (
            _train(wrapped(sharding=zs.Sharding(shard_size=1), offload=zs.Offload(params="cpu")), True),
            _train(wrapped(shard_size=1, offload_params=True), True),
        ),
    }
    refused = {}
    model = ResidualNet()
    for key, call in {
        "sharding and shard_size": lambda: zs.ShardedOptimizer(
            model.parameters(), sharding=zs.Sharding(), shard_size=1
        ),
        "offload policy and offload_dir": lambda: zs.ShardedOptimizer(
            model.parameters(), offload=zs.Offload(optimizer="cpu"), offload_dir="/tmp"
        ),
        "params on the optimizer": lambda: zs.ShardedOptimizer(model.parameters(), offload=zs.Offload(params="cpu")),
        "optimizer on FullyShard": lambda: zs.FullyShard(ResidualNet(), offload=zs.Offload(optimizer="cpu")),
    }.items():
        try:
            call()
            refused[key] = None
        except (ValueError, TypeError) as e:
            refused[key] = str(e)
    return out, refused


def test_policies_equal_the_loose_arguments_which_warn_naming_them(dist_pool):
    for out, refused in dist_pool.run(_both_forms):
        for stage, ((p_params, p_warned, p_report), (l_params, l_warned, l_report)) in out.items():
            assert p_params.keys() == l_params.keys()
            for k in p_params:
                assert torch.equal(p_params[k], l_params[k]), (stage, k)
            assert p_report == l_report and p_report["host"] > 0, (stage, p_report, l_report)
            assert p_warned == [], (stage, p_warned)
            assert all(f.endswith("test_policies.py") for _, f in l_warned), l_warned  # (the user's line)
            messages = " | ".join(m for m, _ in l_warned)
            assert "zeroshard.Sharding(shard_size=...)" in messages, messages
            want = "zeroshard.Offload(params='cpu')" if stage == "zero3" else "zeroshard.Offload(optimizer='cpu'"
            assert want in messages and len(l_warned) == 2, messages
        assert "shard_size inside sharding=zeroshard.Sharding" in refused["sharding and shard_size"]
        assert "offload_dir inside offload=zeroshard.Offload" in refused["offload policy and offload_dir"]
        assert "is FullyShard's" in refused["params on the optimizer"]
        assert "pass it to ShardedOptimizer(offload=...)" in refused["optimizer on FullyShard"]
