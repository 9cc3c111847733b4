"""Linux file calls that keep the output's disk busy and its writes cheap.

start_writeback: start writing dirty pages to disk as soon as they are written, without waiting for them.
With lots of RAM the kernel lets gigabytes of dirty pages pile up and flushes them only at fsync, so
the disk idles while we read and then stalls the run at every shard's end. sync_file_range(WRITE)
queues the writeback at once, so reads and writes share the disk throughout and the final fsync has
little left to do. Linux only; elsewhere this is a no-op and fsync does all the work.

reserve: give a file its final size with every block allocated up front (fallocate). A full disk then
shows before any data is written, and later writes only copy bytes. The kernel serialises buffered
writes to one file, so what each write costs is not won back with more threads: into one tmpfs file,
32 MB pwrites ran at 2.3-2.5 GB/s when they also had to allocate the pages and 3.9-4.1 GB/s into
reserved ones, from 1 thread as from 16 (docs/benchmarks.md).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys

SYNC_FILE_RANGE_WRITE = 2


def _load(name: str, *argtypes):
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
_fallocate = _load("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
# fallocate's "this file system cannot": the file then grows sparse, as before
NOT_SUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


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


def reserve(fd: int, size: int) -> None:
    """Make the file `size` bytes long with its blocks allocated; where the file system cannot allocate
    ahead (or off Linux), only set the size. A full disk raises OSError(ENOSPC) here."""
    if _fallocate is not None and size:
        if _fallocate(fd, 0, 0, size) == 0:
            return
        err = ctypes.get_errno()
        if err not in NOT_SUPPORTED:
            raise OSError(err, os.strerror(err))
    os.ftruncate(fd, size)
