"""Returning freed memory to the operating system, and glibc's allocator settings.

glibc keeps freed large blocks in its heap after it has raised its mmap
threshold (it does so after large frees), so a process's RSS stays at its
high-water mark although the tensors are gone. ``malloc_trim`` returns those
pages; :func:`set_mmap_threshold` keeps large blocks out of the heap from the
start. Other C libraries have neither call: both are no-ops there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

import torch

__all__ = ["return_freed_memory", "set_mmap_threshold"]

# mallopt's parameter number for the mmap threshold (M_MMAP_THRESHOLD in malloc.h).
_M_MMAP_THRESHOLD = -3


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def set_mmap_threshold(nbytes: int = 1 << 20) -> bool:
    """Make glibc serve allocations of ``nbytes`` or more with mmap (returned on free).

    For applications, never called by the library. Same as starting the process
    with ``MALLOC_MMAP_THRESHOLD_=nbytes``.

    Returns:
        Whether the setting took effect (False off glibc).
    """
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, nbytes))


def return_freed_memory(device: torch.device) -> None:
    """Run Python's collector, empty the CUDA caching allocator's cache (on CUDA), and
    return the C heap's free pages to the OS (glibc's ``malloc_trim``)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
