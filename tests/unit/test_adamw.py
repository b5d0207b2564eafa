"""The fused AdamW kernel against torch.optim.AdamW(foreach=False)."""

import itertools

import pytest
import torch

import zeroshard as zs
from support.optimizers import check_against_torch, multi_equals_separate, run_against_torch

GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize(
    "grad_dtype,weight_decay,grad_scale", list(itertools.product(GRAD_DTYPES, [0.0, 0.01], [1.0, 0.37]))
)
def test_matches_torch_adamw_100_steps(grad_dtype, weight_decay, grad_scale):
    torch.set_num_threads(2)
    check_against_torch(*run_against_torch("cpu", grad_dtype, weight_decay, grad_scale))


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
    zs.fused_adamw_(
        [torch.zeros(31)],
        [g16],
        [torch.zeros(31)],
        [torch.zeros(31)],
        lr=1e-3,
        step=1,
        scale=torch.tensor([1e35]),
        found_inf=flag,
    )
    assert flag.item() == 1


def test_noop_flag_skips_the_update():
    p, g, m, v = _state(257)
    before = [t.clone() for t in (p, m, v)]
    zs.fused_adamw_([p], [g], [m], [v], lr=1e-1, step=1, noop=torch.ones(1, dtype=torch.int32))
    for a, b in zip((p, m, v), before):
        assert torch.equal(a, b)
    zs.fused_adamw_([p], [g], [m], [v], lr=1e-1, step=1, noop=torch.zeros(1, dtype=torch.int32))
    assert not torch.equal(p, before[0])


def test_scale_tensor_equals_prescaled_gradients():
    """The kernel takes the gradient as it is; a GradScaler's inverse scale (a tensor) multiplies it."""
    a = _state(999)
    b = [t.clone() for t in a]
    zs.fused_adamw_([a[0]], [a[1] * 0.25], [a[2]], [a[3]], lr=1e-2, step=4)
    zs.fused_adamw_([b[0]], [b[1]], [b[2]], [b[3]], lr=1e-2, step=4, scale=torch.tensor([0.25]))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_several_shards_in_one_call_equal_separate_calls():
    a, b = _state(100, 3), _state(37, 4)
    a2, b2 = [t.clone() for t in a], [t.clone() for t in b]
    zs.fused_adamw_([a[0], b[0]], [a[1], b[1]], [a[2], b[2]], [a[3], b[3]], lr=1e-3, step=2, weight_decay=0.1)
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
    sizes = [3, 700_001, 1, 1_500_007, 65_537]  # 2 threads split ~2.27M elements inside shard 3
    g = torch.Generator().manual_seed(11)
    base = [
        [
            torch.randn(n, generator=g),
            torch.randn(n, generator=g).to(grad_dtype),
            torch.randn(n, generator=g),
            torch.rand(n, generator=g),
        ]
        for n in sizes
    ]
    one = [[t.clone() for t in s] for s in base]
    each = [[t.clone() for t in s] for s in base]
    outs_one = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    outs_each = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    flag = torch.zeros(1, dtype=torch.int32)
    hyper = dict(lr=1e-3, step=4, weight_decay=0.05, scale=torch.tensor([0.5]))
    zs.fused_adamw_(*[[s[k] for s in one] for k in range(4)], outs=outs_one, found_inf=flag, **hyper)
    for s, o in zip(each, outs_each):
        zs.fused_adamw_([s[0]], [s[1]], [s[2]], [s[3]], outs=[o], **hyper)
    for a, b in zip(one, each):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert all(torch.equal(a, b) for a, b in zip(outs_one, outs_each))
    assert flag.item() == 0
    one[3][1][1_000_000] = float("inf")  # a non-finite gradient in the part that spans shards
    zs.fused_adamw_(*[[s[k] for s in one] for k in range(4)], found_inf=flag, **hyper)
    assert flag.item() == 1


def test_one_call_with_several_hyperparameter_sets_equals_separate_calls():
    multi_equals_separate("cpu")


def test_multi_call_checks_every_set_and_index_before_writing():
    a = _state(10)
    before = [t.clone() for t in a]
    with pytest.raises(ValueError, match=r"hyper_of\[1\] is 2 but there are 2 hyperparameter sets"):
        zs.fused_adamw_multi_(
            [a[0], a[0]],
            [a[1], a[1]],
            [a[2], a[2]],
            [a[3], a[3]],
            [dict(lr=1e-3, step=1), dict(lr=1e-3, step=2)],
            [0, 2],
        )
    with pytest.raises(ValueError, match="step must be >= 1"):
        zs.fused_adamw_multi_([a[0]], [a[1]], [a[2]], [a[3]], [dict(lr=1e-3, step=1), dict(lr=1e-3, step=0)], [0])
    with pytest.raises(ValueError, match="hyper_of has 2 entries but params has 1"):
        zs.fused_adamw_multi_([a[0]], [a[1]], [a[2]], [a[3]], [dict(lr=1e-3, step=1)], [0, 0])
    assert all(torch.equal(x, y) for x, y in zip(a, before))


def test_a_hyperparameter_set_with_an_unknown_key_is_refused():
    p, g, m, v = _state(11)
    with pytest.raises(ValueError, match=r"set 0 has unknown keys \['grad_scale'\].*scale= tensor"):
        zs.fused_adamw_multi_([p], [g], [m], [v], [dict(lr=1e-3, step=1, grad_scale=0.5)], [0])
    with pytest.raises(TypeError, match="grad_scale"):
        zs.fused_adamw_([p], [g], [m], [v], lr=1e-3, step=1, grad_scale=0.5)
