"""CUDA-only checks: skipped cleanly without a GPU (conftest marks them)."""

import os

import pytest
import torch

import zeroshard as zs
from support.checks import rel_err
from support.launch import launch
from support.optimizers import Muon32, check_against_torch, multi_equals_separate, run_against_torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_decay,grad_scale", [(0.0, 1.0), (0.01, 0.37)])
def test_cuda_kernel_matches_torch_adamw(grad_dtype, weight_decay, grad_scale):
    check_against_torch(*run_against_torch("cuda", grad_dtype, weight_decay, grad_scale))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_cuda_low_precision_output_is_rounded_master(out_dtype):
    run_against_torch("cuda", torch.bfloat16, 0.01, 1.0, steps=10, out_dtype=out_dtype)


@pytest.mark.parametrize("offset", [0, 1, 3])  # 1, 3: misaligned views take the scalar path
def test_cuda_kernel_equals_cpu_kernel(offset):
    n = 100_003
    g = torch.Generator().manual_seed(5)
    base = [torch.randn(n + offset, generator=g) for _ in range(3)] + [torch.rand(n + offset, generator=g)]
    cpu = [t[offset:].clone() for t in base]
    cuda = [t.cuda()[offset:] for t in base]
    out = torch.empty(n + offset, dtype=torch.bfloat16, device="cuda")[offset:]
    zs.fused_adamw_([cpu[0]], [cpu[1]], [cpu[2]], [cpu[3]], lr=1e-3, step=3, weight_decay=0.1)
    zs.fused_adamw_([cuda[0]], [cuda[1]], [cuda[2]], [cuda[3]], lr=1e-3, step=3, weight_decay=0.1, outs=[out])
    for a, b in zip(cpu, cuda):  # both round every operation alike (no contraction): bit-equal
        torch.testing.assert_close(b.cpu(), a, rtol=0, atol=0)
    assert torch.equal(out, cuda[0].to(torch.bfloat16))


def test_cuda_flags_without_host_sync():
    n = 4099
    p, m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    g = torch.ones(n, device="cuda")
    g[4000] = float("nan")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    zs.fused_adamw_([p], [g], [m], [v], lr=1e-3, step=1, found_inf=flag)
    assert flag.item() == 1
    before = p.clone()
    zs.fused_adamw_([p], [g], [m], [v], lr=1e-3, step=2, noop=flag)
    # p[4000] is NaN since the first step (its gradient was): compare NaN as equal
    torch.testing.assert_close(p, before, rtol=0, atol=0, equal_nan=True)


@pytest.fixture(scope="module")
def nccl_world1():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists")
    # a port of each pytest-xdist worker's own: the GPU tests run several processes on one GPU
    port = 29533 + int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    yield
    dist.destroy_process_group()


def test_cuda_collectives_world_size_1(nccl_world1):
    x = torch.randn(1000, device="cuda")
    y = torch.empty(1000, device="cuda")
    zs.reduce_scatter(x, y, average=True).wait()
    z = torch.empty(1000, device="cuda")
    zs.all_gather(y, z).wait()
    torch.testing.assert_close(z, x)


def test_cuda_uneven_collectives_world_size_1(nccl_world1):
    """The uneven collectives' NCCL path (one broadcast or reduce per chunk that holds
    something, in one NCCL group: [Note: uneven collectives]), out of place and in place."""
    x = torch.randn(999, device="cuda")
    for in_place in (False, True):
        buf = x.clone()
        out = buf if in_place else torch.empty(999, device="cuda")
        zs.reduce_scatter(buf, out, bounds=[0, 999]).wait()
        torch.testing.assert_close(out, x)
        full = torch.full((999,), float("nan"), device="cuda")
        mine = full if in_place else x.clone()
        if in_place:
            full.copy_(x)
        zs.all_gather(mine, full, bounds=[0, 999]).wait()
        torch.testing.assert_close(full, x)


