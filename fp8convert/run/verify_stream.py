"""verify's read engine: the bytes of every check, streamed through quantize's reader in batches.

A check (`Read`) names pieces of source tensors and of output tensors. Reads are grouped into batches
of at most the memory budget; a reader thread reads the next batch (parallel preads, pinned staging
and the device's own buffer on CUDA, the page-cache prefetcher ahead of it) while the caller checks
the current one, and the progress display advances batch by batch, as in quantize. What a check does
with its bytes is the caller's business (fp8convert.verify): this module knows nothing of FP8.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..safetensors_io import TensorInfo, torch_dtype
from .device import io_threads
from .handoff import POLL_S, Failed, acquire_unless_stopped, put_unless_stopped
from .prefetch import Prefetcher, default_threads
from .progress import Progress
from .reader import BatchReader


@dataclass
class Read:
    """What one check reads: pieces of source tensors and of output tensors (each a TensorInfo whose
    file is relative to its checkpoint's directory). `key` is the caller's; `label` is shown in the
    progress display."""

    key: object
    source: list[TensorInfo] = field(default_factory=list)
    output: list[TensorInfo] = field(default_factory=list)
    label: str = ""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.source) + sum(t.nbytes for t in self.output)


@dataclass
class Batch:
    reads: list[Read]
    # the reads' pieces under names unique within the batch (two pieces of one tensor may share a batch)
    source: list[TensorInfo]
    output: list[TensorInfo]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reads)


def make_batches(reads: list[Read], budget: int) -> list[Batch]:
    """Consecutive reads, at most `budget` bytes a batch (a larger read is a batch of its own)."""
    groups: list[list[Read]] = [[]]
    used = 0
    for read in reads:
        if groups[-1] and used + read.nbytes > budget:
            groups.append([])
            used = 0
        groups[-1].append(read)
        used += read.nbytes
    batches = []
    for group in groups:
        if not group:
            continue
        source = [replace(t, name=f"{i}.{j}") for i, r in enumerate(group) for j, t in enumerate(r.source)]
        output = [replace(t, name=f"{i}.{j}") for i, r in enumerate(group) for j, t in enumerate(r.output)]
        batches.append(Batch(group, source, output))
    return batches


def as_tensor(buf: torch.Tensor, offset: int, info: TensorInfo) -> torch.Tensor:
    """A piece of a batch buffer as the tensor it holds (dtype and shape of `info`)."""
    raw = buf[offset : offset + info.nbytes]
    return (
        raw.view(torch_dtype(info.dtype)).view(info.shape)
        if info.nbytes
        else torch.empty(info.shape, dtype=torch_dtype(info.dtype), device=buf.device)
    )


class VerifyStream:
    """A context manager over the batches of `reads`: iterate it for the batches, in the order of
    `reads`. At most two batches are in memory: the one being checked and the one being read."""

    def __init__(
        self,
        reads: list[Read],
        source_root: Path,
        out_root: Path,
        device: torch.device,
        budget: int,
        progress: Progress,
        prefetch: int = 0,
    ):
        self.batches = make_batches(reads, max(1, budget // 2))
        self.device, self.progress, self.prefetch = device, progress, prefetch
        readers, _ = io_threads(device.type)
        self.source_reader = BatchReader(source_root, device, threads=readers)
        self.out_reader = BatchReader(out_root, device, threads=readers)
        self.prefetchers = []
        if prefetch:
            window = max(1, prefetch // 2)
            self.prefetchers = [
                Prefetcher(source_root, [t for b in self.batches for t in b.source], window, threads=default_threads()),
                Prefetcher(out_root, [t for b in self.batches for t in b.output], window, threads=default_threads()),
            ]
        self.handoff: queue.Queue = queue.Queue(maxsize=1)
        self.slots = threading.Semaphore(2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read_loop, name="fp8convert-verify-read", daemon=True)

    def __enter__(self) -> VerifyStream:
        for p in self.prefetchers:
            p.start()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        for p in self.prefetchers:
            p.stop()
        self.source_reader.close()
        self.out_reader.close()

    def __iter__(self) -> Iterator[list[tuple[Read, list[torch.Tensor], list[torch.Tensor]]]]:
        """Batch by batch: (read, source tensors, output tensors) for each read of the batch. The
        tensors are views of buffers reused for a later batch: done with a batch means done with them."""
        while True:
            item = self._next()
            if item is None:
                return
            batch, (src_buf, src_at), (out_buf, out_at) = item
            src_pieces, out_pieces = iter(batch.source), iter(batch.output)
            views = [
                (
                    read,
                    [as_tensor(src_buf, src_at[t.name], t) for t in (next(src_pieces) for _ in read.source)],
                    [as_tensor(out_buf, out_at[t.name], t) for t in (next(out_pieces) for _ in read.output)],
                )
                for read in batch.reads
            ]
            yield views
            del views
            self.progress.advance(batch.nbytes, batch.reads[-1].label)
            self.source_reader.recycle(src_buf)
            self.out_reader.recycle(out_buf)
            del item, src_buf, out_buf
            self.slots.release()

    def _next(self):
        while True:
            try:
                item = self.handoff.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self.thread.is_alive():  # it hands over everything, a failure included, before ending
                    return None
        if isinstance(item, Failed):
            raise item.error
        return item

    def _read_loop(self) -> None:
        try:
            for batch in self.batches:
                if not acquire_unless_stopped(self.slots, self.stop):
                    return
                item = (batch, self.source_reader.read(batch.source), self.out_reader.read(batch.output))
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                for p, pieces in zip(self.prefetchers, (batch.source, batch.output)):
                    p.advance(sum(t.nbytes for t in pieces))
                if not put_unless_stopped(self.handoff, item, self.stop):
                    return
                del item
            put_unless_stopped(self.handoff, None, self.stop)
        except BaseException as e:  # raised in the caller's thread
            with contextlib.suppress(Exception):
                put_unless_stopped(self.handoff, Failed(e), self.stop)
