"""The extension reports how it was built, and CI proves the CUDA code compiles and links."""
import os

import torch

import zeroshard as zs


def test_build_info_reports_torch_and_cuda():
    info = zs.build_info()
    assert info["torch_version"].split("+")[0].split(".")[:2] == torch.__version__.split("+")[0].split(".")[:2], \
        "extension built against a different torch minor version than the one imported"
    assert isinstance(info["cuda"], bool)
    if torch.version.cuda is None:
        assert not info["cuda"], "a CUDA build needs a CUDA build of torch"
    if info["cuda"]:
        assert info["cuda_archs"] and all(a.strip().isdigit() for a in info["cuda_archs"].split(","))
        assert info["cuda_compiler_version"].split(".")[0].isdigit()


def test_ci_builds_the_cuda_kernels():
    # .ci/run sets this when nvcc is present: the CUDA kernels must then be in
    # the extension, not silently left out.
    if os.environ.get("ZEROSHARD_EXPECT_CUDA_BUILD") == "1":
        assert zs.build_info()["cuda"], "nvcc is present but the CUDA kernels were not built"
    else:
        assert zs.build_info()["cuda"] in (True, False)


def test_public_api():
    for name in ("compute_layout", "fused_adamw_", "reduce_scatter", "all_gather", "all_reduce",
                 "build_info"):
        assert callable(getattr(zs, name)), name