def train_both(model, opt, ref, ropt, dtype=torch.float32, steps=10):
    """Ten clipped steps of ours and of torch AdamW on the same random batches."""
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 33, device="cuda", generator=g)
        opt.zero_grad()
        model(x.to(dtype)).float().pow(2).mean().backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        ropt.zero_grad()
        ref(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ropt.step()


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_sharded_optimizer_matches_adamw(nccl_world1, stage, dtype):
    import torch.nn as nn

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(33, 61), nn.Tanh(), nn.Linear(61, 7)).cuda()
    model = nn.Sequential(nn.Linear(33, 61), nn.Tanh(), nn.Linear(61, 7)).cuda()
    model.load_state_dict(ref.state_dict())
    model.to(dtype)
    if dtype != torch.float32:
        ref.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
    opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2, stage=stage, bucket_mb=1e-3, reduce_dtype=torch.float32)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    train_both(model, opt, ref, ropt, dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for p, q in zip(model.parameters(), ref.parameters()):
        err = ((p.float() - q).norm() / q.norm()).item()
        assert err <= tol, err


class Block(torch.nn.Module):
    """A residual MLP block: the sharding unit of the FullyShard tests."""

    def __init__(self, width, hidden):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("reshard", [True, False])
def test_cuda_fully_shard_matches_adamw_and_frees_gathered_memory(nccl_world1, reshard):
    import torch.nn as nn

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(33, 61), *[Block(61, 127) for _ in range(3)], nn.Linear(61, 7)).cuda()

    ref, model = make(), zs.FullyShard(make(), wrap={Block}, reshard_after_forward=reshard)
    opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    train_both(model, opt, ref, ropt)
    sd, rsd = model.state_dict(), ref.state_dict()
    for k in rsd:
        err = ((sd[k].cuda() - rsd[k]).norm() / rsd[k].norm()).item()
        assert err <= 1e-5, (k, err)
    rep = model.memory_report()
    assert rep["gathered"] == 0 and rep["grad_buffers"] == 0
    if reshard:
        assert rep["gathered_units_peak"] <= 2
    # a gathered unit's storage really is released between steps
    assert all(u.full.untyped_storage().nbytes() == 0 for u in model.units if u.params)


def test_cuda_checkpoint_round_trip_and_peak_memory(nccl_world1, tmp_path):
    """Save a CUDA FullyShard + ShardedOptimizer, load it back into other values on
    CUDA and into a plain CPU model: exact, with the CUDA allocator's peak during
    save and load under one unit."""
    import torch.nn as nn

    def make(seed):
        torch.manual_seed(seed)
        return nn.Sequential(*[Block(256, 1024) for _ in range(4)])

    model = zs.FullyShard(make(0).cuda(), wrap={Block})
    opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2)
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()
    path = str(tmp_path / "ck")
    unit = model.memory_report()["max_unit"]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    zs.save_checkpoint(path, model, opt)
    assert torch.cuda.max_memory_allocated() - base <= unit
    expected = model.state_dict()
    other = zs.FullyShard(make(1).cuda(), wrap={Block})
    other_opt = zs.ShardedOptimizer(other.parameters(), lr=1e-2)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    zs.load_checkpoint(path, other, other_opt)
    assert torch.cuda.max_memory_allocated() - base <= unit
    got = other.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    plain = make(2)
    zs.load_checkpoint(path, plain, None)
    assert all(torch.equal(v, expected[k]) for k, v in plain.state_dict().items())


