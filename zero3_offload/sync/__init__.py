"""The synchronous face of the manager: :class:`SyncManager` runs the library's event loop
on a thread of its own, for code that has no event loop (a transformers ``Trainer``, a
Lightning ``Strategy``, a plain script)."""

from zero3_offload.sync.loop_thread import LoopThread
from zero3_offload.sync.sync_manager import SyncManager

__all__ = ["LoopThread", "SyncManager"]
