"""What a rank holds of a (model, optimizer) pair, by checkpoint key: the
tensors (Spec) and this rank's element ranges of them (Piece), read from
the regions a sharded model (FullyShard) and a ShardedOptimizer describe
([Note: shard sources] in core/source.py), or from a plain model and
torch AdamW.
"""

from __future__ import annotations

import json
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from .files import CheckpointError
from .elementwise import ElementwiseLoad, elementwise_save
from .parallel import (
    expert_colors,
    name_experts,
    name_group_experts,
    refuse_expert_buffers,
    refuse_unnamed_experts,
    tp_placements,
)
from .pieces import Piece, Spec
from ..core.regions import persistent_buffers, sharded_model_of
from ..core.tensor_parallel import placed_of

_SKIP_HYPER = ("params", "foreach", "fused", "capturable", "differentiable")


class Holdings:
    """What this rank holds of a (model, optimizer) pair, by checkpoint key."""

    def __init__(self, model: nn.Module, optimizer, for_load: bool):
        fs = sharded_model_of(model)
        inner = (
            fs.module
            if fs is not None
            else model.module
            if isinstance(model, nn.parallel.DistributedDataParallel)
            else model
        )
        sharded = _sharded_optimizers(optimizer)
        sharded_opt = sharded[0] if sharded else None
        plain = optimizers_of(optimizer)
        optimizer = plain[0] if plain and not sharded else None  # a torch AdamW
        self._set_group(fs, sharded_opt)
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.stage = 3 if fs is not None else (sharded_opt.stage if sharded_opt is not None else 0)
        self.for_load = for_load
        self.specs: Dict[str, Spec] = {}  # every rank's: the same on all
        self.local_specs: Dict[str, Spec] = {}  # this rank's alone (whole-tensor optimizer states)
        self.pieces: List[Piece] = []
        self.groups: Optional[list] = None
        self.aliases: Dict[str, str] = {}
        self._finish: List[Callable[[dict], None]] = []
        if fs is not None and fs.device.type == "meta":
            raise CheckpointError(
                "this FullyShard keeps its shards on meta (device='meta'); it has no values to save or load"
            )

        self.names: Dict[int, str] = {}  # id(parameter) -> canonical name
        for name, p in (fs if fs is not None else inner).named_parameters(remove_duplicate=False):
            if id(p) in self.names:
                self.aliases[name] = self.names[id(p)]
            else:
                self.names[id(p)] = name
        # id(parameter) -> its place among its own ranks, for the parameters sharded over their
        # own ranks (experts, under the whole model's names: [Note: expert checkpoints] in checkpoint/parallel.py)
        self.parallel: Dict[int, int] = {}
        held, regions = fs.held_regions() if fs is not None else ([], [])
        self._tensor_parallel(held, sharded)
        # some parameters shard over their own ranks (the same on every rank)
        self.has_experts = any(expert_colors(o) is not None for o in sharded) or any(
            reg.place is not None for reg in regions
        )
        if fs is None and not sharded:
            refuse_unnamed_experts(inner)
        covered = set()
        if fs is not None:
            self._sharded_model(fs, held, regions, covered)
        self._later: List[Callable[[dict], None]] = []  # load: pieces known from the manifest only
        if sharded_opt is not None:
            for opt in sharded:
                self._sharded_optimizer(opt, covered)
        elif optimizer is not None:
            if fs is not None:
                raise CheckpointError(
                    f"FullyShard parameters are updated by zeroshard.ShardedOptimizer; got {type(optimizer).__name__}"
                )
            self._torch_adamw(optimizer, for_load)
        self._unsharded(inner, covered if fs is None else None)

    def _unsharded(self, inner: nn.Module, covered: Optional[set]):
        """What no region holds: the parameters not in ``covered`` (None: none, a FullyShard
        holds them all) and the persistent buffers, each whole."""
        for p in inner.parameters() if covered is not None else ():
            if id(p) not in covered and (id(p) in self.placed or placed_of(p) is not None):
                raise CheckpointError(
                    f"parameter '{self.names[id(p)]}' is tensor-parallel (a DTensor) but no "
                    "ShardedOptimizer steps it (frozen, or the model saved without its optimizer): "
                    "checkpoints of those are not supported yet"
                )
            if id(p) not in covered:
                name = self.names[id(p)]
                self._spec("param:" + name, Spec(tuple(p.shape), p.dtype, p.dtype), p)
                self._whole("param:" + name, p, self.parallel.get(id(p)))
        if self.parallel:
            refuse_expert_buffers(inner, self.parallel)
        for name, b in persistent_buffers(inner):
            self.specs["buffer:" + name] = Spec(tuple(b.shape), b.dtype, b.dtype)
            self._whole("buffer:" + name, b)

    def _sharded_model(self, fs, held, regions, covered: set):
        """A FullyShard's parameters: its regions' fp32 shards."""
        name_experts(self.names, self.parallel, held, regions)
        for h in held:
            self._spec("param:" + self.names[id(h.param)], Spec(tuple(h.shape), torch.float32, h.dtype), h.param)
            covered.add(id(h.param))
        for reg in regions:
            for i, start, sl in reg.owned(self._place(reg)):
                self._piece("param:" + self.names[id(held[i].param)], held[i].param, start, reg.values[sl])
        self._finish.append(lambda man: fs.shards_loaded())

    def _tensor_parallel(self, held, sharded: list):
        """Tensor-parallel parameters ([Note: tensor-parallel checkpoints] in checkpoint/parallel.py):
        their placements, and the checkpoint written over every rank."""
        self.placed = tp_placements(held, sharded)
        self.tp_rank, self.dp_replica = 0, 0
        tp = [pl for pl in self.placed.values() if not pl.expert]  # (experts: by their own ranks)
        if tp:
            mesh = tp[0].mesh
            if self.world * self.replicas * mesh.size() != dist.get_world_size():
                raise CheckpointError(
                    f"a checkpoint of a tensor-parallel model is written over every rank: its "
                    f"dp ({self.world * self.replicas}) x tp ({mesh.size()}) mesh must span the "
                    f"{dist.get_world_size()} ranks"
                )
            self.group, self.world, self.rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
            self.tp_rank = mesh.get_local_rank()  # (hybrid on dp: the first replica writes)
            self.dp_replica, self.every, self.replicas, self.replica_rank = self.replica_rank, None, 1, 0

    def _piece(self, key: str, p: torch.Tensor, start: int, data: torch.Tensor):
        """Elements ``start ..`` of parameter ``p``'s (flattened) tensor ``key``: of its local
        piece where it is tensor-parallel ([Note: tensor-parallel checkpoints])."""
        pl = self.placed.get(id(p))
        if pl is None or not pl.sharded:
            if self.tp_rank == 0 == self.dp_replica or self.for_load:  # (replicated over tp: tp rank 0's)
                self.pieces.append(Piece(key, start, data, False))
            return
        for at, off, n in pl.runs(start, data.numel()) if self.for_load or not self.dp_replica else ():
            self.pieces.append(Piece(key, at, data[off : off + n], False))

    def _set_group(self, fs, sharded_opt):
        """The process group the checkpoint is written over, and the replicas of hybrid sharding."""
        groups = fs.groups if fs is not None else sharded_opt.source.groups if sharded_opt else None
        # hybrid sharding: each shard group holds everything; its first copy writes
        self.replicas = groups.replicas if groups is not None else 1
        self.replica_rank = groups.replica_rank if groups is not None else 0
        self.every = groups.every if groups is not None else None
        if fs is not None:
            self.group = fs.process_group
        elif sharded_opt is not None:
            self.group = sharded_opt.process_group
        else:
            self.group = dist.group.WORLD if dist.is_initialized() else None
        self.world = dist.get_world_size(self.group) if self.group is not None else 1
        self.shard_rank = dist.get_rank(self.group) if self.group is not None else 0

    def _name_of(self, p: torch.Tensor, i: int) -> str:
        name = self.names.get(id(p))
        if name is None:
            raise CheckpointError(
                f"optimizer parameter {i} (shape {tuple(p.shape)}) is not a parameter of the "
                "model; pass the model whose parameters the optimizer updates"
            )
        return name

    def _whole(self, key: str, t: torch.Tensor, place: Optional[int] = None):
        """A tensor every rank holds whole (rank 0 writes it), or with ``place``, every rank
        of an expert's own ranks (the first of them writes it: [Note: expert checkpoints])."""
        t = t.detach()
        if place is not None and place != 0 and not self.for_load:
            return
        flat = t.view(-1) if t.is_contiguous() else t.reshape(-1).clone()
        self.pieces.append(Piece(key, 0, flat, place is None, writeback=None if t.is_contiguous() else t))

    def _spec(self, key: str, spec: Spec, p: torch.Tensor):
        """The tensor ``key`` of parameter ``p``: the same on every rank, or an expert's,
        which only its own ranks know of ([Note: expert checkpoints])."""
        (self.local_specs if id(p) in self.parallel else self.specs)[key] = spec

    def _place(self, reg) -> int:
        """This rank's place among the ranks region ``reg`` is sharded over."""
        return self.shard_rank if reg.place is None else reg.place

    def _groups(self, opt, group_names: List[List[str]]):
        """Record opt's param groups (hyperparameters and parameter names) for a
        save, and have a load restore the hyperparameters: each group takes those
        of the saved group holding its first parameter. Several optimizers' groups
        follow each other."""
        self.groups = self.groups or []
        for g, names in zip(opt.param_groups, group_names):
            hyper = {}
            for k, v in g.items():
                if k in _SKIP_HYPER:
                    continue
                try:
                    json.dumps(v)
                except TypeError:
                    continue
                hyper[k] = v
            self.groups.append({"params": list(names), "hyper": hyper})

        def finish(man):
            where = {n: g["hyper"] for g in man["param_groups"] for n in g["params"]}
            for g, names in zip(opt.param_groups, group_names):
                saved = next((where[n] for n in names if n in where), None)
                for k, v in (saved or {}).items():
                    g[k] = tuple(v) if k == "betas" else v

        self._finish.append(finish)

    def _sharded_optimizer(self, opt, covered: set):
        name_group_experts(self.names, self.parallel, opt)
        whole = opt.whole_tensor_rule
        names = [self._name_of(p, i) for i, p in enumerate(opt.params)]
        if opt.elementwise_rule is not None:  # [Note: elementwise optimizer checkpoints]
            self._elementwise_state(opt, opt.elementwise_rule, names)
        if opt.fused and self.for_load:
            self._later.append(lambda man: _check_fused_can_run(man, set(names)))
        for i in opt.trainable if opt.fused else ():
            step, pl = opt.param_steps[i], self.placed.get(id(opt.params[i]))
            shape = tuple(opt.full_shape(i) if pl is None else pl.shape)  # (a DTensor's: global)
            for kind in ("exp_avg", "exp_avg_sq"):
                self._spec(f"{kind}:{names[i]}", Spec(shape, torch.float32, torch.float32, step), opt.params[i])
        if whole is not None:
            self._whole_tensor_state(opt, whole, names)
        for reg in opt.regions:
            if reg.values is not None and not reg.model_owned:  # (ZeRO-3: the model's, saved above)
                for i, *_ in reg.frags:
                    p = opt.params[i]
                    self._spec("param:" + names[i], Spec(tuple(p.shape), reg.values.dtype, p.dtype), p)
                    covered.add(id(p))
            for i, start, sl in reg.owned(self._place(reg)):
                if reg.values is not None and not reg.model_owned:
                    self._piece("param:" + names[i], opt.params[i], start, reg.values[sl])
                for kind in ("exp_avg", "exp_avg_sq") if opt.fused else ():
                    self._piece(f"{kind}:{names[i]}", opt.params[i], start, getattr(reg, kind)[sl])
        group_names = [[n for i, n in enumerate(names) if opt.group_of(i) == gi] for gi in range(len(opt.param_groups))]
        self._groups(opt, group_names)

        def finish(man):
            by = steps_by_name(man)
            opt.shards_loaded([by.get(n, 0) for n in names])

        self._finish.append(finish)

    def _elementwise_state(self, opt, rule, names: List[str]):
        """An elementwise optimizer_class's state; see [Note: elementwise optimizer checkpoints]."""
        if not self.for_load:
            places = {i: self.parallel[id(p)] for i, p in enumerate(opt.params) if id(p) in self.parallel}
            specs, local, pieces = elementwise_save(opt, rule, names, places)
            self.specs.update(specs)
            self.local_specs.update(local)
            self.pieces.extend(pieces)
            return
        load = ElementwiseLoad(opt, rule, names)
        self._later.append(lambda man: self.pieces.extend(load.adopt(man)))
        self._finish.append(lambda man: load.finish(steps_by_name(man)))

    def _whole_tensor_state(self, opt, rule, names: List[str]):
        """A whole-tensor optimizer's state ([Note: whole-tensor optimizers] in optim/whole.py):
        each owner holds its parameters' state tensors whole, under ``<state key>:<name>``.
        A load learns their keys and shapes from the manifest and hands each owner its
        parameters' state."""
        for i, st in (rule.owned_states() if not self.for_load else {}).items():
            for k, v in st.items():
                t = torch.as_tensor(v)
                key = f"{k}:{names[i]}"
                self.local_specs[key] = Spec(tuple(t.shape), t.dtype, t.dtype, opt.param_steps[i])
                self.pieces.append(Piece(key, 0, t.detach().reshape(-1), False))
        owned = {names[i]: i for i in rule.owned()}
        loaded: Dict[int, dict] = {}

        def adopt(man):
            for key, t in man["tensors"].items():
                kind, _, name = key.partition(":")
                if name in owned and kind not in _MODEL_OR_ADAMW:
                    data = torch.zeros(t["shape"], dtype=torch.float32, device=opt.device)
                    loaded.setdefault(owned[name], {})[kind] = data
                    self.pieces.append(Piece(key, 0, data.view(-1), False))

        self._later.append(adopt)
        self._finish.append(lambda man: rule.set_owned_states(loaded))

    def everyones_expert_keys(self) -> set:
        """The experts' parameter keys of every rank (collective over the checkpoint's group
        where some parameter is an expert's; this rank's alone elsewhere)."""
        mine = sorted(k for k in self.local_specs if k.startswith("param:"))
        if not self.has_experts or self.group is None or self.world == 1:
            return set(mine)
        every = comm.all_gather_object(mine, group=self.group, what="load_checkpoint: the experts each rank holds")
        return {k for theirs in every for k in theirs}

    def adopt(self, man: dict):
        """A load: add the pieces only the manifest names (whole-tensor optimizer states)."""
        for f in self._later:
            f(man)

    def _torch_adamw(self, opt, for_load: bool):
        if not isinstance(opt, (torch.optim.AdamW, torch.optim.Adam)):
            raise CheckpointError(
                f"optimizer {type(opt).__name__} is not supported: checkpoints hold "
                "zeroshard.ShardedOptimizer or torch.optim.AdamW/Adam state"
            )
        group_names = []
        for g in opt.param_groups:
            nm = []
            for p in g["params"]:
                name = self._name_of(p, len(nm))
                nm.append(name)
                state = opt.state.get(p)
                if for_load and not state:
                    state = opt.state[p] = {
                        "step": torch.tensor(0.0, device=p.device if g.get("capturable") or g.get("fused") else None),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }
                if state:
                    step = int(float(state["step"]))  # once: a fused/capturable step is on the GPU
                    for kind in ("exp_avg", "exp_avg_sq"):
                        self.specs[f"{kind}:{name}"] = Spec(tuple(p.shape), state[kind].dtype, p.dtype, step)
                        self._whole(f"{kind}:{name}", state[kind])
            group_names.append(nm)
        self._groups(opt, group_names)

        def finish(man):
            by = steps_by_name(man)
            for g, nm in zip(opt.param_groups, group_names):
                for p, name in zip(g["params"], nm):
                    opt.state[p]["step"].fill_(by.get(name, 0))

        self._finish.append(finish)

    def finish_load(self, man: dict):
        for p in self.pieces:
            if p.writeback is not None:
                p.writeback.copy_(p.data.view(p.writeback.shape))
        for f in self._finish:
            f(man)


