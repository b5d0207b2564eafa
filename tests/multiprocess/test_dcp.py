"""torch.distributed.checkpoint both ways: zeroshard's DCP state dicts (checkpoint/dcp.py) saved and
loaded with dcp.save / dcp.load against FSDP2 (fully_shard + torch.optim.AdamW through
torch's get_state_dict / set_state_dict) and DDP, across world sizes 2 and 3 and stages 1-3:
whoever loads a checkpoint then trains on exactly as the other tool does from it."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import zeroshard as zs
from support.launch import launch
from zeroshard.checkpoint.dcp import dcp_state_dict, load_dcp_state_dict

HYPER = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(13, 13)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), Block(), Block(), nn.Linear(13, 3))


def _train(model, opt, steps: range):
    rank, opts = dist.get_rank(), opt if isinstance(opt, list) else [opt]
    for s in steps:
        x = torch.randn(6, 7, generator=torch.Generator().manual_seed(100 * s + rank))
        model(x).square().mean().backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()


# an optimizer by name: (torch class, its hyperparameters); zeroshard runs torch's SGD and AdamW with amsgrad
# as elementwise optimizer_class, AdamW as its fused kernel
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, HYPER),
    "sgd": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.1)),
    "amsgrad": (torch.optim.AdamW, dict(HYPER, amsgrad=True)),
    "adafactor": (torch.optim.Adafactor, dict(lr=1e-2)),
}  # whole-tensor: on owner ranks


def _muon(kind: str):
    """Muon over the hidden matrices and AdamW over the rest, as a Muon script holds them: DDP's
    two torch optimizers, or zeroshard's two ShardedOptimizers at stage 2 or 3."""
    model = _model()
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif kind == "zs3":
        model = zs.FullyShard(model, wrap={Block})
    mats = [p for n, p in model.named_parameters() if p.dim() == 2 and ".lin." in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and ".lin." in n)]
    muon = dict(lr=2e-2, momentum=0.9)
    if kind == "ddp":
        return model, [torch.optim.Muon(mats, **muon), torch.optim.AdamW(rest, **HYPER)], "torch"
    stage = {} if kind == "zs3" else dict(stage=2)
    return (
        model,
        [
            zs.ShardedOptimizer(mats, optimizer_class=torch.optim.Muon, **stage, **muon),
            zs.ShardedOptimizer(rest, **stage, **HYPER),
        ],
        "zs",
    )


def _build(kind: str):
    """(model, optimizer, whose) for ``kind``: "fsdp2", "ddp", or zeroshard's "zs1"/"zs2"/"zs3", each
    with an optimizer suffix ("-sgd", "-amsgrad"; AdamW without)."""
    kind, _, which = kind.partition("-")
    if which == "muon":
        return _muon(kind)
    cls, hyper = OPTIMIZERS[which or "adamw"]
    model = _model()
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in (model[1], model[2]):
            fully_shard(b)
        fully_shard(model)
        return model, cls(model.parameters(), **hyper), "torch"
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        return model, cls(model.parameters(), **hyper), "torch"
    stage = int(kind[2:])
    extra = dict(optimizer_class=cls) if which else {}
    if stage == 3:
        model = zs.FullyShard(model, wrap={Block})
        return model, zs.ShardedOptimizer(model.parameters(), **extra, **hyper), "zs"
    return model, zs.ShardedOptimizer(model.parameters(), stage=stage, **extra, **hyper), "zs"


def _state_dicts(model, opt, whose):
    return get_state_dict(model, opt) if whose == "torch" else dcp_state_dict(model, opt)


def _full(model, opt, whose) -> dict:
    """{name: values as a list} (lists: tensors returned from the pool's workers can stall it)."""
    if whose == "torch":
        sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))[0]
    else:
        sd = model.state_dict()
    return {k.removeprefix("module."): v.detach().float().reshape(-1).tolist() for k, v in sd.items()}


