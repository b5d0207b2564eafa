"""zeroshard.full_tensors: a sharded model's whole tensors, one unit at a time, under the
unwrapped model's names, equal to its full state dict; streamed into an unsharded copy
in one process, that copy computes what the sharded model does."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard as zs


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x + torch.tanh(self.norm(self.fc(x))) * self.scale


class LM(nn.Module):
    def __init__(self, vocab=29, d=13, layers=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, tok):
        h = self.emb(tok)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _stream(kind, dtype, bucket_mb, to):
    torch.manual_seed(0)
    plain = LM()
    tok = torch.randint(0, 29, (2, 7))
    if kind == "plain":
        model = plain
    else:
        model = zs.FullyShard(LM(), wrap={Layer}, offload_params=(kind == "offload"))
        model.load_state_dict(plain.state_dict())
    expected = model.state_dict() if kind == "plain" else model.state_dict(to=None)
    got = {}
    for name, t in zs.full_tensors(model, dtype=dtype, bucket_mb=bucket_mb, to=to):
        got[name] = t.clone()
    with torch.no_grad():  # (a FullyShard forward is collective: every rank)
        out = model(tok) if kind != "plain" else plain(tok)
    if to is not None and dist.get_rank() != to:
        return got == {}, None, None
    same_names = sorted(got) == sorted(expected)
    exact = all(
        torch.equal(
            got[k],
            v.to(dtype)
            if dtype is not None
            and v.is_floating_point()
            and k not in ("layers.0.scale", "layers.1.scale", "layers.2.scale")
            else v,
        )
        for k, v in expected.items()
    )
    fresh = LM()  # an unsharded copy, loaded from the stream alone
    fresh.load_state_dict({k: v.float() for k, v in got.items()})
    with torch.no_grad():
        err = (fresh(tok) - out).abs().max().item() if dtype is None else 0.0
    return same_names, exact, err


@pytest.mark.parametrize(
    "kind,dtype,bucket_mb,to",
    [
        ("sharded", None, 512, None),
        ("sharded", torch.bfloat16, 512, 0),
        ("sharded", None, 300 / 2**20, None),  # every unit over the bucket: parameter by parameter
        ("offload", torch.bfloat16, 512, None),
        ("plain", None, 512, None),
    ],
)
def test_full_tensors_streams_the_full_state_dict_unit_by_unit(dist_pool, kind, dtype, bucket_mb, to):
    for rank, (same_names, exact, err) in enumerate(dist_pool.run(_stream, kind, dtype, bucket_mb, to)):
        if to is not None and rank != to:
            assert same_names, "the other ranks yield nothing"
            continue
        assert same_names and exact, (rank, same_names, exact)
        assert err == 0.0, err


def _refusals():
    out = {}
    model = zs.FullyShard(nn.Sequential(LM()), wrap={Layer})
    for key, call in (
        ("dtype", lambda: list(zs.full_tensors(model, dtype=torch.int32))),
        ("inner", lambda: list(zs.full_tensors(nn.Sequential(model)))),
    ):
        try:
            call()
        except (TypeError, ValueError) as e:
            out[key] = str(e)
    return out


def test_full_tensors_refuses_what_it_cannot_stream(dist_pool):
    for out in dist_pool.run(_refusals):
        assert "give a floating dtype" in out["dtype"], out
        assert "pass the FullyShard model itself" in out["inner"], out