def leave_out_frozen(h: Holdings, model: nn.Module) -> None:
    """Leave ``model``'s parameters that do not require grad out of ``h`` (save_checkpoint(
    exclude_frozen=True), DeepSpeed's exclude_frozen_parameters), and the names tied to them."""
    frozen = {"param:" + h.names[id(p)] for p in model.parameters() if not p.requires_grad and id(p) in h.names}
    h.specs = {k: s for k, s in h.specs.items() if k not in frozen}
    h.pieces = [p for p in h.pieces if p.key not in frozen]
    h.aliases = {a: c for a, c in h.aliases.items() if "param:" + c not in frozen}


def _check_fused_can_run(man: dict, names: set) -> None:
    """A checkpoint whose param groups ask for what the fused AdamW does not run is refused
    before anything is read (its optimizer was built with amsgrad or maximize)."""
    for g in man["param_groups"] or ():
        asked = sorted(k for k in ("amsgrad", "maximize") if g["hyper"].get(k))
        if asked and names & set(g["params"]):
            raise CheckpointError(
                f"the checkpoint's optimizer ran with {' and '.join(f'{k}=True' for k in asked)}, which the "
                f"fused AdamW does not run: build the ShardedOptimizer with {', '.join(f'{k}=True' for k in asked)} "
                "(it then runs torch.optim.AdamW over its pieces) before loading it"
            )


_MODEL_OR_ADAMW = ("param", "buffer", "exp_avg", "exp_avg_sq")


def _sharded_optimizers(optimizer) -> list:
    """The ShardedOptimizers among those given (all of them, or none)."""
    from ..optim.sharded import ShardedOptimizer

    optimizers = optimizers_of(optimizer)
    sharded = [o for o in optimizers if isinstance(o, ShardedOptimizer)]
    if len(optimizers) > 1 and len(sharded) < len(optimizers):
        raise CheckpointError(
            "several optimizers are saved together only when each is a "
            "zeroshard.ShardedOptimizer (e.g. Muon over the matrices, AdamW over the rest)"
        )
    return sharded


def optimizers_of(optimizer) -> list:
    """The optimizers given to a checkpoint call: none, one, or a list or tuple of them."""
    if optimizer is None:
        return []
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


def steps_by_name(man: dict) -> Dict[str, int]:
    """Each parameter's step count, from its optimizer state's entries in the manifest."""
    out: Dict[str, int] = {}
    for key, t in man["tensors"].items():
        kind, _, name = key.partition(":")
        if kind not in ("param", "buffer") and t.get("step") is not None:
            out[name] = max(out.get(name, 0), t["step"])
    return out
