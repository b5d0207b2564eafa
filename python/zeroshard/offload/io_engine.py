"""Direct reads and writes of a file into and out of tensors, several requests in flight:
the C++ core's I/O engine ([Note: I/O engine] in csrc/io_engine.h), with the GIL released.

    engine = IoEngine(path)                 # an existing file, allocated to its full size
    h = engine.read(buf, offset)            # buf: a contiguous host tensor; returns at once
    h.wait()                                # raises IoError (an OSError) naming file, offset, errno

ZEROSHARD_IO_BACKEND (``auto``, ``io_uring`` or ``aio``) and ZEROSHARD_IO_DEPTH (requests
in flight, 8 by default) choose the queue; an argument given to IoEngine wins.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..native.ext import _C

BLOCK = 4096  # direct I/O's unit, in memory and in the file
IoError = _C.IoError  # an OSError
_BACKEND_ENV, _DEPTH_ENV = "ZEROSHARD_IO_BACKEND", "ZEROSHARD_IO_DEPTH"


class IoHandle:
    """One transfer in flight; ``wait()`` (idempotent) blocks until its bytes have moved. The
    tensor is held until then; a handle dropped unwaited waits as it goes."""

    __slots__ = ("engine", "ticket", "tensor")

    def __init__(self, engine: "IoEngine", ticket: int, tensor: torch.Tensor):
        self.engine, self.ticket, self.tensor = engine, ticket, tensor

    def wait(self) -> None:
        if self.tensor is not None:
            try:
                self.engine.native.wait(self.ticket)
            finally:
                self.tensor = None

    def __del__(self):
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - nobody is left to tell; the memory is no longer read
            pass


class IoEngine:
    """Reads and writes of ``path`` by O_DIRECT through io_uring (or the kernel's AIO where
    io_uring is refused); see [Note: I/O engine] in csrc/io_engine.h."""

    def __init__(
        self, path: str, *, backend: Optional[str] = None, depth: Optional[int] = None, piece_bytes: int = 1 << 20
    ):
        backend = backend or os.environ.get(_BACKEND_ENV, "auto")
        depth = int(depth if depth is not None else os.environ.get(_DEPTH_ENV, "8"))
        self.native = _C.IoEngine(str(path), backend, depth, piece_bytes)

    def read(self, dst: torch.Tensor, offset: int) -> IoHandle:
        """The file's bytes [offset, offset + dst.nbytes) into ``dst`` (contiguous, host)."""
        return IoHandle(self, self.native.submit(False, dst, offset), dst)

    def write(self, src: torch.Tensor, offset: int) -> IoHandle:
        """``src``'s bytes (contiguous, host) into the file at ``offset``."""
        return IoHandle(self, self.native.submit(True, src, offset), src)

    def check(self, nbytes: int) -> None:
        """Raises IoError if the file was deleted or is shorter than ``nbytes``."""
        self.native.check(nbytes)

    path = property(lambda self: self.native.path, doc="the file")
    backend = property(lambda self: self.native.backend, doc="``io_uring`` or ``aio``")
    fallback = property(lambda self: self.native.fallback, doc="why io_uring was not used ('' where it is)")
    depth = property(lambda self: self.native.depth, doc="how many requests are in flight at most")


def congruent_start(buf: torch.Tensor, offset: int) -> int:
    """The element of ``buf`` at which a transfer to or from file ``offset`` is congruent modulo
    BLOCK (its whole blocks then move without a copy); ``buf`` needs BLOCK bytes to spare."""
    return ((offset - buf.data_ptr()) % BLOCK) // buf.element_size()
