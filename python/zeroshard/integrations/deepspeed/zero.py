"""``zeroshard.integrations.deepspeed.zero``: what a DeepSpeed script reaches as
``deepspeed.zero``: ``GatheredParameters``, parameters whole for a with-block, edited on
one rank (gathered_parameters.py)."""
from .gathered_parameters import GatheredParameters

__all__ = ["GatheredParameters"]
