"""ShardedOptimizer's state dicts, full and sharded: the methods (``StateDicts``,
a base class of ShardedOptimizer) and the functions behind them, which read and
write one region at a time through the optimizer's public accessors
(``regions``, ``trainable``, ``group_of``, ``full_shape``, ``param_steps``)."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .rules import require_fused
from .. import comm

_FORMAT = "zeroshard-sharded-optimizer"


def layout_signature(opt) -> list:
    """What a sharded state dict is only valid for: world size, rank, stage and every region's cut."""
    return [opt.world_size, opt.rank, opt.stage,
            [[reg.shard_numel, [list(f) for f in reg.frags]] + ([reg.bounds] if reg.bounds else [])
             for reg in opt.regions]]


def take_hyperparameters(opt, groups: list):
    """Each param group takes the saved group's hyperparameters (everything but its params).
    The fused AdamW has no amsgrad nor maximize: a saved group asking for them is refused
    before anything changes (an optimizer built with them runs torch's AdamW, which does)."""
    for sg in groups:
        if opt.fused and (sg.get("amsgrad") or sg.get("maximize")):
            raise NotImplementedError(comm.on_rank(opt,
                "this state dict's param groups ask for amsgrad or maximize, which the fused AdamW does not "
                "run; build the ShardedOptimizer with them (amsgrad=True / maximize=True: it then runs "
                "torch.optim.AdamW over its pieces) before loading it"))
    for g, sg in zip(opt.param_groups, groups):
        g.update((k, v) for k, v in sg.items() if k != "params")


@torch.no_grad()
def sharded(opt, param_groups: list) -> dict:
    """This rank's shard (views of the live state); see ShardedOptimizer.sharded_state_dict."""
    state = {}
    for k, reg in enumerate(opt.regions):
        if reg.exp_avg is not None:
            state[f"{k}.exp_avg"], state[f"{k}.exp_avg_sq"] = reg.exp_avg, reg.exp_avg_sq
        if reg.values is not None and not reg.model_owned:    # (ZeRO-3: the model's to save)
            state[f"{k}.values"] = reg.values
    whole = opt.whole_tensor_rule        # the state of the parameters this rank owns, whole
    for i, st in (whole.owned_states() if whole is not None else {}).items():
        state.update({f"owned.{i}.{key}": v for key, v in st.items()})
    return {"format": _FORMAT, "layout": layout_signature(opt), "param_steps": opt.param_steps,
            "param_groups": param_groups, "state": state}


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
    problems = comm.all_gather_object(_mismatch(opt, sd), group=opt.process_group,
                                      what="load_sharded_state_dict check")
    bad = [f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None]
    if bad:
        raise ValueError(comm.on_rank(opt,
            "cannot load the sharded state dict (" + "; ".join(bad) + "); a sharded state dict loads "
            "only into the layout it was saved from: use state_dict()/load_state_dict() or "
            "zeroshard.save_checkpoint/load_checkpoint to change world size, stage or layout"))
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
        raise ValueError(comm.on_rank(opt, f"the state dict has {len(groups)} param groups but this optimizer "
                                           f"has {len(opt.param_groups)}"))
    for gi, (g, sg) in enumerate(zip(opt.param_groups, groups)):
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(comm.on_rank(opt, f"param group {gi} has {len(sg['params'])} parameters in the "
                                               f"state dict but {len(g['params'])} here"))


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
                raise ValueError(comm.on_rank(opt,
                    f"state of parameter {i}: {name} has {st[name].numel()} elements but the "
                    f"parameter has {numel} (shape {tuple(opt.full_shape(i))}); the state dict "
                    "is of another model"))
        steps[i] = int(float(st.get("step", 0)))
    rule.load_full(opt, state, saved_ids)
    return steps


