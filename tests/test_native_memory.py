"""A long-running process hands freed native memory back (``lakehouse.runtime.native_memory``)."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest

from lakehouse.runtime import native_memory

pytestmark = pytest.mark.skipif(native_memory._glibc() is None, reason="glibc only")


def _rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_freed_blocks_inside_the_heap_are_released() -> None:
    """200 MB of 100 KB blocks, all freed but every tenth: the free pages between the survivors
    stay resident until ``release``."""
    libc = native_memory._glibc()
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    assert native_memory.fix_mmap_threshold()
    size = 100 * 1024
    blocks = [libc.malloc(size) for _ in range(2000)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # resident
    for i, b in enumerate(blocks):
        if i % 10:
            libc.free(b)
    before = _rss_mb()
    assert native_memory.release()
    after = _rss_mb()
    try:
        assert before - after > 100, (before, after)  # most of the ~176 MB freed came back
    finally:
        for b in blocks[::10]:
            libc.free(b)


def test_jvm_options_trim_the_native_heap_only_where_the_jvm_accepts_it() -> None:
    """JDK 17 builds before the flag refuse to start with it: probed, left out there."""
    from lakehouse.runtime.jars import java_binary

    assert native_memory.jvm_options("/bin/false") == (native_memory.NIO_BUFFER_CACHE,)
    assert native_memory.jvm_options(None) == (native_memory.NIO_BUFFER_CACHE,)
    java = java_binary()
    opts = native_memory.jvm_options(java)
    accepted = subprocess.run([java, native_memory.TRIM_NATIVE_HEAP, "-version"],
                              capture_output=True).returncode == 0
    assert opts == (native_memory.NIO_BUFFER_CACHE,) + ((native_memory.TRIM_NATIVE_HEAP,) if accepted else ())
