"""The planner's trace of one training step on fake tensors: the live bytes of
every tensor a forward and backward create, with a stage's gradient policy
replayed (see [Note: model plan] in plan/planner.py)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, List, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..core.reduction import ReductionOrder
from ..core.pool import BufferPool


def torch_dtype(dtype: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)


@dataclass
class PlannedReduction:
    names: List[str]  # parameters whose gradients it takes
    buffer: int  # bytes of its flat gradient buffer
    shard: int  # gradient-shard bytes allocated when it retires (ZeRO-3's units)
    scratch: int = 0  # transport scratch while in flight (gloo's point-to-point reduce-scatter)


@dataclass
class Gather:
    module: str  # a non-root ZeRO-3 unit's module path
    nbytes: int  # its gathered (full, padded) parameters
    names: List[str]  # its trainable parameters: resharded in backward once all their gradients arrived


@dataclass
class Policy:
    """A stage's gradient lifetimes, replayed in the fake backward; see [Note: model plan]."""

    reductions: List[PlannedReduction]  # in launch order
    inflight: int  # reductions in flight at once
    first: int  # bytes allocated by the first launch (ZeRO-2's gradient shard)
    keep: int = 0  # buffers kept free for reuse (ZeRO-2's pool; ZeRO-3 keeps none)
    pooled: bool = False  # the pool and the gradient shard are kept between steps (CPU:
    # [Note: bucket buffers between steps] in zero12/reducer.py): the step
    # starts with them as the last one left them
    gathers: List[Gather] = field(default_factory=list)  # ZeRO-3's non-root units, in forward order
    prefetch: int = 0  # units gathered ahead of the one running (FullyShard's prefetch)


class _PolicyReplay:
    """Installs a Policy on a (fake) model: each gradient stays on its parameter
    until every gradient of its reduction has arrived; then the reduction's
    buffer is allocated and the gradients freed; retiring a reduction frees its
    buffer (to the reducer's pool, the same BufferPool) and allocates its
    gradient shard."""

    def __init__(self, model: nn.Module, policy: Policy):
        self.policy, self.held = policy, []
        self.pool = BufferPool(policy.keep, lambda n, dt: torch.empty(n, dtype=dt))
        if policy.pooled:
            for (n, dt), bufs in _pool_after_backward(policy).free.items():
                for _ in bufs:
                    self.pool.release(self.pool.acquire(n, dt))
            if policy.first:
                self.held.append(torch.empty(policy.first, dtype=torch.uint8))
        self.params = dict(model.named_parameters())
        self.items = [SimpleNamespace(r=r, pending=len(r.names), buf=None) for r in policy.reductions]
        self.left = {n: 0 for n in self.params}
        for it in self.items:
            for n in it.r.names:
                self.left[n] += 1
        self.ordered = ReductionOrder(self._launch, self._retire, policy.inflight)
        self.ordered.start(self.items)
        by_name = {n: [it for it in self.items if n in it.r.names] for n in self.params}
        self.gathers = _GatherReplay(model, policy)
        for n, p in self.params.items():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p, n=n: self._arrived(n, by_name[n]))

    def _arrived(self, name, items):
        for it in items:
            it.pending -= 1
        self.gathers.arrived(name)  # (the unit is resharded before its gradients are flattened)
        self.ordered.advance()

    def _launch(self, it):
        if self.policy.first and not self.held:
            self.held.append(torch.empty(self.policy.first, dtype=torch.uint8))
        it.buf = self.pool.acquire(it.r.buffer, torch.uint8)
        it.scratch = torch.empty(it.r.scratch, dtype=torch.uint8)
        for n in it.r.names:
            self.left[n] -= 1
            if self.left[n] == 0:
                self.params[n].grad = None

    def _retire(self, it):
        self.pool.release(it.buf)
        it.buf = it.scratch = None
        if it.r.shard:
            self.held.append(torch.empty(it.r.shard, dtype=torch.uint8))

    def finish(self):
        self.ordered.advance(flush=True)
        self.ordered.drain()
        self.gathers.reshard_all()


