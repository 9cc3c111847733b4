"""Read stage: one batch's tensors into one device buffer by parallel preads, returning while they are in
flight so the first stacks are quantized before the last bytes land. For CUDA each thread reads through its
own pinned staging chunk and stream (host memory stays threads x chunk).
"""

from __future__ import annotations

import contextlib
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
    """One pread; its parts (offset in it, offset in the buffer, bytes) and the tensor of each."""

    file: str
    offset: int
    length: int
    parts: tuple[tuple[int, int, int], ...]
    tensors: tuple[str, ...]


def plan_pieces(tensors: list[TensorInfo], offsets: dict[str, int], chunk: int, merge: bool) -> list[Piece]:
    """Preads of at most `chunk` bytes, of one tensor or, with `merge`, of tensors adjacent in a file."""
    pieces: list[Piece] = []
    file, start, length, parts, names = None, 0, 0, [], []

    def close() -> None:
        if length:
            pieces.append(Piece(file, start, length, tuple(parts), tuple(names)))

    ordered = sorted(tensors, key=lambda t: (t.file, t.offset)) if merge else tensors
    for t in ordered:
        done = 0
        while done < t.nbytes:
            at = t.offset + done
            if not (merge and t.file == file and at == start + length and length < chunk):
                close()
                file, start, length, parts, names = t.file, at, 0, [], []
            n = min(chunk - length, t.nbytes - done)
            parts.append((length, offsets[t.name] + done, n))
            names.append(t.name)
            length += n
            done += n
        if not merge:
            close()
            file, length = None, 0
    close()
    return pieces


@dataclass
class PendingRead:
    """A batch's reads in flight: `pieces_of` each tensor's preads (in submission order), `waited` seconds."""

    buf: torch.Tensor
    offsets: dict[str, int]
    jobs: list[Future]
    pieces_of: dict[str, list[int]]
    waited: float = 0.0

    def arrival(self, tensors: list[TensorInfo]) -> int:
        """The submission rank of the last pread `tensors` need: preads finish roughly in order."""
        return max((i for t in tensors for i in self.pieces_of[t.name]), default=-1)

    def wait(self, tensors: list[TensorInfo]) -> None:
        """Until every byte of `tensors` is in the buffer; a failed read raises here."""
        t0 = time.monotonic()
        for i in sorted({i for t in tensors for i in self.pieces_of[t.name]}):
            self.jobs[i].result()
        self.waited += time.monotonic() - t0

    def wait_all(self) -> None:
        for job in self.jobs:
            job.result()


class BatchReader(contextlib.AbstractContextManager):
    def __init__(self, root: Path, device: torch.device, threads: int = 8, chunk_bytes: int = 32 << 20):
        self.root, self.device, self.chunk = Path(root), device, chunk_bytes
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="fp8convert-read")
        self.fds: dict[str, int] = {}
        self.fds_lock = threading.Lock()
        self.local = threading.local()
        self.spare: torch.Tensor | None = None  # CPU: a batch buffer handed back for reuse

    def recycle(self, buf: torch.Tensor) -> None:
        """Nothing refers to `buf` any more: reuse it (on the CPU a fresh buffer costs a page fault per 4 KiB;
        CUDA's caching allocator reuses device memory itself)."""
        if buf.device.type == "cpu" and (self.spare is None or buf.untyped_storage().nbytes() > self.spare.numel()):
            self.spare = torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage())

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True)
        self.forget(list(self.fds))

    def forget(self, files: list[str]) -> None:
        """Close files no batch reads again (a deleted streamed shard then frees its space)."""
        with self.fds_lock:
            for file in files:
                fd = self.fds.pop(file, None)
                if fd is not None:
                    os.close(fd)

    @staticmethod
    def layout(tensors: list[TensorInfo]) -> tuple[dict[str, int], int]:
        offsets, cursor = {}, 0
        for t in tensors:
            offsets[t.name] = cursor
            cursor += -(-t.nbytes // ALIGN) * ALIGN
        return offsets, cursor

    def read(self, tensors: list[TensorInfo]) -> tuple[torch.Tensor, dict[str, int]]:
        pending = self.start(tensors)
        pending.wait_all()
        return pending.buf, pending.offsets

    def start(self, tensors: list[TensorInfo]) -> PendingRead:
        """Returns while the reads are in flight."""
        offsets, total = self.layout(tensors)
        if self.spare is not None and self.spare.numel() >= total:
            buf, self.spare = self.spare[:total], None
        else:
            buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        pieces = plan_pieces(tensors, offsets, self.chunk, merge=self.device.type != "cpu")
        pieces_of: dict[str, list[int]] = {t.name: [] for t in tensors}
        for i, piece in enumerate(pieces):  # a tensor has at most one part in a piece
            for name in piece.tensors:
                pieces_of[name].append(i)
        jobs = [self.pool.submit(self._read_piece, piece, buf) for piece in pieces]
        return PendingRead(buf, offsets, jobs, pieces_of)

    def _read_piece(self, piece: Piece, buf: torch.Tensor) -> None:
        with self.fds_lock:
            if piece.file not in self.fds:
                self.fds[piece.file] = open_read(self.root / piece.file)
            fd, label = self.fds[piece.file], str(self.root / piece.file)
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
