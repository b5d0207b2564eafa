"""Lightning on zeroshard: ``Trainer(strategy="zeroshard_stage_2")`` once this module is
imported, or ``Trainer(strategy=ZeroShardStrategy(stage=3, ...))`` (``strategy``);
the optimizer ``configure_optimizers`` returns is rebuilt as a ``ShardedOptimizer``
(``optimizers``); ``trainer.save_checkpoint`` writes a zeroshard checkpoint directory
and ``convert_checkpoint`` turns it into one plain Lightning file (``checkpoints``).
Lightning (``lightning.pytorch``) is an optional extra: only this package imports it.
See docs/lightning.md.

May import: the public API only (``zeroshard``, ``zeroshard.checkpoint``,
``zeroshard.comm``, ``zeroshard.plan``).
"""

from __future__ import annotations

try:
    from lightning.pytorch.strategies import StrategyRegistry
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "zeroshard.integrations.lightning needs Lightning: pip install lightning "
        "(the lightning.pytorch package; tested with lightning 2.6)"
    ) from e

from .checkpoints import convert_checkpoint
from .strategy import ZeroShardStrategy

ZeroShardStrategy.register_strategies(StrategyRegistry)

__all__ = ["ZeroShardStrategy", "convert_checkpoint"]
