"""One rank's optimizer-state file for ``offload="nvme"``: allocated in full up front,
read and written by offset through the I/O engine (O_DIRECT: [Note: I/O engine] in
csrc/io_engine.h), and mapped shared for state dicts and checkpoints ([Note: offload]
in offload/policy.py)."""

from __future__ import annotations

import os
import shutil
import weakref
from typing import Callable

import torch

from .io_engine import IoEngine, IoError, IoHandle, congruent_start
from .policy import check_directory


class DiskFile:
    """One rank's state file: allocated in full, read and written by offset through the I/O
    engine, mapped shared for state dicts and checkpoints (region by region)."""

    def __init__(self, directory: str, rank: int, numel: int, err: Callable[[str], str]):
        check_directory(directory)
        self.path = os.path.join(directory, f"zeroshard-rank{rank}-pid{os.getpid()}-{id(self):x}.optstate")
        nbytes = max(4, 4 * numel)
        free = shutil.disk_usage(directory).free
        if free < nbytes:
            raise ValueError(
                err(
                    f"offload_dir {directory!r} has {free / 2**30:.2f} GiB free but this rank's "
                    f"offloaded optimizer state needs {nbytes / 2**30:.2f} GiB; free space, use "
                    "another directory or a smaller offload_fraction"
                )
            )
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._cleanup = weakref.finalize(self, _close, self.fd, self.path)
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as e:
            self._cleanup()
            raise ValueError(
                err(
                    f"cannot allocate {nbytes / 2**30:.2f} GiB for the offloaded optimizer state in "
                    f"{directory!r}: {e.strerror}; free space or use another directory"
                )
            ) from None
        try:
            self.engine = IoEngine(self.path)
        except IoError as e:
            self._cleanup()
            raise ValueError(err(f"offload_dir {directory!r}: {e}")) from None
        self.size = nbytes
        self.mapped = torch.from_file(self.path, shared=True, size=max(1, numel), dtype=torch.float32)
        self.used = 0

    def take(self, n: int) -> torch.Tensor:
        """The next ``n`` elements of the file, as a mapped view (zeros)."""
        t = self.mapped[self.used : self.used + n]
        self.used += n
        return t

    def holds(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.untyped_storage().data_ptr() == self.mapped.untyped_storage().data_ptr()

    def read(self, dst: torch.Tensor, src: torch.Tensor) -> IoHandle:
        """Starts ``dst`` (contiguous fp32 host tensor) := ``src`` (a mapped view), by the engine."""
        return self.engine.read(dst, 4 * src.storage_offset())

    def write(self, dst: torch.Tensor, src: torch.Tensor) -> IoHandle:
        """Starts ``dst`` (a mapped view) := ``src`` (contiguous fp32 host tensor), by the engine."""
        return self.engine.write(src, 4 * dst.storage_offset())

    def check(self) -> None:
        """Raises IoError, naming the file, if it was deleted or truncated while the job ran."""
        self.engine.check(self.size)

    @staticmethod
    def window(buf: torch.Tensor, view: torch.Tensor, n: int) -> torch.Tensor:
        """``n`` elements of ``buf`` (with a block to spare) placed for moving ``view``'s bytes:
        congruent with its file offset, so whole blocks move without a copy."""
        k = congruent_start(buf, 4 * view.storage_offset())
        return buf[k : k + n]

    @property
    def nbytes(self) -> int:
        return os.fstat(self.fd).st_size


def _close(fd: int, path: str) -> None:
    try:
        os.close(fd)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
