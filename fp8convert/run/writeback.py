"""Start writing dirty pages to disk as soon as they are written, without waiting for them.

With lots of RAM the kernel lets gigabytes of dirty pages pile up and flushes them only at fsync, so
the disk idles while we read and then stalls the run at every shard's end. sync_file_range(WRITE)
queues the writeback at once, so reads and writes share the disk throughout and the final fsync has
little left to do. Linux only; elsewhere this is a no-op and fsync does all the work.
"""
from __future__ import annotations

import ctypes
import os
import ctypes.util
import sys

SYNC_FILE_RANGE_WRITE = 2


def _load():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load()


def fsync_dir(path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)  # best effort: failure only costs speed
