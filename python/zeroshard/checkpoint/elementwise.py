"""An elementwise ``optimizer_class``'s state in a checkpoint.

[Note: elementwise optimizer checkpoints] The class (torch's SGD, Adam with
amsgrad, AdamW with maximize, Adagrad, ...) keeps its state per piece of
this rank's shard ([Note: update rules] in optim/rules.py). A checkpoint
holds it by parameter name, as it holds the fused AdamW's:
* a key the class keeps one value per element for (``exp_avg``,
  ``max_exp_avg_sq``, ``momentum_buffer``, ``sum``...) is a tensor of the
  parameter's full shape, ``<key>:<name>``, written piece by piece by the
  ranks holding it, so it loads at any world size and stage (and the fused
  AdamW's ``exp_avg``/``exp_avg_sq`` load into torch's AdamW and back);
* a per-parameter scalar (``step``, NAdam's ``mu_product``, ASGD's ``eta``)
  is a 0-d tensor under the same naming, gathered when saving (one small
  exchange) and written by the first rank;
* a parameter that never stepped has no state, as in torch's optimizers.
A load learns the keys from the manifest and gives each piece of this rank
its part; a checkpoint without a ``step`` (the fused AdamW's) gives the
class the step count the manifest records.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from .. import comm
from ..optim.rules import probe_state
from .files import parse_dtype
from .pieces import Piece, Spec


def elementwise_save(
    opt, rule, names: List[str], places: Dict[int, int]
) -> Tuple[Dict[str, Spec], Dict[str, Spec], List[Piece]]:
    """The specs (the same on every rank, and this rank's alone: its experts') and this
    rank's pieces of ``rule``'s state (collective: the scalars and which keys each
    parameter has are gathered over the optimizer's ranks, by name). ``places``: each
    expert parameter's place among its own ranks ([Note: expert checkpoints] in
    checkpoint/parallel.py; the first writes its scalars)."""
    keys = rule.elementwise_keys
    mine: Dict[str, dict] = {}  # param name -> {key: None (per element) or its scalar value}
    for i, t_off in rule.piece_leaves():
        for k, v in (rule.piece_state(i, t_off) or {}).items():
            if k in keys and isinstance(v, torch.Tensor):
                mine.setdefault(names[i], {})[k] = None
            elif k not in keys and v is not None:
                mine.setdefault(names[i], {})[k] = torch.as_tensor(v).detach().cpu().clone()
    every: Dict[str, dict] = {}
    for theirs in comm.all_gather_object(mine, group=opt.process_group, what="save_checkpoint: optimizer state"):
        for name, d in theirs.items():
            every.setdefault(name, {}).update(d)
    specs, local, pieces = {}, {}, []
    for i, name in enumerate(names):
        for k, v in every.get(name, {}).items():
            key, to = f"{k}:{name}", local if i in places else specs
            if v is None:
                to[key] = Spec(tuple(opt.full_shape(i)), torch.float32, torch.float32, opt.param_steps[i])
            else:
                to[key] = Spec(tuple(v.shape), v.dtype, v.dtype, opt.param_steps[i])
                if places.get(i, 0) == 0:
                    pieces.append(Piece(key, 0, v.reshape(-1), i not in places))
    for i, t_off in rule.piece_leaves():
        for k, v in (rule.piece_state(i, t_off) or {}).items():
            if k in keys and isinstance(v, torch.Tensor):
                pieces.append(Piece(f"{k}:{names[i]}", t_off, v.detach().reshape(-1), False))
    return specs, local, pieces


class ElementwiseLoad:
    """Loading ``rule``'s state: the pieces, known from the manifest (``adopt``), and
    the state each piece of this rank then takes (``finish``)."""

    def __init__(self, opt, rule, names: List[str]):
        self.opt, self.rule, self.names = opt, rule, names
        self.loaded: Dict[Tuple[int, int], dict] = {}  # (param, offset) -> its state

    def adopt(self, man: dict) -> List[Piece]:
        """The pieces to read: this rank's part of every state tensor the manifest holds for
        the optimizer's parameters."""
        index = {n: i for i, n in enumerate(self.names)}
        leaves = self.rule.piece_leaves()
        keys, pieces = self.rule.elementwise_keys, []
        self.loaded.clear()
        for key, t in man["tensors"].items():
            kind, _, name = key.partition(":")
            i = index.get(name)
            if i is None or kind in ("param", "buffer"):
                continue
            mine = [(t_off, leaf) for (j, t_off), leaf in leaves.items() if j == i]
            if kind in keys:
                for t_off, leaf in mine:
                    data = torch.zeros(leaf.numel(), dtype=torch.float32, device=leaf.device)
                    self.loaded.setdefault((i, t_off), {})[kind] = data.view(leaf.shape)
                    pieces.append(Piece(key, t_off, data, False))
            elif mine:
                data = torch.zeros(t["shape"], dtype=parse_dtype(t["dtype"]))
                for t_off, _ in mine:
                    self.loaded.setdefault((i, t_off), {})[kind] = data
                pieces.append(Piece(key, 0, data.view(-1), False))
        return pieces

    def finish(self, steps: Dict[str, int]) -> None:
        """Every piece of this rank takes its loaded state (none where the checkpoint has
        none); ``steps``: each parameter's step count, by name, from the manifest."""
        keeps_step = None
        for i, t_off in self.rule.piece_leaves():
            st = self.loaded.get((i, t_off))
            if st is not None:
                # scalars are shared by a parameter's pieces: each takes its own (step() updates them)
                st = {k: v if k in self.rule.elementwise_keys else v.clone() for k, v in st.items()}
                if "step" not in st:  # a fused AdamW checkpoint: the count is the manifest's
                    if keeps_step is None:
                        keeps_step = "step" in probe_state(self.rule.cls, self.rule.kwargs)
                    if keeps_step:
                        st["step"] = torch.tensor(float(steps.get(self.names[i], 0)))
            self.rule.set_piece_state(i, t_off, st)
