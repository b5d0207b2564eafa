"""One rank's optimizer-state file for ``offload="nvme"``: allocated in full up front,
mapped shared, read and written by offset ([Note: offload] in offload/policy.py)."""
from __future__ import annotations

import os
import shutil
import weakref
from typing import Callable

import torch

from .policy import check_directory


class DiskFile:
    """One rank's state file: allocated in full, mapped shared, read and written by offset."""

    def __init__(self, directory: str, rank: int, numel: int, err: Callable[[str], str]):
        check_directory(directory)
        self.path = os.path.join(directory, f"zeroshard-rank{rank}-pid{os.getpid()}-{id(self):x}.optstate")
        nbytes = max(4, 4 * numel)
        free = shutil.disk_usage(directory).free
        if free < nbytes:
            raise ValueError(err(f"offload_dir {directory!r} has {free / 2**30:.2f} GiB free but this rank's "
                                 f"offloaded optimizer state needs {nbytes / 2**30:.2f} GiB; free space, use "
                                 "another directory or a smaller offload_fraction"))
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._cleanup = weakref.finalize(self, _close, self.fd, self.path)
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as e:
            self._cleanup()
            raise ValueError(err(f"cannot allocate {nbytes / 2**30:.2f} GiB for the offloaded optimizer state in "
                                 f"{directory!r}: {e.strerror}; free space or use another directory")) from None
        self.mapped = torch.from_file(self.path, shared=True, size=max(1, numel), dtype=torch.float32)
        self.used = 0

    def take(self, n: int) -> torch.Tensor:
        """The next ``n`` elements of the file, as a mapped view (zeros)."""
        t = self.mapped[self.used:self.used + n]
        self.used += n
        return t

    def holds(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.untyped_storage().data_ptr() == self.mapped.untyped_storage().data_ptr()

    def read(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (contiguous fp32 host tensor) := ``src`` (a mapped view), by pread."""
        _transfer(os.preadv, self.fd, dst, 4 * src.storage_offset())

    def write(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (a mapped view) := ``src`` (contiguous fp32 host tensor), by pwrite."""
        _transfer(os.pwritev, self.fd, src, 4 * dst.storage_offset())

    @property
    def nbytes(self) -> int:
        return os.fstat(self.fd).st_size


def _transfer(op, fd: int, t: torch.Tensor, offset: int) -> None:
    view = memoryview(t.numpy()).cast("B")
    done = 0
    while done < len(view):     # short reads and writes continue where they stopped
        n = op(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"offload file I/O stopped at byte {offset + done} (end of file or disk error)")
        done += n


def _close(fd: int, path: str) -> None:
    try:
        os.close(fd)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass

