"""Freed native memory handed back to the system by long-running iotlake processes (glibc only).

glibc's malloc raises its mmap threshold each time a large block is freed, so later large blocks
(the dict tables of silver's dedup index as it grows and shrinks with the stream's lag, pandas
and Python buffers) come from per-thread arenas, and freed space there stays resident: in an
hour-long soak one arena of the ``iotlake run`` driver doubled within minutes. A fixed threshold returns large blocks to the system when they are freed, and a
periodic ``malloc_trim`` releases the free pages left inside the arenas. Elsewhere (musl, macOS)
both are no-ops. The JVMs get the same from their own options (``jvm_options``).
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
import sys

#: A thread that reads or writes a heap buffer through an NIO channel (Kafka fetches, Arrow
#: batches to Python workers) borrows a temporary direct buffer of that size, and the JDK caches
#: up to 16 per thread whatever their size: direct memory then creeps up with the largest batch
#: each thread has seen. Above 256 KiB they are freed after use.
NIO_BUFFER_CACHE = "-Djdk.nio.maxCachedBufferSize=262144"
#: The JVM hands glibc's free memory back every minute, as ``release`` does for Python (JDK
#: 17.0.15 has the flag; older builds refuse to start with it, hence the probe).
TRIM_NATIVE_HEAP = "-XX:TrimNativeHeapInterval=60000"


@functools.cache
def jvm_options(java: str | None) -> tuple[str, ...]:
    """Options for iotlake's long-running JVMs (Spark driver, embedded Kafka) started by ``java``."""
    if java is None:
        return (NIO_BUFFER_CACHE,)
    try:
        ok = subprocess.run([java, TRIM_NATIVE_HEAP, "-version"], capture_output=True,
                            timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (NIO_BUFFER_CACHE, TRIM_NATIVE_HEAP) if ok else (NIO_BUFFER_CACHE,)


#: mallopt's parameter number for the mmap threshold (glibc's malloc.h)
_M_MMAP_THRESHOLD = -3
#: blocks of at least this size are mmapped, so freeing them returns them at once
MMAP_THRESHOLD_BYTES = 1 << 20


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes, libc.mallopt.argtypes = [ctypes.c_size_t], [ctypes.c_int, ctypes.c_int]
        return libc
    except (OSError, AttributeError):  # not glibc
        return None


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve blocks of ``nbytes`` or more by mmap from now on (no dynamic threshold)."""
    libc = _glibc()
    return bool(libc and libc.mallopt(_M_MMAP_THRESHOLD, nbytes))


def release() -> bool:
    """Return the free pages of every malloc arena to the system; True if any were."""
    libc = _glibc()
    return bool(libc and libc.malloc_trim(0))
