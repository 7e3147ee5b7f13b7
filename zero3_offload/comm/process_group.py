"""Joining and leaving the default process group (a TCP rendezvous, torchrun's variables).

[Note: watched rendezvous]
``init_process_group`` builds the rendezvous itself, so that a rank that dies or
stops while the others join, or while they build their managers afterwards, is
named within the heartbeat's timeout instead of ending the wait only at
``timeout_s``:

1. The store: rank 0 hosts a TCP store at ``host:port`` (every other rank connects
   to it); under torchrun's elastic agent (``TORCHELASTIC_USE_AGENT_STORE``) every
   rank connects to the agent's store instead, which outlives the ranks of one
   attempt.
2. Every key of this rendezvous lies under a prefix of the attempt
   (``TORCHELASTIC_RESTART_COUNT``, 0 outside torchelastic): the agent's store keeps
   the keys of the attempt before a restart (each rank's gloo address among them),
   and a new rank must never read its dead predecessor's.
3. A *process heartbeat* (a :class:`~zero3_offload.comm.heartbeat.Heartbeat` over
   every rank, see [Note: heartbeat]) starts as soon as this rank reached the store,
   before the backend's group exists. A rank that has not reached the store yet is
   *absent*, never silent: it may only be slow to start.
4. The backend's group (``dist.init_process_group`` on the prefixed store) is built
   on a thread of its own, and waited for by the group's rules ([Note: one wait] in
   ``comm.wait``) with that heartbeat: a rank that arrived and then exited or
   stopped is named within the heartbeat's timeout; ranks that never arrived are
   named when ``timeout_s`` passes.
5. The process heartbeat beats until ``destroy_process_group`` (or the process's
   end: see [Note: leaving cleanly] in ``comm.heartbeat``). A manager built on
   the default group waits with it for its own heartbeat's start (the one window of
   its construction its own heartbeat cannot watch): ``joined_heartbeat``.

A rendezvous that fails this way leaves its thread blocked in the backend: the
process cannot join another group and should exit (the ranks are restarted).
"""

from __future__ import annotations

import concurrent.futures
import datetime as _dt
import ipaddress
import os
import socket
import threading

import anyio.to_thread
import attrs
import torch
import torch.distributed as dist

from zero3_offload.comm.heartbeat import Heartbeat
from zero3_offload.comm.wait import CollectiveWait
from zero3_offload.errors import (
    CollectiveTimeoutError,
    CommunicationError,
    ConfigError,
    Zero3Error,
)
from zero3_offload.logging import get_logger

__all__ = [
    "destroy_process_group",
    "init_process_group",
    "init_process_group_from_env",
    "joined_heartbeat",
    "rendezvous_store",
]

log = get_logger(__name__)

_BACKENDS = ("gloo", "nccl")
_DEFAULT_HEARTBEAT_S = 5.0
_LISTEN_BACKLOG = 4096  # as torch's own store listens


@attrs.frozen
class _Joined:
    """The default group this module built, its store (rank 0 hosts it: kept alive
    here) and its process heartbeat."""

    group: dist.ProcessGroup
    store: dist.Store
    heartbeat: Heartbeat | None


_JOINED: _Joined | None = None


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _attempt_prefix() -> str:
    return f"zero3/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def joined_heartbeat(group: dist.ProcessGroup) -> Heartbeat | None:
    """The process heartbeat of ``group`` when it is the default group that
    :func:`init_process_group` built (see [Note: watched rendezvous]), else None."""
    joined = _JOINED
    if joined is None or joined.heartbeat is None or group is not joined.group:
        return None
    return joined.heartbeat


def _check(backend: str | None, rank: int, world_size: int) -> str:
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
    return backend