class StateDicts:
    """ShardedOptimizer's state-dict methods: torch's names and formats, over sharded state."""

    def refuse_own_ranks(self, what: str) -> None:
        """Raise where some param group shards over its own ranks ([Note: param groups over
        their own ranks] in comm/mesh.py), or some parameter is tensor-parallel, and ``what``
        does not handle that yet."""
        if self._source.tensor_parallel() is not None:
            raise NotImplementedError(self._err(
                f"{what} is not supported yet for tensor-parallel (DTensor) parameters: save and load them "
                "per rank yourself for now (docs/tensor-parallel.md)"))
        if self._source.param_colors() is not None:
            raise NotImplementedError(self._err(
                f"{what} is not supported yet for a ShardedOptimizer with a param group sharded over its own "
                "ranks ('device_mesh': expert parallelism): the ranks of different expert-parallel groups hold "
                "different experts under the same names. Save each rank's model and optimizer state yourself "
                "(e.g. opt.sharded_state_dict() is refused too), or train without the param group's "
                "'device_mesh'"))

    def sharded_state_dict(self) -> dict:
        """This rank's shard of the optimizer state, without communication: fast
        to save (e.g. ``torch.save`` per rank) and exact (stages 1/2 include the
        fp32 master of bf16/fp16 parameters). It loads back only with
        ``load_sharded_state_dict`` into the same layout (same model, world size,
        rank, stage and bucket_mb); to change any of those use ``state_dict()``
        or ``zeroshard.save_checkpoint``. The tensors are views of the live
        state (stages 1/2: ``values`` is this rank's chunk of the fp32 master or
        of the fp32 parameters) on its device: copy them (or save) before the
        next step."""
        require_fused(self, "sharded_state_dict()")
        self.refuse_own_ranks("sharded_state_dict()")
        return sharded(self, super().state_dict()["param_groups"])

    def load_sharded_state_dict(self, sharded: dict):
        """Load what ``sharded_state_dict()`` returned on this rank, into the same
        layout. Collective: every rank calls it with its own dict; if any rank's
        does not match its layout, every rank raises, naming the rank and what
        differs. Stages 1/2 restore the parameters too (each rank's chunk, then
        an all-gather); stage 3's are the model's: load the model's state first."""
        require_fused(self, "load_sharded_state_dict()")
        self.refuse_own_ranks("load_sharded_state_dict()")
        self.shards_loaded(load_sharded(self, sharded))

    def consolidate_state_dict(self, to: Optional[int] = 0):
        """Gather the full state onto global rank ``to`` (every rank with ``to=None``),
        where ``state_dict()`` then returns it without communication, as with
        torch's ZeroRedundancyOptimizer. Collective: every rank must call it. The
        copy is on CPU and is dropped by the next step."""
        self._consolidated = (to, self._gather_state(to, "consolidate_state_dict()"))

    def state_dict(self, to: Optional[int] = None):
        """The full state in torch.optim.AdamW's format (with ``optimizer_class``:
        that class's), loadable by that torch optimizer over the unwrapped
        model's parameters, in the same order.

        After ``consolidate_state_dict(to=r)`` on every rank, rank ``r`` gets it
        here without communication (a checkpoint under ``if rank == 0:``).
        Otherwise it is collective: every rank must call it; a rank that waits
        for the others longer than the watchdog's timeout raises
        ``CollectiveTimeout``, naming them. Gathers one region (bucket, or unit for FullyShard parameters) at a
        time, so the transient extra memory is one region; the result is on CPU.
        With ``to=r`` only global rank ``r`` builds and returns the dict; the
        others return None.
        """
        held = self._consolidated
        if held is not None and to is None:
            if held[1] is None:
                raise RuntimeError(self._err(
                    f"the state was consolidated onto rank {held[0]} by consolidate_state_dict(to="
                    f"{held[0]}): call opt.state_dict() there (this rank holds none; a collective "
                    "state_dict() here would wait for a rank that already has its copy)"))
            return held[1]
        return self._gather_state(to, "ShardedOptimizer.state_dict()")

    def _gather_state(self, to: Optional[int], what: str):
        """The full state dict on rank ``to`` (every rank if None), None elsewhere; collective."""
        self.refuse_own_ranks(what)
        comm.check_in(what, self, self.process_group,
                      "For a checkpoint written by rank 0 alone, call opt.consolidate_state_dict(to=0) on "
                      "every rank first, then opt.state_dict() on rank 0 needs no communication")
        keep = to is None or dist.get_rank() == to
        packed = super().state_dict()   # param_groups with indices; our torch state is empty
        full = self._rule.gather_full(self, keep)
        if not keep:
            return None
        packed["state"] = full
        return packed

    def load_state_dict(self, state_dict: dict):
        """Load a full AdamW state dict (ours or torch.optim.AdamW's, from any world
        size), keeping only this rank's shard. Parameters come from the model:
        load the model's state dict first; bf16/fp16 master weights are re-made
        from the parameters."""
        self.refuse_own_ranks("load_state_dict()")
        self._param_steps = load_full(self, state_dict, self._rule)
        self._source.params_loaded()
        self._consolidated = None
