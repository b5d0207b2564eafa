"""Files the tests write and hold: directories on the repository's disk (for direct I/O),
one whose filesystem refuses O_DIRECT, a checkpoint's bytes, and checkpoint writes held
back until a test lets them go."""

import contextlib
import errno
import os
import shutil
import subprocess
import tempfile
import threading

from zeroshard.checkpoint import files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def on_disk() -> tempfile.TemporaryDirectory:
    """A temporary directory on the repository's disk (its build folder)."""
    os.makedirs(os.path.join(ROOT, "build"), exist_ok=True)
    return tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "build"))


@contextlib.contextmanager
def no_direct_io_directory(base):
    """A directory whose filesystem refuses O_DIRECT: /dev/shm where tmpfs does (Linux before
    6.6), else a ramfs mounted for the test (root only); None where neither is possible."""
    probe = f"/dev/shm/zeroshard-probe-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT))
    except OSError as e:
        if e.errno == errno.EINVAL:
            yield "/dev/shm"
            return
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    mnt = os.path.join(base, "ramfs")
    os.mkdir(mnt)
    if (
        os.geteuid() != 0
        or shutil.which("mount") is None
        or subprocess.run(["mount", "-t", "ramfs", "ramfs", mnt], capture_output=True).returncode
    ):
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", mnt], check=True)


def dir_bytes(path):
    """{file name: its bytes} of a checkpoint directory."""
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))}


class HeldWrite:
    """Holds each ``files.write_safetensors`` of this process until a ``release()``, so a
    test can act after a background save's call and before its write."""

    def __init__(self):
        self.started, self._permits, self._real = threading.Event(), threading.Semaphore(0), files.write_safetensors

    def release(self, after: float = 0.0):
        """Let one write go on, ``after`` seconds from now."""
        threading.Timer(after, self._permits.release).start()

    def __enter__(self):
        def held(*args, **kw):
            self.started.set()
            assert self._permits.acquire(timeout=60), "never released"
            return self._real(*args, **kw)

        files.write_safetensors = held
        return self

    def __exit__(self, *exc):
        self._permits.release(100)
        files.write_safetensors = self._real
