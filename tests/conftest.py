import os
import sys

import pytest
import torch

# tests/ on the path, for the shared code in tests/support/ (``from support.launch import launch``);
# test modules never import one another.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from support.launch import launch  # noqa: E402
from support.pool import close_pools  # noqa: E402


@pytest.fixture(params=[2, 3], ids=lambda n: f"world{n}")
def dist_pool(request):
    """A live gloo pool of world size 2 or 3, shared by every test of the session."""
    return launch("pool", request.param)


def pytest_sessionfinish(session, exitstatus):
    close_pools()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
