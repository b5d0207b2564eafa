"""What crosses a unit's boundary: the tensors in its outputs (whose gradients
start its backward), and its floating inputs cast to the compute dtype.

[Note: unit outputs] A unit's backward begins when the gradient of one of its
outputs is computed: a hook on those tensors gathers the unit again (it was
resharded after its forward). A tensor the hook does not see would reach the
unit's backward with its parameters released, or half-gathered by a
prefetch, and autograd would compute on that memory. So every container a
model returns is walked: pytree nodes (tuples, lists, dicts, namedtuples,
anything registered with ``torch.utils._pytree``), dataclasses (also
``transformers.ModelOutput``) and other sequences and mappings. An object
that still holds a tensor requiring grad in its attributes is refused, naming
the unit and the type, before any backward runs; one holding none (a cache of
detached tensors, a config) passes: no gradient can flow through it. The
wrapped model's own output is walked but not refused: the root unit stays
gathered to the end of the backward. And a
gradient that arrives for a unit whose parameters are not gathered is
refused too (``UnitBackward.on_grad``), whatever hid its output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Callable, List, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, type)
_DEPTH = 16


def output_tensors(out, where: str, err: Callable[[str], str], strict: bool = True) -> List[torch.Tensor]:
    """Every tensor requiring grad in ``out`` (a unit's output); with ``strict``, raises on
    one hidden in an object the walk cannot see into ([Note: unit outputs]). (The model's
    own output is not strict: the root unit stays gathered to the end of the backward, and
    a model may return such objects, e.g. a key-value cache.)"""
    found: List[torch.Tensor] = []
    _walk(out, found, set(), 0, where, err if strict else None)
    return found


def _walk(obj, found: list, seen: set, depth: int, where: str, err):
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            found.append(obj)
        return
    if isinstance(obj, _PLAIN) or id(obj) in seen or depth > _DEPTH:
        return
    seen.add(id(obj))
    leaves, spec = tree_flatten(obj)
    if not spec.is_leaf():
        for leaf in leaves:
            _walk(leaf, found, seen, depth + 1, where, err)
        return
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            _walk(getattr(obj, f.name, None), found, seen, depth + 1, where, err)
        if isinstance(obj, Mapping):  # (ModelOutput: a dataclass and a mapping)
            for v in obj.values():
                _walk(v, found, seen, depth + 1, where, err)
        return
    if isinstance(obj, Mapping):
        for v in obj.values():
            _walk(v, found, seen, depth + 1, where, err)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _walk(v, found, seen, depth + 1, where, err)
        return
    hidden = _hidden_tensor(obj) if err is not None else None
    if hidden is not None:
        raise TypeError(
            err(
                f"{where} returned a {type(obj).__module__}.{type(obj).__qualname__} whose attribute "
                f"'{hidden}' holds a tensor that requires grad, inside an object zeroshard cannot see into: its "
                "backward would run without the unit's parameters gathered. Return tensors in a tuple, list, "
                "dict, namedtuple or dataclass, or register the type with "
                "torch.utils._pytree.register_pytree_node"
            )
        )


def _hidden_tensor(obj) -> Optional[str]:
    """The name of an attribute of ``obj`` holding (in a pytree) a tensor that requires grad, else None."""
    attrs = dict(getattr(obj, "__dict__", {}) or {})
    for name in getattr(type(obj), "__slots__", ()) or ():
        if hasattr(obj, name):
            attrs[name] = getattr(obj, name)
    for name, value in attrs.items():
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(value)[0]):
            return name
    return None


def cast_inputs(dtype: torch.dtype, args: tuple, kwargs: dict):
    """``args`` and ``kwargs`` with every floating tensor in them cast to ``dtype``
    (as FSDP2's ``cast_forward_inputs``); integer and other tensors unchanged."""

    def cast(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t

    return tree_map(cast, args), tree_map(cast, kwargs)


def cast_floating(dtype: torch.dtype, obj):
    """``obj`` (a unit's or the model's output: pytrees, dataclasses) with every floating
    tensor in it cast to ``dtype`` (FSDP2's ``output_dtype``); a dataclass is rebuilt."""

    def leaf(t):
        if isinstance(t, torch.Tensor):
            return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
        if dataclasses.is_dataclass(t) and not isinstance(t, type):
            fields = {f.name: cast_floating(dtype, getattr(t, f.name)) for f in dataclasses.fields(t) if f.init}
            return dataclasses.replace(t, **fields)
        return t

    return tree_map(leaf, obj)
