"""The extension reports how it was built, and CI proves the CUDA code compiles and links."""

import os

import pytest
import torch

import zeroshard as zs


def test_build_info_reports_torch_and_cuda():
    info = zs.build_info()
    assert info["torch_version"].split("+")[0].split(".")[:2] == torch.__version__.split("+")[0].split(".")[:2], (
        "extension built against a different torch minor version than the one imported"
    )
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


def test_the_cuda_adamw_launch_choices_set_and_read_back():
    """`python -m benchmarks adamw` measures the CUDA kernel under other launch choices; setting
    them touches no device. The default is 16 plain-access blocks per multiprocessor."""
    if not zs.build_info()["cuda"]:
        assert not hasattr(zs._C, "adamw_cuda_launch")
        return
    launch = zs._C.adamw_cuda_launch
    assert launch() == (False, 16)
    try:
        assert launch(True, 4) == (True, 4)
        assert launch(blocks_per_sm=2) == (True, 2) and launch() == (True, 2)
        with pytest.raises(ValueError, match="blocks_per_sm must be at least 1"):
            launch(blocks_per_sm=0)
    finally:
        launch(False, 16)
    assert launch() == (False, 16)


def test_public_api():
    for name in ("compute_layout", "fused_adamw_", "reduce_scatter", "all_gather", "all_reduce", "build_info"):
        assert callable(getattr(zs, name)), name


def _needed_libraries(path: str) -> list:
    """DT_NEEDED entries of a 64-bit little-endian ELF shared object (its dynamic section)."""
    import struct

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path} is not a 64-bit LE ELF file"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, sh_type, _, _, off, size, link, _, _, entsize in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for k in range(0, size, entsize):
            tag, val = struct.unpack_from("<qQ", data, off + k)
            if tag == 1:  # DT_NEEDED
                names.append(data[strtab + val : data.index(b"\0", strtab + val)].decode())
    return names


def test_extension_uses_the_shared_cxx_runtime():
    """A private static copy of libstdc++ crashes the first error message that
    formats a number (see [Note: shared C++ runtime] in CMakeLists.txt)."""
    from zeroshard import _C

    needed = _needed_libraries(_C.__file__)
    assert "libstdc++.so.6" in needed, f"{_C.__file__} links {needed}: the C++ runtime was linked statically"
    with pytest.raises(ValueError, match="1009"):  # formats an int64 into the message
        zs.fused_adamw_(
            [torch.zeros(1009)], [torch.zeros(1008)], [torch.zeros(1009)], [torch.zeros(1009)], lr=1e-3, step=1
        )
