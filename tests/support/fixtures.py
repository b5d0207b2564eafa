"""Fixtures a test module imports to change the session's defaults (tests/conftest.py)."""

import pytest

from .launch import launch


@pytest.fixture(params=[3], ids=lambda n: f"world{n}", name="dist_pool")
def dist_pool_at_3(request):
    """``dist_pool`` at 3 ranks only, for a module whose tests at 2 ranks add time and no case
    (the suite's time): 3 ranks give uneven chunks, the harder layouts; the even split of 2
    ranks runs in the modules that keep both world sizes, and in the integration tier."""
    return launch("pool", request.param)
