"""Read stage: bytes of one batch of tensors into one buffer on the device.

Parallel preads (several threads help a cold disk). For CUDA the batch's tensors that lie back to back
in a file are read together, in preads of up to one chunk, whatever order they take in the buffer; each
thread owns one pinned staging chunk and its own stream, copies each tensor's part of the chunk to its
place, and host memory stays threads x chunk whatever the layer size. (A MoE layer is hundreds of
tensors of a few MB: read one by one, with 16 threads, they came out of the page cache at 7.8 GB/s,
together at 18.6 GB/s; docs/benchmarks.md.) For CPU the threads read each tensor straight into the
batch buffer.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import FP8ConvertError
from ..safetensors_io import TensorInfo, pread_into

ALIGN = 64  # every tensor starts aligned in the batch buffer, so dtype views are always legal


@dataclass(frozen=True)
class Piece:
    """One pread of `length` bytes at `offset` in `file`, and where its parts go in the batch buffer:
    (offset in the piece, offset in the buffer, bytes)."""

    file: str
    offset: int
    length: int
    parts: tuple[tuple[int, int, int], ...]


def plan_pieces(tensors: list[TensorInfo], offsets: dict[str, int], chunk: int, merge: bool) -> list[Piece]:
    """The preads that fill the batch buffer: each tensor in pieces of at most `chunk` bytes, or with
    `merge` the runs of tensors adjacent in a file, cut every `chunk` bytes (a piece may then end or
    start inside a tensor). Empty tensors need no read."""
    pieces: list[Piece] = []
    file, start, length, parts = None, 0, 0, []

    def close() -> None:
        if length:
            pieces.append(Piece(file, start, length, tuple(parts)))

    ordered = sorted(tensors, key=lambda t: (t.file, t.offset)) if merge else tensors
    for t in ordered:
        done = 0
        while done < t.nbytes:
            at = t.offset + done
            if not (merge and t.file == file and at == start + length and length < chunk):
                close()
                file, start, length, parts = t.file, at, 0, []
            n = min(chunk - length, t.nbytes - done)
            parts.append((length, offsets[t.name] + done, n))
            length += n
            done += n
        if not merge:
            close()
            file, length = None, 0
    close()
    return pieces


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

    def read(self, tensors: list[TensorInfo], room: Callable[[], bool] | None = None
             ) -> tuple[torch.Tensor, dict[str, int]] | None:
        """A uint8 buffer on the device and each tensor's offset in it. `room()`, when given, waits until
        the device has room for the buffer; False means the run stopped, and read returns None. From a GPU
        the threads read their first pieces into their pinned chunks meanwhile, so a batch's read
        starts while the batch before it is being quantized (on the CPU the reads go into the buffer)."""
        offsets, total = self.layout(tensors)
        on_cpu = self.device.type == "cpu"
        pieces = plan_pieces(tensors, offsets, self.chunk, merge=not on_cpu)
        if on_cpu:
            if room is not None and not room():
                return None
            buf = self._cpu_buffer(total)
            for job in [self.pool.submit(self._read_piece, piece, buf) for piece in pieces]:
                job.result()
            return buf, offsets
        target = _Target()
        jobs = [self.pool.submit(self._read_piece_via_chunk, piece, target) for piece in pieces]
        try:
            if room is None or room():
                target.buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        finally:
            target.ready.set()  # the threads copy their pieces into it, or give up when there is none
            wait(jobs)
        for job in jobs:
            job.result()
        return (target.buf, offsets) if target.buf is not None else None

    def _cpu_buffer(self, total: int) -> torch.Tensor:
        if self.spare is not None and self.spare.numel() >= total:
            buf, self.spare = self.spare[:total], None
            return buf
        return torch.empty(total, dtype=torch.uint8, device=self.device)

    def _read_piece(self, piece: Piece, buf: torch.Tensor) -> None:
        """On the CPU: one part, read into its place."""
        ((_, dest, length),) = piece.parts
        pread_into(self._fd(piece.file), memoryview(buf[dest:dest + length].numpy()), piece.offset,
                   str(self.root / piece.file))

    def _read_piece_via_chunk(self, piece: Piece, target: "_Target") -> None:
        """For a GPU: read into this thread's pinned chunk, then, once the batch buffer exists, copy each
        tensor's part of the chunk to its place."""
        if not hasattr(self.local, "staging"):
            self.local.staging = torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True)
            self.local.stream = torch.cuda.Stream(self.device)
        staging, stream = self.local.staging, self.local.stream
        pread_into(self._fd(piece.file), memoryview(staging[:piece.length].numpy()), piece.offset,
                   str(self.root / piece.file))
        target.ready.wait()
        if target.buf is None:
            return
        with torch.cuda.stream(stream):
            for at, dest, length in piece.parts:
                target.buf[dest:dest + length].copy_(staging[at:at + length], non_blocking=True)
        stream.synchronize()  # the staging chunk is reused by this thread's next read


class _Target:
    """The batch buffer a GPU read copies into, set (or left None) before `ready` is."""

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.ready = threading.Event()
