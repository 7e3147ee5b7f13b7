"""The directory a rank's disk-tier files live in, claimed for one run at a time."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path

from zero3_offload.errors import DiskTierError
from zero3_offload.logging import get_logger

__all__ = ["RankDirectory"]

log = get_logger(__name__)

# What a run leaves in the directory: the disk tiers' files (nothing else is removed).
_FILES = frozenset({"state.bin", "params.bin", "activations-0.bin", "activations-1.bin"})


class RankDirectory:
    """``root/rank<N>``, created for this run (see [Note: disk tier]).

    A run holds an exclusive lock on ``root/rank<N>.lock`` (``flock``) while it
    uses the directory; the kernel drops the lock when the process ends, however it
    ends. So a directory whose lock is held belongs to a live run and is always
    refused, and one whose lock is free was left by a run that crashed: it is
    refused too, with a message that says to remove it, unless ``replace_stale``
    is set, in which case it is removed and created again, provided it holds only
    the disk tiers' files (anything else is refused and left untouched).
    :meth:`remove` deletes the directory and the lock file.

    Raises:
        DiskTierError: another run uses the directory, a crashed run left it (without
            ``replace_stale``, or holding other files), or it cannot be created.
    """

    def __init__(
        self, root: str | os.PathLike[str], rank: int, *, replace_stale: bool = False
    ) -> None:
        self.path = Path(root) / f"rank{rank}"
        self._lock_path = Path(root) / f"rank{rank}.lock"
        self._lock = -1
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise DiskTierError(f"cannot create {self._lock_path}: {exc}") from exc
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)  # the lock file is the other run's: it stays
            raise DiskTierError(
                f"{self.path} is in use by another run (it holds {self._lock_path}); "
                "choose another nvme_path"
            ) from None
        try:
            self._create(replace_stale)
        except BaseException:
            self._unlock()
            raise

    def _create(self, replace_stale: bool) -> None:
        try:
            self.path.mkdir()
            return
        except FileExistsError:
            pass
        except OSError as exc:
            raise DiskTierError(f"cannot create {self.path}: {exc}") from exc
        left = sorted(p.name for p in self.path.iterdir())
        if not replace_stale:
            raise DiskTierError(
                f"{self.path} exists: a run that crashed left it behind; remove it (the "
                "disk tiers hold nothing a checkpoint does not), choose another nvme_path, "
                "or set nvme_replace_stale"
            )
        others = [name for name in left if name not in _FILES]
        if others:
            raise DiskTierError(
                f"{self.path} was left by a run that crashed but holds files the disk tiers "
                f"do not write ({', '.join(others)}): it is not replaced; remove it"
            )
        log.warning("disk_tier_replaced", path=str(self.path), files=left)
        shutil.rmtree(self.path)
        self.path.mkdir()

    def _unlock(self) -> None:
        if self._lock >= 0:
            self._lock_path.unlink(missing_ok=True)
            os.close(self._lock)  # releases the lock
            self._lock = -1

    def remove(self) -> None:
        """Delete the directory and every file in it, then the lock file."""
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            self._unlock()
