"""Write stage: byte runs into partial shard files whose headers the plan fixed, every block reserved by an
allocator thread from the start (a full disk shows at once). Runs land at their offsets in any order through
a pool of pwrite threads; a shard's last byte gets it fsynced and renamed into place. Each unit fully written
is recorded for a rerun.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import os
import sys
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..errors import FP8ConvertError
from ..files import fsync_dir
from ..output.partial import UnitRecorder, partial_path, record_path, unit_spans
from ..plan.batches import Run
from ..plan.plan import Plan

PREALLOCATE = True  # reserve every shard while torch loads (a switch for scripts/profile_stages.py)
FALLOCATE_NOT_SUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}  # the file then grows sparse
SYNC_FILE_RANGE_WRITE = 2


def _libc(name: str, *argtypes):
    """A Linux libc call through ctypes (Python has neither); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn


_sync_file_range = _libc("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
_fallocate = _libc("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Dirty pages queued for the disk as they are written, else they pile up until fsync."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)


def reserve(fd: int, size: int) -> None:
    """Make the file `size` bytes long with its blocks allocated, or only set the size where the file system
    cannot allocate ahead."""
    if _fallocate is not None and size:
        if _fallocate(fd, 0, 0, size) == 0:
            return
        err = ctypes.get_errno()
        if err not in FALLOCATE_NOT_SUPPORTED:
            raise OSError(err, os.strerror(err))
    os.ftruncate(fd, size)


class ShardWriter:
    """`written`: per partial shard, the units an earlier run wrote there (its file is kept, the rest written)."""

    def __init__(
        self,
        plan: Plan,
        out_dir: Path,
        work_dir: Path,
        skip_shards: set[int],
        chunk_bytes: int = 32 << 20,
        threads: int = 4,
        written: dict[int, set[int]] | None = None,
    ):
        self.plan, self.out_dir, self.work_dir = plan, Path(out_dir), Path(work_dir)
        self.chunk, self.threads = chunk_bytes, threads
        self.written = {index: units for index, units in (written or {}).items() if units}
        spans = {s.index: unit_spans(plan, s) for s in plan.shards if s.index not in skip_shards}
        self.recorder = UnitRecorder(plan, work_dir, spans)
        # per shard: (start, end, unit) of the units still to write, by start; each one's bytes left
        self.unit_ranges: dict[int, list[tuple[int, int, int]]] = {}
        self.unit_left: dict[int, Counter] = {}
        for index, shard_spans in spans.items():
            todo = {ui: unit for ui, unit in shard_spans.items() if ui not in self.written.get(index, ())}
            self.unit_ranges[index] = sorted((a, b, ui) for ui, unit in todo.items() for a, b in unit)
            self.unit_left[index] = Counter({ui: sum(b - a for a, b in unit) for ui, unit in todo.items()})
        self.unit_lock = threading.Lock()  # the two above; never held while waiting
        self.remaining = {index: sum(left.values()) for index, left in self.unit_left.items()}  # bytes to write
        self.fds: dict[int, int] = {}
        self.pool: ThreadPoolExecutor | None = None  # started by the first pooled write
        self.pending: dict[int, list[Future]] = {}  # shard -> writes in flight
        self.lock = threading.Lock()  # the bookkeeping above, shared by the threads that call write()
        self.ring: list = []  # (pinned staging buffer, the write it feeds), CUDA only
        self.next_slot = 0
        self.stream = None
        self.closed = False
        self.allocate_error: BaseException | None = None  # raised by the next write: fail before the work
        self.allocator = threading.Thread(target=self._create_all, name="fp8convert-allocate", daemon=True)

    def partial_path(self, index: int) -> Path:
        return partial_path(self.work_dir, self.plan.shards[index])

    def _fd(self, index: int) -> int:
        """The shard's partial file (lock held): new, header written and blocks reserved, or reopened."""
        if index in self.fds:
            return self.fds[index]
        shard, path, keep = self.plan.shards[index], self.partial_path(index), index in self.written
        if not keep:  # the record goes first: it must never describe a file it did not check
            record_path(self.work_dir, shard).unlink(missing_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | (0 if keep else os.O_CREAT | os.O_TRUNC), 0o644)
        except OSError as e:
            raise FP8ConvertError(f"{path}: cannot {'open' if keep else 'create'} ({e.strerror})") from e
        try:
            if not keep:
                self._write_host(index, fd, memoryview(shard.header), 0)
            reserve(fd, shard.size)
        except OSError as e:
            os.close(fd)
            raise self._write_error(path, e, "write failed") from e
        self.fds[index] = fd
        return fd

    def _create_all(self) -> None:
        """The allocator thread; its first failure (a full disk, above all) is raised by the next write."""
        for index in range(len(self.plan.shards)):
            with self.lock:
                if self.closed:
                    return
                if index not in self.remaining:
                    continue  # an earlier run's, another worker's, or already whole
                try:
                    self._fd(index)
                except BaseException as e:
                    self.allocate_error = e
                    return

    def write(self, run: Run, data, ready=None) -> None:
        """`data`: a uint8 tensor on any device or a host buffer (held until written); `ready`: a CUDA event
        after which device bytes are complete."""
        with self.lock:
            if self.allocate_error is not None:
                raise self.allocate_error
            if run.shard not in self.remaining:
                return  # finished in an earlier run
            size = data.numel() if hasattr(data, "numel") else memoryview(data).nbytes
            if size != run.nbytes or run.nbytes > self.remaining[run.shard]:
                raise AssertionError(
                    f"shard {run.shard}: {size} bytes for a run of {run.nbytes}, "
                    f"{self.remaining[run.shard]} left to write"
                )
            fd = self._fd(run.shard)
        try:
            if getattr(data, "is_cuda", False):
                self._write_from_device(run.shard, fd, data, run.start, ready)
            else:
                view = memoryview(data.numpy() if hasattr(data, "numpy") else data).cast("B")
                for start in range(0, run.nbytes, self.chunk):
                    self._submit(run.shard, fd, view[start : start + self.chunk], run.start + start)
        except OSError as e:
            raise self._write_error(self.partial_path(run.shard), e, "write failed") from e
        with self.lock:
            self.remaining[run.shard] -= run.nbytes
            if not self.remaining[run.shard]:
                self._finish(run.shard)

    def _submit(self, index: int, fd: int, host: memoryview, offset: int) -> Future:
        with self.lock:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fp8convert-write")
            future = self.pool.submit(self._write_host, index, fd, host, offset)
            self.pending.setdefault(index, []).append(future)
        return future

    def _write_host(self, index: int, fd: int, host: memoryview, offset: int) -> None:
        pwrite_all(fd, host, offset)
        start_writeback(fd, offset, host.nbytes)
        end, done = offset + host.nbytes, []
        with self.unit_lock:
            ranges, left = self.unit_ranges.get(index, []), self.unit_left.get(index, {})
            for start, stop, ui in ranges[max(0, bisect.bisect_right(ranges, (offset, float("inf"))) - 1) :]:
                if start >= end:
                    break
                overlap = min(stop, end) - max(start, offset)
                if overlap > 0 and ui in left:
                    left[ui] -= overlap
                    if not left[ui]:
                        del left[ui]
                        done.append(ui)
        for ui in done:
            self.recorder.unit_written(index, ui, fd)

    def pin_ring(self, size: int | None = None) -> None:
        """Pinned staging buffers up to `size`; by default the ring while the first batch is read (pinning is
        slow), no larger than the bytes left fill."""
        import torch

        if size is None:
            with self.lock:
                size = min(self.threads + 1, -(-sum(self.remaining.values()) // self.chunk))
        while len(self.ring) < size:
            self.ring.append((torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True), None))

    def _write_from_device(self, index: int, fd: int, raw, offset: int, ready) -> None:
        # only the pipeline's writer thread writes device tensors: the ring needs no lock
        import torch

        if self.stream is None:
            self.stream = torch.cuda.Stream(raw.device)
        if ready is not None:
            self.stream.wait_event(ready)
        for start in range(0, raw.numel(), self.chunk):
            n = min(self.chunk, raw.numel() - start)
            slot = self.next_slot
            self.next_slot = (slot + 1) % (self.threads + 1)
            self.pin_ring(slot + 1)  # a buffer left out at first
            staging, busy = self.ring[slot]
            if busy is not None:
                busy.result()  # the buffer's previous write must finish before it is refilled
            with torch.cuda.stream(self.stream):
                staging[:n].copy_(raw[start : start + n], non_blocking=True)
            self.stream.synchronize()
            self.ring[slot] = (staging, self._submit(index, fd, memoryview(staging[:n].numpy()), offset + start))

    def _write_error(self, path: Path, error: OSError, what: str) -> Exception:
        """A full disk stays an OSError naming the file, with the bytes still to write (the CLI's disk-full
        line); anything else is a resumable failure."""
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            full = OSError(error.errno, error.strerror, str(path))
            full.bytes_needed = sum(self.remaining.values())
            return full
        return FP8ConvertError(
            f"{path}: {what} ({error.strerror}); rerun the same command to resume once the problem is fixed"
        )

    def _finish(self, index: int) -> None:
        """Lock held."""
        for future in self.pending.pop(index, []):
            try:
                future.result()
            except OSError as e:
                raise self._write_error(self.partial_path(index), e, "write failed") from e
        fd = self.fds.pop(index)
        final = self.out_dir / self.plan.shards[index].name
        try:
            try:
                os.fsync(fd)  # a full disk often shows only here (delayed allocation)
            finally:
                os.close(fd)
            os.replace(self.partial_path(index), final)
            fsync_dir(self.out_dir)
        except OSError as e:
            raise self._write_error(final, e, "cannot finish shard") from e
        del self.remaining[index]
        self.recorder.shard_finished(index)

    def __enter__(self) -> ShardWriter:
        for index in [i for i, left in self.remaining.items() if not left]:
            with self.lock:  # every unit written by an earlier run, which stopped before the rename
                self._fd(index)
                self._finish(index)
        if PREALLOCATE:
            self.allocator.start()
        self.recorder.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.closed = True
        if self.allocator.is_alive():
            self.allocator.join()  # it may be creating a file: let it finish, then close that file too
        if self.pool is not None:
            self.pool.shutdown(wait=True)  # no write may land after its file is closed
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.recorder.close()  # the units written so far get their lines: a rerun keeps them
