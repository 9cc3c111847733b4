"""Write stage: stream byte ranges into shards whose headers the plan already fixed.

Each shard is a hidden partial file, its header written first and its blocks reserved at its final
size (every shard, by a thread of its own, from the start of the run: a full disk shows at once);
runs of output bytes (plan/runs.py) land at their planned offsets as they arrive, in any order and
from any of the writer's threads. When a shard's last byte
arrives it is fsynced and renamed into place; a rerun skips shards that already have their final name.
Within a partial shard, each unit whose bytes are all written is recorded (output/partial.py): a rerun
keeps the file and those units and writes the rest.

Writes are large and go through a pool of threads, so the next chunk leaves the device while earlier
ones are written. The kernel serialises pwrites to one file, so with enough threads (the GPU's 8) a
reserved shard on tmpfs or ext4 is filled through shared mappings instead, which many threads fill at
once (writeback.write_mapped); from CUDA each chunk is first copied into one of a small ring of
pinned buffers, so host memory stays fixed whatever the layer size.
"""

from __future__ import annotations

import bisect
import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..errors import FP8ConvertError
from ..output.partial import UnitRecorder, partial_path, record_path
from ..plan.plan import Plan
from ..plan.runs import Run
from .writeback import fsync_dir, maps_writes, reserve, start_writeback, write_mapped

# Create every shard and reserve its blocks at the start of the run, while torch loads, rather than as
# its first bytes arrive (scripts/profile_stages.py --no-preallocate measures the difference).
PREALLOCATE = True
# Write reserved shards through mappings when the pool has this many threads: one thread copies
# through a mapping at about half pwrite's speed, four together already beat pwrite's one file at a time
# (scripts/profile_stages.py --no-mapped-writes measures the difference).
MAPPED_WRITES = True
MAPPED_MIN_THREADS = 4


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


