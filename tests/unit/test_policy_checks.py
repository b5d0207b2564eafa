"""The policies validate themselves when made, with the errors the constructors gave."""

import dataclasses

import pytest

import zeroshard as zs
from zeroshard.offload import Placement


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(optimizer="gpu"), ValueError, r"Offload\(optimizer=...\) must be None, 'cpu' or 'nvme', got 'gpu'"),
        (dict(optimizer="cpu", fraction=1.5), ValueError, r"Offload\(fraction=...\) must be in \[0, 1\].*1.5"),
        (dict(optimizer="cpu", fraction="half"), ValueError, r"Offload\(fraction=...\) must be a number"),
        (dict(optimizer="nvme"), ValueError, r"needs a directory on a fast local disk"),
        (dict(optimizer="cpu", directory="/tmp"), ValueError, r"directory='/tmp'\) is only used with optimizer='nvme'"),
        (dict(optimizer="nvme", directory="/no/such/dir"), ValueError, r"does not exist"),
        (dict(params="gpu"), ValueError, r"Offload\(params=...\) must be None or 'cpu'"),
        (dict(params="nvme"), NotImplementedError, r"parameter shards on disk are not supported yet"),
    ],
)
def test_offload_refuses_what_the_constructor_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        zs.Offload(**kwargs)


def test_offload_is_keyword_only_frozen_and_says_where(tmp_path):
    with pytest.raises(TypeError):
        zs.Offload("cpu")
    off = zs.Offload(optimizer="nvme", directory=tmp_path, fraction=0.25)
    assert (off.placement, off.directory, off.fraction, off.active) == (Placement.DISK, str(tmp_path), 0.25, True)
    assert not zs.Offload(optimizer="cpu", fraction=0).active and zs.Offload().placement is Placement.DEVICE
    with pytest.raises(dataclasses.FrozenInstanceError):
        off.fraction = 1.0


class _Mesh:
    def __init__(self, ndim):
        self.ndim = ndim


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(shard_size=0), ValueError, r"shard_size must be a positive integer"),
        (dict(shard_size=True), ValueError, r"shard_size must be a positive integer"),
        (dict(shard_size=2, process_group=object()), ValueError, r"pass process_group or shard_size, not both"),
        (dict(device_mesh=_Mesh(2), shard_size=2), ValueError, r"pass device_mesh alone"),
        (dict(device_mesh=_Mesh(3)), ValueError, r"device_mesh must be 1-D \(the ranks to shard over\) or 2-D"),
        (dict(expert_modules=["Expert"]), TypeError, r"expert_modules must be a dict"),
    ],
)
def test_sharding_refuses_what_the_constructors_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        zs.Sharding(**kwargs)
    with pytest.raises(TypeError):
        zs.Sharding(None, 2)
