"""Keeping freed host memory for reuse in the trainer process (glibc's ``mallopt``).

Packing a row allocates a few MB of fresh arrays per field (the samples' ids, masks and log-probs concatenated,
the row's tensors, the top-k extras). glibc serves allocations above its mmap threshold (128 KiB, then adapting)
with fresh pages and returns freed memory at the heap's top to the kernel, so the next row faults every page in
again: ~2,200 page faults per 64k-token row of 2,000 samples, 35-45% of the packer's time on the development
machine (``asyncgrpo bench planning host_memory=both`` measures it, the two settings alternating in one process).
:func:`keep_freed_memory` raises both thresholds so that freed memory stays with the process for its next row:
allocations up to 32 MiB come from the heap, and up to 256 MiB of free heap is kept rather than returned.

Set for the trainer's processes by ``trainer.keep_host_memory`` (on by default). No effect outside glibc, nor
when the user set glibc's own variables (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``), which win.
Written by hand: ``mallopt`` is one libc call, which no library wraps.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 256 << 20}
"""The kept setting: heap allocations up to 32 MiB (glibc's largest mmap threshold), 256 MiB of free heap kept."""
RETURN = {M_MMAP_THRESHOLD: 128 << 10, M_TRIM_THRESHOLD: 128 << 10}
"""glibc's starting thresholds, fixed (its default then adapts them): what ``bench planning`` compares against."""
_USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return libc
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return None


def set_thresholds(values: dict[int, int], trim: bool = False) -> bool:
    """Apply ``values`` (mallopt parameter -> value), then with ``trim`` return the free heap to the kernel;
    False where glibc is not there or refused a value."""
    libc = _libc()
    if libc is None:
        return False
    ok = all(libc.mallopt(param, value) == 1 for param, value in values.items())
    if trim:
        libc.malloc_trim(0)
    return ok


def keep_freed_memory() -> bool:
    """Keep freed host memory for reuse (module docstring). Returns whether it was applied: False outside glibc
    and when the user set glibc's malloc variables."""
    if any(name in os.environ for name in _USER_VARIABLES):
        return False
    return set_thresholds(KEEP)
