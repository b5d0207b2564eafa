"""An FSDP2 training script ported to zeroshard by its imports.

    torchrun --nproc-per-node 2 examples/fsdp2_port.py

The shape of pytorch/examples' FSDP2 example: a Transformer built on meta, ``fully_shard``
on each layer and then on the model (classes swapped in place: ``isinstance`` holds), explicit
prefetch lists, ``to_empty`` then the model's own ``reset_parameters()``, ``model.unshard()``
ahead of each forward, ``clip_grad_norm_``, torch's Adam over the sharded parameters, and its
checkpointer's DCP path (full state dicts of the model and the optimizer through torch's
``get_*_state_dict``, loaded into a fresh model and optimizer with ``set_*_state_dict``). The
only line that differs from the FSDP2 script is marked ``# zeroshard``. At the end the script
checks the full state dict (``model.state_dict()``, collective) against the same training in
one process with plain ``torch.optim.Adam`` on the whole batch.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy  # torch's policy, taken as it is

import _device  # examples/_device.py: NCCL on cuda:LOCAL_RANK where there are GPUs, else gloo
from zeroshard import FSDPModule, fully_shard  # zeroshard (was: from torch.distributed.fsdp import ...)

VOCAB, SEQ, DIM, HEADS, LAYERS, BATCH, STEPS = 64, 16, 32, 4, 3, 8, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        # (no qkv bias, as llama's: a key bias takes a gradient that is zero but for rounding,
        # which Adam's normalisation would blow up into +-lr in either run)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))

    def reset_parameters(self):
        for m in (self.norm1, self.norm2, self.qkv, self.proj, self.up, self.down):
            m.reset_parameters()


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.output = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def reset_parameters(self):
        for m in (self.tok, self.pos, self.norm, *self.layers):
            m.reset_parameters()
        nn.init.normal_(self.output.weight, std=DIM**-0.5)


def batch(step, rank=0, world=1):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    n = BATCH // world
    return x[rank * n : (rank + 1) * n]


def train(model, opt, device, rank, world, unshard=False):
    losses = []
    for step in range(STEPS):
        x = batch(step, rank, world).to(device)
        if unshard:
            model.unshard()  # the root's parameters gathered ahead of the forward, as the FSDP2 example does
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def build(device):
    with torch.device("meta"):
        model = Transformer()
    fsdp_kwargs = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float32)}
    for layer in model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    assert isinstance(model, Transformer) and isinstance(model, FSDPModule), type(model)
    layers = list(model.layers)
    for i, layer in enumerate(layers):  # FSDP2's explicit prefetching
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 3])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - 2) : i][::-1])
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.reset_parameters()  # the model's own init, on the shards: the values one process gets
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def main():
    device = _device.setup()
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()

    model, opt = build(device)
    losses = train(model, opt, device, rank, world, unshard=True)
    # the FSDP2 example's checkpointer (its DCP path): full state dicts, on rank 0, into a fresh model
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, opt_sd = get_model_state_dict(model, options=full), get_optimizer_state_dict(model, opt, options=full)
    model, opt = build(device)
    load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, model_sd, options=load)
    set_optimizer_state_dict(model, opt, opt_sd, options=load)
    losses += train(model, opt, device, rank, world, unshard=True)
    sd = model.state_dict()  # collective: the full state dict on every rank

    if rank == 0:
        torch.manual_seed(0)  # the same training in one process, plain torch, whole batches
        ref = Transformer().to(device)
        torch.manual_seed(0)
        ref.reset_parameters()
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        ref_losses = train(ref, ref_opt, device, 0, 1) + train(ref, ref_opt, device, 0, 1)
        err = max(((sd[k] - v.cpu()).norm() / v.norm()).item() for k, v in ref.state_dict().items())
        print(
            f"fsdp2_port: {type(model).__name__}, rank 0's loss {losses[0]:.4f} -> {losses[-1]:.4f} (plain torch, "
            f"whole batch: {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f}); parameters vs plain torch: max relative "
            f"error {err:.1e}"
        )
        assert err < 1e-5, f"the ported FSDP2 script differs from plain torch.optim.Adam (relative error {err})"
        assert losses[-1] < losses[0], f"the loss did not go down: {losses[0]:.4f} -> {losses[-1]:.4f}"
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
