"""Communication: process groups, awaitable collectives, copy streams, worker threads.

These are the parts the Rust module only simulates (its collectives wait a fixed time).
Here every collective is a real ``torch.distributed`` call whose completion the
event loop awaits, every host/device copy runs on a CUDA side stream ordered
by events, and CPU work runs in worker threads.
"""

from zero3_offload.comm.collectives import Collectives, PendingCollective
from zero3_offload.comm.copy_streams import CopyStreams
from zero3_offload.comm.process_group import (
    destroy_process_group,
    init_process_group,
    init_process_group_from_env,
)
from zero3_offload.comm.worker_threads import WorkerThreads

__all__ = [
    "Collectives",
    "CopyStreams",
    "PendingCollective",
    "WorkerThreads",
    "destroy_process_group",
    "init_process_group",
    "init_process_group_from_env",
]
