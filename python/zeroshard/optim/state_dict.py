"""ShardedOptimizer's state dicts, full and sharded: its part that answers them
(``StateDicts``) and the functions behind it, which read and
write one region at a time through the optimizer's public accessors
(``regions``, ``trainable``, ``group_of``, ``full_shape``, ``param_steps``)."""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .rules import require_fused
from .. import comm

_FORMAT = "zeroshard-sharded-optimizer"


def layout_signature(opt) -> list:
    """What a sharded state dict is only valid for: world size, rank, stage and every region's cut."""
    return [
        opt.world_size,
        opt.rank,
        opt.stage,
        [[reg.shard_numel, [list(f) for f in reg.frags]] + ([reg.bounds] if reg.bounds else []) for reg in opt.regions],
    ]


def take_hyperparameters(opt, groups: list):
    """Each param group takes the saved group's hyperparameters (everything but its params).
    The fused AdamW has no amsgrad nor maximize: a saved group asking for them is refused
    before anything changes (an optimizer built with them runs torch's AdamW, which does)."""
    for sg in groups:
        if opt.fused and (sg.get("amsgrad") or sg.get("maximize")):
            raise NotImplementedError(
                comm.on_rank(
                    opt,
                    "this state dict's param groups ask for amsgrad or maximize, which the fused AdamW does not "
                    "run; build the ShardedOptimizer with them (amsgrad=True / maximize=True: it then runs "
                    "torch.optim.AdamW over its pieces) before loading it",
                )
            )
    for g, sg in zip(opt.param_groups, groups):
        g.update((k, v) for k, v in sg.items() if k != "params")


@torch.no_grad()
def sharded(opt, param_groups: list) -> dict:
    """This rank's shard (views of the live state); see ShardedOptimizer.sharded_state_dict."""
    state = {}
    for k, reg in enumerate(opt.regions):
        if reg.exp_avg is not None:
            state[f"{k}.exp_avg"], state[f"{k}.exp_avg_sq"] = reg.exp_avg, reg.exp_avg_sq
        if reg.values is not None and not reg.model_owned:  # (ZeRO-3: the model's to save)
            state[f"{k}.values"] = reg.values
    whole = opt.whole_tensor_rule  # the state of the parameters this rank owns, whole
    for i, st in (whole.owned_states() if whole is not None else {}).items():
        state.update({f"owned.{i}.{key}": v for key, v in st.items()})
    return {
        "format": _FORMAT,
        "layout": layout_signature(opt),
        "param_steps": opt.param_steps,
        "param_groups": param_groups,
        "state": state,
    }


def _mismatch(opt, sd) -> Optional[str]:
    if not isinstance(sd, dict) or sd.get("format") != _FORMAT:
        return "it is not a sharded state dict of ShardedOptimizer (load_state_dict takes full ones)"
    mine, theirs = layout_signature(opt), sd["layout"]
    for name, a, b in zip(("world size", "rank", "stage"), mine[:3], theirs[:3]):
        if a != b:
            return f"it was saved with {name} {b}, this optimizer has {a}"
    if mine[3] != theirs[3]:
        return "it was saved with another flat layout (other parameters, param groups or bucket_mb)"
    return None


@torch.no_grad()
def load_sharded(opt, sd: dict) -> List[int]:
    """Writes a sharded state dict into the regions (collective: every rank checks
    every rank's match first); returns the saved per-parameter step counts."""
    opt.wait_params()
    problems = comm.all_gather_object(_mismatch(opt, sd), group=opt.process_group, what="load_sharded_state_dict check")
    bad = [f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None]
    if bad:
        raise ValueError(
            comm.on_rank(
                opt,
                "cannot load the sharded state dict (" + "; ".join(bad) + "); a sharded state dict loads "
                "only into the layout it was saved from: use state_dict()/load_state_dict() or "
                "zeroshard.save_checkpoint/load_checkpoint to change world size, stage or layout",
            )
        )
    take_hyperparameters(opt, sd["param_groups"])
    for k, reg in enumerate(opt.regions):
        if reg.exp_avg is not None:
            reg.exp_avg.copy_(sd["state"][f"{k}.exp_avg"])
            reg.exp_avg_sq.copy_(sd["state"][f"{k}.exp_avg_sq"])
        if reg.values is not None and not reg.model_owned:
            reg.values.copy_(sd["state"][f"{k}.values"])
    whole = opt.whole_tensor_rule
    if whole is not None:
        owned: Dict[int, dict] = {}
        for name, v in sd["state"].items():
            if name.startswith("owned."):
                _, i, key = name.split(".", 2)
                owned.setdefault(int(i), {})[key] = v.clone() if isinstance(v, torch.Tensor) else v
        whole.set_owned_states(owned)
    return list(sd["param_steps"])


def _check_full(opt, state_dict: dict):
    groups = state_dict["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise ValueError(
            comm.on_rank(
                opt, f"the state dict has {len(groups)} param groups but this optimizer has {len(opt.param_groups)}"
            )
        )
    for gi, (g, sg) in enumerate(zip(opt.param_groups, groups)):
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(
                comm.on_rank(
                    opt,
                    f"param group {gi} has {len(sg['params'])} parameters in the "
                    f"state dict but {len(g['params'])} here",
                )
            )