def test_cuda_background_save_copies_into_pinned_memory_and_writes_what_a_blocking_save_does(nccl_world1, tmp_path):
    """A background save of CUDA shards: no CUDA memory beyond what is held, the state
    changed on the GPU right after the call does not reach the files, which are byte for
    byte the blocking save's."""
    import os
    import torch.nn as nn

    torch.manual_seed(0)
    model = zs.FullyShard(nn.Sequential(*[Block(256, 1024) for _ in range(4)]).cuda(), wrap={Block})
    opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2)
    x = torch.randn(8, 256, device="cuda")
    model(x).sum().backward()
    opt.step()
    zs.save_checkpoint(str(tmp_path / "blocking"), model, opt)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    done = zs.save_checkpoint(str(tmp_path / "background"), model, opt, background=True)
    assert torch.cuda.max_memory_allocated() == base
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()  # changes every shard while the thread writes
    done.result(timeout=120)

    def files(d):
        return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}

    assert files(tmp_path / "blocking") == files(tmp_path / "background")


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_cuda_training_example(stage, tmp_path):
    """examples/train_gpt.py under torchrun on one GPU (NCCL): it trains, and the memory table matches the formula."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = launch(
        "torchrun",
        os.path.join(root, "examples", "train_gpt.py"),
        1,
        ["--stage", str(stage), "--dtype", "bf16", "--steps", "60", "--out-dir", str(tmp_path)],
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "(nccl, cuda)" in res.stdout and "peak GPU memory on rank 0" in res.stdout
    first, last = map(
        float, re.search(r"loss: first \d+ steps ([\d.]+) -> last \d+ steps ([\d.]+)", res.stdout).groups()
    )
    assert last < first - 0.5, res.stdout
    row = re.search(r"^0\s+(?:[\d.]+\s+){4}([\d.]+)\s+([\d.]+)\s+[\d.]+$", res.stdout, re.M)
    assert row and row.group(1) == row.group(2), res.stdout  # measured total == the seeds' formula


# every example that starts through examples/_device.py, on one GPU (a rank per GPU: NCCL on cuda:0)
# (dcp_interop: DCP save and load of device shards; moe: expert groups of one rank; finetune: LoRA;
# tensor_parallel: DTensor parameters over a tp mesh of one rank)
GPU_EXAMPLES = [
    "quickstart",
    "fully_shard",
    "fully_shard_habits",
    "optimizers",
    "uneven_inputs",
    "muon",
    "mixed_precision",
    "offload",
    "checkpoints",
    "llama_zero3",
    "deepspeed_config",
    "lightning_gpt",
    "dcp_interop",
    "moe",
    "finetune",
    "tensor_parallel",
]


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_cuda_examples_run_where_the_user_is(name, tmp_path):
    """Each example under torchrun on one GPU host takes the NCCL branch of examples/_device.py
    (the unit test checks which branch each machine gets) and passes its own check."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = launch(
        "torchrun",
        os.path.join(root, "examples", f"{name}.py"),
        1,
        env={"TMPDIR": str(tmp_path), "ZEROSHARD_RECORD_DIR": str(tmp_path)},
        cwd=root,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert re.search(rf"^{name}: ", res.stdout, re.MULTILINE), res.stdout[-3000:]


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.extra, self.head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 5)

    def forward(self, x, use_extra):
        h = torch.relu(self.a(x))
        if use_extra:
            h = h + self.extra(h)
        return self.head(torch.relu(self.b(h)))


