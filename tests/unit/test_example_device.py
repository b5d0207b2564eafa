"""examples/_device.py: which backend and device each example picks, for the machines users have
(the CUDA branch is taken here with torch.cuda's answers replaced; on a GPU host it runs for real
in tests/integration/test_gpu.py's examples)."""

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples")


def _load():
    spec = importlib.util.spec_from_file_location("_device", os.path.join(EXAMPLES, "_device.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "gpus,local_rank,local_ranks,want",
    [
        (0, "0", None, ("gloo", "cpu")),  # no GPU: plain python
        (0, "1", "2", ("gloo", "cpu")),  # no GPU: torchrun, 2 ranks
        (1, "0", None, ("nccl", "cuda:0")),  # one GPU, plain python
        (2, "1", "2", ("nccl", "cuda:1")),  # a GPU per rank: each rank its own, never GPU 0
        (8, "5", "8", ("nccl", "cuda:5")),
        (1, "1", "2", ("gloo", "cpu")),  # 2 ranks on 1 GPU: NCCL cannot share it
        (4, "3", "8", ("gloo", "cpu")),
    ],
)
def test_backend_and_device(monkeypatch, gpus, local_rank, local_ranks, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    if local_ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    backend, device = _load().backend_and_device()
    assert (backend, str(device)) == want


def test_no_nccl_means_gloo(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _load().backend_and_device() == ("gloo", torch.device("cpu"))
