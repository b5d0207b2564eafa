"""Module buffers kept equal to rank 0's, as DDP keeps them.

[Note: module buffers] DDP (``broadcast_buffers=True``, its default)
broadcasts the wrapped module's buffers from rank 0 at the start of each
forward, so every rank normalizes with rank 0's BatchNorm statistics and a
checkpoint written by rank 0 holds what every rank used. ShardedOptimizer
stands in for DDP at stages 1 and 2 but is given parameters, not the module:
``BufferSync`` finds the module at its first forward (the outermost module
called that holds some of the optimizer's parameters: the model, in
``model(x)``) and from then on broadcasts that module's buffers from rank 0
before each of its *training* forwards (train mode, gradients enabled): one
broadcast per dtype, none at all for a model without buffers. A forward in
eval mode or without gradients broadcasts nothing, so evaluation on the
master rank alone stays local (each rank then evaluates with its own
statistics; rank 0's are DDP's). ``ShardedOptimizer(broadcast_buffers=False)``
turns it off, as DDP's argument does. DDP also broadcasts them when it is
built; so does ShardedOptimizer when it is given a module's ``parameters()``
or ``named_parameters()`` (or param groups of them: ``modules_given``), so the
buffers are equal from construction on. Given a list of tensors it knows no
module until the first forward, which then makes them equal. FullyShard
broadcasts buffers once, at wrapping, as FSDP2 does.
"""

from __future__ import annotations

import weakref
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..core.hooks import remove_hooks, weak_hook


class BufferSync:
    """Broadcasts the buffers of the module holding ``params`` from ``src`` over ``group``
    before each training forward; see [Note: module buffers]."""

    def __init__(
        self,
        params: List[torch.Tensor],
        group: dist.ProcessGroup,
        src: int,
        before: Optional[Callable[[], None]] = None,
        source: Optional[Callable[[bool], int]] = None,
    ):
        """``before()``: called before each broadcast (the first collective of an iteration);
        ``source(training)``: the global rank to broadcast from, when it is not always ``src``
        (collective: under torch's Join, the highest rank still training)."""
        self.ids, self.group, self.src, self.before, self.source = {id(p) for p in params}, group, src, before, source
        self.module = None
        self.hooks = [nn.modules.module.register_module_forward_pre_hook(weak_hook(self._find))]
        # an optimizer dropped before its first forward leaves no global hook behind
        weakref.finalize(self, remove_hooks, self.hooks)

    def _find(self, module: nn.Module, args):
        if self.module is not None or not any(id(p) in self.ids for p in module.parameters()):
            return
        if self.use(module):
            self._broadcast(module, args)  # (this call's own hooks were collected already)

    def use(self, module: nn.Module) -> bool:
        """Broadcast ``module``'s buffers before each of its training forwards from now on (the
        module found by an earlier layout of the optimizer's parameters); whether it has any."""
        self.release()
        self.module = module
        if any(True for _ in module.buffers()):
            self.hooks.append(module.register_forward_pre_hook(weak_hook(self._broadcast)))
            return True
        return False

    @property
    def active(self) -> bool:
        """The module is known and has buffers to broadcast."""
        return self.module is not None and len(self.hooks) > 0

    def shadow(self):
        """The broadcast a training forward of the module makes, made by a rank that has
        no batch for it ([Note: uneven inputs] in optim/join.py)."""
        if self.active and self.module.training and torch.is_grad_enabled():
            self.sync(self.source(False) if self.source is not None else self.src)

    def _broadcast(self, module: nn.Module, args):
        if not (module.training and torch.is_grad_enabled()):
            return
        if self.before is not None:
            self.before()
        self.sync(self.source(True) if self.source is not None else self.src)

    def sync(self, src: int):
        """Every rank's buffers of the module become global rank ``src``'s (collective)."""
        sync_buffers([self.module], self.group, src)

    def release(self):
        """Remove the hooks (the optimizer is rebound, or the search is over)."""
        remove_hooks(self.hooks)


def sync_buffers(modules: List[nn.Module], group: dist.ProcessGroup, src: int) -> None:
    """Every rank's buffers of ``modules`` become global rank ``src``'s: one broadcast per
    (dtype, device), of its bytes (any dtype: complex, unsigned), none without buffers or
    over one rank (collective)."""
    if dist.get_world_size(group) == 1:  # ([Note: one rank] in comm/collectives.py)
        return
    by_kind, seen = {}, set()
    for m in modules:
        for b in m.buffers():
            if id(b) not in seen:
                seen.add(id(b))
                by_kind.setdefault((b.dtype, b.device), []).append(b)
    with torch.no_grad():
        for bufs in by_kind.values():
            flat = torch.cat([b.reshape(-1) for b in bufs])
            comm.broadcast_bytes(flat, src, group)
            offset = 0
            for b in bufs:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()


_PARAMETER_GENERATORS = (nn.Module.parameters.__code__, nn.Module.named_parameters.__code__)


def modules_given(params) -> List[nn.Module]:
    """The modules whose ``parameters()`` / ``named_parameters()`` an optimizer is given
    (``ShardedOptimizer(model.parameters())``, or param groups of them), read before the
    optimizer iterates them: such a generator, not yet started, holds its module as
    ``self``. A list of tensors names no module (then []). See [Note: module buffers]."""
    given = [params]
    if isinstance(params, (list, tuple)):  # param groups: each group's "params"
        given += [d.get("params") for d in params if isinstance(d, dict)]
    found = []
    for g in given:
        frame = getattr(g, "gi_frame", None)
        if getattr(g, "gi_code", None) in _PARAMETER_GENERATORS and frame is not None:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module):
                found.append(module)
    return found
