"""verify's read engine: pieces of source and output tensors, streamed through quantize's reader in
batches of at most half the memory budget; the next batch is read while the caller checks the current
one. It knows nothing of FP8 (fp8convert.verify does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..safetensors_io import TensorInfo, torch_dtype
from .device import io_threads
from .prefetch import Prefetcher, default_threads
from .progress import Progress
from .reader import BatchReader

# One batch's reads, each with its source and output tensors (views of buffers reused for a later batch:
# done with a batch means done with them).
Batch = list[tuple["Read", list[torch.Tensor], list[torch.Tensor]]]


@dataclass
class Read:
    """What one check reads (files relative to each checkpoint's directory); `key` is the caller's,
    `label` is shown in the progress display."""

    key: object
    source: list[TensorInfo]
    output: list[TensorInfo]
    label: str = ""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.source) + sum(t.nbytes for t in self.output)


def group_reads(reads: list[Read], budget: int) -> list[list[Read]]:
    """Consecutive reads, at most `budget` bytes a batch (a larger read is a batch of its own)."""
    groups: list[list[Read]] = []
    used = 0
    for read in reads:
        if not groups or used + read.nbytes > budget:
            groups.append([])
            used = 0
        groups[-1].append(read)
        used += read.nbytes
    return groups


def pieces(group: list[Read], side: str) -> list[TensorInfo]:
    """A batch's source or output pieces, under names unique within it (read `k`'s j-th is "k.j")."""
    return [replace(t, name=f"{i}.{j}") for i, read in enumerate(group) for j, t in enumerate(getattr(read, side))]


def as_tensor(buf: torch.Tensor, offset: int, info: TensorInfo) -> torch.Tensor:
    """A piece of a batch buffer as the tensor it holds (dtype and shape of `info`)."""
    if not info.nbytes:
        return torch.empty(info.shape, dtype=torch_dtype(info.dtype), device=buf.device)
    return buf[offset : offset + info.nbytes].view(torch_dtype(info.dtype)).view(info.shape)


@contextlib.contextmanager
def verify_stream(
    reads: list[Read],
    source_root: Path,
    out_root: Path,
    device: torch.device,
    budget: int,
    progress: Progress,
    prefetch: int = 0,
) -> Iterator[Iterator[Batch]]:
    """The batches of `reads`, in their order, to iterate inside the context."""
    groups = group_reads(reads, max(1, budget // 2))
    roots = (source_root, out_root)
    side_pieces = [[pieces(group, side) for group in groups] for side in ("source", "output")]
    with contextlib.ExitStack() as stack:  # leaving it stops the prefetchers, then waits for the reads in flight
        readers = [stack.enter_context(BatchReader(root, device, threads=io_threads(device.type)[0])) for root in roots]
        window = max(1, prefetch // 2)
        prefetchers = [
            stack.enter_context(Prefetcher(root, [t for b in batches for t in b], window, threads=default_threads()))
            for root, batches in zip(roots, side_pieces)
            if prefetch
        ]
        yield _batches(groups, side_pieces, readers, prefetchers, device, progress)


def _batches(groups, side_pieces, readers, prefetchers, device, progress) -> Iterator[Batch]:
    def start(i: int) -> list | None:
        if i == len(groups):
            return None
        return [reader.start(batches[i]) for reader, batches in zip(readers, side_pieces)]

    ahead = start(0)
    for i, group in enumerate(groups):
        current, ahead = ahead, None
        ahead = start(i + 1)  # read while this batch is checked
        for pending in current:
            pending.wait_all()
        for p, batches in zip(prefetchers, side_pieces):
            p.advance(sum(t.nbytes for t in batches[i]))
        source, output = current
        yield [(read, tensors(source, read.source, k), tensors(output, read.output, k)) for k, read in enumerate(group)]
        if device.type == "cuda":  # the next batch's reads (other streams) may reuse these buffers' memory
            torch.cuda.current_stream(device).synchronize()
        progress.advance(sum(read.nbytes for read in group), group[-1].label)
        for reader, pending in zip(readers, current):
            reader.recycle(pending.buf)
        del current, pending, source, output


def tensors(pending, infos: list[TensorInfo], k: int) -> list[torch.Tensor]:
    """Read `k`'s pieces (named by `pieces`) in the batch buffer."""
    return [as_tensor(pending.buf, pending.offsets[f"{k}.{j}"], t) for j, t in enumerate(infos)]
