"""ZeRO-3 forward: the hooks that gather a unit around each of its calls, the
model's forward around them, and the calls recorded for prefetch and for the
backward's reduction order. See [Note: fully shard policy] in
zero3/fully_shard.py.

[Note: units called directly] FSDP2 gathers a module whenever its forward
runs, and so does FullyShard: a unit gathers itself when it is called inside
the wrapped model's forward, outside it (a chunked-loss head applied to
slices of the hidden states after the trunk, ``model.blocks[0](x)`` alone),
several times in one forward (a weight-shared block), or through another
method registered with ``register_forward_method``. Nested calls of one unit
(a registered method calling ``forward``) reshard it when the outermost one
returns. Every call with gradients enabled is recorded, and the next backward
reduces the units in the reverse order of their first calls: a unit called
several times reduces once, when the backward of its first call (the last
of its backwards) has given every gradient. A module of the root unit called
directly gathers the root unit, which stays gathered to the end of the
backward when gradients are enabled (as after the model's forward), and is
freed after the call when not; so does the wrapped model itself called
directly (a trainer's ``self.model``: TRL reads the LM head's weight inside
the model's forward without calling the head), for the whole call, nested
root-unit modules counted. Without gradients, a call that gathers checks
in first ([Note: rank-0 code] in comm/collectives.py): evaluation of one
unit under ``if rank == 0:`` raises instead of hanging.
"""

from __future__ import annotations

from typing import Callable, List, Union

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from .backward import UnitBackward
from .gather import Gatherer
from .outputs import cast_floating, cast_inputs, output_tensors
from .records import InPlace, MixedPrecision, Unit, UnitState


def _hook_outputs(out, fn, where: str, err, strict: bool = True):
    """``fn()`` when the gradient of any of ``out``'s tensors is first computed ([Note: unit outputs])."""
    tensors = output_tensors(out, where, err, strict)
    if tensors:
        register_multi_grad_hook(tensors, lambda grads: fn(), mode="any")


class _InputsDone(torch.autograd.Function):
    """Identity on a call's inputs; its backward (the inputs' gradients are computed) calls ``done``."""

    @staticmethod
    def forward(ctx, done, *inputs):
        ctx.done = done
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None,) + grads


def _watch_inputs(args: tuple, kwargs: dict, done: Callable[[], None]):
    """``args`` and ``kwargs`` with their tensors that require grad passed through ``_InputsDone``
    (``done()`` once their gradients are computed: [Note: frozen parameters] in zero3/wrap.py),
    and 1, or unchanged and 0 when none requires grad."""
    leaves, spec = tree_flatten((args, kwargs))
    at = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not at:
        return args, kwargs, 0
    for k, t in zip(at, _InputsDone.apply(done, *[leaves[k] for k in at])):
        leaves[k] = t
    args, kwargs = tree_unflatten(leaves, spec)
    return args, kwargs, 1


