"""Thousands of ranks, rehearsed in one process: rank 0 of N over the no-op process
group ([Note: no-op process group] in comm/noop.py). What a training step does on
the host must not grow with N: the same collectives, each given as many tensors,
and as many Python calls, at N = 8 and N = 4096. (Timings are the scale
benchmark's: python -m benchmarks scale.)"""

import collections
import sys
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroshard as zs
from zeroshard.comm import noop, watchdog

D, BLOCKS = 48, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 3 * D), nn.Linear(3 * D, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def _build(stage: int, shard_size, muon: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(BLOCKS)])
    kw = {} if shard_size is None else {"shard_size": shard_size}
    if stage == 3:
        model = zs.FullyShard(model, wrap={Block}, **kw)
        kw = {}
    else:
        kw["stage"] = stage
    if not muon:
        return model, [zs.ShardedOptimizer(model.parameters(), lr=1e-3, **kw)]
    mats = [p for p in model.parameters() if p.ndim == 2]
    return model, [
        zs.ShardedOptimizer(mats, optimizer_class=torch.optim.Muon, lr=0.02, **kw),
        zs.ShardedOptimizer([p for p in model.parameters() if p.ndim != 2], lr=1e-3, **kw),
    ]


def _step(model, opts, x):
    model(x).square().mean().backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()


def _work(world: int, stage: int, shard_size=None, muon=False):
    """(the collectives of one step: (kind, tensors given) -> count, Python calls in it, construction s)."""
    x = torch.randn(3, D)
    with noop.noop_world(world):
        t0 = time.perf_counter()
        model, opt = _build(stage, shard_size, muon)
        built = time.perf_counter() - t0
        for _ in range(2):
            _step(model, opt, x)
        noop.calls.clear()
        calls = collections.Counter()

        def count(frame, event, arg):
            if event in ("call", "c_call"):
                calls[event] += 1

        sys.setprofile(count)
        try:
            _step(model, opt, x)
        finally:
            sys.setprofile(None)
        return dict(noop.calls), sum(calls.values()), built


@pytest.mark.parametrize(
    "stage,shard_size,muon",
    [(1, None, False), (2, None, False), (3, None, False), (2, 8, False), (3, 8, False), (3, None, True)],
    ids=["stage1", "stage2", "stage3", "hybrid2", "hybrid3", "muon3"],
)
def test_a_steps_host_work_is_the_same_at_8_and_4096_ranks(stage, shard_size, muon):
    """Muon under FullyShard: each unit's chunks differ in length, and its collectives run one
    per chunk that holds something ([Note: uneven collectives]): as many at 4096 ranks."""
    small = _work(8 if shard_size is None else 16, stage, shard_size, muon)
    big = _work(4096, stage, shard_size, muon)
    assert big[0] == small[0], (small[0], big[0])  # the same collectives, each with as many tensors
    assert all(n <= 2 for (_, n) in big[0]), big[0]  # never a per-rank list of chunks
    assert big[1] <= small[1] * 1.02 + 20, (small[1], big[1])  # Python calls in the step
    assert big[2] < 5.0, big[2]  # construction (the benchmark holds it under a second, quiet)


def test_the_diagnosis_of_a_4096_rank_divergence_is_short_and_names_the_odd_rank():
    def rec(seq, kind, what, end):
        return {
            "seq": seq,
            "group": "0",
            "kind": kind,
            "what": what,
            "numel": 10,
            "dtype": "float32",
            "start": 0.0,
            "end": end,
        }

    common = [
        rec(40, "all_reduce", "a", 1.0),
        rec(41, "reduce_scatter", "step 7, backward", 1.0),
        rec(42, "all_gather", "b", 1.0),
        rec(43, "all_gather", "unit 'blocks.2'", None),
    ]
    odd = common[:1] + [rec(41, "reduce_scatter", "step 7, backward", None)]
    reports = {
        r: {"cause": "timed out in #43" if r != 512 else "timed out in #41", "records": odd if r == 512 else common}
        for r in range(4096)
        if r != 77
    }
    text = watchdog.diagnose(reports, "0", 4096, now=30.0)
    lines = text.splitlines()
    assert len(lines) <= 20, text
    assert "ranks 0-76, 78-511, 513-4095 issued #42 all_gather" in text, text
    assert "rank 512 never issued it" in text, text
    assert any(line.strip().startswith("rank 512: last started #41 reduce_scatter") for line in lines), text
    assert "Rank 77 did not answer" in text, text
    # many states: at most GROUPS lines of them, the rest counted
    varied = {r: {"cause": f"failed: peer {r} closed", "records": common} for r in range(4096)}
    text = watchdog.diagnose(varied, "0", 4096, now=30.0)
    assert len(text.splitlines()) <= 20 and "more rank(s) in" in text, text


def test_a_whole_tensor_optimizer_padding_past_the_parameters_at_stage_2_warns():
    import warnings

    def build(world):
        with noop.noop_world(world), warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            torch.manual_seed(0)
            model = nn.Sequential(*[Block() for _ in range(BLOCKS)])
            mats = [p for p in model.parameters() if p.ndim == 2]
            zs.ShardedOptimizer(mats, optimizer_class=torch.optim.Muon, lr=0.02, stage=2)
            zs.ShardedOptimizer(mats, optimizer_class=torch.optim.Muon, lr=0.02, stage=2, shard_size=8)
        return [str(w.message) for w in got if issubclass(w.category, ResourceWarning)]

    assert build(8) == []
    said = build(512)
    assert len(said) == 1, said  # (with shard_size=8 the owners are within 8 ranks: no warning)
    assert "over 512 ranks" in said[0] and "shard_size=8" in said[0] and "FullyShard" in said[0], said


def test_a_load_finds_the_entries_of_a_4096_rank_manifest_by_bisection():
    """Each piece a rank loads overlaps few of a tensor's 4096 entries; the reader finds
    exactly those (as a scan over all would), entries given in any order."""
    import random
    from zeroshard.checkpoint import files

    rnd = random.Random(3)
    numel, world = 1_000_003, 4096
    cuts = sorted(rnd.sample(range(1, numel), world - 1))
    starts = [0] + cuts
    entries = [[f"rank{r}.safetensors", 0, s, e - s, []] for r, (s, e) in enumerate(zip(starts, cuts + [numel]))]
    rnd.shuffle(entries)
    man = {"block_bytes": files.BLOCK, "tensors": {"param:w": {"dtype": "float32", "entries": entries}}}
    reader = files.CheckpointReader("/nonexistent", man)
    for _ in range(200):
        lo = rnd.randrange(numel)
        hi = min(numel, lo + rnd.choice([1, 7, 245, 5000, 300_000]))
        got = sorted((e[2], a, b) for e, a, b, *_ in reader._spans("param:w", lo, hi))
        want = sorted(
            (e[2], max(lo, e[2]), min(hi, e[2] + e[3])) for e in entries if max(lo, e[2]) < min(hi, e[2] + e[3])
        )
        assert got == want, (lo, hi)
