import os
import sys

import pytest
import torch

# The shared helpers (tests/_*.py) and every tier's modules are importable from any test,
# whichever tier pytest was pointed at (a few tests reuse another tier's models).
_HERE = os.path.dirname(os.path.abspath(__file__))
for _tier in ("unit", "multiprocess", "integration", ""):
    sys.path.insert(0, os.path.join(_HERE, _tier) if _tier else _HERE)

from _dist import DistPool  # noqa: E402

_pools: dict = {}


class Refusals(dict):
    """What each call raised, by key (type and message): ``catch(key, fn)`` runs fn and keeps
    a ValueError, NotImplementedError or RuntimeError it raises (the refusals tests read)."""

    def catch(self, key, fn):
        try:
            fn()
        except (ValueError, NotImplementedError, RuntimeError) as e:
            self[key] = f"{type(e).__name__}: {e}"


def get_pool(world_size: int) -> DistPool:
    if world_size not in _pools:
        _pools[world_size] = DistPool(world_size)
    return _pools[world_size]


@pytest.fixture(params=[2, 3], ids=lambda n: f"world{n}")
def dist_pool(request):
    """A live gloo pool of world size 2 or 3, shared by every test of the session."""
    return get_pool(request.param)


def pytest_sessionfinish(session, exitstatus):
    for p in _pools.values():
        p.close()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
