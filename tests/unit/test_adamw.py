"""The fused AdamW kernel against torch.optim.AdamW(foreach=False)."""
import itertools

import pytest
import torch

import zeroshard as zs

SIZES = [1, 13, 1009, 65537]  # odd and prime; 65537 spans several CPU threads' chunks
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rel_err(a, b) -> float:
    """Norm-wise relative error max|a - b| / max|b| over all tensors of a list, in float64."""
    a = torch.cat([t.detach().double().flatten().cpu() for t in a])
    b = torch.cat([t.detach().double().flatten().cpu() for t in b])
    return ((a - b).abs().max() / b.abs().max()).item()


def run_against_torch(device, grad_dtype, weight_decay, grad_scale, steps=100, out_dtype=None,
                      lr=1e-3, betas=(0.9, 0.999), eps=1e-8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(n, generator=gen) for n in SIZES]
    ref = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    opt = torch.optim.AdamW(ref, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            foreach=False)
    exact = [torch.nn.Parameter(t.clone().double().to(device)) for t in init]  # fp64 AdamW
    opt64 = torch.optim.AdamW(exact, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                              foreach=False)
    ours = [t.clone().to(device) for t in init]
    m = [torch.zeros_like(t) for t in ours]
    v = [torch.zeros_like(t) for t in ours]
    outs = None if out_dtype is None else [torch.empty_like(t, dtype=out_dtype) for t in ours]
    for step in range(1, steps + 1):
        grads = [torch.randn(n, generator=gen).to(grad_dtype).to(device) for n in SIZES]
        for p, p64, g in zip(ref, exact, grads):
            p.grad = g.float() * grad_scale
            p64.grad = g.double() * grad_scale
        opt.step()
        opt64.step()
        zs.fused_adamw_(ours, grads, m, v, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                        weight_decay=weight_decay, step=step, grad_scale=grad_scale, outs=outs)
        if outs is not None:
            for o, p in zip(outs, ours):
                assert torch.equal(o, p.to(out_dtype)), "low-precision output != rounded master"
    return ref, opt, exact, opt64, ours, m, v


@pytest.mark.parametrize("grad_dtype,weight_decay,grad_scale",
                         list(itertools.product(GRAD_DTYPES, [0.0, 0.01], [1.0, 0.37])))
def test_matches_torch_adamw_100_steps(grad_dtype, weight_decay, grad_scale):
    torch.set_num_threads(2)
    check_against_torch(*run_against_torch("cpu", grad_dtype, weight_decay, grad_scale))


def check_against_torch(ref, opt, exact, opt64, ours, m, v):
    """fp32 relative error <= 1e-6 against torch, and no worse than twice
    torch's own fp32 error against fp64 AdamW (plus one fp32 ulp)."""
    for name, mine, key in (("params", ours, None), ("exp_avg", m, "exp_avg"),
                            ("exp_avg_sq", v, "exp_avg_sq")):
        theirs = ref if key is None else [opt.state[p][key] for p in ref]
        truth = exact if key is None else [opt64.state[p][key] for p in exact]
        errs = f"{name}: ours vs torch {rel_err(mine, theirs):.3g}, ours vs fp64 {rel_err(mine, truth):.3g}, " \
               f"torch vs fp64 {rel_err(theirs, truth):.3g}"
        assert rel_err(mine, theirs) <= 1e-6, errs
        assert rel_err(mine, truth) <= 2 * rel_err(theirs, truth) + 6e-8, errs


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_output_is_rounded_master(out_dtype):
    # the equality is asserted inside every step
    run_against_torch("cpu", torch.bfloat16, 0.01, 1.0, steps=10, out_dtype=out_dtype)


def _state(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(3)] + [torch.rand(n, generator=g)]