class ShardWriter:
    """A context manager: leaving it waits for writes in flight and closes the files (a shard left
    unfinished stays a partial file, of which the next run keeps the units recorded as written)."""

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
        """`written`: per partial shard, the units an earlier run wrote in it (partial.written_units):
        its file is kept and only its other units are written."""
        self.plan, self.out_dir, self.work_dir = plan, Path(out_dir), Path(work_dir)
        self.written = {index: units for index, units in (written or {}).items() if units}
        self.recorder = UnitRecorder(plan, work_dir)
        # shard -> unit -> its bytes still to write there; shard -> (start, end, unit) of those units, by start
        self.unit_left: dict[int, dict[int, int]] = {}
        self.unit_ranges: dict[int, list[tuple[int, int, int]]] = {}
        for s in plan.shards:
            if s.index not in skip_shards:
                ranges = [
                    (start, end, ui)
                    for ui, spans in self.recorder.spans[s.index].items()
                    if ui not in self.written.get(s.index, ())
                    for start, end in spans
                ]
                self.unit_ranges[s.index] = sorted(ranges)
                self.unit_left[s.index] = {}
                for start, end, ui in ranges:
                    self.unit_left[s.index][ui] = self.unit_left[s.index].get(ui, 0) + end - start
        self.unit_lock = threading.Lock()  # the two above; never held while waiting for anything
        # shard -> data bytes still to write; a shard is finished when none are left
        self.remaining = {index: sum(left.values()) for index, left in self.unit_left.items()}
        self.fds: dict[int, int] = {}
        self.reserved: set[int] = set()  # shards whose blocks are all allocated
        self.file_system_maps: bool | None = None  # whether mapped writes pay on this file system; asked once
        self.chunk = chunk_bytes
        self.threads = threads
        self.pool: ThreadPoolExecutor | None = None  # started by the first pooled write
        self.pending: dict[int, list[Future]] = {}  # shard -> writes in flight
        self.lock = threading.Lock()  # the bookkeeping above, shared by the threads that call write()
        self.ring: list = []  # pinned staging buffers and the write each one feeds (CUDA)
        self.next_slot = 0
        self.stream = None
        self.closed = False
        self.allocate_error: BaseException | None = None  # raised by the next write: fail before the work
        self.allocator = threading.Thread(target=self._create_all, name="fp8convert-allocate", daemon=True)

    def use_threads(self, threads: int) -> None:
        """How many threads write pooled writes (before the first one; the device decides it)."""
        if self.pool is None:
            self.threads = threads

    def partial_path(self, index: int) -> Path:
        return partial_path(self.work_dir, self.plan.shards[index])

    def _fd(self, index: int) -> int:
        """The shard's open partial file, created on first use (called with the lock held)."""
        if index not in self.fds:
            self.fds[index] = self._create(index)
        return self.fds[index]

    def _create(self, index: int) -> int:
        """A new partial file: the header, then every block reserved; or the earlier run's, when it has
        written units to keep. Nothing is left open on failure, so the next call starts the file again."""
        shard = self.plan.shards[index]
        path = self.partial_path(index)
        keep = index in self.written
        if not keep:  # the record goes first: it must never describe a file it did not check
            record_path(self.work_dir, shard).unlink(missing_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | (0 if keep else os.O_CREAT | os.O_TRUNC), 0o644)
        except OSError as e:
            raise FP8ConvertError(f"{path}: cannot {'open' if keep else 'create'} ({e.strerror})") from e
        try:
            if not keep:
                self._write_host(index, pwrite_all, fd, memoryview(shard.header), 0)
            if reserve(fd, shard.size):
                self.reserved.add(index)
        except OSError as e:
            os.close(fd)
            raise self._write_error(path, e, "write failed") from e
        return fd

    def _create_all(self) -> None:
        """The allocator thread: every shard still to write, in order. Its first failure (a full disk,
        above all) is raised by the next write, not hours later when that shard's turn comes. It holds
        the lock while it reserves a shard, so no write can open that file meanwhile (longer on tmpfs,
        which must clear the pages)."""
        for index in range(len(self.plan.shards)):
            with self.lock:
                if self.closed:
                    return
                if index not in self.remaining:
                    continue  # written in an earlier run, another worker's, or already whole (kept tensors)
                try:
                    self._fd(index)
                except BaseException as e:
                    self.allocate_error = e
                    return

    def write(self, run: Run, data, in_this_thread: bool = False, ready=None) -> None:
        """Write one run. `data` is its bytes in file order: a uint8 torch tensor on any device, or a
        host buffer (anything memoryview takes). Host bytes are written by the pool, which holds them
        until they are written, or with `in_this_thread` before this returns (the caller may then
        reuse its buffer). `ready`: a CUDA event after which device bytes are complete (the stream that
        computed them goes on meanwhile)."""
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
                    if in_this_thread:
                        self._write_host(run.shard, pwrite_all, fd, view[start : start + self.chunk], run.start + start)
                    else:
                        self._submit(run.shard, fd, view[start : start + self.chunk], run.start + start)
        except OSError as e:
            self._raise_write_error(run.shard, e)
        self._count(run)

    def _count(self, run: Run) -> None:
        """`run` is written (or on its way): its shard is finished once every run of it is."""
        with self.lock:
            self.remaining[run.shard] -= run.nbytes
            if not self.remaining[run.shard]:
                self._finish(run.shard)

    def _submit(self, index: int, fd: int, host: memoryview, offset: int) -> Future:
        # The task holds `host` until it has run; the future's result is None, so the bytes are freed
        # as soon as they are written, not when the shard is finished.
        with self.lock:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fp8convert-write")
            copy = write_mapped if self._mapped(index) and not host.readonly else pwrite_all
            future = self.pool.submit(self._write_host, index, copy, fd, host, offset)
            self.pending.setdefault(index, []).append(future)
        return future

    def _write_host(self, index: int, copy, fd: int, host: memoryview, offset: int) -> None:
        """`copy` (pwrite_all or write_mapped) host bytes to `offset` in shard `index`, then hand them to
        writeback."""
        copy(fd, host, offset)
        start_writeback(fd, offset, host.nbytes)
        self._landed(index, fd, offset, host.nbytes)

    def _landed(self, index: int, fd: int, offset: int, nbytes: int) -> None:
        """Bytes [offset, offset + nbytes) of shard `index` are in its file: a unit all of whose bytes are
        goes to the recorder."""
        done = []
        with self.unit_lock:
            ranges, left = self.unit_ranges.get(index, []), self.unit_left.get(index, {})
            i = max(0, bisect.bisect_right(ranges, (offset, float("inf"))) - 1)
            for start, end, ui in ranges[i:]:
                if start >= offset + nbytes:
                    break
                overlap = min(end, offset + nbytes) - max(start, offset)
                if overlap > 0 and ui in left:
                    left[ui] -= overlap
                    if not left[ui]:
                        del left[ui]
                        done.append(ui)
        for ui in done:
            self.recorder.unit_written(index, ui, fd)

    def _mapped(self, index: int) -> bool:
        """Whether the pool writes this shard through mappings (called with the lock held)."""
        if not (MAPPED_WRITES and self.threads >= MAPPED_MIN_THREADS and index in self.reserved):
            return False
        if self.file_system_maps is None:
            self.file_system_maps = maps_writes(self.work_dir)
        return self.file_system_maps

    def pin_ring(self) -> None:
        """Allocate the ring of pinned buffers now, not one by one inside the first writes (pinning is slow);
        the pipeline's writer thread calls this while the first batch is read.
        No more buffers than the bytes left to write can fill (a small model needs one)."""
        with self.lock:  # the copier of kept tensors finishes shards meanwhile
            left = sum(self.remaining.values())
        self._grow_ring(min(self.threads + 1, -(-left // self.chunk)))

    def _grow_ring(self, size: int) -> None:
        """Pin buffers until the ring holds `size` (the writer thread's own)."""
        import torch

        while len(self.ring) < size:
            self.ring.append((torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True), None))

    def _write_from_device(self, index: int, fd: int, raw, offset: int, ready=None) -> None:
        """Only the pipeline's writer thread writes device tensors, so the ring needs no lock."""
        import torch

        if self.stream is None:
            self.stream = torch.cuda.Stream(raw.device)
        if ready is not None:
            self.stream.wait_event(ready)
        for start in range(0, raw.numel(), self.chunk):
            n = min(self.chunk, raw.numel() - start)
            slot = self.next_slot
            self.next_slot = (slot + 1) % (self.threads + 1)
            self._grow_ring(slot + 1)  # a buffer pin_ring left out
            staging, busy = self.ring[slot]
            if busy is not None:
                busy.result()  # the buffer's previous write must finish before it is refilled
            with torch.cuda.stream(self.stream):
                staging[:n].copy_(raw[start : start + n], non_blocking=True)
            self.stream.synchronize()
            self.ring[slot] = (staging, self._submit(index, fd, memoryview(staging[:n].numpy()), offset + start))

    def _raise_write_error(self, index: int, error: OSError) -> None:
        raise self._write_error(self.partial_path(index), error, "write failed") from error

    def _write_error(self, path: Path, error: OSError, what: str) -> Exception:
        """The error to raise for a failed write of `path`. A full disk stays an OSError naming the file,
        with the bytes still to write, for the CLI's disk-full line (free space and what is needed)."""
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            full = OSError(error.errno, error.strerror, str(path))
            full.bytes_needed = sum(self.remaining.values())
            return full
        return FP8ConvertError(
            f"{path}: {what} ({error.strerror}); rerun the same command to resume once the problem is fixed"
        )

    def _finish(self, index: int) -> None:
        """Called with the lock held, once the shard's last run was handed over."""
        for future in self.pending.pop(index, []):
            try:
                future.result()
            except OSError as e:
                self._raise_write_error(index, e)
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
            with self.lock:  # every unit of it was written by an earlier run, which stopped before the rename
                self._fd(index)
                self._finish(index)
        if PREALLOCATE:
            self.allocator.start()
        self.recorder.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
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
