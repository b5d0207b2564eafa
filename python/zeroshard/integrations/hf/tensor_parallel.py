"""``zeroshard=dict(..., tp_size=T)``: a Hugging Face model's own tensor-parallel plan
applied over the tp axis of a (dp, tp) mesh, and zeroshard over dp.

[Note: Hugging Face tensor parallelism] transformers applies a model's
``tp_plan`` itself only when it loads the model with a ``DistributedConfig`` whose
sizes multiply to the world size, and shards whatever is left of the world with
FSDP2; the Trainer then asks Accelerate for a ``ParallelismConfig``, which
Accelerate refuses on the CPU (gloo). With zeroshard the Trainer keeps the model
transformers loaded (or built) whole on every rank and applies the same plan,
with transformers' own parallel styles (``transformers.distributed.tensor_parallel``),
over the ``tp`` dimension of a (dp_shard, tp) mesh of its own, on any device:
each rank keeps its piece of every tensor the plan shards (no communication: the
ranks hold the same weights), and zeroshard shards the pieces over ``dp_shard``
([Note: tensor-parallel parameters]). The data follows the mesh as under
Accelerate's tensor parallelism: its data loaders are prepared with the mesh (the
ranks of a tp group get the same batches), and ``get_tp_size()`` divides the
Trainer's token counts and scales its loss.
"""

from __future__ import annotations

import contextlib
from typing import Dict

import torch
import torch.distributed as dist
import torch.nn as nn

# transformers' styles whose parameters are Shard or Replicate DTensors (or plain) and whose
# hooks act on activations alone; the others (packed weights' strided shards, gradient hooks
# of their own, expert styles) are refused by name
STYLES = {
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "colwise_rep",
    "rowwise_rep",
    "rowwise_split_input",
    "embedding_rowwise",
    "embedding_colwise",
    "replicate",
}
# the ep_plan styles: experts Shard(0) over ep, tokens exchanged all-to-all
EP_STYLES = {"grouped_gemm", "ep_dispatch_experts"}


def _world(key: str, size: int, what: str, where: str) -> int:
    """The world size, which ``size`` (the ``key`` option) must divide."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % size:
        raise ValueError(f"{where}: zeroshard {key}={size} must divide the world size ({world}); {what}")
    return world


def mesh(args, tp: int, device_type: str, where: str):
    """The (dp_shard, tp) mesh over every rank (collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = _world(
        "tp_size", tp, "tp_size is the number of ranks each matrix is split over, zeroshard shards over the rest", where
    )
    if getattr(args, "parallelism_config", None) is not None:
        raise ValueError(
            f"{where}: TrainingArguments(parallelism_config=...) with zeroshard tp_size={tp}: "
            "zeroshard lays out the (dp_shard, tp) ranks itself; leave parallelism_config out"
        )
    return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp_shard", "tp"))


@contextlib.contextmanager
def data_follow(accelerator, mesh):
    """Data loaders prepared in here give the ranks of a tp group the same batches
    (Accelerate's own way: the mesh its state holds while it prepares them)."""
    state = accelerator.state
    before = state.device_mesh
    state.device_mesh = mesh
    try:
        yield
    finally:
        state.device_mesh = before


def expanded_plan(model: nn.Module, where: str, kind: str = "tp") -> Dict[str, str]:
    """The model's ``tp_plan`` (``kind`` "ep": its ``ep_plan``) with its layer wildcards
    expanded: each parameter the plan names (by its own rule or its module's) and each
    module it hooks, as transformers applies it."""
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    plan = dict(getattr(model, f"{kind}_plan", None) or {})
    allowed = STYLES if kind == "tp" else EP_STYLES
    if not plan:
        raise ValueError(
            f"{where}: zeroshard {kind}_size > 1, but {type(model).__name__} has no {kind}_plan (its "
            f"config's base_model_{kind}_plan is empty); train it with {kind}_size=1"
        )
    out: Dict[str, str] = {}
    for mname, module in model.named_modules():
        mstyle = plan.get(replace_layer_number_by_wildcard(mname))
        for pname, _ in module.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            style = plan.get(replace_layer_number_by_wildcard(name), mstyle)
            if style is not None:
                out[name] = style
        if mstyle is not None:
            out[mname] = mstyle
    refused = sorted((name, style) for name, style in out.items() if style not in allowed)
    if refused:
        name, style = refused[0]
        raise ValueError(
            f"{where}: {type(model).__name__}'s {kind}_plan shards '{name}' with transformers' "
            f"'{style}' style, which zeroshard does not train yet (it does {sorted(allowed)}); "
            f"train this model with {kind}_size=1"
        )
    return out


def parallelize(model: nn.Module, tp_mesh, where: str) -> None:
    """Apply the model's plan over ``tp_mesh`` in place."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    apply_tensor_parallelism(model, tp_mesh, expanded_plan(model, where))


def expert_parallelize(model: nn.Module, ep: int, device_type: str, where: str):
    """Apply the model's ``ep_plan`` over the ep dimension of an (edp, ep) mesh of the world
    (every rank its own batch; the tokens exchanged all-to-all); returns the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    world = _world("ep_size", ep, "the experts are split over ep_size ranks and sharded over the rest", where)
    plan = expanded_plan(model, where, "ep")
    # (a tp dimension of one rank: transformers' dispatch asks for the ranks sharing a batch)
    mesh = init_device_mesh(device_type, (world // ep, ep, 1), mesh_dim_names=("edp", "ep", "tp"))
    apply_expert_parallelism(model, mesh["ep"], mesh["tp"], plan, ep_implementation="all_to_all")
    return mesh


def full_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Collective over the tp ranks: the model's state dict with every DTensor whole."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def is_tensor_parallel(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