def test_found_inf_flag_is_set_only_for_non_finite_grads():
    p, g, m, v = _state(1009)
    flag = torch.zeros(1, dtype=torch.int32)
    zs.fused_adamw_([p], [g], [m], [v.abs()], lr=1e-3, step=1, found_inf=flag)
    assert flag.item() == 0
    for bad in (float("inf"), float("-inf"), float("nan")):
        g2 = g.clone()
        g2[877] = bad
        flag.zero_()
        zs.fused_adamw_([p], [g2], [m], [v.abs()], lr=1e-3, step=2, found_inf=flag)
        assert flag.item() == 1, bad
    # finite in fp16 storage, overflows once scaled
    g16 = torch.full((31,), 60000.0, dtype=torch.float16)
    flag.zero_()
    zs.fused_adamw_([torch.zeros(31)], [g16], [torch.zeros(31)], [torch.zeros(31)], lr=1e-3, step=1,
                    grad_scale=1e35, found_inf=flag)
    assert flag.item() == 1


def test_noop_flag_skips_the_update():
    p, g, m, v = _state(257)
    before = [t.clone() for t in (p, m, v)]
    zs.fused_adamw_([p], [g], [m], [v], lr=1e-1, step=1, noop=torch.ones(1, dtype=torch.int32))
    for a, b in zip((p, m, v), before):
        assert torch.equal(a, b)
    zs.fused_adamw_([p], [g], [m], [v], lr=1e-1, step=1, noop=torch.zeros(1, dtype=torch.int32))
    assert not torch.equal(p, before[0])


def test_scale_tensor_equals_host_scale():
    a = _state(999)
    b = [t.clone() for t in a]
    zs.fused_adamw_([a[0]], [a[1]], [a[2]], [a[3]], lr=1e-2, step=4, grad_scale=0.25)
    zs.fused_adamw_([b[0]], [b[1]], [b[2]], [b[3]], lr=1e-2, step=4, grad_scale=0.5,
                    scale=torch.tensor([0.5]))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_several_shards_in_one_call_equal_separate_calls():
    a, b = _state(100, 3), _state(37, 4)
    a2, b2 = [t.clone() for t in a], [t.clone() for t in b]
    zs.fused_adamw_([a[0], b[0]], [a[1], b[1]], [a[2], b[2]], [a[3], b[3]], lr=1e-3, step=2,
                    weight_decay=0.1)
    for s in (a2, b2):
        zs.fused_adamw_([s[0]], [s[1]], [s[2]], [s[3]], lr=1e-3, step=2, weight_decay=0.1)
    for x, y in zip(a + b, a2 + b2):
        assert torch.equal(x, y)


def test_thread_count_does_not_change_results():
    a = _state(200_003)
    b = [t.clone() for t in a]
    torch.set_num_threads(1)
    zs.fused_adamw_([a[0]], [a[1]], [a[2]], [a[3]], lr=1e-3, step=1)
    torch.set_num_threads(2)
    zs.fused_adamw_([b[0]], [b[1]], [b[2]], [b[3]], lr=1e-3, step=1)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_one_call_over_many_shards_equals_one_call_per_shard(grad_dtype):
    """The CPU kernel runs one parallel region over every shard of a call: parts
    that span shard boundaries give exactly the per-shard results."""
    torch.set_num_threads(2)
    sizes = [3, 700_001, 1, 1_500_007, 65_537]      # 2 threads split ~2.27M elements inside shard 3
    g = torch.Generator().manual_seed(11)
    base = [[torch.randn(n, generator=g), torch.randn(n, generator=g).to(grad_dtype),
             torch.randn(n, generator=g), torch.rand(n, generator=g)] for n in sizes]
    one = [[t.clone() for t in s] for s in base]
    each = [[t.clone() for t in s] for s in base]
    outs_one = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    outs_each = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    flag = torch.zeros(1, dtype=torch.int32)
    hyper = dict(lr=1e-3, step=4, weight_decay=0.05, grad_scale=0.5)
    zs.fused_adamw_(*[[s[k] for s in one] for k in range(4)], outs=outs_one, found_inf=flag, **hyper)
    for s, o in zip(each, outs_each):
        zs.fused_adamw_([s[0]], [s[1]], [s[2]], [s[3]], outs=[o], **hyper)
    for a, b in zip(one, each):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert all(torch.equal(a, b) for a, b in zip(outs_one, outs_each))
    assert flag.item() == 0
    one[3][1][1_000_000] = float("inf")               # a non-finite gradient in the part that spans shards
    zs.fused_adamw_(*[[s[k] for s in one] for k in range(4)], found_inf=flag, **hyper)
    assert flag.item() == 1


