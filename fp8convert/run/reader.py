"""Read stage: bytes of one batch of tensors into one buffer on the device.

Parallel preads (several threads help a cold disk). For CUDA each thread owns one pinned staging
chunk and its own stream, so host memory is threads x chunk whatever the layer size, and the copies
run at pinned speed; for CPU the threads read straight into the batch buffer.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..errors import FP8ConvertError
from ..safetensors_io import TensorInfo, pread_into

ALIGN = 64  # every tensor starts aligned in the batch buffer, so dtype views are always legal


class BatchReader:
    """A context manager: leaving it waits for reads in flight and closes the files."""

    def __init__(self, root: Path, device: torch.device, threads: int = 8, chunk_bytes: int = 32 << 20):
        self.root, self.device, self.chunk = Path(root), device, chunk_bytes
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="fp8convert-read")
        self.fds: dict[str, int] = {}
        self.fds_lock = threading.Lock()
        self.local = threading.local()
        self.spare: torch.Tensor | None = None  # CPU: a batch buffer handed back for reuse

    def recycle(self, buf: torch.Tensor) -> None:
        """The caller is done with `buf` (nothing refers to it): reuse it for a later batch. On the CPU a
        fresh buffer costs a page fault per 4 KiB, as much as a third of the read time; CUDA's caching
        allocator already reuses device memory."""
        if buf.device.type == "cpu" and (self.spare is None or buf.untyped_storage().nbytes() > self.spare.numel()):
            self.spare = torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage())

    def __enter__(self) -> "BatchReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def forget(self, files: list[str]) -> None:
        """No batch reads these files again: close them (a deleted streamed shard frees its space)."""
        with self.fds_lock:
            for file in files:
                fd = self.fds.pop(file, None)
                if fd is not None:
                    os.close(fd)

    def _fd(self, file: str) -> int:
        with self.fds_lock:
            if file not in self.fds:
                try:
                    self.fds[file] = os.open(self.root / file, os.O_RDONLY)
                except OSError as e:
                    raise FP8ConvertError(f"{self.root / file}: cannot open ({e.strerror})") from e
            return self.fds[file]

    @staticmethod
    def layout(tensors: list[TensorInfo]) -> tuple[dict[str, int], int]:
        offsets, cursor = {}, 0
        for t in tensors:
            offsets[t.name] = cursor
            cursor += -(-t.nbytes // ALIGN) * ALIGN
        return offsets, cursor

    def read(self, tensors: list[TensorInfo]) -> tuple[torch.Tensor, dict[str, int]]:
        """Returns a uint8 buffer on the device and each tensor's offset in it."""
        offsets, total = self.layout(tensors)
        if self.spare is not None and self.spare.numel() >= total:
            buf, self.spare = self.spare[:total], None
        else:
            buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        jobs = []
        for t in tensors:
            for start in range(0, t.nbytes, self.chunk):
                length = min(self.chunk, t.nbytes - start)
                jobs.append(self.pool.submit(self._read_piece, t.file, t.offset + start, buf,
                                             offsets[t.name] + start, length))
        for job in jobs:
            job.result()
        return buf, offsets

    def _read_piece(self, file: str, file_offset: int, buf: torch.Tensor, dest: int, length: int) -> None:
        fd = self._fd(file)
        if self.device.type == "cpu":
            pread_into(fd, memoryview(buf[dest:dest + length].numpy()), file_offset, str(self.root / file))
            return
        if not hasattr(self.local, "staging"):
            self.local.staging = torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True)
            self.local.stream = torch.cuda.Stream(self.device)
        staging, stream = self.local.staging, self.local.stream
        pread_into(fd, memoryview(staging[:length].numpy()), file_offset, str(self.root / file))
        with torch.cuda.stream(stream):
            buf[dest:dest + length].copy_(staging[:length], non_blocking=True)
        stream.synchronize()  # the staging chunk is reused by this thread's next read
