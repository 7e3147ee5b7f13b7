"""A preallocated file read and written at aligned offsets, with direct I/O where possible."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from zero3_offload.errors import DiskTierError
from zero3_offload.logging import get_logger

__all__ = ["ALIGN", "RecordFile", "aligned", "record_offsets"]

log = get_logger(__name__)

ALIGN = 4096  # offsets, lengths and buffer addresses of direct I/O are multiples of this


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def record_offsets(sizes: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """Where each record starts when records of ``sizes`` bytes follow one another in
    order from the start of a file, and the file's size."""
    offsets, end = {}, 0
    for name, nbytes in sizes.items():
        offsets[name] = end
        end += nbytes
    return offsets, end


class RecordFile:
    """One file of ``nbytes``, created exclusively and allocated in full on construction.

    Opened with ``O_DIRECT`` where the filesystem takes it (the page cache is
    bypassed; buffers, offsets and lengths must then be multiples of
    :data:`ALIGN`), buffered otherwise. :meth:`read` and :meth:`write` may run in
    several threads at once; each counts its calls, seconds and bytes.

    Args:
        path: the file; it must not exist.
        nbytes: its size, allocated at once (``posix_fallocate``), so a later write
            never meets a full disk.
        holds: what the file holds, in words (for the message of a full disk).

    Raises:
        DiskTierError: the file exists or cannot be created, or the disk has no room
            (the message gives the path, the bytes needed and the bytes free); nothing
            is left behind.
    """

    def __init__(self, path: Path, nbytes: int, *, holds: str) -> None:
        self.path = path
        self.nbytes = nbytes
        self._fd = -1
        self._created = False  # this object created the file (close() deletes it then)
        # reads / writes: (count, seconds, bytes), counted as they complete
        self.reads: tuple[int, float, int] = (0, 0.0, 0)
        self.writes: tuple[int, float, int] = (0, 0.0, 0)
        self._seen = (self.reads, self.writes)  # at the last step_figures()
        self._lock = threading.Lock()
        try:
            self._fd, self.direct = _open_file(path)
            self._created = True
            _allocate(self._fd, nbytes)
        except OSError as exc:
            self.close()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(path.parent).free
                raise DiskTierError(
                    f"{path}: no room for the disk tier: it needs {nbytes} bytes ({holds}), "
                    f"{free} are free"
                ) from exc
            raise DiskTierError(f"cannot create {path}: {exc}") from exc
        log.info("disk_tier_opened", path=str(path), bytes=nbytes, direct=self.direct)

    def allocated_bytes(self) -> int:
        """Bytes the file occupies on disk (its allocated blocks)."""
        return os.fstat(self._fd).st_blocks * 512 if self._fd >= 0 else 0

    def read(self, buffer: memoryview, offset: int) -> None:
        """Fill ``buffer`` from the file at ``offset`` (blocking, on this thread).

        Raises:
            DiskTierError: the read failed or stopped short (the message names the file).
        """
        self._transfer("read", buffer, offset)

    def write(self, buffer: memoryview, offset: int) -> None:
        """Write ``buffer`` into the file at ``offset`` (blocking, on this thread).

        Raises:
            DiskTierError: the write failed (the message names the file).
        """
        self._transfer("write", buffer, offset)

    def _transfer(self, what: str, view: memoryview, offset: int) -> None:
        nbytes = len(view)
        start, done = time.perf_counter(), 0
        while done < nbytes:
            at = offset + done
            try:
                if what == "read":
                    n = os.preadv(self._fd, [view[done:]], at)
                else:
                    n = os.pwritev(self._fd, [view[done:]], at)
            except OSError as exc:
                raise DiskTierError(f"{what} of {self.path} at byte {at} failed: {exc}") from exc
            if n <= 0:
                raise DiskTierError(f"{what} of {self.path} at byte {at} stopped short")
            done += n
        seconds = time.perf_counter() - start
        with self._lock:
            count, total, moved = self.reads if what == "read" else self.writes
            figures = (count + 1, total + seconds, moved + done)
            if what == "read":
                self.reads = figures
            else:
                self.writes = figures

    def step_figures(self) -> dict[str, float]:
        """Bytes and seconds read and written since the previous call (one step's)."""
        (_, read_s0, read_b0), (_, write_s0, write_b0) = self._seen
        with self._lock:
            self._seen = (self.reads, self.writes)
        (_, read_s, read_b), (_, write_s, write_b) = self._seen
        return {
            "read_bytes": read_b - read_b0,
            "read_seconds": read_s - read_s0,
            "write_bytes": write_b - write_b0,
            "write_seconds": write_s - write_s0,
        }

    def close(self) -> None:
        """Close the file and delete it."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._created:
            self.path.unlink(missing_ok=True)
            self._created = False


def _open_file(path: Path) -> tuple[int, bool]:
    """The file, created exclusively: with ``O_DIRECT`` where the filesystem takes it."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o600), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this filesystem has no direct I/O
                raise
    return os.open(path, flags, 0o600), False


def _allocate(fd: int, nbytes: int) -> None:
    if nbytes == 0:
        return
    allocate = getattr(os, "posix_fallocate", None)
    if allocate is None:
        os.ftruncate(fd, nbytes)
        return
    allocate(fd, 0, nbytes)