def _mixed_shards(device, seed):
    """Awkward shards for one multi-set call: empty, shorter than a vector, one past
    a CUDA chunk (4096), misaligned views, fp32/bf16/fp16 gradients, outputs of
    every kind or none."""
    g = torch.Generator().manual_seed(seed)
    specs = [(0, torch.float32, None, 0), (1, torch.bfloat16, torch.bfloat16, 0), (7, torch.float16, torch.float16, 0),
             (4097, torch.bfloat16, None, 0), (4096, torch.float32, torch.bfloat16, 1),
             (10_007, torch.float16, torch.float32, 0), (8_200, torch.bfloat16, torch.float16, 3)]
    shards = []
    for n, gd, od, skew in specs:
        ts = [torch.randn(n + skew, generator=g), torch.randn(n + skew, generator=g).to(gd),
              torch.randn(n + skew, generator=g), torch.rand(n + skew, generator=g)]
        ts = [t.to(device)[skew:] for t in ts]
        out = None if od is None else torch.zeros(n + skew, dtype=od, device=device)[skew:]
        shards.append(ts + [out])
    return shards


SETS = [dict(lr=1e-3, step=1, weight_decay=0.01), dict(lr=3e-4, beta1=0.8, beta2=0.99, eps=1e-6, step=7, grad_scale=0.5),
        dict(lr=1e-2, beta1=0.95, beta2=0.995, step=1000, weight_decay=0.1, grad_scale=2.0)]
WHICH = [0, 1, 0, 2, 1, 2, 0]


def multi_equals_separate(device):
    """One fused_adamw_multi_ call over shards with three hyperparameter sets equals
    one fused_adamw_ call per shard, bit for bit, outputs and the non-finite flag included."""
    one, each = _mixed_shards(device, 3), _mixed_shards(device, 3)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    scale = torch.tensor([0.25], device=device)
    zs.fused_adamw_multi_(*[[s[k] for s in one] for k in range(4)], SETS, WHICH, outs=[s[4] for s in one],
                          scale=scale, found_inf=flag)
    for s, k in zip(each, WHICH):
        h = dict(SETS[k])
        zs.fused_adamw_(s[:1], s[1:2], s[2:3], s[3:4], outs=None if s[4] is None else [s[4]], scale=scale,
                        beta1=h.pop("beta1", 0.9), beta2=h.pop("beta2", 0.999), **h)
    for a, b in zip(one, each):
        for x, y in zip(a, b):
            assert (x is None and y is None) or torch.equal(x, y)
    assert flag.item() == 0
    one[3][1][4096] = float("nan")            # the one element past the first chunk
    zs.fused_adamw_multi_(*[[s[k] for s in one] for k in range(4)], SETS, WHICH, found_inf=flag)
    assert flag.item() == 1


def test_one_call_with_several_hyperparameter_sets_equals_separate_calls():
    multi_equals_separate("cpu")


def test_multi_call_checks_every_set_and_index_before_writing():
    a = _state(10)
    before = [t.clone() for t in a]
    with pytest.raises(ValueError, match=r"hyper_of\[1\] is 2 but there are 2 hyperparameter sets"):
        zs.fused_adamw_multi_([a[0], a[0]], [a[1], a[1]], [a[2], a[2]], [a[3], a[3]],
                              [dict(lr=1e-3, step=1), dict(lr=1e-3, step=2)], [0, 2])
    with pytest.raises(ValueError, match="step must be >= 1"):
        zs.fused_adamw_multi_([a[0]], [a[1]], [a[2]], [a[3]], [dict(lr=1e-3, step=1), dict(lr=1e-3, step=0)], [0])
    with pytest.raises(ValueError, match="hyper_of has 2 entries but params has 1"):
        zs.fused_adamw_multi_([a[0]], [a[1]], [a[2]], [a[3]], [dict(lr=1e-3, step=1)], [0, 0])
    assert all(torch.equal(x, y) for x, y in zip(a, before))
