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
from support.launch import launch
from support.models import Residual
from support.titan import Layer, Titan, initialised

D = 13  # no unit divides evenly over 2, 3 or 4 ranks


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.Sequential(Residual(D), Residual(D))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def _batches(steps, n=12):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(n, D, generator=g) for _ in range(steps)]


def _mine(x):
    k = x.shape[0] // dist.get_world_size()
    return x[dist.get_rank() * k : (dist.get_rank() + 1) * k]


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
    model = zs.FullyShard(Net(), wrap={Residual}, shard_size=shard_size)
    if factor is not None:
        model.set_gradient_divide_factor(factor)
    opt = zs.ShardedOptimizer(model.parameters(), lr=0.1, optimizer_class=torch.optim.SGD)
    return _train(model, opt), model.state_dict()


def _fsdp2(factor, shard_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    world = dist.get_world_size()
    mesh = (
        init_device_mesh("cpu", (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))
        if shard_size
        else init_device_mesh("cpu", (world,))
    )
    torch.manual_seed(0)
    net = Net()
    for b in net.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(net, mesh=mesh)
    for m in net.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # gloo: no AVG, no PREMUL_SUM
            if factor is not None:
                m.set_gradient_divide_factor(factor)
    norms = _train(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return norms, {k: v.full_tensor() for k, v in net.state_dict().items()}


def _divide_factors(shard_size=None):
    out = {}
    for factor in (None, 1.0, 5.0):
        (norms, sd), (ref_norms, ref_sd) = _ours(factor, shard_size), _fsdp2(factor, shard_size)
        out[factor] = dict(
            norms=norms, ref_norms=ref_norms, err=max((sd[k] - v).abs().max().item() for k, v in ref_sd.items())
        )
    out["refused"] = _bad_factors()
    return out


@pytest.mark.parametrize("world,shard_size", [(2, None), (3, None), (4, 2)], ids=["world2", "world3", "world4-hsdp2"])
def test_gradient_divide_factor_equals_fsdp2s(world, shard_size):
    """FullyShard had no set_gradient_divide_factor: a torchtitan script ported without it
    got gradients and grad norms N times smaller. With factor F the gradient is the sum over
    every rank (replicas too) over F, as FSDP2's: the parameters after steps (clipped or not) and
    torch's clip_grad_norm_ equal FSDP2's."""
    for r in launch("pool", world).run(_divide_factors, shard_size):
        said = r.pop("refused")  # (not a factor: 0, -1, inf, "2", True)
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


# ------------------------------------------------------------- initialisation
def _titan_on_meta(fully_shard):
    with torch.device("meta"):
        model = Titan()
    return fully_shard(model)


def _fsdp2_initialised():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def wrap(m):
        for layer in m.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(m, mesh=mesh)

    net = _titan_on_meta(wrap)
    net.to_empty(device="cpu")
    torch.manual_seed(1)
    net.init_weights()
    return {k: v.full_tensor() for k, v in net.state_dict().items()}


def _warnings(fn):
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in seen if "own initialisation" in str(w.message)]


def _initialise():
    out = {}
    want = initialised().state_dict()
    # FSDP2's idiom: on meta, wrap, to_empty, the model's init_weights()
    model = _titan_on_meta(lambda m: zs.FullyShard(m, wrap={Layer}))
    before = model.emb.weight.to_local().clone(), model.freqs.clone()
    model.to_empty(device="cpu")
    out["to_empty_kept"] = torch.equal(model.emb.weight.to_local(), before[0]) and torch.equal(model.freqs, before[1])
    torch.manual_seed(1)
    model.init_weights()
    got = model.state_dict()
    out["differ"] = [k for k in want if not torch.equal(got[k], want[k])]
    out["std"] = {k: got[k].std().item() for k in ("layers.0.attn.wqkv.weight", "out.weight")}
    ref2 = _fsdp2_initialised()
    out["fsdp2_std"] = {k: ref2[k].std().item() for k in out["std"]}
    x = torch.tensor([[1, 2, 3]])
    out["warned_after_init"] = _warnings(lambda: model(x))
    with torch.no_grad():  # elementwise on the pieces (no whole value kept)
        model.layers[1].ff.weight.mul_(2.0)
    out["doubled"] = torch.equal(model.state_dict()["layers.1.ff.weight"], 2 * want["layers.1.ff.weight"])
    # what needs a parameter whole is refused naming its module and the way
    wo = model.layers[0].attn.wo.weight
    try:
        nn.init.orthogonal_(wo)
    except RuntimeError as e:
        out["orthogonal"] = str(e)
    torch.manual_seed(2)
    w = nn.init.orthogonal_(torch.empty(wo.shape))
    with torch.no_grad():
        wo.copy_(w)  # (the way it names)
    out["copied"] = torch.equal(model.state_dict()["layers.0.attn.wo.weight"], w)
    try:
        model.to_empty(device="meta")
    except ValueError as e:
        out["to_empty_elsewhere"] = str(e)
    # wrapped on meta, its own initialisation never run: a warning at the first forward
    lost = _titan_on_meta(lambda m: zs.FullyShard(m, wrap={Layer}))
    out["warned_lost"] = _warnings(lambda: lost(x))
    loaded = _titan_on_meta(lambda m: zs.FullyShard(m, wrap={Layer}))
    loaded.load_state_dict(want)
    out["warned_loaded"] = _warnings(lambda: loaded(x))
    # a seed per rank would give each piece its own stream: refused
    torch.manual_seed(dist.get_rank())
    try:
        _titan_on_meta(lambda m: zs.FullyShard(m, wrap={Layer})).init_weights()
    except RuntimeError as e:
        out["seeds"] = str(e)
    return out


def test_fsdp2s_initialisation_idiom_gives_one_process_values_at_any_world_size(dist_pool):
    """Wrapping on meta ran only reset_parameters(): torchtitan's init_weights() was replaced
    by torch's defaults without a word, to_empty() emptied the buffers and nn.init's
    trunc_normal_ on a sharded parameter raised. Now to_empty() keeps shards and buffers, the
    model's init_weights() after wrapping gives exactly the values it gives in one process
    with the same seed (so the same at 2 and 3 ranks; trunc_normal_'s std 0.02, as FSDP2's), a
    model whose own initialisation never ran warns at its first forward, and what needs a
    parameter whole is refused naming its module and the way."""
    for r in dist_pool.run(_initialise):
        assert r["to_empty_kept"] and r["differ"] == [] and r["doubled"] and r["copied"], r
        # trunc_normal_(std=0.02) at +-2 std has std 0.02 x 0.8796 (a normal's cut at 2 sigma)
        for k, want in (("layers.0.attn.wqkv.weight", 0.02), ("out.weight", 0.02 * 0.8796)):
            assert abs(r["std"][k] - want) < 0.1 * want and abs(r["fsdp2_std"][k] - want) < 0.1 * want, r
        assert "module 'layers.0.attn.wo'" in r["orthogonal"] and "p.copy_(w)" in r["orthogonal"], r["orthogonal"]
        assert "device=meta to FullyShard" in r["to_empty_elsewhere"], r
        assert len(r["warned_lost"]) == 1 and "Titan.init_weights" in r["warned_lost"][0], r["warned_lost"]
        assert r["warned_after_init"] == [] and r["warned_loaded"] == [], r
        assert "random generators differ" in r["seeds"] and "torch.manual_seed(seed) on every rank" in r["seeds"], r


# ------------------------------------------------------------ state-dict hooks
class FusedQKV(nn.Module):
    """torchtitan's fused linear: one weight in the model, three in its state dict (a
    post-hook splits it, a load pre-hook fuses it back); a pre-hook counts the saves."""

    def __init__(self):
        super().__init__()
        self.wqkv = nn.Linear(D, 3 * D, bias=False)
        self.saves = 0
        self.register_state_dict_pre_hook(lambda m, prefix, keep_vars: setattr(m, "saves", m.saves + 1))
        self._register_state_dict_hook(FusedQKV._split)
        self._register_load_state_dict_pre_hook(FusedQKV._fuse)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata):
        w = state_dict.pop(prefix + "wqkv.weight")
        for name, part in zip("qkv", w.chunk(3)):
            state_dict[f"{prefix}w{name}"] = part
        return state_dict

    @staticmethod
    def _fuse(state_dict, prefix, *args):
        if prefix + "wq" in state_dict:
            state_dict[prefix + "wqkv.weight"] = torch.cat([state_dict.pop(prefix + "w" + n) for n in "qkv"])

    def forward(self, x):
        return self.wqkv(x).chunk(3, -1)[0]


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = FusedQKV()
        self.out = nn.Linear(D, D)
        self.register_buffer("freqs", torch.randn(7, dtype=torch.complex64))

    def forward(self, x):
        return self.out(self.attn(x)) + x


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(Attn(), Attn())
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.layers(x))


