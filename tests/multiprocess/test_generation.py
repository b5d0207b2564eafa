"""Generation at ZeRO-3: a Hugging Face model's generate() on a FullyShard model (wrapped, or
in place by fully_shard) gathers each unit once per call (not once per token), with the unsharded model's tokens for greedy,
sampled and beam-search decoding; between unshard() (also async_op=True, its gathers left in
flight) and reshard() nothing is gathered; a
generate that raises leaves nothing gathered; and the
model's whole tensors stream (zeroshard.full_tensors) into an unsharded copy that computes
the same logits."""

import time

import torch

import zeroshard as zs
from zeroshard.zero3.fully_shard import UnitState


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    plain = LlamaForCausalLM(cfg).eval()
    torch.manual_seed(0)
    model = zs.FullyShard(LlamaForCausalLM(cfg).eval(), wrap={LlamaDecoderLayer})
    torch.manual_seed(0)
    in_place = LlamaForCausalLM(cfg).eval()  # FSDP2's way: a call per layer, then the model
    for layer in in_place.model.layers:
        zs.fully_shard(layer)
    zs.fully_shard(in_place)
    return plain, model, LlamaForCausalLM(cfg), in_place


def _count(fn):
    t0 = time.time()  # (the flight record keeps the last few hundred: count by start time)
    out = fn()
    return out, sum(r["kind"] == "all_gather" and r["start"] >= t0 for r in zs.flight_record())


def _generate():
    plain, model, fresh, in_place = _llama()
    prompt = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    res = {}
    for name, kw in (
        ("greedy", dict(do_sample=False)),
        ("beams", dict(do_sample=False, num_beams=2)),
        ("sampled", dict(do_sample=True, top_k=20, temperature=0.9)),
    ):
        kw = dict(kw, max_new_tokens=12, pad_token_id=0)
        torch.manual_seed(5)  # (the same seed on every rank: the same tokens everywhere)
        ours, gathers = _count(lambda: model.generate(prompt, **kw))
        torch.manual_seed(5)
        res[name] = (torch.equal(ours, plain.generate(prompt, **kw)), gathers)
    greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    ours, gathers = _count(lambda: in_place.generate(prompt, **greedy))
    res["in_place"] = (torch.equal(ours, plain.generate(prompt, **greedy)), gathers, type(in_place).__name__)
    model.generate_gathered = False  # today's per-token gathering, kept as an option
    res["per_token"] = _count(lambda: model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0))[1]
    handle = model.unshard(async_op=True)  # FSDP2's explicit calls: held gathered until reshard()
    res["in_flight"] = all(u.state is UnitState.GATHERING for u in model.units if u.params)
    handle.wait()
    model.unshard()  # (a second changes nothing)
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ours, res["unsharded_gathers"] = _count(lambda: model.generate(prompt, **greedy))  # per token, yet none
    res["unsharded_same"] = torch.equal(ours, plain.generate(prompt, **greedy))
    res["held"] = all(u.state is UnitState.GATHERED for u in model.units)
    model.reshard()
    res["reshard"] = all(u.state is UnitState.SHARDED for u in model.units)
    model.reshard()  # (without unshard(): nothing)
    model.unshard(async_op=True)  # no wait(): each forward finishes its unit's gather
    ours, res["async_gathers"] = _count(lambda: model.generate(prompt, **greedy))
    res["async_same"] = torch.equal(ours, plain.generate(prompt, **greedy))
    model.reshard()
    res["async_reshard"] = all(u.state is UnitState.SHARDED for u in model.units)
    model.generate_gathered = True
    try:
        model.generate(prompt, max_new_tokens=3, num_beams=2, num_return_sequences=5)  # more than beams
        res["raised"] = False
    except ValueError:
        res["raised"] = True
    res["resharded"] = all(u.state is UnitState.SHARDED for u in model.units)
    fresh.load_state_dict({k: v.float() for k, v in zs.full_tensors(model, dtype=None)})
    with torch.no_grad():
        res["logits"] = (fresh(prompt).logits - plain(prompt).logits).abs().max().item()
    return res


def test_generate_gathers_each_unit_once_per_call_with_the_unsharded_models_tokens(dist_pool):
    for res in dist_pool.run(_generate):
        units = 5  # four decoder layers and the root
        for name in ("greedy", "beams", "sampled"):
            same, gathers = res[name]
            assert same and gathers == units, (name, res[name])
        assert res["in_place"] == (True, units, "FSDPLlamaForCausalLM"), res["in_place"]  # fully_shard's too
        assert res["per_token"] >= 12 * units, res["per_token"]  # every unit, every token
        assert res["unsharded_gathers"] == 0 and res["unsharded_same"] and res["held"] and res["reshard"], res
        assert res["in_flight"] and res["async_gathers"] == 0 and res["async_same"] and res["async_reshard"], res
        assert res["raised"] and res["resharded"], res
        assert res["logits"] == 0.0, res["logits"]