def _save(kind: str, path: str, saver: str = "save"):
    """Train 2 steps and save with dcp.save (or dcp.async_save, training on while it writes);
    then 2 more: the parameters after them."""
    model, opt, whose = _build(kind)
    _train(model, opt, range(2))
    msd, osd = _state_dicts(model, opt, whose)
    if saver == "async_save":  # (its collectives in a group of their own, as torch's docs ask)
        written = dcp.async_save(
            {"model": msd, "optim": osd}, checkpoint_id=path, process_group=dist.new_group(backend="gloo")
        )
        _train(model, opt, range(2, 4))  # (changes the shards the state dicts view)
        written.result()
    else:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        _train(model, opt, range(2, 4))
    return _full(model, opt, whose)


def _load(kind: str, path: str):
    """Load with dcp.load (other weights first), train the last 2 steps: the parameters after them."""
    model, opt, whose = _build(kind)
    msd, osd = _state_dicts(model, opt, whose)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    if whose == "torch":
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    else:
        load_dcp_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    _train(model, opt, range(2, 4))
    return _full(model, opt, whose)


def _worst(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in a)


@pytest.mark.parametrize("writer", ["fsdp2", "ddp"])
def test_a_torch_checkpoint_at_world_2_trains_on_in_zeroshard_at_world_3(writer, tmp_path):
    path = str(tmp_path / "ckpt")
    launch("pool", 2).run(_save, writer, path)
    want = launch("pool", 3).run(_load, writer, path)[0]  # the writer continuing from its checkpoint
    for stage in (3, 2, 1):
        got = launch("pool", 3).run(_load, f"zs{stage}", path)[0]
        assert _worst(got, want) < 1e-6, (writer, stage)


@pytest.mark.parametrize("stage,saver", [(3, "save"), (2, "async_save")])
def test_a_zeroshard_checkpoint_at_world_3_trains_on_in_fsdp2_at_world_2(stage, saver, tmp_path):
    """async_save: the checkpoint holds the state at the call, though training went on."""
    path = str(tmp_path / "ckpt")
    saved = launch("pool", 3).run(_save, f"zs{stage}", path, saver)[0]
    _assert_no_empty_chunks(path)
    assert _worst(launch("pool", 3).run(_load, f"zs{stage}", path)[0], saved) < 1e-6, stage
    fsdp2 = launch("pool", 2).run(_load, "fsdp2", path)[0]
    for now in (3, 2):
        assert _worst(launch("pool", 2).run(_load, f"zs{now}", path)[0], fsdp2) < 1e-6, (stage, now)


def _assert_no_empty_chunks(path: str) -> None:
    """A rank that holds none of a tensor writes nothing of it (its empty stand-in shard is
    left out of the plan: every written item costs DCP's writer a record)."""
    written = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key, md in written.items():
        if hasattr(md, "chunks") and md.size.numel():
            assert all(c.sizes.numel() for c in md.chunks), key


def _native_save(kind: str, path: str):
    """zeroshard's own checkpoint after 2 steps; the parameters after 2 more."""
    model, opt, whose = _build(kind)
    _train(model, opt, range(2))
    zs.save_checkpoint(path, model, opt)
    _train(model, opt, range(2, 4))
    return _full(model, opt, whose)


def _native_load(kind: str, path: str):
    model, opt, whose = _build(kind)
    zs.load_checkpoint(path, model, opt)
    _train(model, opt, range(2, 4))
    return _full(model, opt, whose)


def test_converters_both_ways(tmp_path):
    """python -m zeroshard.checkpoint.convert: a zeroshard checkpoint as DCP (FSDP2 trains on from it
    as zeroshard does), and FSDP2's DCP checkpoint as a zeroshard one (loaded at another world size
    and stage, training on as FSDP2 does)."""
    from zeroshard.checkpoint import convert

    native, as_dcp = str(tmp_path / "native"), str(tmp_path / "as-dcp")
    ours = launch("pool", 2).run(_native_save, "zs3", native)[0]
    assert convert.main(["--to", "dcp", native, as_dcp]) == 0
    assert _worst(launch("pool", 2).run(_load, "fsdp2", as_dcp)[0], ours) < 1e-6
    theirs, back = str(tmp_path / "fsdp2"), str(tmp_path / "back")
    launch("pool", 2).run(_save, "fsdp2", theirs)
    assert convert.main(["--to", "zeroshard", theirs, back]) == 0
    want = launch("pool", 3).run(_load, "fsdp2", theirs)[0]
    assert _worst(launch("pool", 3).run(_native_load, "zs2", back)[0], want) < 1e-6
    assert convert.main(["--to", "dcp", native, back]) == 2  # an existing destination is refused


