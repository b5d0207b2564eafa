"""FSDP2's module API, ``zeroshard.fully_shard``: one script run twice, once with
``torch.distributed.fsdp``'s imports and once with zeroshard's (torch's optimizer in both),
against each other on gloo at 2 ranks and hybrid sharding at 4: the class swap, a call per
block then the root, a group of modules, per-unit settings, FSDP2's ``set_*`` calls, the
state dicts and checkpoints both ways; then the module calls and the errors at 2 ranks."""

import pytest
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard as zs
from support.launch import launch
from support.titan import Layer, Titan, initialised, mine


def _full(v):
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def _mesh(hybrid: bool):
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if hybrid:
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _script(api, make_opt, hybrid: bool, factor: bool = True):
    """An FSDP2 training script; ``api`` is torch.distributed.fsdp or zeroshard."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = _mesh(hybrid)
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    model = initialised()
    for i, layer in enumerate(model.layers):
        api.fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i == 0)
    api.fully_shard([model.emb, model.out], mesh=mesh, mp_policy=mp)  # one group
    api.fully_shard(model, mesh=mesh, mp_policy=mp)
    out = {
        "classes": isinstance(model, Titan) and isinstance(model.layers[1], Layer),
        "fsdp": [type(m).__name__ for m in model.modules() if isinstance(m, api.FSDPModule)],
    }
    for m in model.modules():
        if isinstance(m, api.FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # (FSDP2 on gloo: no AVG)
    if factor:
        model.layers[1].set_gradient_divide_factor(1.0)  # that unit's gradients: the sum
    model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])
    model.layers[1].set_modules_to_backward_prefetch([model.layers[0]])
    model.layers[0].set_reshard_after_backward(False)
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(3)
    out["losses"] = []
    for _ in range(3):
        x = mine(torch.randint(0, 50, (8, 5), generator=g))
        model.set_requires_gradient_sync(False)  # accumulate a micro-batch unreduced,
        model(x[:, :3]).square().mean().backward()
        model.set_requires_gradient_sync(True)
        model.set_requires_all_reduce(False)  # one reduced within the replica (hybrid),
        model(x[:, 2:]).square().mean().backward()
        model.set_requires_all_reduce(True)  # then all
        loss = model(x).square().mean()
        loss.backward()
        out["losses"].append(loss.item())
        opt.step()
        opt.zero_grad()
    out["sd"] = {k: _full(v) for k, v in model.state_dict().items()}
    return out, model, opt


def _both(hybrid, tmp):
    import torch.distributed.fsdp as fsdp

    ours, model, _ = _script(zs, lambda ps: torch.optim.SGD(ps, lr=0.1), hybrid)
    ref, ref_model, _ = _script(fsdp, lambda ps: torch.optim.SGD(ps, lr=0.1), hybrid)
    unfactored, _, _ = _script(
        zs, lambda ps: zs.ShardedOptimizer(ps, lr=0.1, optimizer_class=torch.optim.SGD), hybrid, factor=False
    )
    err = lambda a, b: max((a[k] - v).abs().max().item() for k, v in b.items())  # noqa: E731
    out = {
        "classes": (ours["classes"], ref["classes"]),
        "fsdp": (ours["fsdp"], ref["fsdp"]),
        "keys": sorted(ours["sd"]) == sorted(ref["sd"]),
        "losses": (ours["losses"], ref["losses"]),
        "err": err(ours["sd"], ref["sd"]),
        "factor_matters": err(unfactored["sd"], ref["sd"]),
    }
    # checkpoints both ways: ours saved, read by the wrapper form; FSDP2's full state dict, loaded in
    # place; ours loaded into FSDP2's model
    zs.save_checkpoint(tmp, model)
    torch.manual_seed(5)
    wrapped = zs.FullyShard(Titan(), wrap={Layer})
    zs.load_checkpoint(tmp, wrapped)
    out["ckpt_err"] = err(wrapped.state_dict(), ref["sd"])
    ref_model.layers[0].ff.weight.data.mul_(0)  # (a change only FSDP2's model has)
    fresh = {k: _full(v) for k, v in ref_model.state_dict().items()}
    model.load_state_dict(fresh)
    out["load_err"] = err(model.state_dict(), fresh)
    # and ours into FSDP2's model, through torch's own helper
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    ours_now = model.state_dict()
    set_model_state_dict(ref_model, dict(ours_now), options=StateDictOptions(full_state_dict=True))
    out["into_fsdp2_err"] = err({k: _full(v) for k, v in ref_model.state_dict().items()}, ours_now)
    return out


@pytest.mark.parametrize("world,hybrid", [(2, False), (4, True)], ids=["world2", "world4-hsdp"])
def test_fsdp2_script_runs_with_the_import_changed(world, hybrid, tmp_path):
    """FSDP2 code changed modules in place and zeroshard had only a wrapper: a script ported
    took 10-85 changed lines. Now the same script runs with zeroshard's fully_shard and torch's
    SGD (ShardedOptimizer's SGD without the divide factor): classes swapped (isinstance holds), a call per block then the root, a group of
    two modules as one unit, per-unit reshard_after_forward, a divide factor on one block,
    explicit prefetch lists, a block kept gathered after backward, gradient sync and the replicas'
    all-reduce toggled for accumulation; the losses, parameters and state-dict keys equal FSDP2's, and checkpoints
    cross both ways (ours read by the wrapper form and loaded into FSDP2's model by torch's
    set_model_state_dict, FSDP2's full state dict loaded in place)."""
    for r in launch("pool", world).run(_both, hybrid, str(tmp_path / "ckpt")):
        assert r["classes"] == (True, True), r
        assert r["fsdp"][0] == r["fsdp"][1] == ["FSDPTitan", "FSDPEmbedding", "FSDPLayer", "FSDPLayer", "FSDPLinear"]
        assert r["keys"], r
        for a, b in zip(*r["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), r["losses"]  # (fp32 sums in another order)
        assert r["err"] < 1e-5 and r["factor_matters"] > 1e-4, r
        assert r["ckpt_err"] < 1e-6 and r["load_err"] < 1e-6 and r["into_fsdp2_err"] < 1e-6, r


def _output_dtype(api):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    mesh = _mesh(False)
    model = initialised()
    for layer in [*model.layers, model.out]:  # (each casts its fp32 inputs to bf16)
        api.fully_shard(layer, mesh=mesh, mp_policy=mp)
    api.fully_shard(model, mesh=mesh, mp_policy=mp)
    seen = []
    model.layers[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    out = model(mine(torch.randint(0, 50, (4, 5), generator=torch.Generator().manual_seed(2))))
    loss = out.square().mean()
    loss.backward()
    return out.dtype, seen[0], loss.item()


def _output_dtypes():
    import torch.distributed.fsdp as fsdp

    return _output_dtype(zs), _output_dtype(fsdp)


def test_output_dtype_casts_each_units_outputs_as_fsdp2s():
    """MixedPrecisionPolicy(output_dtype=...) was refused. Now each unit's and the model's floating
    outputs are cast to it, as FSDP2's (bf16 compute, fp32 outputs), the loss FSDP2's."""
    for ours, ref in launch("pool", 2).run(_output_dtypes):
        assert ours[:2] == ref[:2] == (torch.float32, torch.float32), (ours, ref)
        assert abs(ours[2] - ref[2]) <= 1e-3 * abs(ref[2]), (ours, ref)


# ------------------------------------------------------------- module calls, errors
def _refused(fn):
    try:
        fn()
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _calls():
    out = {}
    plain = initialised()
    want = plain.state_dict()
    # one call on the whole model: completed at its first use, with the values it had then
    torch.manual_seed(0)
    one = Titan()
    zs.fully_shard(one)
    torch.manual_seed(1)
    one.init_weights()  # (before the first use: on the unsharded model)
    got = one.state_dict()
    held = sum(p.to_local().numel() for p in one.parameters())
    out["one_call"] = (
        [k for k in want if not torch.equal(got[k], want[k])],
        held < sum(p.numel() for p in plain.parameters()),
    )
    # blocks then root: unshard/reshard on one block gathers that unit alone
    m = initialised()
    for layer in m.layers:
        zs.fully_shard(layer)
    zs.fully_shard(m)
    w = m.layers[1].ff.weight
    h = m.layers[1].unshard(async_op=True)
    out["in_flight"] = m.layers[1].ff.weight is w  # (swapped in by wait())
    h.wait()
    full = m.layers[1].ff.weight
    out["unshard"] = (tuple(full.shape), torch.equal(full.detach(), m.state_dict()["layers.1.ff.weight"]))
    out["others_sharded"] = type(m.layers[0].ff.weight) is type(w) and type(full) is not type(w)
    m.layers[1].reshard()
    out["resharded"] = m.layers[1].ff.weight is w
    out["sync_returns_none"] = m.layers[0].unshard() is None
    with torch.no_grad():  # the forward takes the gathered unit over and frees it after, as usual
        m(torch.tensor([[1, 2]]))
    out["freed_by_forward"] = type(m.layers[0].ff.weight) is type(w)
    # FSDP2's initialisation idiom, in place: meta, calls, to_empty, init_weights
    with torch.device("meta"):
        meta = Titan()
    for layer in meta.layers:
        zs.fully_shard(layer)
    zs.fully_shard(meta)
    meta.to_empty(device="cpu")
    torch.manual_seed(1)
    meta.init_weights()
    out["meta_init"] = [k for k, v in meta.state_dict().items() if not torch.equal(v, want[k])]
    # errors, each naming the fix
    blocks_only = Titan()
    for layer in blocks_only.layers:
        zs.fully_shard(layer)
    opt = zs.ShardedOptimizer(blocks_only.parameters(), lr=0.1)  # (the blocks each complete on their own)
    out["no_root"] = _refused(lambda: blocks_only(torch.tensor([[1, 2]])).sum().backward() or opt.step())
    # two models, one call each (an RL actor and its reference): each completes on its own
    a, b = initialised(), initialised(3, 4)
    zs.fully_shard(a)
    zs.fully_shard(b)
    out["two_models"] = a(torch.tensor([[1, 2]])).shape == b(torch.tensor([[1, 2]])).shape == (1, 2, 257)
    out["twice"] = _refused(lambda: zs.fully_shard(m.layers[0]))
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out["override_fn"] = _refused(
        lambda: zs.fully_shard(nn.Linear(2, 2), mp_policy=MixedPrecisionPolicy(param_dtype_override_fn=lambda p: None))
    )
    lin = nn.Linear(2, 2)
    out["ignored"] = _refused(lambda: zs.fully_shard(lin, ignored_params={lin.weight}))
    out["int_reshard"] = _refused(lambda: zs.fully_shard(nn.Linear(2, 2), reshard_after_forward=2.0))
    out["int_divides"] = _refused(lambda: zs.FullyShard(nn.Linear(2, 2), reshard_after_forward=3))
    out["block_zero_grad"] = _refused(lambda: m.layers[0].zero_grad())
    out["not_here"] = _refused(lambda: m.set_custom_all_gather(None))
    out["foreign"] = _refused(lambda: m.layers[0].set_modules_to_forward_prefetch([one]))
    return out


def test_module_calls_and_what_is_refused():
    """A single call on the whole model completes at first use; unshard()/reshard() on a block
    gather that unit alone (FSDP2's: a prefetch the next forward takes over and frees),
    unshard(async_op=True) returns a handle whose wait() finishes the gather; the meta +
    to_empty + init_weights idiom in place gives the one-process values; and each misuse or
    unsupported option is refused naming the fix."""
    for r in launch("pool", 2).run(_calls):
        assert r["one_call"] == ([], True), r
        assert r["unshard"][0] == (2 * 13, 13) and r["unshard"][1], r
        assert (
            r["in_flight"]
            and r["others_sharded"]
            and r["resharded"]
            and r["sync_returns_none"]
            and r["freed_by_forward"]
        ), r
        assert r["meta_init"] == [], r
        assert "fully_shard(model)" in r["no_root"] and r["two_models"], r
        assert "once a module" in r["twice"], r
        assert "param_dtype_override_fn" in r["override_fn"] and "ignored_params" in r["ignored"], r
        assert "an int" in r["int_reshard"] and "optimizer.zero_grad()" in r["block_zero_grad"], r
        assert "reshard_after_forward=3" in r["int_divides"] and "dividing the 2 ranks" in r["int_divides"], r
        assert "NotImplementedError" in r["not_here"] and "set_custom_all_gather" in r["not_here"], r
        assert "same model" in r["foreign"], r


def _post_forward(api, k):
    """Two steps of a script whose second block has reshard_after_forward=k; the losses, the
    parameters, and (ours) the flight record's backward all-gathers and the bytes kept."""
    model = initialised()
    for i, layer in enumerate(model.layers):
        api.fully_shard(layer, reshard_after_forward=k if i else True)
    api.fully_shard(model)
    for m in model.modules():
        if isinstance(m, api.FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # (FSDP2 on gloo: no AVG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    out = {"losses": []}
    for _ in range(2):
        loss = model(mine(torch.randint(0, 50, (8, 5), generator=g))).square().mean()
        if api is zs:
            out["kept"] = model.memory_report()["gathered"]  # between the forward and the backward
            start = time.time()  # (the flight record keeps its last records: select by start time)
        loss.backward()
        if api is zs:
            out["backward"] = [
                (r["group"], r["numel"])
                for r in zs.flight_record()
                if r["start"] >= start and "post-forward" in r["what"]
            ]
        out["losses"].append(loss.item())
        opt.step()
        opt.zero_grad()
    out["sd"] = {k: _full(v) for k, v in model.state_dict().items()}
    out["after"] = model.memory_report()["gathered"] if api is zs else None
    return out


def _post_forward_runs():
    import torch.distributed.fsdp as fsdp

    ours, ref = _post_forward(zs, 2), _post_forward(fsdp, 2)
    block = zs.FullyShard(initialised(), wrap={Layer}).units[2]  # (the second block's unit: its size)
    return dict(
        losses=(ours["losses"], ref["losses"]),
        err=max((ours["sd"][k] - v).abs().max().item() for k, v in ref["sd"].items()),
        kept=(ours["kept"], 4 * -(-block.numel // 2)),
        backward=ours["backward"],
        world=dist.group.WORLD.group_name,
        after=ours["after"],
    )


def test_reshard_after_forward_as_an_int_gathers_the_backward_within_its_ranks():
    """FSDP2's reshard_after_forward=<int> ([Note: post-forward shards]) at 4 ranks, k = 2: the
    losses and parameters equal FSDP2's; between the forward and the backward the block keeps
    half its gathered bytes (rounded up) on each rank, and its backward all-gathers over a
    group of 2 ranks, not the world (the flight record); nothing is kept after the step."""
    for r in launch("pool", 4).run(_post_forward_runs):
        assert r["losses"][0] == pytest.approx(r["losses"][1], abs=1e-6) and r["err"] <= 1e-6, r
        assert r["kept"][0] == r["kept"][1] > 0, r["kept"]
        assert len(r["backward"]) == 1 and r["backward"][0][0] != r["world"], r["backward"]
        assert r["after"] == 0, r