def _dropin_run(kind, stage, cls):
    """4 steps of bf16 autocast + GradScaler + torch's clip with a branch used every other
    step, on one GPU: plain torch (kind "torch") or zeroshard at ``stage``."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = _Branchy().cuda()
    kw = dict(lr=1e-2, weight_decay=0.1) if cls is torch.optim.AdamW else dict(lr=0.05, momentum=0.9)
    extra = {} if cls is torch.optim.AdamW else dict(optimizer_class=cls)
    if kind == "torch":
        net, opt = model, cls(model.parameters(), foreach=False, **kw)
    elif stage == 3:
        net = zs.FullyShard(model, wrap={torch.nn.Linear})
        opt = zs.ShardedOptimizer(net.parameters(), **kw, **extra)
    else:
        net, opt = model, zs.ShardedOptimizer(model.parameters(), stage=stage, **kw, **extra)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12)
    g = torch.Generator(device="cuda").manual_seed(3)
    for k in range(4):
        x = torch.randn(16, 64, device="cuda", generator=g)
        y = torch.randint(0, 5, (16,), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x, k % 2 == 0).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return {k: v.float().cpu() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD], ids=["adamw", "sgd"])
def test_cuda_drop_in_idioms_equal_plain_torch(nccl_world1, stage, cls):
    ref = _dropin_run("torch", stage, cls)
    ours = _dropin_run("zeroshard", stage, cls)
    for k, v in ref.items():
        err = ((ours[k] - v).norm() / v.norm()).item()
        assert err < 1e-5, (k, err)


@pytest.mark.gpu
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_cuda_offload_steps_as_on_the_device(nccl_world1, offload, tmp_path):
    """CUDA parameters with the optimizer state offloaded: host state pinned ("cpu"),
    gradients copied to host window by window, the result copied into the device
    parameters; equal to the run without offload up to the CPU and CUDA kernels' rounding."""
    models, opts = [], []
    for off in (None, offload):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(97, 131), torch.nn.GELU(), torch.nn.Linear(131, 7)).cuda()
        model = model.to(torch.bfloat16)
        opt = zs.ShardedOptimizer(
            model.parameters(), stage=2, offload=off, offload_dir=str(tmp_path) if off == "nvme" else None
        )
        for i in range(3):
            x = torch.randn(8, 97, generator=torch.Generator().manual_seed(i)).cuda().to(torch.bfloat16)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        models.append(model)
        opts.append(opt)
    errs = [rel_err(p, q) for p, q in zip(models[0].parameters(), models[1].parameters())]
    assert max(errs) < 1e-2, errs  # bf16 parameters: one rounding step apart at most
    rep = opts[1].memory_report()
    assert rep["host" if offload == "cpu" else "disk"] > 0 and rep["device"] < opts[0].memory_report()["device"]
    if offload == "cpu":
        assert all(seg.exp_avg.is_pinned() for seg in opts[1].source.segments if seg.streamed)


@pytest.mark.gpu
def test_cuda_offload_params_keeps_the_shards_in_pinned_host_memory(nccl_world1):
    """FullyShard(offload_params=True) on CUDA: shards and gradient shards pinned in host
    memory, copied to the device before each gather and back as each unit is reduced;
    the step runs on the CPU. Equal to the run on the device up to the kernels' rounding."""
    models, opts = [], []
    for offload_params in (False, True):
        torch.manual_seed(0)
        inner = torch.nn.Sequential(torch.nn.Linear(97, 131), torch.nn.GELU(), torch.nn.Linear(131, 7)).cuda()
        model = zs.FullyShard(inner, wrap={torch.nn.Linear}, offload_params=offload_params)
        opt = zs.ShardedOptimizer(model.parameters())
        for i in range(3):
            x = torch.randn(8, 97, generator=torch.Generator().manual_seed(i)).cuda()
            model(x).square().mean().backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)
        models.append(model)
        opts.append(opt)
    full = [m.state_dict() for m in models]
    errs = [rel_err(full[1][k], v) for k, v in full[0].items()]
    assert max(errs) < 1e-5, errs
    pieces = [p.to_local() for p in models[1].parameters()]  # (a FullyShard parameter refuses is_pinned)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in pieces if t.numel())
    assert all(p.grad is None or p.grad.device.type == "cpu" for p in models[1].parameters())
    rep = opts[1].memory_report()
    assert rep["device"] == 0 and rep["host"] == rep["total"] == opts[0].memory_report()["total"], rep


