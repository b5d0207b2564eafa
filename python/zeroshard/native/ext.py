"""Loads the compiled core, with a clear message when it is missing."""

import torch  # noqa: F401  (loads libtorch before the extension that links it)

try:
    from .. import _C
except ImportError as e:  # pragma: no cover - exercised only on broken installs
    raise ImportError(
        "zeroshard's compiled core (zeroshard._C) could not be loaded: "
        f"{e}. Build it with `pip install --no-build-isolation .` in an environment "
        "that already has torch, or run `make test` from the repository."
    ) from e

__all__ = ["_C"]
