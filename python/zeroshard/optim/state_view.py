"""``ShardedOptimizer.state``: torch's per-parameter state map, as a view.

[Note: the state view] torch's ``Optimizer.state`` maps each parameter to its state; a
ShardedOptimizer keeps the state in flat shards, so its ``state`` is a read-only view
that says which parameters have state and their step counts: ``{p: {"step": tensor}}``
for each parameter some step gave a gradient (the moments themselves are in
``state_dict()`` and ``sharded_state_dict()``). Code that reads ``optimizer.state`` to
learn whether the optimizer has state sees the truth: torch's
``torch.distributed.checkpoint.state_dict`` helpers, which step an optimizer whose
``state`` is empty with zero gradients and lr 0 to create it, leave a stepped
ShardedOptimizer alone (an empty ``state`` had let them take a step that decayed the
moments and counted one step more, without a word).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Dict, Iterator, List, Tuple

import torch


class StateView(Mapping):
    """``{parameter: {"step": tensor}}`` for each parameter with a step (see the Note)."""

    def __init__(self, steps: Callable[[], Tuple[List[torch.Tensor], List[int]]]):
        self._steps = steps  # () -> (params in state-dict order, their step counts)

    def _stepped(self) -> Dict[int, Tuple[torch.Tensor, int]]:
        params, counts = self._steps()
        return {id(p): (p, n) for p, n in zip(params, counts) if n}

    def __getitem__(self, p) -> dict:
        found = self._stepped().get(id(p))
        if found is None:
            raise KeyError("this parameter has no optimizer state (no step has given it a gradient)")
        return {"step": torch.tensor(float(found[1]))}

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([p for p, _ in self._stepped().values()])

    def __len__(self) -> int:
        return len(self._stepped())
