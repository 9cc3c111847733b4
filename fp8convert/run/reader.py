"""Read stage: bytes of one batch of tensors into one buffer on the device.

Parallel preads (several threads help a cold disk). For CUDA the batch's tensors that lie back to back in a
file are read together, in preads of up to one chunk, whatever order they take in the buffer; each thread owns
one pinned staging chunk and its own stream, copies each tensor's part of the chunk to its place, and host
memory stays threads x chunk whatever the layer size. (A MoE layer is hundreds of tensors of a few MB: reading
neighbours together makes far fewer, larger preads.) For CPU the threads read each tensor straight into the
batch buffer. `start` returns while the reads are in flight, so the batch's first stacks can be quantized
before its last bytes land (PendingRead.wait).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..safetensors_io import TensorInfo, open_read, pread_into

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


@dataclass
class PendingRead:
    """A batch's reads in flight: its buffer and offsets, and a wait for the tensors one step needs, so
    the step can start while the rest of the batch is still being read. `pieces_of` maps each tensor to
    the indices of the preads (in submission order) that fill it; `waited` adds up the seconds spent
    waiting."""

    buf: torch.Tensor
    offsets: dict[str, int]
    jobs: list[Future]
    pieces_of: dict[str, list[int]]
    waited: float = 0.0

    def arrival(self, tensors: list[TensorInfo]) -> int:
        """When `tensors` will all have landed, as the submission rank of their last pread (-1: nothing
        to read). Preads finish roughly in that order."""
        return max((i for t in tensors for i in self.pieces_of[t.name]), default=-1)

    def wait(self, tensors: list[TensorInfo]) -> None:
        """Return once every byte of `tensors` is in the buffer; a failed read raises here."""
        t0 = time.monotonic()
        for i in sorted({i for t in tensors for i in self.pieces_of[t.name]}):
            self.jobs[i].result()
        self.waited += time.monotonic() - t0

    def wait_all(self) -> None:
        for job in self.jobs:
            job.result()


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

    def __enter__(self) -> BatchReader:
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
                self.fds[file] = open_read(self.root / file)
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
        pending = self.start(tensors)
        pending.wait_all()
        return pending.buf, pending.offsets

    def start(self, tensors: list[TensorInfo]) -> PendingRead:
        """Start reading `tensors` into a new buffer on the device; returns at once."""
        offsets, total = self.layout(tensors)
        if self.spare is not None and self.spare.numel() >= total:
            buf, self.spare = self.spare[:total], None
        else:
            buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        pieces = plan_pieces(tensors, offsets, self.chunk, merge=self.device.type != "cpu")
        pieces_of: dict[str, list[int]] = {t.name: [] for t in tensors}
        spans = sorted((offsets[t.name], offsets[t.name] + t.nbytes, t.name) for t in tensors if t.nbytes)
        for i, piece in enumerate(pieces):  # each part lands in one tensor's span of the buffer
            for _, dest, _ in piece.parts:
                name = spans[bisect.bisect_right(spans, (dest, float("inf"))) - 1][2]
                if not pieces_of[name] or pieces_of[name][-1] != i:
                    pieces_of[name].append(i)
        jobs = [self.pool.submit(self._read_piece, piece, buf) for piece in pieces]
        return PendingRead(buf, offsets, jobs, pieces_of)

    def _read_piece(self, piece: Piece, buf: torch.Tensor) -> None:
        fd, label = self._fd(piece.file), str(self.root / piece.file)
        if self.device.type == "cpu":  # one part, read into its place
            ((_, dest, length),) = piece.parts
            pread_into(fd, memoryview(buf[dest : dest + length].numpy()), piece.offset, label)
            return
        if not hasattr(self.local, "staging"):
            self.local.staging = torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True)
            self.local.stream = torch.cuda.Stream(self.device)
        staging, stream = self.local.staging, self.local.stream
        pread_into(fd, memoryview(staging[: piece.length].numpy()), piece.offset, label)
        with torch.cuda.stream(stream):
            for at, dest, length in piece.parts:
                buf[dest : dest + length].copy_(staging[at : at + length], non_blocking=True)
        stream.synchronize()  # the staging chunk is reused by this thread's next read
