"""offload="nvme" on the I/O engine ([Note: I/O engine] in csrc/io_engine.h), through
ShardedOptimizer on gloo ranks: a state file truncated or deleted under a running job
is an error naming it (never a wrong parameter), and an offload_dir whose filesystem
refuses O_DIRECT is a ValueError naming the directory, the filesystem and the fix."""

import os
import re
import shutil

import pytest
import torch.distributed as dist

import zeroshard as zs
from support.disk import no_direct_io_directory, on_disk
from support.flat_net import make_model, train_ours
from support.launch import launch


def _broken_under_the_job(directory: str, how: str):
    os.environ["ZEROSHARD_OFFLOAD_WINDOW_MB"] = "0.004"  # several windows a step
    try:
        model, opt, _ = train_ours(1, 2, offload="nvme", offload_dir=directory)
        (path,) = (os.path.join(directory, f) for f in os.listdir(directory) if f"rank{dist.get_rank()}-" in f)
        if how == "truncated":
            os.truncate(path, 1000)
        else:
            os.unlink(path)
        try:
            train_ours(1, 2, model=model, opt=opt, first_step=1)
        except OSError as e:
            return path, str(e)
        return path, None
    finally:
        del os.environ["ZEROSHARD_OFFLOAD_WINDOW_MB"]


@pytest.mark.parametrize(
    "how,says",
    [
        ("truncated", r" is 1000 bytes but holds \d+: it was truncated while the job ran"),
        ("deleted", " was deleted while the job ran"),
    ],
    ids=["truncated", "deleted"],
)
def test_a_state_file_broken_under_the_job_is_an_error_naming_it(how, says):
    with on_disk() as d:
        for path, message in launch("pool", 2).run(_broken_under_the_job, d, how):
            assert message is not None and message.startswith(path), message
            assert re.search(says, message), message


def _refused(directory: str) -> str:
    real = shutil.disk_usage
    shutil.disk_usage = lambda d: real(d)._replace(free=2**40)  # ramfs says it has no space at all
    try:
        zs.ShardedOptimizer(make_model().parameters(), offload="nvme", offload_dir=directory)
    except ValueError as e:
        return str(e)
    finally:
        shutil.disk_usage = real
    return ""


def test_an_offload_dir_without_direct_io_is_named_with_the_fix(tmp_path):
    with no_direct_io_directory(str(tmp_path)) as d:
        if d is None:
            pytest.skip("no filesystem here refuses O_DIRECT (tmpfs accepts it since Linux 6.6; ramfs needs root)")
        for rank, message in enumerate(launch("pool", 2).run(_refused, d)):
            assert f"rank {rank}" in message and f"offload_dir '{d}': cannot open {d}/zeroshard-rank{rank}-" in message
            assert "does not support direct I/O; put the file in a directory on a local disk" in message, message
