"""Linux file calls that keep the output's disk busy and its writes cheap (elsewhere: plain fallbacks).

start_writeback: queue dirty pages for the disk as they are written (else they pile up until fsync).
reserve: the file's final size with every block allocated: a full disk shows before any data is written.
write_mapped: copy into a reserved file through a shared mapping; unlike pwrites, threads add up.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
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
_statfs = _load("statfs", ctypes.c_char_p, ctypes.c_void_p)
# fallocate's "this file system cannot": the file then grows sparse
NOT_SUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
# Where writes through a mapping were measured faster than pwrite (statfs f_type); elsewhere (network and
# parallel file systems above all, where each page fault can be a round trip) shards get pwrite.
MAPPED_WRITE_FILE_SYSTEMS = {0x01021994: "tmpfs", 0xEF53: "ext4"}


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)  # best effort: failure only costs speed


def reserve(fd: int, size: int) -> bool:
    """Make the file `size` bytes long with its blocks allocated (True), or only set the size (False)."""
    if _fallocate is not None and size:
        if _fallocate(fd, 0, 0, size) == 0:
            return True
        err = ctypes.get_errno()
        if err not in NOT_SUPPORTED:
            raise OSError(err, os.strerror(err))
    os.ftruncate(fd, size)
    return False


def maps_writes(directory) -> bool:
    if _statfs is None:
        return False
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first field, a long
    if _statfs(os.fsencode(directory), buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value in MAPPED_WRITE_FILE_SYSTEMS


def write_mapped(fd: int, data: memoryview, offset: int) -> None:
    """Copy `data` to `offset` through a shared mapping. Only into reserved blocks: a write fault that needs
    a block the disk lacks kills the process (SIGBUS) where pwrite would get ENOSPC."""
    if not data.nbytes:
        return
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, offset + data.nbytes - start, offset=start) as view:  # shared, read-write
        # addresses only: a ctypes object pointing into the mapping would keep it from closing
        target = ctypes.addressof(ctypes.c_char.from_buffer(view, offset - start))
        ctypes.memmove(target, ctypes.addressof(ctypes.c_char.from_buffer(data)), data.nbytes)  # GIL released
