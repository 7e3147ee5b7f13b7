"""The directory a rank's disk-tier files live in, claimed exclusively for one run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from zero3_offload.errors import DiskTierError

__all__ = ["RankDirectory"]


class RankDirectory:
    """``root/rank<N>``, created for this run (see [Note: disk tier]).

    The directory must not exist: one left by a crashed run is refused with a
    message that says to remove it, and is left untouched. :meth:`remove`
    deletes it with what it holds.

    Raises:
        DiskTierError: the directory exists already or cannot be created.
    """

    def __init__(self, root: str | os.PathLike[str], rank: int) -> None:
        self.path = Path(root) / f"rank{rank}"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.mkdir()
        except FileExistsError:
            raise DiskTierError(
                f"{self.path} exists: another run uses it, or a crashed run left it "
                "behind; remove it (the disk tiers hold nothing a checkpoint does not) "
                "or choose another nvme_path"
            ) from None
        except OSError as exc:
            raise DiskTierError(f"cannot create {self.path}: {exc}") from exc

    def remove(self) -> None:
        """Delete the directory and every file in it."""
        shutil.rmtree(self.path, ignore_errors=True)
