"""ZeRO-1/2's all-gather of the updated parameters after a step: blocking, or
overlapped with the next forward.

[Note: overlapped parameter gather] With ``overlap_param_gather=True``
``step()`` launches every bucket's all-gather and returns; the next forward
then waits, module by module, only for the buckets holding that module's own
parameters (a forward pre-hook registered for all modules with torch's
``register_module_forward_pre_hook`` while gathers are in flight, removed
when none is left), so the gathers of later layers run while earlier layers
compute (Megatron's overlap_param_gather). Everything still in flight is
waited for at the first gradient of the next backward, before the next
step, and before any state dict, checkpoint or load (``settle``). What it
cannot see: a parameter read outside the forward of the module that owns it
before that module's forward has run (a weight used directly by another
module, ``model.state_dict()`` or ``p.data`` between step() and forward):
such code must call ``opt.wait_params()`` first; so must code that ends a
torch.profiler session right after a step (torch's profiler corrupts its
results when a collective it saw start is still running as the session
ends). Hence opt-in; the default waits for every gather inside ``step()``.
"""

from __future__ import annotations

import atexit
import weakref
from typing import TYPE_CHECKING, Dict, List

import torch
import torch.distributed as dist

from .. import comm

if TYPE_CHECKING:
    from .flat import ParamPlace


# every ParamGather alive: the process's exit waits for their gathers first (atexit
# runs before the interpreter tears torch and the transport down)
_LIVE: "weakref.WeakSet[ParamGather]" = weakref.WeakSet()


@atexit.register
def _settle_all() -> None:
    for gather in list(_LIVE):
        gather.settle_quietly()


class ParamGather:
    """The all-gathers of one FlatReducer's buckets, each over its buffer's ranks (see the Note above)."""

    def __init__(
        self,
        buffers: list,
        params: List[torch.Tensor],
        where: Dict[int, "ParamPlace"],
        *,
        overlap: bool,
        comm_elements: dict,
        hook_factory,
    ):
        self.buffers, self.overlap = buffers, overlap
        self.comm_elements = comm_elements
        # parameter -> the buckets holding its elements (by identity: tensors compare elementwise)
        self.buckets_of = {id(params[i]): sorted({f.bucket for f in place.frags}) for i, place in where.items()}
        self.pending: Dict[int, comm.CommHandle] = {}  # bucket index -> its all-gather in flight
        self._hook = None
        self._hook_fn = hook_factory(self._before_forward)  # held weakly by the caller's factory
        _LIVE.add(self)

    def launch(self, step: int) -> None:
        """All-gather every bucket's parameters in place from each rank's chunk, all in
        flight at once; without overlap, wait for them here."""
        self.settle()
        for buf in self.buffers:
            for b in buf.buckets:
                region = buf.params[b.offset : b.offset + b.numel]
                self.pending[b.index] = comm.all_gather(
                    b.own(buf.params), region, group=buf.shard.group, what=f"step {step}, bucket {b.index} all-gather"
                )
                self.comm_elements["all_gather"] += b.numel
        if not self.overlap:
            self.settle()
        elif self.pending and self._hook is None:
            self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._hook_fn)

    def settle(self) -> None:
        """Wait for every all-gather still in flight."""
        if self.pending and not dist.is_initialized():
            # the process group was destroyed after the last step (its destruction ran the
            # queued collectives): never wait on a dead group; a collective not done is parked
            for t in self.pending.values():
                t.handle.wait_for(0.0)
            self.pending.clear()
        for b in sorted(self.pending):
            self.pending.pop(b).wait()
        self._drop_hook()

    def __del__(self):
        # dropped with gathers in flight (the optimizer deleted): wait for them while their
        # buffers are certainly alive
        self.settle_quietly()

    def settle_quietly(self):
        """settle(), for finalizers: a failed collective was reported where it failed."""
        try:
            self.settle()
        except Exception:  # noqa: BLE001 - a failed collective was reported where it failed
            pass

    def _before_forward(self, module: torch.nn.Module, args):
        for p in module.parameters(recurse=False):
            for b in self.buckets_of.get(id(p), ()):
                handle = self.pending.pop(b, None)
                if handle is not None:
                    handle.wait()
        if not self.pending:
            self._drop_hook()

    def _drop_hook(self):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