class UnitForward:
    """The forward side of one FullyShard's units."""

    def __init__(
        self,
        units: List[Unit],
        gatherer: Gatherer,
        backward: UnitBackward,
        *,
        root: nn.Module,
        mixed_precision: MixedPrecision,
        param_dtype: torch.dtype,
        reshard_after_forward: Union[bool, int],
        err: Callable[[str], str],
        check_in: Callable[[], None],
    ):
        """``root``: the wrapped model; ``check_in()``: every rank must run this gathering too
        (a forward without gradients)."""
        self.units, self.gatherer, self.backward, self.root = units, gatherer, backward, root
        self.mp, self.param_dtype, self.reshard_after_forward = mixed_precision, param_dtype, reshard_after_forward
        self.err, self.check_in = err, check_in
        self.in_forward = False
        self.order: List[int] = []  # recorded forward order of non-root units (prefetch)
        self.seen: List[int] = []  # the units the current forward ran
        self.calls: List[int] = []  # units called with gradients since the last backward began
        self.root_calls = 0  # root-unit modules running outside the model's forward
        self.unit_of = {id(m): u for u in units[1:] for m in u.modules}
        self.ran: dict = {}  # a group's unit index -> its modules that ran since it was gathered
        self._install()

    def _install(self):
        # one hook object of each kind for every unit: see [Note: fully shard policy], torch.compile
        pre = torch.compiler.disable(self.unit_pre_forward)
        post = torch.compiler.disable(self.unit_post_forward)
        for u in self.units[1:]:
            for m in u.modules:
                u.hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
                u.hooks.append(m.register_forward_hook(post))
        # root-unit modules called directly (not through the wrapper) gather the root unit
        mods = {id(mod): mod for q in self.units[0].params for mod, _ in q.slots}
        if isinstance(self.root, InPlace):  # (fully_shard in place: its forward is the model's run_forward)
            mods.pop(id(self.root), None)
        else:  # the wrapped model called directly (a trainer's self.model): gathered for the whole call
            mods[id(self.root)] = self.root
        pre = torch.compiler.disable(self._root_module_pre_forward)
        post = torch.compiler.disable(self._root_module_post_forward)
        for mod in mods.values():
            self.units[0].hooks.append(mod.register_forward_pre_hook(pre))
            self.units[0].hooks.append(mod.register_forward_hook(post))
        for u in self.units:
            for q in u.params:
                if q.requires_grad:
                    self.watch_grad(u, q)

    def watch_grad(self, u: Unit, q) -> None:
        """``q``'s gradient goes to its unit's reduction as it arrives (a parameter trainable
        when wrapped, or laid out again since: relayout.retrain); once for each."""
        if not q.watched:
            q.watched = True
            u.hooks.append(q.full.register_post_accumulate_grad_hook(lambda p, u=u, q=q: self.backward.on_grad(u, q)))

    # ------------------------------------------------------------ unit hooks
    def unit_pre_forward(self, module, args, kwargs):
        u = self.unit_of[id(module)]
        self._pre_forward(u)
        changed = self.mp.casts_inputs(root=False)
        if changed:
            args, kwargs = cast_inputs(self.param_dtype, args, kwargs)
        if (
            torch.is_grad_enabled()
            and not self.backward.active
            and any(not (q.requires_grad and q.sharded.requires_grad) for q in u.params)
        ):
            args, kwargs, watched = _watch_inputs(args, kwargs, lambda: self.backward.inputs_done(u))
            u.input_waits += watched
            changed = changed or watched
        return (args, kwargs) if changed else None

    def unit_post_forward(self, module, args, out):
        """(A forward hook: the output, cast to ``output_dtype``, replaces the unit's.)"""
        return self._post_forward(self.unit_of[id(module)], out, module)

    def _cast_output(self, out):
        """``out``'s floating tensors in ``output_dtype`` (FSDP2's ``MixedPrecisionPolicy``'s), if set."""
        return out if self.mp.output_dtype is None else cast_floating(self.mp.output_dtype, out)

    def reshards(self, u: Unit) -> Union[bool, int]:
        """Whether ``u`` is freed after its forward (its own setting, else the model's); an
        int: to a piece over that many ranks ([Note: post-forward shards] in zero3/gather.py)."""
        own = u.settings.reshard_after_forward
        return self.reshard_after_forward if own is None else own

    def _reshard(self, u: Unit, grad: bool):
        after = self.reshards(u)
        self.gatherer.reshard(u, keep=after if grad and not isinstance(after, bool) else 0)

    def _pre_forward(self, u: Unit):
        u.calls += 1
        with torch.no_grad():
            if self.backward.active:  # recomputation (activation checkpointing)
                self.gatherer.gather(u)
                return
            grad = torch.is_grad_enabled()
            if grad and len(self.calls) < 8 * len(self.units) + 64:
                self.calls.append(u.index)  # the next backward's order follows the calls
            if not self.in_forward:  # called directly ([Note: units called directly])
                if not grad and u.state == UnitState.SHARDED:
                    self.check_in()
                self.gatherer.gather(u)
                return
            self.seen.append(u.index)
            pos = len(self.seen) - 1
            self.gatherer.gather(u)
            if u.settings.forward_prefetch is not None:  # set_modules_to_forward_prefetch
                self.gatherer.prefetch_these(u.settings.forward_prefetch)
            elif pos < len(self.order) and self.order[pos] == u.index:
                self.gatherer.prefetch_after(self.order, pos)

    def _post_forward(self, u: Unit, out, module=None):
        u.calls = max(0, u.calls - 1)
        out = self._cast_output(out)
        if self.backward.active:
            return out
        grad = torch.is_grad_enabled()
        ran = self.ran.setdefault(u.index, set()) if u.group else None
        if ran is not None and module is not None:
            ran.add(id(module))
        done = ran is None or len(ran) >= len(u.modules)  # a group: once each of its modules ran
        if u.calls == 0 and (self.reshards(u) or not grad) and done:
            self.ran.pop(u.index, None)
            with torch.no_grad():
                self._reshard(u, grad)
        if grad:
            _hook_outputs(out, lambda u=u: self.backward.pre_backward(u), f"unit '{u.name}'", self.err)
        return out

    def take_calls(self) -> List[int]:
        """The units called with gradients since the last backward began (then forgotten)."""
        calls, self.calls = self.calls, []
        return calls or list(self.order)

    # ------------------------------------------------------ root-unit modules
    def _root_module_pre_forward(self, module, args):
        if self.in_forward or self.backward.active:
            return
        if self.root_calls:  # nested (a root-unit module inside the wrapped model called directly)
            self.root_calls += 1
            return
        if self.units[0].state == UnitState.GATHERED:  # kept from the model's forward to its backward
            return
        if not torch.is_grad_enabled():
            self.check_in()
        self.root_calls = 1  # this call gathered it ([Note: units called directly])
        with torch.no_grad():
            self.gatherer.gather(self.units[0])

    def _root_module_post_forward(self, module, args, out):
        if self.root_calls and not (self.in_forward or self.backward.active):
            self.root_calls -= 1
            if not self.root_calls and not torch.is_grad_enabled():  # with grad: kept to the end of backward
                with torch.no_grad():
                    self.gatherer.reshard(self.units[0])

    # ------------------------------------------------------- other methods
    def register_method(self, module: nn.Module, name: str):
        """Make ``module.<name>(...)`` gather as ``forward`` does; see FullyShard.register_forward_method."""
        if id(module) not in self.unit_of and module is not self.root:
            raise ValueError(
                self.err(
                    f"register_forward_method: {type(module).__name__} is not a sharding unit of this FullyShard "
                    "(nor the model it wraps); pass the unit's module (a module the wrap policy selected), or add "
                    "its class to wrap="
                )
            )
        method = getattr(module, name, None)
        if not callable(method):
            raise ValueError(self.err(f"register_forward_method: {type(module).__name__} has no method '{name}'"))
        if module is self.root:

            def gathered(*args, **kwargs):
                return self.around_root(method, args, kwargs)
        else:

            def gathered(*args, **kwargs):
                cast = self.unit_pre_forward(module, args, kwargs)
                if cast is not None:
                    args, kwargs = cast
                return self.unit_post_forward(module, args, method(*args, **kwargs))

        setattr(module, name, gathered)

    # ------------------------------------------------------ the model's forward
    def around_root(self, fn, args, kwargs):
        """``fn(*args, **kwargs)`` as the model's forward: the root unit gathered around it."""
        self._begin()
        if self.mp.casts_inputs(root=True):
            args, kwargs = cast_inputs(self.param_dtype, args, kwargs)
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            self._abort()
            raise
        return self._end(out)

    @torch.compiler.disable
    def _begin(self):
        if self.backward.active:
            if torch._C._current_graph_task_id() != -1:
                raise RuntimeError(self.err("the FullyShard model was called during its own backward"))
            self.backward.abandon()  # the last backward raised before it finished
        if not torch.is_grad_enabled():  # evaluation: every rank must run it too
            self.check_in()
        root = self.units[0]
        self.in_forward = True
        self.seen = []
        try:
            with torch.no_grad():
                self.gatherer.gather(root, wait=False)
                if root.settings.forward_prefetch is not None:
                    self.gatherer.prefetch_these(root.settings.forward_prefetch)
                else:
                    self.gatherer.prefetch_after(self.order, -1)
                self.gatherer.gather(root)
        except BaseException:
            self._abort()
            raise

    @torch.compiler.disable
    def _abort(self):
        self.in_forward = False
        for u in self.units:
            u.calls = 0
        self.gatherer.reshard_all()

    @torch.compiler.disable
    def _end(self, out):
        self.in_forward = False
        out = self._cast_output(out)
        grad = torch.is_grad_enabled()
        if self.seen != self.order:
            self.order = list(self.seen)  # (re-)record the order
        with torch.no_grad():
            for u in self.units[1:]:  # prefetched but not run (or a group not every module of which ran)
                if u.state == UnitState.GATHERING or (
                    u.state == UnitState.GATHERED
                    and self.reshards(u)
                    and (u.index not in self.seen or u.index in self.ran)
                ):
                    self._reshard(u, grad)
            self.ran.clear()
            if not grad:
                self.gatherer.reshard_all()
                return out
        _hook_outputs(out, lambda: self.backward.pre_backward(None), "the model's forward", self.err, strict=False)
        return out