@pytest.mark.parametrize("which,peer", [("sgd", "fsdp2"), ("amsgrad", "fsdp2"), ("adafactor", "ddp")])
def test_other_optimizer_classes_both_ways(which, peer, tmp_path):
    """torch's SGD with momentum and AdamW with amsgrad (elementwise optimizer_class) against FSDP2,
    Adafactor (whole-tensor: factored state on owner ranks) against DDP: the peer's checkpoint at
    world 2 into zeroshard at world 3 (stages 3 and 2), and zeroshard's back."""
    theirs, ours = str(tmp_path / peer), str(tmp_path / "zs")
    launch("pool", 2).run(_save, f"{peer}-{which}", theirs)
    want = launch("pool", 3).run(_load, f"{peer}-{which}", theirs)[0]
    for stage in (3, 2):
        assert _worst(launch("pool", 3).run(_load, f"zs{stage}-{which}", theirs)[0], want) < 1e-6, stage
    launch("pool", 3).run(_save, f"zs3-{which}", ours)
    want = launch("pool", 2).run(_load, f"{peer}-{which}", ours)[0]
    assert _worst(launch("pool", 2).run(_load, f"zs2-{which}", ours)[0], want) < 1e-6


def test_muon_with_adamw_both_ways(tmp_path):
    """Muon (each matrix's momentum on its owner rank) with AdamW: DDP's two torch optimizers'
    checkpoint at world 2 into zeroshard at world 3 (stages 3 and 2), and zeroshard's back into DDP."""
    theirs, ours = str(tmp_path / "ddp"), str(tmp_path / "zs")
    launch("pool", 2).run(_save, "ddp-muon", theirs)
    want = launch("pool", 3).run(_load, "ddp-muon", theirs)[0]
    for stage in (3, 2):
        assert _worst(launch("pool", 3).run(_load, f"zs{stage}-muon", theirs)[0], want) < 1e-5, stage
    launch("pool", 3).run(_save, "zs3-muon", ours)
    want = launch("pool", 2).run(_load, "ddp-muon", ours)[0]
    assert _worst(launch("pool", 2).run(_load, "zs2-muon", ours)[0], want) < 1e-5


FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _full_save(kind: str, path: str):
    """Full state dicts on rank 0 (``full_state_dict=True, cpu_offload=True``), torch.save'd there."""
    model, opt, whose = _build(kind)
    _train(model, opt, range(2))
    msd, osd = (
        get_state_dict(model, opt, options=FULL) if whose == "torch" else dcp_state_dict(model, opt, options=FULL)
    )
    if dist.get_rank() == 0:
        torch.save({"model": msd, "optim": osd}, path)
    else:
        assert msd == {} and not osd.get("state")
    dist.barrier()
    _train(model, opt, range(2, 4))
    return _full(model, opt, whose)


def _full_load(kind: str, path: str):
    """zeroshard: rank 0 loads the file and every rank takes its part (``broadcast_from_rank0=True``);
    FSDP2: every rank loads the file (``full_state_dict=True``)."""
    model, opt, whose = _build(kind)
    if whose == "torch":
        sd = torch.load(path, weights_only=False)
        set_state_dict(
            model,
            opt,
            model_state_dict=sd["model"],
            optim_state_dict=sd["optim"],
            options=StateDictOptions(full_state_dict=True),
        )
    else:
        sd = (
            torch.load(path, weights_only=False)
            if dist.get_rank() == 0
            else {"model": {}, "optim": {"state": {}, "param_groups": []}}
        )
        load_dcp_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=FROM_RANK0)
    _train(model, opt, range(2, 4))
    return _full(model, opt, whose)


