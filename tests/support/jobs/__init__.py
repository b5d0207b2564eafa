"""The jobs the tests launch, as scripts (torchrun) or as modules whose functions run on the
ranks of a pool:

* ``hf_job.py``, ``lightning_job.py``: every Hugging Face / Lightning trainer of one world
  size in one torchrun launch (tests/integration/test_hf.py, test_lightning.py, and their
  ``--device`` runs in test_gpu_integrations.py);
* ``rank0_traps.py``: a collective call on rank 0 alone (tests/integration/test_gpt_script.py);
* ``restart_job.py``: a rank that kills itself in the first attempts (test_restarts.py);
* ``ds_helpers_job.py``, ``ds_front_door_job.py``: rank-side code of the DeepSpeed tests,
  run on a pool's ranks (test_deepspeed_engine.py);
* ``TINY_SCRIPT``: the start of the torchrun scripts the checkpoint tests write.
"""

TINY_SCRIPT = (  # a torchrun script's start: a tiny ZeRO-3 model, its optimizer, a batch
    "import sys, torch, torch.distributed as dist, torch.nn as nn, zeroshard as zs\n"
    "dist.init_process_group('gloo')\n"
    "torch.manual_seed(0)\n"
    "model = zs.FullyShard(nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 1)), wrap={nn.Linear})\n"
    "opt = zs.ShardedOptimizer(model.parameters(), lr=1e-2)\n"
    "x = torch.randn(8, 7)\n"
)