def _hooked_state_dicts(ckpt):
    """Every save path of a FullyShard model whose modules have state-dict hooks."""
    torch.manual_seed(0)
    plain = Hooked()
    expected = plain.state_dict()
    torch.manual_seed(0)
    model = zs.FullyShard(Hooked(), wrap={Attn})
    full, to0 = model.state_dict(), model.state_dict(to=0)
    some = model.state_dict(keys=["layers.1.attn.wk"])
    saves = [m.saves for m in model.modules() if isinstance(m, FusedQKV)]
    # loading the split entries fuses them back (each rank writes its pieces)
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in expected.items()}
    model.load_state_dict(changed)
    reloaded = model.state_dict()
    opt = zs.ShardedOptimizer(model.parameters(), lr=0.1)
    model(torch.randn(4, D)).sum().backward()
    opt.step()
    stepped = model.state_dict()
    zs.save_checkpoint(ckpt, model, opt)
    zs.checkpoint.dcp_state_dict(model, opt)  # (sharded: the parameters as registered)
    torch.manual_seed(1)
    again = zs.FullyShard(Hooked(), wrap={Attn})
    zs.load_checkpoint(ckpt, again, zs.ShardedOptimizer(again.parameters(), lr=0.1))
    return dict(
        expected=expected,
        full=full,
        to0=to0,
        some=some,
        saves=saves,
        changed=changed,
        reloaded=reloaded,
        stepped=stepped,
        loaded=again.state_dict(),
    )