def test_full_state_dicts_on_rank_0_both_ways(tmp_path):
    """StateDictOptions(full_state_dict=True, cpu_offload=True) to save on rank 0, and
    broadcast_from_rank0=True for zeroshard to load, as FSDP2 scripts do: FSDP2's file at world 2
    into zeroshard at world 3, and zeroshard's (stage 3, world 3) into FSDP2 at world 2, each
    against FSDP2 loading the same file on every rank."""
    theirs, ours = str(tmp_path / "fsdp2.pt"), str(tmp_path / "zs.pt")
    launch("pool", 2).run(_full_save, "fsdp2", theirs)
    want = launch("pool", 3).run(_full_load, "fsdp2", theirs)[0]
    assert _worst(launch("pool", 3).run(_full_load, "zs3", theirs)[0], want) < 1e-6
    launch("pool", 3).run(_full_save, "zs3", ours)
    want = launch("pool", 2).run(_full_load, "fsdp2", ours)[0]
    assert _worst(launch("pool", 2).run(_full_load, "zs2", ours)[0], want) < 1e-6


# ------------------------------------------------ torch's state-dict helpers on zeroshard models
def _helpers(form: str, path: str) -> dict:
    from torch.distributed.checkpoint import state_dict as S

    from support.titan import Layer, initialised

    m = initialised()
    if form == "wrapper":
        model = zs.FullyShard(m, wrap={Layer})
    elif form == "in place":
        for layer in m.layers:
            zs.fully_shard(layer)
        model = zs.fully_shard(m)
    else:
        model = m
    opt = zs.ShardedOptimizer(model.parameters(), lr=0.1, **({"stage": 2} if form == "stage 2" else {}))

    def step():
        model(torch.tensor([[1, 2, 3]])).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    names = [n for n, _ in model.named_parameters()]
    full, osd, steps = model.state_dict(), opt.state_dict(), opt.param_steps
    out = {"view": (len(opt.state), float(opt.state[opt.params[0]]["step"]))}
    out["model"] = _worst(S.get_model_state_dict(model), full)
    offloaded = S.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["model_full"] = _worst(offloaded, full) if offloaded else "empty"
    got = S.get_optimizer_state_dict(model, opt)
    out["optim"] = max(
        (got["state"][n]["exp_avg"] - osd["state"][i]["exp_avg"]).abs().max().item() for i, n in enumerate(names)
    )
    out["steps_kept"] = opt.param_steps == steps  # (an empty opt.state had let torch step it with lr 0)
    # torchtitan's checkpoint: dcp.save of get_state_dict, a step, dcp.load and set_state_dict
    msd, saved = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": saved}, checkpoint_id=path)
    step()
    msd, osd2 = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd2}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd2)
    now = opt.state_dict()
    out["restored"] = (
        _worst(model.state_dict(), full),
        max((now["state"][i]["exp_avg"] - osd["state"][i]["exp_avg"]).abs().max().item() for i in range(len(names))),
    )
    fresh = initialised(7, 8).state_dict()
    S.set_model_state_dict(model, dict(fresh), options=StateDictOptions(full_state_dict=True))
    out["set_full"] = _worst(model.state_dict(), fresh)
    return out


@pytest.mark.parametrize("form", ["wrapper", "in place", "stage 2"])
def test_torchs_state_dict_helpers_on_zeroshard_models(form, tmp_path):
    """torch.distributed.checkpoint.state_dict's helpers over a FullyShard (wrapper and in
    place) or a stage-2 model and a ShardedOptimizer: get_optimizer_state_dict had stepped the
    optimizer with zero gradients and lr 0 (its empty ``state`` looked uninitialised: the
    moments decayed and a step more was counted, silently), and set_model_state_dict with a
    full state dict failed on the wrapper's ``module.`` names. Now each returns the values
    model.state_dict() / opt.state_dict() hold (full tensors on every rank: FSDP2's sharded
    form is dcp_state_dict's), loads them back, and torchtitan's dcp.save / dcp.load through
    get_state_dict / set_state_dict restores the model and the optimizer exactly."""
    for r in launch("pool", 2).run(_helpers, form, str(tmp_path / "dcp")):
        assert r["view"][0] > 0 and r["view"][1] == 1.0, r
        assert r["model"] == 0 and r["optim"] == 0 and r["steps_kept"], r
        assert r["model_full"] == 0 or r["model_full"] == "empty", r
        assert r["restored"] == (0, 0) and r["set_full"] == 0, r
