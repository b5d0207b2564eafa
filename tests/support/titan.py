"""A torchtitan-shaped model for the FSDP2 tests: its own ``init_weights()`` after wrapping
(trunc_normal_, xavier, constants, an elementwise scale), a buffer it computes, a layer list."""

import math

import torch
import torch.distributed as dist
import torch.nn as nn

D = 13  # no unit divides evenly over 2, 3 or 4 ranks


def mine(x):
    """This rank's equal share of a batch's rows."""
    k = x.shape[0] // dist.get_world_size()
    return x[dist.get_rank() * k : (dist.get_rank() + 1) * k]


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wqkv = nn.Linear(D, 3 * D, bias=False)
        self.wo = nn.Linear(D, D)

    def init_weights(self, std):
        nn.init.trunc_normal_(self.wqkv.weight, mean=0.0, std=0.02)  # torchtitan's
        nn.init.trunc_normal_(self.wo.weight, std=std, a=-std / 4, b=std / 4)  # (nn.init's narrow branch)
        nn.init.zeros_(self.wo.bias)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.norm, self.ff = Attention(), nn.LayerNorm(D), nn.Linear(D, 2 * D)

    def init_weights(self, std):
        self.norm.reset_parameters()
        self.attn.init_weights(std)
        nn.init.xavier_uniform_(self.ff.weight)
        nn.init.constant_(self.ff.bias, 0.1)
        with torch.no_grad():
            self.ff.weight.mul_(0.5)

    def forward(self, h):
        return h + torch.tanh(self.ff(self.norm(h)))[..., :D] + self.attn.wo(self.attn.wqkv(h)[..., :D])


class Titan(nn.Module):
    """torchtitan's shape of initialisation: the model's init_weights() after wrapping, a
    buffer it computes, nothing in __init__ that survives meta."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, D)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.out = nn.Linear(D, 257, bias=False)
        self.register_buffer("freqs", torch.empty(D), persistent=False)

    def init_weights(self):
        nn.init.normal_(self.emb.weight)
        for layer in self.layers:
            layer.init_weights(0.02 / math.sqrt(2))
        nn.init.trunc_normal_(self.out.weight, std=0.02, a=-0.04, b=0.04)  # (nn.init's rejection loop)
        self.freqs = torch.arange(1.0, D + 1) ** -0.5

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def initialised(seed: int = 0, init_seed: int = 1) -> Titan:
    """A Titan built with ``seed`` and initialised by its own init_weights() with ``init_seed``."""
    torch.manual_seed(seed)
    model = Titan()
    torch.manual_seed(init_seed)
    model.init_weights()
    return model