def test_every_save_path_runs_the_models_state_dict_hooks(dist_pool, tmp_path):
    out = dist_pool.run(_hooked_state_dicts, str(tmp_path / "ckpt"))
    for rank, r in enumerate(out):
        keys = list(r["expected"])
        assert "layers.0.attn.wq" in keys and "layers.0.attn.wqkv.weight" not in keys
        assert list(r["full"]) == keys, (rank, list(r["full"]))
        assert all(torch.equal(r["full"][k], r["expected"][k]) for k in keys)
        assert (r["to0"] is None) == (rank != 0)
        assert r["to0"] is None or all(torch.equal(r["to0"][k], r["expected"][k]) for k in keys)
        assert list(r["some"]) == ["layers.1.attn.wk"] and torch.equal(
            r["some"]["layers.1.attn.wk"], r["expected"]["layers.1.attn.wk"]
        )
        assert min(r["saves"]) >= 1
        assert all(torch.equal(r["reloaded"][k], r["changed"][k]) for k in keys)
        assert not torch.equal(r["stepped"]["layers.0.attn.wq"], r["changed"]["layers.0.attn.wq"])
        assert list(r["loaded"]) == keys and all(torch.equal(r["loaded"][k], r["stepped"][k]) for k in keys)


class SplitOnly(nn.Module):
    """A save hook that renames the weight, and no load hook to name it back."""

    def __init__(self):
        super().__init__()
        self.wqkv = nn.Linear(D, 3 * D, bias=False)
        self._register_state_dict_hook(FusedQKV._split)


def _split_only_load():
    model = zs.FullyShard(SplitOnly())
    try:
        model.load_state_dict(model.state_dict())
    except RuntimeError as e:
        return str(e)
    return None


def test_a_renamed_parameter_with_no_load_hook_is_missing_not_skipped(dist_pool):
    for msg in dist_pool.run(_split_only_load):
        assert msg is not None and "missing keys ['wqkv.weight']" in msg, msg