@torch.no_grad()
def load_full(opt, state_dict: dict, rule) -> List[int]:
    """Checks a full state dict (ours or the optimizer class's own, any world size) against
    the parameters and has the update ``rule`` write this rank's pieces of it
    (``rule.load_full``); returns each parameter's step count."""
    _check_full(opt, state_dict)
    groups = state_dict["param_groups"]
    take_hyperparameters(opt, groups)
    saved_ids = [pid for sg in groups for pid in sg["params"]]
    state = state_dict["state"]
    steps = [0] * len(opt.params)
    for i in opt.trainable:
        st = state.get(saved_ids[i])
        if st is None:
            continue
        numel = opt.full_shape(i).numel()
        for name in sorted(rule.elementwise_keys if rule.fused else rule.elementwise_keys & set(st)):
            if st[name].numel() != numel:
                raise ValueError(
                    comm.on_rank(
                        opt,
                        f"state of parameter {i}: {name} has {st[name].numel()} elements but the "
                        f"parameter has {numel} (shape {tuple(opt.full_shape(i))}); the state dict "
                        "is of another model",
                    )
                )
        steps[i] = int(float(st.get("step", 0)))
    rule.load_full(opt, state, saved_ids)
    return steps


class StateDicts:
    """A ShardedOptimizer's state dicts in torch's names and formats, over sharded state: the
    full one (gathered region by region, or consolidated onto one rank first) and this
    rank's shard. The optimizer's methods of the same names ask this part."""

    def __init__(self, opt):
        self._opt = weakref.ref(opt)  # (the optimizer holds this part)
        # (to, the full state dict on rank ``to`` / None elsewhere) from consolidate(), until a step or load
        self.consolidated = None

    @property
    def opt(self):
        return self._opt()

    def forget(self) -> None:
        """The state changed (a step, a load, a new layout): a consolidated copy is stale."""
        self.consolidated = None

    def refuse_own_ranks(self, what: str) -> None:
        """Raise where some param group shards over its own ranks ([Note: param groups over
        their own ranks] in comm/mesh.py), or some parameter is tensor-parallel, and ``what``
        does not handle that yet."""
        opt = self.opt
        if opt.source.tensor_parallel() is not None:
            raise NotImplementedError(
                comm.on_rank(
                    opt,
                    f"{what} is not supported yet for tensor-parallel (DTensor) parameters: checkpoint the model "
                    "and this optimizer with zeroshard.save_checkpoint(path, model, opt) and load_checkpoint, which "
                    "keep the global tensors and load at another dp or tp degree (docs/tensor-parallel.md)",
                )
            )
        if opt.source.param_colors() is not None:
            raise NotImplementedError(
                comm.on_rank(
                    opt,
                    f"{what} is not supported yet for a ShardedOptimizer with a param group sharded over its own "
                    "ranks ('device_mesh': expert parallelism): the ranks of different expert-parallel groups hold "
                    "different experts under the same names. Save each rank's model and optimizer state yourself "
                    "(e.g. opt.sharded_state_dict() is refused too), or train without the param group's "
                    "'device_mesh'",
                )
            )

    def sharded_state_dict(self) -> dict:
        opt = self.opt
        require_fused(opt, "sharded_state_dict()")
        self.refuse_own_ranks("sharded_state_dict()")
        return sharded(opt, torch.optim.Optimizer.state_dict(opt)["param_groups"])

    def load_sharded_state_dict(self, state: dict) -> None:
        opt = self.opt
        require_fused(opt, "load_sharded_state_dict()")
        self.refuse_own_ranks("load_sharded_state_dict()")
        opt.shards_loaded(load_sharded(opt, state))

    def consolidate(self, to: Optional[int]) -> None:
        self.consolidated = (to, self.gather(to, "consolidate_state_dict()"))

    def state_dict(self, to: Optional[int]):
        held = self.consolidated
        if held is not None and to is None:
            if held[1] is None:
                raise RuntimeError(
                    comm.on_rank(
                        self.opt,
                        f"the state was consolidated onto rank {held[0]} by consolidate_state_dict(to="
                        f"{held[0]}): call opt.state_dict() there (this rank holds none; a collective "
                        "state_dict() here would wait for a rank that already has its copy)",
                    )
                )
            return held[1]
        return self.gather(to, "ShardedOptimizer.state_dict()")

    def gather(self, to: Optional[int], what: str):
        """The full state dict on rank ``to`` (every rank if None), None elsewhere; collective."""
        opt = self.opt
        self.refuse_own_ranks(what)
        comm.check_in(
            what,
            opt,
            opt.process_group,
            "For a checkpoint written by rank 0 alone, call opt.consolidate_state_dict(to=0) on "
            "every rank first, then opt.state_dict() on rank 0 needs no communication",
        )
        keep = to is None or dist.get_rank() == to
        packed = torch.optim.Optimizer.state_dict(opt)  # param_groups with indices; our torch state is empty
        full = opt.bound.rule.gather_full(opt, keep)
        if not keep:
            return None
        packed["state"] = full
        return packed

    def load_state_dict(self, state_dict: dict) -> None:
        opt = self.opt
        self.refuse_own_ranks("load_state_dict()")
        opt.bound.param_steps = load_full(opt, state_dict, opt.bound.rule)
        opt.source.params_loaded()
        self.forget()
