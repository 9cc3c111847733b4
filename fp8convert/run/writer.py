"""Write stage: stream tensors into shards whose headers the plan already fixed.

Each shard is a hidden partial file, preallocated to its final size with the header written first;
tensors land at their planned offsets as they arrive (in any order). When the last tensor of a shard
arrives it is fsynced and renamed into place; a rerun skips shards that already have their final name.

Writes go through a few threads (a disk takes parallel writes faster than one stream); from CUDA each
chunk is first copied into one of a small ring of pinned buffers, so host memory stays fixed.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..errors import FP8ConvertError
from ..plan.plan import Plan
from .writeback import fsync_dir, start_writeback


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
    start_writeback(fd, offset, len(data))


class ShardWriter:
    """A context manager: leaving it waits for writes in flight and closes the files (a shard left
    unfinished stays a partial file, which the next run rewrites)."""

    def __init__(self, plan: Plan, out_dir: Path, work_dir: Path, skip_shards: set[int], chunk_bytes: int = 16 << 20,
                 threads: int = 4):
        self.plan, self.out_dir, self.work_dir = plan, Path(out_dir), Path(work_dir)
        # shard -> tensor -> bytes still to write (a tensor may come in pieces); a shard is finished when empty
        self.remaining = {s.index: {name: t.nbytes for name, t in s.tensors.items()}
                          for s in plan.shards if s.index not in skip_shards}
        self.fds: dict[int, int] = {}
        self.chunk = chunk_bytes
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="fp8convert-write")
        self.pending: dict[int, list[Future]] = {}  # shard -> writes in flight
        self.ring: list[tuple[torch.Tensor, Future | None]] = []  # pinned staging buffers (CUDA)
        self.ring_size = threads + 1
        self.next_slot = 0
        self.stream = None

    def partial_path(self, index: int) -> Path:
        return self.work_dir / (self.plan.shards[index].name + ".partial")

    def _fd(self, index: int) -> int:
        if index not in self.fds:
            shard = self.plan.shards[index]
            path = self.partial_path(index)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            except OSError as e:
                raise FP8ConvertError(f"{path}: cannot create ({e.strerror})") from e
            self.fds[index] = fd  # closed by close(), also when the next lines fail
            try:
                pwrite_all(fd, memoryview(shard.header), 0)
                os.ftruncate(fd, shard.size)
            except OSError as e:
                raise FP8ConvertError(f"{path}: write failed ({e.strerror}); rerun the same command to "
                                      "resume once the problem is fixed") from e
        return self.fds[index]

    def write(self, name: str, data: torch.Tensor, at: int = 0) -> None:
        """Write one output tensor, or the piece of it that starts `at` bytes in (any device; raw bytes
        taken in memory order). A tensor counts as written once all its bytes are."""
        index = self.plan.shard_of[name]
        if index not in self.remaining:
            return  # finished in an earlier run
        shard = self.plan.shards[index]
        placed = shard.tensors[name]
        raw = data.contiguous().view(-1).view(torch.uint8) if data.numel() else data.view(torch.uint8)
        left = self.remaining[index].get(name, 0) - raw.numel()
        if at + raw.numel() > placed.nbytes or left < 0:
            raise AssertionError(f"{name}: {raw.numel()} bytes at {at}, plan says {placed.nbytes} in all")
        fd = self._fd(index)
        offset = len(shard.header) + placed.offset + at
        try:
            if raw.device.type == "cpu":
                # `raw` stays referenced by the task until its bytes are written
                self._submit(index, fd, raw, offset)
            else:
                self._write_from_device(index, fd, raw, offset)
        except OSError as e:
            self._raise_write_error(index, e)
        if left:
            self.remaining[index][name] = left
            return
        del self.remaining[index][name]
        if not self.remaining[index]:
            self._finish(index)

    def _submit(self, index: int, fd: int, host: torch.Tensor, offset: int) -> Future:
        # The task holds `host` until it has run; the future's result is None, so the bytes are freed
        # as soon as they are written, not when the shard is finished.
        future = self.pool.submit(pwrite_all, fd, memoryview(host.numpy()), offset)
        self.pending.setdefault(index, []).append(future)
        return future

    def _write_from_device(self, index: int, fd: int, raw: torch.Tensor, offset: int) -> None:
        if self.stream is None:
            self.stream = torch.cuda.Stream(raw.device)
        for start in range(0, raw.numel(), self.chunk):
            n = min(self.chunk, raw.numel() - start)
            slot = self.next_slot
            self.next_slot = (slot + 1) % self.ring_size
            if slot == len(self.ring):
                self.ring.append((torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True), None))
            staging, busy = self.ring[slot]
            if busy is not None:
                busy.result()  # the buffer's previous write must finish before it is refilled
            with torch.cuda.stream(self.stream):
                staging[:n].copy_(raw[start:start + n], non_blocking=True)
            self.stream.synchronize()
            self.ring[slot] = (staging, self._submit(index, fd, staging[:n], offset + start))

    def _raise_write_error(self, index: int, error: OSError) -> None:
        raise FP8ConvertError(f"{self.partial_path(index)}: write failed ({error.strerror}); "
                              "rerun the same command to resume once the problem is fixed") from error

    def _finish(self, index: int) -> None:
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
            raise FP8ConvertError(f"{final}: cannot finish shard ({e.strerror}); rerun the same command to "
                                  "resume once the problem is fixed") from e
        del self.remaining[index]

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True)  # no write may land after its file is closed
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
