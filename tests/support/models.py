"""Small models several test files build: ``Residual``, a residual tanh layer (the unit the
DDP, FSDP2, compile, hand-gradient and rank-0 tests shard); ``ResidualNet``, an input layer, ``layers``
Residual blocks and a head; ``Branchy``, a ResidualNet with a branch some ranks take in
some steps and a layer no step uses."""

import torch
import torch.nn as nn


class Residual(nn.Module):
    """x + tanh(Linear(x)), ``d`` wide."""

    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class ResidualNet(nn.Module):
    """11 inputs, ``layers`` Residual blocks 17 wide, 3 outputs."""

    def __init__(self, layers=2):
        super().__init__()
        self.inp = nn.Linear(11, 17)
        self.blocks = nn.Sequential(*[Residual(17) for _ in range(layers)])
        self.head = nn.Linear(17, 3)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


class Branchy(ResidualNet):
    """A branch some ranks take in some steps, and a layer no step uses."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(17, 17)
        self.never = nn.Linear(3, 3)

    def forward(self, x, use_extra=False):
        h = self.inp(x)
        if use_extra:
            h = h + self.extra(h)
        return self.head(self.blocks(h))
