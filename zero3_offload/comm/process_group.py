"""Joining and leaving the default process group (a TCP rendezvous, torchrun's variables)."""

from __future__ import annotations

import datetime as _dt
import os

import anyio
import torch
import torch.distributed as dist

from zero3_offload.errors import CommunicationError, ConfigError
from zero3_offload.logging import get_logger

__all__ = ["destroy_process_group", "init_process_group", "init_process_group_from_env"]

log = get_logger(__name__)

_BACKENDS = ("gloo", "nccl")


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


async def init_process_group(
    backend: str | None = None,
    *,
    rank: int,
    world_size: int,
    host: str = "127.0.0.1",
    port: int = 29500,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join the default process group (a TCP rendezvous at ``host:port``).

    The rendezvous blocks until every rank has arrived, so it runs in a worker
    thread and the event loop stays free.

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA); ``None`` picks NCCL when
            CUDA is present, else gloo.
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks.
        host: address of rank 0's rendezvous store.
        port: port of the rendezvous store.
        timeout_s: rendezvous and collective timeout of the group.

    Returns:
        The default (world) process group.

    Raises:
        ConfigError: on an unknown backend or an impossible rank/world size.
        CommunicationError: when the rendezvous fails or a group already exists.
    """
    backend = backend or _default_backend()
    if backend not in _BACKENDS:
        raise ConfigError(f"backend={backend!r} is invalid: must be one of {_BACKENDS}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r} is invalid: must be an integer >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank!r} is invalid: must be in [0, {world_size})")
    if dist.is_initialized():
        raise CommunicationError(
            "a default process group already exists in this process; "
            "call destroy_process_group() first or pass the existing group to the manager"
        )
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local_rank)

    def rendezvous() -> None:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=_dt.timedelta(seconds=timeout_s),
        )

    try:
        await anyio.to_thread.run_sync(rendezvous)
    except Exception as exc:
        raise CommunicationError(
            f"rendezvous of rank {rank}/{world_size} at {host}:{port} ({backend}) failed: {exc}"
        ) from exc
    log.debug("process_group_ready", rank=rank, world_size=world_size, backend=backend)
    return dist.group.WORLD


async def init_process_group_from_env(
    backend: str | None = None, *, timeout_s: float = 300.0
) -> dist.ProcessGroup:
    """Join the default group from torchrun-style environment variables.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``.

    Raises:
        ConfigError: when a variable is missing or not an integer.
        CommunicationError: when the rendezvous fails.
    """
    env: dict[str, str] = {}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        value = os.environ.get(name)
        if value is None:
            raise ConfigError(
                f"environment variable {name} is not set: launch with torchrun "
                "or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
            )
        env[name] = value
    try:
        rank, world_size, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
    except ValueError as exc:
        raise ConfigError(f"RANK, WORLD_SIZE and MASTER_PORT must be integers: {exc}") from exc
    return await init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        host=env["MASTER_ADDR"],
        port=port,
        timeout_s=timeout_s,
    )


def destroy_process_group() -> None:
    """Leave the default process group, if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()
