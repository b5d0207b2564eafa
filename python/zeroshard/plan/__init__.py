"""The memory planner: per-rank bytes of DDP and ZeRO-1/2/3, from a parameter count
(``formula``) or from a real model built on the meta device, whose step is
replayed on fake tensors (``planner``, ``trace``). ``python -m zeroshard.plan``
is its command line.

May import: every part below it (``native``, ``comm``, ``offload``, ``core``,
``zero12``, ``zero3``, ``optim``).
"""

from .formula import CARDS_GB, STAGES, format_table, model_state_bytes, offloaded_bytes, slow_link_bytes
from .cli import main
from .planner import format_model_plan, plan_model
from .trace import activation_bytes

__all__ = [
    "CARDS_GB",
    "STAGES",
    "model_state_bytes",
    "offloaded_bytes",
    "slow_link_bytes",
    "format_table",
    "plan_model",
    "format_model_plan",
    "activation_bytes",
    "main",
]
