"""``zeroshard.zero``: what a DeepSpeed script reaches as ``deepspeed.zero``: ``Init``, the
construction context that shards each module's parameters as it is built
([Note: sharded as built] in zero_init.py), and ``GatheredParameters``, parameters
whole for a with-block, edited on one rank (gathered_parameters.py)."""

from .gathered_parameters import GatheredParameters
from .zero_init import Init

__all__ = ["GatheredParameters", "Init"]
