"""Where the examples run: NCCL on ``cuda:LOCAL_RANK`` where this node has a GPU for
every rank, else gloo on the CPU. Every training example starts with

    import _device                      # this file (examples/ is on sys.path when a script there runs)
    device = _device.setup()            # the process group is up; put the model and batches on `device`

so a script runs on the GPUs where there are GPUs and on the CPU elsewhere,
unchanged. ``torchrun --nproc-per-node N examples/X.py`` (or ``python
examples/X.py``) puts the script's own folder, examples/, first on ``sys.path``:
that is what makes ``import _device`` work from any working directory. To use it
in a script of your own, copy this file next to it, or copy ``setup``'s few lines.
"""

import os

import torch
import torch.distributed as dist

import zeroshard


def backend_and_device():
    """``("nccl", cuda:LOCAL_RANK)`` when CUDA (and NCCL) is available and this node
    has at least as many visible GPUs as torchrun started ranks on it
    (``LOCAL_WORLD_SIZE``); else ``("gloo", cpu)``. NCCL needs a GPU of its own for
    every rank, so 4 ranks on a 1-GPU machine run on the CPU (as they would with
    ``CUDA_VISIBLE_DEVICES=``), not on one shared GPU. Outside torchrun (plain
    ``python``) there is one rank: ``LOCAL_RANK`` 0 of 1."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= local_ranks:
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def setup() -> torch.device:
    """Initialise the default process group on the backend ``backend_and_device()``
    picks and return the device this rank computes on. On a GPU it is made the
    current device first (``torch.cuda.set_device``), so that NCCL, ``.cuda()``
    and torch's object collectives use this rank's GPU, never GPU 0, and the group
    is bound to it (``device_id``: NCCL connects at once, not at the first
    collective). ``zeroshard.init_distributed`` creates the group so that a job
    ``torchrun --max-restarts`` restarts comes up again; its collectives time out
    after 10 minutes on either backend."""
    backend, device = backend_and_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        zeroshard.init_distributed(backend, device_id=device)
    else:
        zeroshard.init_distributed(backend)
    return device
