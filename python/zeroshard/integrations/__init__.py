"""Adapters for other tools: each translates a tool's calls and configuration
into zeroshard's public API, at the edge of the package, and is never a second
implementation of stages, checkpoints or clipping. ``deepspeed``: DeepSpeed
configs and scripts through ``zeroshard.initialize`` (docs/deepspeed.md);
``lightning``: ``Trainer(strategy="zeroshard_stage_2")`` (docs/lightning.md), the only
module that imports Lightning.

May import: the public API only (the root package ``zeroshard`` and the public
modules ``zeroshard.comm``, ``zeroshard.checkpoint``, ``zeroshard.plan``).
"""