def _loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.1, ::1; a name is not resolved)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def rendezvous_store(
    host: str, port: int, *, hosted: bool, world_size: int, timeout_s: float
) -> dist.TCPStore:
    """A connection to the TCP rendezvous store at ``host:port`` (``hosted``: this process
    serves it; ``port`` 0 then picks a free one, the store's ``port``).

    torch's store listens on every interface of its host whatever ``host`` is; a
    store for a loopback ``host`` is served on a socket bound to that address only,
    so no other machine can reach a local run's store (see docs/security.md).
    """
    listen_fd = None
    if hosted and _loopback(host):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((host, port))
            listener.listen(_LISTEN_BACKLOG)
        except OSError:
            listener.close()
            raise
        listen_fd = listener.detach()  # the store's from now on
    try:
        return dist.TCPStore(
            host,
            port,
            world_size,
            is_master=hosted,
            timeout=_dt.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
    except BaseException:
        if listen_fd is not None:
            os.close(listen_fd)
        raise


async def init_process_group(
    backend: str | None = None,
    *,
    rank: int,
    world_size: int,
    host: str = "127.0.0.1",
    port: int = 29500,
    timeout_s: float = 300.0,
    heartbeat_timeout_s: float | None = _DEFAULT_HEARTBEAT_S,
) -> dist.ProcessGroup:
    """Join the default process group (a TCP rendezvous at ``host:port``, rank 0 hosting
    its store), watched by a heartbeat (see [Note: watched rendezvous]).

    The rendezvous blocks until every rank has arrived, so it runs on a thread of its
    own and the event loop stays free. The group is the caller's to end with
    :func:`destroy_process_group`; a process that ends without calling it has its
    process heartbeat closed at its end, and torch's group torn down by torch (see
    [Note: leaving cleanly] in ``comm.heartbeat``).

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA); ``None`` picks NCCL when
            CUDA is present, else gloo.
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks.
        host: address of rank 0's rendezvous store.
        port: port of the rendezvous store.
        timeout_s: rendezvous and collective timeout of the group.
        heartbeat_timeout_s: silence after which a rank that arrived is named (also
            while the managers are built, until their own heartbeats start); None:
            only ``timeout_s`` bounds the rendezvous.

    Returns:
        The default (world) process group.

    Raises:
        ConfigError: on an unknown backend or an impossible rank/world size.
        CommunicationError: when the rendezvous fails (naming a rank that exited or
            stopped meanwhile, or the ranks that never arrived), or a group already
            exists.
    """
    return await _join(
        _check(backend, rank, world_size),
        host,
        port,
        rank=rank,
        world_size=world_size,
        store_host_rank=0,
        timeout_s=timeout_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
    )


async def _join(
    backend: str,
    host: str,
    port: int,
    *,
    rank: int,
    world_size: int,
    store_host_rank: int | None,
    timeout_s: float,
    heartbeat_timeout_s: float | None,
) -> dist.ProcessGroup:
    """[Note: watched rendezvous] over the store at ``host:port``, which this process
    serves when it is ``store_host_rank`` (None: another process serves it)."""
    global _JOINED
    where = f"{host}:{port}"
    hosted = rank == store_host_rank
    try:  # a client waits for the store's host: off the event loop
        store = await anyio.to_thread.run_sync(
            lambda: rendezvous_store(
                host, port, hosted=hosted, world_size=world_size, timeout_s=timeout_s
            )
        )
    except Exception as exc:  # DistNetworkError: the port is taken, the host never came
        raise CommunicationError(
            f"rendezvous of rank {rank}/{world_size} at {where} ({backend}) failed: "
            f"{str(exc).splitlines()[0]}"
        ) from exc
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local_rank)
    prefix = _attempt_prefix()
    beat = None
    if heartbeat_timeout_s is not None and world_size > 1:
        try:
            beat = Heartbeat(
                store,
                rank=rank,
                world_size=world_size,
                key=f"{prefix}/heartbeat",
                timeout_s=heartbeat_timeout_s,
                store_host_rank=store_host_rank,
                closed_as="has left the process group",
            )
        except Exception as exc:  # the store stopped answering right after the connect
            raise CommunicationError(
                f"rendezvous of rank {rank}/{world_size} at {where} ({backend}) failed: "
                f"cannot start the heartbeat: {str(exc).splitlines()[0]}"
            ) from exc
        beat.start()
    done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def rendezvous() -> None:
        try:
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(f"{prefix}/group", store),
                rank=rank,
                world_size=world_size,
                timeout=_dt.timedelta(seconds=timeout_s),
            )
        except BaseException as exc:  # handed to the waiting rank below
            done.set_exception(exc)
        else:
            done.set_result(None)

    threading.Thread(target=rendezvous, name=f"zero3-rendezvous-{rank}", daemon=True).start()
    wait = CollectiveWait(
        rank=rank,
        timeout_s=timeout_s,
        heartbeat=beat,
        waiting_for=lambda label: label,
        fail=lambda exc: exc,
    )
    label = f"every rank to join the {backend} group at {where}"
    try:
        await wait.until_done(done, label)
    except Zero3Error as exc:
        absent = beat.absent() if beat is not None else []
        if beat is not None:
            beat.close()
        if absent and isinstance(exc, CollectiveTimeoutError):
            ranks = ", ".join(map(str, absent))
            raise CommunicationError(
                f"rank(s) {ranks} never reached the rendezvous store at {where} within "
                f"{timeout_s:g} s; this rank ({rank}) was waiting for {label}: start every "
                f"rank of the {world_size}, or give the right world size"
            ) from exc
        raise CommunicationError(
            f"rendezvous of rank {rank}/{world_size} at {where} ({backend}) failed: {exc}"
        ) from exc
    _JOINED = _Joined(group=dist.group.WORLD, store=store, heartbeat=beat)
    log.debug("process_group_ready", rank=rank, world_size=world_size, backend=backend)
    return dist.group.WORLD


async def init_process_group_from_env(
    backend: str | None = None,
    *,
    timeout_s: float = 300.0,
    heartbeat_timeout_s: float | None = _DEFAULT_HEARTBEAT_S,
) -> dist.ProcessGroup:
    """Join the default group from torchrun-style environment variables, watched by a
    heartbeat as :func:`init_process_group` is.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. Under
    torchrun's elastic agent (``TORCHELASTIC_USE_AGENT_STORE=True``) every rank
    connects to the agent's store at that address, with the keys of this attempt
    (``TORCHELASTIC_RESTART_COUNT``) apart from those of the attempts before a
    restart; otherwise rank 0 hosts the store.

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
    if not _agent_store():
        return await init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            host=env["MASTER_ADDR"],
            port=port,
            timeout_s=timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
        )
    return await _join(  # every rank a client of the agent's store
        _check(backend, rank, world_size),
        env["MASTER_ADDR"],
        port,
        rank=rank,
        world_size=world_size,
        store_host_rank=None,
        timeout_s=timeout_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
    )


def destroy_process_group() -> None:
    """Stop the process heartbeat of the group :func:`init_process_group` built (the
    store's host waits for the other ranks to stop theirs: see [Note: leaving
    cleanly] in ``comm.heartbeat``), then destroy the default process group, if one
    exists."""
    global _JOINED
    joined, _JOINED = _JOINED, None
    if joined is not None and joined.heartbeat is not None:
        joined.heartbeat.close()
    if dist.is_initialized():
        dist.destroy_process_group()
