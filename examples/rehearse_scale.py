"""Rehearse a 4096-rank job in one process: rank 0 of N over the no-op process group.

    python examples/rehearse_scale.py

``zeroshard.comm.noop_world(N)`` makes this process rank 0 of N ranks whose
collectives return at once (they move no data: what a float collective returns
is meaningless). The script wraps the same model at N = 8 and N = 4096, runs a
few training steps, and checks what a large job needs from the library: each
rank's state bytes (``memory_report()``) are the planner's 16 bytes a parameter
over N, a step issues the same collectives at both sizes, each over one flat
buffer, and the host time of a step does not grow with N.
"""

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroshard
from zeroshard.comm import noop, noop_world
from zeroshard.plan.formula import model_state_bytes

D, BLOCKS = 128, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def rehearse(world: int) -> dict:
    """Rank 0 of ``world``: build, take steps, measure."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(BLOCKS)])
    params = sum(p.numel() for p in model.parameters())
    x = torch.randn(8, D)
    with noop_world(world):
        t0 = time.perf_counter()
        model = zeroshard.FullyShard(model, wrap={Block})
        opt = zeroshard.ShardedOptimizer(model.parameters(), lr=1e-3)
        built = time.perf_counter() - t0
        times = []
        for step in range(8):
            if step == 3:
                noop.calls.clear()
            t = time.perf_counter()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t)
            if step == 3:
                collectives = dict(noop.calls)
        state = model.memory_report()
    return {
        "built_s": built,
        "step_ms": min(times[3:]) * 1e3,
        "collectives": collectives,
        "state": state["total"],
        "padding": state["padding"],
        "formula": model_state_bytes(params, world, "fp32")["ZeRO-3"]["total"],
    }


def main():
    torch.set_num_threads(1)
    small, big = rehearse(8), rehearse(4096)
    for world, r in ((8, small), (4096, big)):
        print(
            f"N={world:<5} built in {r['built_s'] * 1e3:5.0f} ms, step {r['step_ms']:5.1f} ms (host), "
            f"state {r['state']:>9,} bytes (formula {r['formula']:>11,.0f}, padding {r['padding']:,})"
        )
    assert big["collectives"] == small["collectives"], (small["collectives"], big["collectives"])
    assert all(tensors == 1 for _, tensors in big["collectives"]), big["collectives"]  # one flat buffer each
    for r in (small, big):
        assert abs(r["state"] - r["padding"] - r["formula"]) <= 16 * 4 * (2 * BLOCKS + 1), r  # alignment only
    assert big["built_s"] < 10, big
    print(
        f"rehearse_scale: at 4096 ranks the same {sum(big['collectives'].values())} collectives per step as at 8, "
        f"state {big['state'] - big['formula']:.0f} bytes over 16/N of the parameters (chunks rounded up to "
        f"4 elements), host step {big['step_ms'] / small['step_ms']:.2f}x"
    )


if __name__ == "__main__":
    main()
