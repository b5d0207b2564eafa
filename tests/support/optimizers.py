"""Reference optimizers: the fused AdamW kernel run beside torch's AdamW in fp32 and fp64
(the kernel's tests on the CPU and on the GPU), one multi-set kernel call against one call
per shard, and ``Muon32``, torch's Muon with Newton-Schulz in fp32."""

import math

import torch

import zeroshard as zs

SIZES = [1, 13, 1009, 65537]  # odd and prime; 65537 spans several CPU threads' chunks


def list_rel_err(a, b) -> float:
    """Norm-wise relative error max|a - b| / max|b| over all tensors of a list, in float64."""
    a = torch.cat([t.detach().double().flatten().cpu() for t in a])
    b = torch.cat([t.detach().double().flatten().cpu() for t in b])
    return ((a - b).abs().max() / b.abs().max()).item()


def run_against_torch(
    device,
    grad_dtype,
    weight_decay,
    grad_scale,
    steps=100,
    out_dtype=None,
    lr=1e-3,
    betas=(0.9, 0.999),
    eps=1e-8,
    seed=0,
):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(n, generator=gen) for n in SIZES]
    ref = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    opt = torch.optim.AdamW(ref, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    exact = [torch.nn.Parameter(t.clone().double().to(device)) for t in init]  # fp64 AdamW
    opt64 = torch.optim.AdamW(exact, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    ours = [t.clone().to(device) for t in init]
    m = [torch.zeros_like(t) for t in ours]
    v = [torch.zeros_like(t) for t in ours]
    outs = None if out_dtype is None else [torch.empty_like(t, dtype=out_dtype) for t in ours]
    # (the kernel takes the gradient as it is; a GradScaler's inverse scale comes as a tensor)
    scale = None if grad_scale == 1.0 else torch.tensor([grad_scale], device=device)
    for step in range(1, steps + 1):
        grads = [torch.randn(n, generator=gen).to(grad_dtype).to(device) for n in SIZES]
        for p, p64, g in zip(ref, exact, grads):
            p.grad = g.float() * grad_scale
            p64.grad = g.double() * grad_scale
        opt.step()
        opt64.step()
        zs.fused_adamw_(
            ours,
            grads,
            m,
            v,
            lr=lr,
            beta1=betas[0],
            beta2=betas[1],
            eps=eps,
            weight_decay=weight_decay,
            step=step,
            scale=scale,
            outs=outs,
        )
        if outs is not None:
            for o, p in zip(outs, ours):
                assert torch.equal(o, p.to(out_dtype)), "low-precision output != rounded master"
    return ref, opt, exact, opt64, ours, m, v


def check_against_torch(ref, opt, exact, opt64, ours, m, v):
    """fp32 relative error <= 1e-6 against torch, and no worse than twice
    torch's own fp32 error against fp64 AdamW (plus one fp32 ulp)."""
    for name, mine, key in (("params", ours, None), ("exp_avg", m, "exp_avg"), ("exp_avg_sq", v, "exp_avg_sq")):
        theirs = ref if key is None else [opt.state[p][key] for p in ref]
        truth = exact if key is None else [opt64.state[p][key] for p in exact]
        errs = (
            f"{name}: ours vs torch {list_rel_err(mine, theirs):.3g}, ours vs fp64 {list_rel_err(mine, truth):.3g}, "
            f"torch vs fp64 {list_rel_err(theirs, truth):.3g}"
        )
        assert list_rel_err(mine, theirs) <= 1e-6, errs
        assert list_rel_err(mine, truth) <= 2 * list_rel_err(theirs, truth) + 6e-8, errs


def mixed_shards(device, seed):
    """Awkward shards for one multi-set call: empty, shorter than a vector, one past
    a CUDA chunk (4096), misaligned views, fp32/bf16/fp16 gradients, outputs of
    every kind or none."""
    g = torch.Generator().manual_seed(seed)
    specs = [
        (0, torch.float32, None, 0),
        (1, torch.bfloat16, torch.bfloat16, 0),
        (7, torch.float16, torch.float16, 0),
        (4097, torch.bfloat16, None, 0),
        (4096, torch.float32, torch.bfloat16, 1),
        (10_007, torch.float16, torch.float32, 0),
        (8_200, torch.bfloat16, torch.float16, 3),
    ]
    shards = []
    for n, gd, od, skew in specs:
        ts = [
            torch.randn(n + skew, generator=g),
            torch.randn(n + skew, generator=g).to(gd),
            torch.randn(n + skew, generator=g),
            torch.rand(n + skew, generator=g),
        ]
        ts = [t.to(device)[skew:] for t in ts]
        out = None if od is None else torch.zeros(n + skew, dtype=od, device=device)[skew:]
        shards.append(ts + [out])
    return shards


SETS = [
    dict(lr=1e-3, step=1, weight_decay=0.01),
    dict(lr=3e-4, beta1=0.8, beta2=0.99, eps=1e-6, step=7),
    dict(lr=1e-2, beta1=0.95, beta2=0.995, step=1000, weight_decay=0.1),
]


WHICH = [0, 1, 0, 2, 1, 2, 0]


def multi_equals_separate(device):
    """One fused_adamw_multi_ call over shards with three hyperparameter sets equals
    one fused_adamw_ call per shard, bit for bit, outputs and the non-finite flag included."""
    one, each = mixed_shards(device, 3), mixed_shards(device, 3)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    scale = torch.tensor([0.25], device=device)
    zs.fused_adamw_multi_(
        *[[s[k] for s in one] for k in range(4)], SETS, WHICH, outs=[s[4] for s in one], scale=scale, found_inf=flag
    )
    for s, k in zip(each, WHICH):
        h = dict(SETS[k])
        zs.fused_adamw_(
            s[:1],
            s[1:2],
            s[2:3],
            s[3:4],
            outs=None if s[4] is None else [s[4]],
            scale=scale,
            beta1=h.pop("beta1", 0.9),
            beta2=h.pop("beta2", 0.999),
            **h,
        )
    for a, b in zip(one, each):
        for x, y in zip(a, b):
            assert (x is None and y is None) or torch.equal(x, y)
    assert flag.item() == 0
    one[3][1][4096] = float("nan")  # the one element past the first chunk
    zs.fused_adamw_multi_(*[[s[k] for s in one] for k in range(4)], SETS, WHICH, found_inf=flag)
    assert flag.item() == 1


class Muon32(torch.optim.Muon):
    """torch.optim.Muon's update with Newton-Schulz in fp32 (torch's runs in bf16): a
    class vouched for with whole_tensor=True, and a reference whose only noise is fp32's."""

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            a, b, c = g["ns_coefficients"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - g["momentum"])
                x = p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf.clone()
                tall = x.shape[0] > x.shape[1]
                x = x.T if tall else x
                x = x / x.norm().clamp(min=g["eps"])
                for _ in range(g["ns_steps"]):
                    m = x @ x.T
                    x = a * x + (b * m + c * m @ m) @ x
                x = x.T if tall else x
                rows, cols = p.shape
                ratio = (
                    0.2 * math.sqrt(max(rows, cols))
                    if g["adjust_lr_fn"] == "match_rms_adamw"
                    else math.sqrt(max(1, rows / cols))
                )
                adjusted = g["lr"] * ratio
                p.mul_(1 - g["lr"] * g["weight_decay"]).add_(x, alpha=-adjusted)
