"""Returning freed memory to the operating system, and glibc's allocator settings.

glibc keeps freed large blocks in its heap after it has raised its mmap
threshold (it does so after large frees), so a process's RSS stays at its
high-water mark although the tensors are gone. ``malloc_trim`` returns those
pages; :func:`set_mmap_threshold` keeps large blocks out of the heap from the
start. Blocks below the threshold stay in the heap's arenas (one per thread
that allocates), and the free ones among them add up over a long run: the
default ``zero3-offload train`` job held 60-90 MiB of free heap per rank after
800 steps, which :func:`trim_heap` returned. Other C libraries have none of
these calls: they are no-ops there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

import torch

__all__ = ["TRAIN_MMAP_THRESHOLD", "return_freed_memory", "set_mmap_threshold", "trim_heap"]

TRAIN_MMAP_THRESHOLD = 1 << 20
"""The threshold ``zero3-offload train`` sets in every training process: blocks of 1 MiB
or more are returned on free (and each is new memory, faulted in, when allocated).
Smaller blocks stay resident in the heap's arenas when freed (docs/planning.md, "The C
heap", has what a lower threshold changes)."""

# mallopt's parameter number for the mmap threshold (M_MMAP_THRESHOLD in malloc.h).
_M_MMAP_THRESHOLD = -3


@functools.cache  # find_library runs ldconfig: once per process
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


def trim_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc's ``malloc_trim(0)``), and nothing else.

    Cheap enough for a training loop to call every few steps: 2-3 ms with a heap of
    about 200 MiB on a busy 2-core machine.

    Returns:
        Whether memory was returned (always False off glibc).
    """
    trim = getattr(_libc(), "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


def return_freed_memory(device: torch.device) -> None:
    """Run Python's collector, empty the CUDA caching allocator's cache (on CUDA), and
    return the C heap's free pages to the OS (:func:`trim_heap`)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    trim_heap()
