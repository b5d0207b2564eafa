"""Checkpoints of models whose ranks hold different parameters under the same names:
expert parallelism (every expert under its whole-model name) and tensor parallelism (each
tp piece as the ranges of the global tensor it covers).

[Note: expert checkpoints] An expert-parallel model's ranks hold different experts
under the same names (rank 1's ``moe.experts.0`` is the whole model's expert 1),
each sharded over its own ranks (its expert-data-parallel group). A checkpoint
keeps every expert under its name in the whole model, which the user gives
(a param group's named parameters at stages 1/2, FullyShard's ``expert_names``):
* its tensors are known to its own ranks only, so their specs are each rank's
  (``local_specs``, merged by the committer) and each group of ranks writes its
  experts' pieces, by the rank's place among them (``Region.place``); an expert
  parameter every rank of its group holds whole (not sharded) is written by the
  first of them;
* param groups list each rank's names; the manifest's lists every rank's;
* a load reads each expert wherever the new layout puts it: at another world
  size, stage or expert-parallel degree (the experts regrouped), or into the
  whole model, and ``export_full_state_dict`` writes the whole model's state
  dict. Every expert of the checkpoint must be some rank's (checked).

[Note: tensor-parallel checkpoints] A tensor-parallel model's checkpoint holds the
whole (global) tensors under the model's names: each rank writes its dp shard of its
tp piece of each tp-sharded parameter as the ranges of the global tensor it covers
(``Placed.runs`` in core/tensor_parallel.py); a parameter replicated over tp is
written by tp rank 0's dp group. So it loads at any dp size, stage and tp degree (tp
2 to 1 or 1 to 2: each rank reads its pieces' ranges), and exports as the whole
model. The checkpoint is written over every rank (dp x tp: the mesh must span them).
"""

from __future__ import annotations

from typing import Dict

import torch.distributed as dist
import torch.nn as nn

from .files import CheckpointError
from ..core.claims import claimant


def tp_placements(held, sharded: list) -> Dict[int, object]:
    """id(parameter) -> placements of the tensor-parallel parameters of a FullyShard's held
    parameters and the ShardedOptimizers' (whose state the checkpoint holds: the fused AdamW's)."""
    placed = {id(h.param): h.placed for h in held if h.placed is not None}
    for o in sharded:
        tp = o.source.tensor_parallel()
        placed.update({id(o.params[i]): pl for i, pl in (tp.placed.items() if tp is not None else ())})
        placed.update({id(o.params[i]): pl for i, pl in o.source.expert_placements().items()})
        if tp is not None and (o.whole_tensor_rule is not None or o.elementwise_rule is not None):
            raise CheckpointError(
                "checkpoints of tensor-parallel parameters hold the fused AdamW's state; "
                f"{o.optimizer_class.__name__}'s is not supported yet"
            )
    return placed


def name_experts(names: Dict[int, str], parallel: Dict[int, int], held, regions) -> None:
    """FullyShard: the expert units' parameters go under their whole-model names (``names``),
    their places among their own ranks in ``parallel``."""
    for reg in regions:
        for i, *_ in reg.frags if reg.place is not None else ():
            h = held[i]
            if h.whole_name is None:
                raise CheckpointError(
                    f"parameter '{names[id(h.param)]}' is an expert's (FullyShard's expert_modules): "
                    "the ranks of different expert-parallel groups hold different experts under the same "
                    "names, so a checkpoint needs each one's name in the whole model. Pass "
                    "FullyShard(..., expert_names=fn), fn mapping a name in this rank's model to the whole "
                    "model's (see docs/experts.md)"
                )
            names[id(h.param)], parallel[id(h.param)] = h.whole_name, reg.place


def name_group_experts(names: Dict[int, str], parallel: Dict[int, int], opt) -> None:
    """ZeRO-1/2: the parameters of a param group over its own ranks go under the names
    the group gives them (torch's named parameters: ``param_names``)."""
    colors, dtensors = expert_colors(opt), opt.source.expert_placements()
    given = {id(p): n for g in opt.param_groups for n, p in zip(g.get("param_names", ()), g["params"])}
    for i, p in enumerate(opt.params):
        if colors is None or colors[i][1] == 1 or id(p) in parallel or i in dtensors:  # (DTensors: global)
            continue
        if id(p) not in given:
            raise CheckpointError(
                f"parameter '{names.get(id(p), i)}' is in param group {opt.group_of(i)}, sharded over its "
                "own ranks ('device_mesh': expert parallelism): the ranks of different expert-parallel "
                "groups hold different experts under the same names, so a checkpoint needs each one's name "
                "in the whole model. Name the optimizer's parameters (torch's named parameters, every "
                "group), the experts' with their names in the whole model: {'params': [(whole_model_name, "
                "p), ...], 'device_mesh': mesh['edp']} (see docs/experts.md)"
            )
        names[id(p)] = given[id(p)]
        parallel[id(p)] = dist.get_rank(opt.source.param_process_group(i))


def expert_colors(opt):
    """The statistics colors of an optimizer's param groups over their own ranks (experts);
    None without (a tensor-parallel model's colors are its tp places)."""
    return None if opt.source.tensor_parallel() is not None else opt.source.param_colors()


def refuse_unnamed_experts(model: nn.Module) -> None:
    """A plain model saved or loaded without its ShardedOptimizer, whose param groups over
    their own ranks hold experts: only the optimizer knows their whole-model names."""
    for name, p in model.named_parameters():
        held = claimant(p)
        if held is not None and expert_colors(held.opt) is not None:
            raise CheckpointError(
                f"parameter '{name}' is in a ShardedOptimizer param group sharded over its own ranks (expert "
                "parallelism): the ranks of different expert-parallel groups hold different experts under the "
                "same names. Pass that optimizer too (save_checkpoint(path, model, opt)): its param groups name "
                "the experts in the whole model"
            )


def refuse_expert_buffers(model: nn.Module, parallel: Dict[int, int]) -> None:
    """An expert module's persistent buffers: the ranks hold different experts' under one name."""
    for mname, m in model.named_modules():
        params = list(m.parameters())
        if params and all(id(p) in parallel for p in params):
            saved = m.state_dict(keep_vars=True)  # (its persistent buffers are in it)
            for bname, _ in m.named_buffers(recurse=False):
                if bname in saved:
                    raise CheckpointError(
                        f"buffer '{mname}.{bname}' belongs to an expert module (its parameters are sharded over "
                        "their own ranks): checkpoints do not keep experts' buffers apart yet. Register it with "
                        "persistent=False (and set it in the module's code), or keep it outside the expert"
                    )
