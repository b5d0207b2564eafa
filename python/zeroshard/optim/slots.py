"""Where each parameter's per-step statistics sit in the vector the ranks all-reduce.

Every parameter has one slot, the same on every rank, except the parameters of a
param group sharded over its own ranks ([Note: param groups over their own ranks]
in comm/mesh.py): at one place in the parameter list the ranks of different such
groups hold different parameters (other experts), so such a parameter has one
slot per group and each rank writes its group's (its ``color``). After the sum
over every rank, a rank reads its own slots for its parameters' values, and the
whole vector holds every distinct parameter's once (the total norm, an overflow
anywhere). Without such groups the slots are the parameter indices themselves.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch


class Slots:
    """The statistics slots of ``n`` parameters; ``colors``: per parameter (color,
    count) of its shard group, or None when no parameter has more than one slot."""

    def __init__(self, colors: Optional[List[Tuple[int, int]]], n: int, device: torch.device):
        self.identity = colors is None or all(count == 1 for _, count in colors)
        if self.identity:
            self.size = n
            self.starts = list(range(n))
            self.counts = [1] * n
            mine = list(range(n))
        else:
            self.counts = [count for _, count in colors]
            self.starts, at = [], 0
            for c in self.counts:
                self.starts.append(at)
                at += c
            self.size = at
            mine = [s + color for s, (color, _) in zip(self.starts, colors)]
        self.mine_list = mine
        self.mine = torch.tensor(mine, dtype=torch.long, device=device)
        self.param_of = torch.tensor(
            [i for i, c in enumerate(self.counts) for _ in range(c)], dtype=torch.long, device=device
        )

    def spread(self, local: torch.Tensor) -> torch.Tensor:
        """A per-parameter vector of this rank's values, in the slots (zero in the others')."""
        if self.identity:
            return local
        out = local.new_zeros(self.size)
        return out.index_copy_(0, self.mine, local)

    def own(self, slots: torch.Tensor) -> torch.Tensor:
        """This rank's per-parameter values from a slots vector (without other groups: itself)."""
        return slots if self.identity else slots[self.mine]

    def summed(self, slots: torch.Tensor) -> torch.Tensor:
        """Per parameter, the sum over its slots (every group's place)."""
        if self.identity:
            return slots
        return slots.new_zeros(len(self.counts)).index_add_(0, self.param_of, slots)

    def of_params(self, indices: List[int]) -> List[int]:
        """Every slot of these parameters (each group's)."""
        return [s for i in indices for s in range(self.starts[i], self.starts[i] + self.counts[i])]

    def own_of(self, indices: List[int]) -> List[int]:
        """This rank's slot of each of these parameters."""
        return indices if self.identity else [self.mine_list[i] for i in indices]
