"""Autograd hooks as the gradient sources install them: held weakly, removed together,
refusing sparse gradients."""

from __future__ import annotations

import weakref
from typing import Callable

import torch


def weak_hook(method):
    """``method`` (bound) as a tensor hook that does not keep its object alive: hooks
    are held by the parameters' autograd metadata, out of the garbage collector's
    sight, so a strong reference would keep an optimizer (and its state) alive
    for as long as the model lives, and its offload file on disk."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        fn = ref()
        return None if fn is None else fn(*args)

    return hook


def remove_hooks(hooks: list) -> None:
    """Remove every handle in ``hooks`` (emptying the list, which a weakref.finalize may hold)."""
    while hooks:
        hooks.pop().remove()


def check_dense_grad(grad: torch.Tensor, what: Callable[[], str], err: Callable[[str], str]) -> None:
    """Refuse a sparse gradient of parameter ``what()`` (e.g. from ``nn.Embedding(sparse=True)``);
    the name is made only then: this runs once per parameter every backward."""
    if grad.layout != torch.strided:
        raise RuntimeError(
            err(
                f"{what()} got a sparse gradient ({grad.layout}): zeroshard reduces dense gradients in flat "
                "buffers. Build its module with sparse=False (nn.Embedding, nn.EmbeddingBag), or keep the "
                "parameter out of the optimizer"
            )
        )
