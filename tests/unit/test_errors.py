"""Bad input to the kernels gets a ValueError naming the tensor, dtype, device or size."""

import pytest
import torch

import zeroshard as zs


def shard(n=10, dtype=torch.float32):
    return torch.zeros(n, dtype=dtype)


def call(params=None, grads=None, m=None, v=None, **kw):
    params = params if params is not None else [shard(), shard()]
    grads = grads if grads is not None else [shard(), shard()]
    m = m if m is not None else [shard(), shard()]
    v = v if v is not None else [shard(), shard()]
    kw.setdefault("lr", 1e-3)
    kw.setdefault("step", 1)
    zs.fused_adamw_(params, grads, m, v, **kw)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(grads=[shard()]), "grads has 1 tensors but params has 2"),
        (dict(outs=[shard(dtype=torch.bfloat16)]), "outs has 1 tensors"),
        (dict(grads=[shard(), torch.zeros(20)[::2]]), r"grads\[1\] is not contiguous"),
        (
            dict(grads=[shard(), shard(dtype=torch.float64)]),
            r"grads\[1\] has dtype Double, but expected Float or BFloat16 or Half",
        ),
        (dict(params=[shard(), shard(dtype=torch.bfloat16)]), r"params\[1\] has dtype BFloat16, but expected Float"),
        (dict(m=[shard(), shard(dtype=torch.float16)]), r"exp_avgs\[1\] has dtype Half"),
        (dict(grads=[shard(), shard(dtype=torch.int32)]), r"grads\[1\] has dtype Int"),
        (dict(v=[shard(), shard(9)]), r"exp_avg_sqs\[1\] has 9 elements, but 10 are needed"),
        (dict(outs=[shard(dtype=torch.bfloat16), shard(11, dtype=torch.bfloat16)]), r"outs\[1\] has 11 elements"),
        (dict(grads=[shard(), torch.zeros(10, device="meta")]), r"grads\[1\] is on meta but params\[0\] is on cpu"),
        (
            dict(params=[torch.zeros(10, device="meta"), shard()]),
            r"params\[0\] is on meta; fused_adamw_ supports CPU and CUDA",
        ),
        (dict(found_inf=torch.zeros(2, dtype=torch.int32)), "found_inf has 2 elements"),
        (dict(noop=torch.zeros(1)), "noop has dtype Float, but expected Int"),
        (dict(scale=torch.zeros(1, dtype=torch.float64)), "scale has dtype Double"),
        (dict(step=0), "step must be >= 1"),
        (dict(lr=-1.0), "lr must be >= 0"),
        (dict(beta1=1.0), r"beta1 must be in \[0, 1\)"),
        (dict(weight_decay=-0.1), "weight_decay must be >= 0"),
    ],
)
def test_bad_kernel_input(kwargs, match):
    before = [t.clone() for t in (shard(), shard())]
    params = kwargs.pop("params", [shard(), shard()])
    with pytest.raises(ValueError, match=match):
        call(params=params, **kwargs)
    # nothing was written before the error
    if all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params):
        assert all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.skipif(
    zs.build_info()["cuda"] or not torch.cuda.is_available(),
    reason="only meaningful for a CPU-only build on a CUDA machine",
)
def test_cuda_tensor_on_cpu_only_build():  # pragma: no cover
    t = torch.zeros(4, device="cuda")
    with pytest.raises(ValueError, match="no CUDA kernels"):
        zs.fused_adamw_([t], [t], [t.clone()], [t.clone()], lr=1e-3, step=1)


def test_collective_without_process_group():
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        zs.all_reduce(torch.zeros(3))