def test_cuda_one_launch_over_shards_with_several_hyperparameter_sets():
    """[Note: one launch]: equal to one call per shard, and one kernel launch in all."""
    multi_equals_separate("cuda")
    shards = [
        [torch.randn(n, device="cuda") for _ in range(3)] + [torch.rand(n, device="cuda")]
        for n in (5, 70_001, 4096, 0, 12_345)
    ]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        zs.fused_adamw_multi_(
            *[[s[k] for s in shards] for k in range(4)], [dict(lr=1e-3, step=1), dict(lr=1e-2, step=9)], [0, 1, 1, 0, 1]
        )
        torch.cuda.synchronize()
    launches = [e for e in prof.events() if "adamw_multi_kernel" in e.name]
    assert len(launches) == 1, [e.name for e in prof.events()]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cuda_offloaded_gradients_reach_host_memory_during_backward(nccl_world1, stage):
    """[Note: offloaded gradients] on CUDA: by the end of backward the host copies
    (ZeRO-1/2: pinned mirrors; ZeRO-3: the units' pinned gradient shards) hold the
    reduced gradients, so the step copies no gradient (its window buffers have none);
    torch's clip reaches them; equal to the run without offload up to rounding."""
    results = []
    for off in (None, "cpu"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(97, 131), torch.nn.GELU(), torch.nn.Linear(131, 7)).cuda()
        if stage == 3:
            model = zs.FullyShard(model, wrap={torch.nn.Linear})
        opt = zs.ShardedOptimizer(model.parameters(), stage=min(stage, 2), offload=off, offload_fraction=0.6)
        for i in range(3):
            x = torch.randn(8, 97, generator=torch.Generator().manual_seed(i)).cuda()
            model(x).square().mean().backward()
            if off is not None and stage < 3:
                mirrored = [seg for seg in opt.source.segments if seg.mirror is not None]
                assert mirrored and all(seg.mirror.is_pinned() for seg in mirrored)
                assert all(torch.equal(seg.mirror, seg.grad.cpu()) for seg in mirrored)
            if off is not None and stage == 3:
                hosted = [u for u in model.units if u.grad_to_host]
                assert hosted and all(u.reduction.grad.tensor.is_pinned() for u in hosted)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        if off is not None:
            assert all("g" not in slot for slot in opt.source.storage.streamer.slots)
        full = model.state_dict()
        results.append({k: v.float().cpu() for k, v in full.items()})
    errs = [rel_err(results[1][k], v) for k, v in results[0].items()]
    assert max(errs) < 1e-5, errs


def _muon_run(kind, stage, cls, steps):
    """Muon (``cls``) over the 2-D weights and AdamW over the biases, clipped steps on
    CUDA: on a plain model ("torch") or through zeroshard at ``stage``; the final parameters."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(97, 131), torch.nn.GELU(), torch.nn.Linear(131, 61), torch.nn.GELU(), torch.nn.Linear(61, 7)
    ).cuda()
    if kind == "zeroshard" and stage == 3:
        net = zs.FullyShard(net, wrap={torch.nn.Linear})
    hidden = [p for p in net.parameters() if p.dim() == 2]
    rest = [p for p in net.parameters() if p.dim() != 2]
    muon, adamw = dict(lr=0.02, momentum=0.95), dict(lr=3e-3, weight_decay=0.1)
    if kind == "torch":
        opts = [cls(hidden, **muon), torch.optim.AdamW(rest, **adamw)]
    else:
        st = {} if stage == 3 else dict(stage=stage)
        vouch = {} if cls is torch.optim.Muon else dict(whole_tensor=True)
        opts = [
            zs.ShardedOptimizer(hidden, optimizer_class=cls, **muon, **st, **vouch),
            zs.ShardedOptimizer(rest, **adamw, **st),
        ]
    g = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(steps):
        x = torch.randn(16, 97, device="cuda", generator=g)
        net(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        for o in opts:
            o.step()
            o.zero_grad()
    return {k: v.float().cpu() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cuda_muon_equals_torch_muon(nccl_world1, stage):
    """The whole-tensor path on CUDA (issue 39). At world size 1 each matrix's owner is
    rank 0 and its gradient arrives unchanged: torch.optim.Muon's first step (bf16
    Newton-Schulz) is bitwise torch's; later steps see the AdamW-stepped biases, one fp32
    rounding apart, which bf16 Newton-Schulz magnifies, so three steps are compared with
    Newton-Schulz in fp32 (Muon32) within 1e-5."""
    ref, ours = (_muon_run(k, stage, torch.optim.Muon, 1) for k in ("torch", "zeroshard"))
    for k, v in ref.items():
        if v.dim() == 2:
            assert torch.equal(ours[k], v), k
    ref, ours = (_muon_run(k, stage, Muon32, 3) for k in ("torch", "zeroshard"))
    for k, v in ref.items():
        err = ((ours[k] - v).norm() / v.norm()).item()
        assert err < 1e-5, (k, err)