class _GatherReplay:
    """ZeRO-3's gathered units over a fake step, as zero3/fully_shard.py and zero3/gather.py
    keep them: a unit is gathered before its forward, the next ``prefetch`` units
    in forward order ahead of it (at most prefetch + 1 alive), and resharded after
    its forward; in backward the same in reverse order, each resharded once all its
    gradients have arrived. The root unit is gathered for the whole step: the
    caller counts it."""

    def __init__(self, model: nn.Module, policy: Policy):
        self.prefetch, self.full, self.backward = policy.prefetch, {}, False
        self.nbytes = {g.module: g.nbytes for g in policy.gathers}
        self.left = {g.module: set(g.names) for g in policy.gathers}
        self.fwd = [g.module for g in policy.gathers]
        self.bwd = self.fwd[::-1]
        last = len(self.fwd) - 1
        for k, name in enumerate(self.fwd):
            mod = model.get_submodule(name)
            # (a forward in backward is recomputation: gathered, no prefetch, kept until its gradients)
            mod.register_forward_pre_hook(
                lambda m, a, k=k: self._gather(self.fwd[k]) if self.backward else self._run(self.fwd, k)
            )
            mod.register_forward_hook(lambda m, a, o, name=name: None if self.backward else self._reshard(name))
            mod.register_full_backward_pre_hook(lambda m, go, k=k: self._run(self.bwd, last - k))
        if self.fwd:
            model.register_forward_pre_hook(lambda m, a: self._prefetch(self.fwd, -1))

    def start_backward(self):
        """The root's outputs got their gradient: the first units in backward order are prefetched."""
        self.backward = True
        self._prefetch(self.bwd, -1)

    def _gather(self, name: str):
        if name not in self.full:
            self.full[name] = torch.empty(self.nbytes[name], dtype=torch.uint8)

    def _reshard(self, name: str):
        self.full.pop(name, None)

    def _run(self, order: List[str], pos: int):
        self._gather(order[pos])
        self._prefetch(order, pos)

    def _prefetch(self, order: List[str], pos: int):
        for name in order[pos + 1 : pos + 1 + self.prefetch]:
            if name in self.full:
                continue
            if len(self.full) >= self.prefetch + 1:
                break
            self._gather(name)

    def arrived(self, param: str):
        for name, left in self.left.items():
            if param in left:
                left.discard(param)
                if not left:
                    self._reshard(name)

    def reshard_all(self):
        self.full.clear()


def _pool_after_backward(policy: Policy) -> BufferPool:
    """The pool one backward leaves (sizes only: meta tensors), launching and retiring
    in the reducer's order."""
    pool = BufferPool(policy.keep, lambda n, dt: torch.empty(n, dtype=dt, device="meta"))
    items = [SimpleNamespace(r=r, pending=0, buf=None) for r in policy.reductions]

    def launch(it):
        it.buf = pool.acquire(it.r.buffer, torch.uint8)

    ordered = ReductionOrder(launch, lambda it: pool.release(it.buf), policy.inflight)
    ordered.start(items)
    ordered.advance(flush=True)
    ordered.drain()
    return pool


class _LiveBytes(TorchDispatchMode):
    """A dispatch mode that counts the bytes of live tensor storages created under it, and their peak."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self._seen = 0, 0, {}

    def ignore(self, tensors):
        """Storages that exist already (parameters, inputs): views of them are not new bytes."""
        for t in tensors:
            self._seen[id(t.untyped_storage())] = None

    def _free(self, key, n):
        self.live -= n
        self._seen.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if id(st) not in self._seen:
                    n = st.nbytes()
                    self._seen[id(st)] = weakref.finalize(st, self._free, id(st), n)
                    self.live += n
                    self.peak = max(self.peak, self.live)
        return out


def activation_bytes(build: Callable, example: Callable, dtype: str = "fp32", policy: Optional[Policy] = None) -> int:
    """Peak bytes of the tensors one forward + backward of the unwrapped model creates (fake tensors).

    Without ``policy`` each gradient is dropped as soon as autograd has
    accumulated it (ZeRO-1 and DDP copy it into memory counted elsewhere);
    with one, gradients, reduction buffers and gradient shards live as that
    stage's policy keeps them (see [Note: model plan])."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    pdt = torch_dtype(dtype)
    fake = FakeTensorMode()
    default = torch.get_default_dtype()
    torch.set_default_dtype(pdt)  # (module.to() cannot convert fake parameters in place)
    try:
        with fake:
            model = build()
            inputs = example()
    finally:
        torch.set_default_dtype(default)
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    replay = None
    if policy is None:
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    live = _LiveBytes()
    live.ignore([*model.parameters(), *model.buffers(), *(t for t in inputs if torch.is_tensor(t))])
    with fake, live:
        if policy is not None:
            replay = _PolicyReplay(model, policy)
        out = model(*inputs)
        loss = out if out.dim() == 0 else out.float().sum()
        if replay is not None:
            replay.gathers.start_backward()
        loss.backward()
        if replay is not None:
            replay.finish()
    return live.peak
