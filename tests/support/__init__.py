"""What the tests share, so that no test module imports another (tests/conftest.py puts
tests/ on the path: ``from support.launch import launch``):

* ``launch.py``: ``launch(kind, ...)``, the one way tests start ranks: "pool" (the session's
  gloo ranks, ``pool.py``), "forked" (ranks forked from a server that imported torch once,
  ``forked.py``) and "torchrun" (torch.distributed.run itself), and the torchrun jobs' results;
* ``jobs/``: the scripts and rank-side modules those launches run;
* models and their reference runs: ``models.py`` (small shared models), ``flat_net.py``
  (ZeRO-1/2's Net and single-process AdamW), ``gpt.py`` (ZeRO-3's GPT and its reference),
  ``ddp_parity.py`` (a DDP script under DDP and under a stage), ``optimizers.py`` (the AdamW
  kernel against torch, Muon32), ``ds.py`` and ``ds_configs.py`` (the DeepSpeed tests');
* ``checks.py`` (errors between tensors and state dicts, refusals), ``records.py`` (the flight
  record as a test reads it), ``disk.py`` (directories, held checkpoint writes).
"""
