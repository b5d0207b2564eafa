"""The I/O engine through its Python wrapper (offload/io_engine.py, [Note: I/O engine]):
tensors in and out at awkward offsets and lengths, several transfers in flight, both
queues (the AIO fallback forced by argument and by ZEROSHARD_IO_BACKEND), and the
errors: a filesystem that refuses O_DIRECT, a file truncated or deleted under a job.
The files go under the repository (a disk): /tmp may be a tmpfs without O_DIRECT."""

import os
import shutil

import pytest
import torch

from support.disk import no_direct_io_directory, on_disk
from zeroshard.offload import disk, io_engine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZE = 3 * 2**20 + 1234  # not a whole number of blocks


@pytest.fixture
def workdir():
    with on_disk() as d:
        yield d


def _file(directory, data: bytes) -> str:
    path = os.path.join(directory, "f.bin")
    with open(path, "wb") as f:
        f.write(data)
    return path


@pytest.mark.parametrize("backend", ["io_uring", "aio"])
def test_round_trips_at_awkward_offsets_with_several_in_flight(workdir, backend):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=g)
    path = _file(workdir, data.numpy().tobytes())
    engine = io_engine.IoEngine(path, backend=backend, depth=4, piece_bytes=64 * 1024)
    assert engine.backend == backend and engine.depth == 4 and engine.fallback == ""
    ranges = [(0, 4096), (3, 5), (4095, 300000), (12345, 1 << 20), (SIZE - 1000, 1000), (2 << 20, 1 << 20)]
    bufs = [torch.empty(n + 3, dtype=torch.uint8)[3:] for _, n in ranges]  # unaligned memory too
    handles = [engine.read(b, off) for b, (off, _) in zip(bufs, ranges)]  # all in flight together
    for h, b, (off, n) in zip(handles, bufs, ranges):
        h.wait()
        h.wait()  # idempotent
        assert torch.equal(b, data[off : off + n]), (off, n)
    expect = data.clone()
    writes = []
    for k, (off, n) in enumerate(ranges[1:]):  # neighbours and overlaps with earlier reads
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        writes.append(engine.write(src, off))
        expect[off : off + n] = src
        writes[-1].wait()  # (two of these ranges overlap: keep their order)
    floats = torch.empty(1 << 18)
    engine.read(floats, 8).wait()
    assert torch.equal(floats.view(torch.uint8), expect[8 : 8 + (1 << 20)])
    with open(path, "rb") as f:
        assert f.read() == expect.numpy().tobytes()
    assert os.path.getsize(path) == SIZE  # the last partial block: the file never grows


def test_the_environment_forces_the_aio_fallback(workdir, monkeypatch):
    path = _file(workdir, bytes(8192))
    monkeypatch.setenv("ZEROSHARD_IO_BACKEND", "aio")
    monkeypatch.setenv("ZEROSHARD_IO_DEPTH", "3")
    engine = io_engine.IoEngine(path)
    assert (engine.backend, engine.depth) == ("aio", 3)
    assert io_engine.IoEngine(path, backend="io_uring").backend == "io_uring"
    with pytest.raises(ValueError, match="backend must be 'auto', 'io_uring' or 'aio', got 'libaio'"):
        io_engine.IoEngine(path, backend="libaio")


def test_bad_tensors_and_ranges_are_refused(workdir):
    engine = io_engine.IoEngine(_file(workdir, bytes(8192)))
    with pytest.raises(ValueError, match="is not contiguous"):
        engine.read(torch.zeros(4, 4).t(), 0)
    with pytest.raises(ValueError, match=r"bytes \[8000, 8400\) are outside the file \(8192 bytes\)"):
        engine.write(torch.zeros(100), 8000)


def test_a_truncated_or_deleted_file_is_an_error_naming_it(workdir):
    path = _file(workdir, bytes(1 << 20))
    engine = io_engine.IoEngine(path)
    os.truncate(path, 5000)
    with pytest.raises(
        io_engine.IoError,
        match=rf"{path}: reading .* at offset \d+ returned \d+ bytes: the file is "
        r"5000 bytes \(truncated while the job ran\?\)",
    ):
        engine.read(torch.empty(1 << 18), 0).wait()
    with pytest.raises(OSError, match=rf"{path} is 5000 bytes but holds 1048576: it was truncated"):
        engine.check(1 << 20)
    os.unlink(path)
    with pytest.raises(OSError, match=rf"{path} was deleted while the job ran"):
        engine.check(5000)


def test_a_filesystem_without_direct_io_is_named_with_the_fix(workdir, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda d: real(d)._replace(free=2**40))  # ramfs says 0 free
    with no_direct_io_directory(workdir) as d:
        if d is None:
            pytest.skip("no filesystem here refuses O_DIRECT (tmpfs accepts it since Linux 6.6; ramfs needs root)")
        with pytest.raises(
            ValueError,
            match=rf"rank 3: offload_dir '{d}': cannot open {d}/zeroshard-rank3-\S+ for "
            r"direct I/O \(O_DIRECT\): .*\(errno 22\): its filesystem \((ramfs|tmpfs), "
            rf"the directory {d}\) does not support direct I/O; put the file in a "
            r"directory on a local disk",
        ):
            disk.DiskFile(d, 3, 1000, lambda msg: f"rank 3: {msg}")
        assert not [f for f in os.listdir(d) if f.startswith("zeroshard-rank3-")]  # removed again
