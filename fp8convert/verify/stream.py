"""The data checks: every pair's pieces read through quantize's reader in batches of at most half the
memory budget (the next batch read while this one is checked), checked by worker threads, and their
results recorded into the report in order."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..formats import QuantizationConfig
from ..plan.architectures import GENERIC, Architecture, architecture_of
from ..plan.rules import fused_group_key
from ..run.device import budget_for, io_threads, resolve_device
from ..run.numerics import FP8_MAX
from ..run.prefetch import Prefetcher, default_threads, usable_cores, window_for
from ..run.progress import Progress
from ..run.reader import BatchReader
from ..safetensors_io import TensorInfo, torch_dtype
from ..source.checkpoint import Source
from .numbers import oversized
from .report import VerifyReport


@dataclass
class Read:
    """One piece of a pair: what it reads of the source and of the output (files relative to each
    checkpoint's directory)."""

    pair: object
    r0: int
    last: bool
    source: list[TensorInfo]
    output: list[TensorInfo]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.source) + sum(t.nbytes for t in self.output)


@dataclass
class SharedScale:
    """The tensor scheme's scales of one fused group (or of one tensor outside any group)."""

    scales: set[float] = field(default_factory=set)  # the scales its members carry
    names: list[str] = field(default_factory=list)
    measured_scale: float | None = None  # the largest scale of members quantized here (not passed through)
    amax: float = 0.0  # ... and their largest |w|


@dataclass
class Checks:
    """What every check shares: the output's layout (None for a dequantized output), an FP8 source's
    scheme, the report, and the tensor scheme's scales by fused group."""

    fmt: QuantizationConfig | None
    source_scheme: str | None
    report: VerifyReport
    arch: Architecture
    groups: dict[str, SharedScale] = field(default_factory=dict)
    global_scales: dict[str, set[float]] = field(default_factory=dict)  # NVFP4's, by fused group

    def add_tensor_scale(self, pair, measured: bool) -> None:
        """A finished tensor-scheme weight's scale, under its fused group (or its own name); `measured`: its
        codes were quantized here, and its largest |w| counts toward what the scale must fit."""
        value = pair.first.scale_value
        if value is None:
            return
        shared = self.groups.setdefault(fused_group_key(pair.name, self.arch.fused) or pair.name, SharedScale())
        shared.scales.add(value)
        shared.names.append(pair.name)
        if measured:
            shared.measured_scale = max(shared.measured_scale or 0.0, value)
            shared.amax = max(shared.amax, pair.sums.amax)

    def add_global_scale(self, name: str, value: float) -> None:
        self.global_scales.setdefault(fused_group_key(name, self.arch.fused) or name, set()).add(value)

    def check_global_scales(self) -> None:
        """vLLM runs a fused group as one GEMM with one NVFP4 global scale: members with different ones
        would be scaled wrongly (it takes the largest, or the gate's in MoE)."""
        for key, values in self.global_scales.items():
            if len(values) > 1:
                self.report.fail(
                    key,
                    f"fused members have {len(values)} different global scales; vLLM runs them as one GEMM "
                    "with one global scale, so all but one member would be scaled wrongly",
                )

    def check_tensor_scales(self) -> None:
        """The tensor scheme's one scale must be at most OVERSIZE x amax / 448 of what it scales (a fused
        group's largest |w|), or 1 for all-zero weights (numbers.OVERSIZE). Passed-through scales are the
        source's own and are not held to it. Fused members with different scales are a warning."""
        for key, shared in self.groups.items():
            if len(shared.scales) > 1:
                self.report.warnings.append(
                    f"{key}: fused members have different per-tensor scales; vLLM re-quantizes "
                    "them to the largest (a second rounding)"
                )
        as_double = functools.partial(torch.tensor, dtype=torch.float64)  # the arithmetic of Python's floats
        for shared in self.groups.values():
            scale = shared.measured_scale
            if scale is None or not oversized(as_double(scale), as_double(shared.amax)):
                continue
            whose = "its" if len(shared.names) == 1 else "its fused group's"
            for name in shared.names:
                self.report.fail(
                    name,
                    f"scale {scale:.6g} is more than twice amax / 448 = {shared.amax / FP8_MAX:.6g} of "
                    f"{whose} weights (codes lose precision, or round to zero)",
                )


def check_data(
    source: Source, out: Path, pairs: list, fmt: QuantizationConfig | None, report: VerifyReport, settings
) -> None:
    """Stream every pair's bytes and check them; the problems and figures go into `report`."""
    dev = resolve_device(settings.device)
    checks = Checks(
        fmt, source.quant.scheme if source.quant else None, report, architecture_of(source.config) or GENERIC
    )
    reads = []
    for pair in pairs:
        pieces = pair.pieces()
        reads += [Read(pair, r0, i == len(pieces) - 1, src, got) for i, (r0, src, got) in enumerate(pieces)]
    report.bytes_read = sum(r.nbytes for r in reads)
    budget = budget_for(dev, settings.max_resident)
    bar = Progress(report.bytes_read, f"verify {out}", enabled=settings.progress)
    seconds = report.stage_seconds
    seconds.update(wait_read=0.0, check=0.0)
    try:
        with (
            read_batches(reads, source.root, out, dev, budget, bar, window_for(settings.prefetch)) as batches,
            checkers(dev) as run_all,
            torch.no_grad(),
        ):
            waited = time.monotonic()
            for batch in batches:
                checking = time.monotonic()
                jobs = [functools.partial(read.pair.check, s, o, read.r0, checks) for read, s, o in batch]
                for (read, _, _), result in zip(batch, run_all(jobs)):
                    read.pair.record(read.r0, read.last, result, checks)
                del batch, jobs
                seconds["wait_read"] += checking - waited
                waited = time.monotonic()
                seconds["check"] += waited - checking
    except (torch.OutOfMemoryError, MemoryError) as e:
        e.max_resident = budget  # the CLI suggests a smaller one
        raise
    finally:
        bar.close()
    checks.check_tensor_scales()
    checks.check_global_scales()


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


@contextlib.contextmanager
def read_batches(reads, source_root: Path, out_root: Path, device, budget: int, progress: Progress, prefetch: int):
    """The batches of `reads` in order, each a list of (read, source tensors, output tensors): views of
    buffers reused for a later batch, so done with a batch means done with them."""
    groups = group_reads(reads, max(1, budget // 2))
    roots = (source_root, out_root)
    # each batch's source and output pieces, under names unique within it (read k's j-th is "k.j")
    sides = [
        [
            [replace(t, name=f"{k}.{j}") for k, read in enumerate(group) for j, t in enumerate(getattr(read, side))]
            for group in groups
        ]
        for side in ("source", "output")
    ]
    with contextlib.ExitStack() as stack:  # leaving it stops the prefetchers, then waits for the reads in flight
        readers = [stack.enter_context(BatchReader(root, device, threads=io_threads(device.type)[0])) for root in roots]
        window = max(1, prefetch // 2)
        prefetchers = [
            stack.enter_context(Prefetcher(root, [t for b in batches for t in b], window, threads=default_threads()))
            for root, batches in zip(roots, sides)
            if prefetch
        ]
        yield _batches(groups, sides, readers, prefetchers, device, progress)


def _batches(groups, sides, readers, prefetchers, device, progress) -> Iterator[list]:
    def start(i: int) -> list | None:
        return None if i == len(groups) else [reader.start(batches[i]) for reader, batches in zip(readers, sides)]

    ahead = start(0)
    for i, group in enumerate(groups):
        current, ahead = ahead, None
        ahead = start(i + 1)  # read while this batch is checked
        for pending in current:
            pending.wait_all()
        for p, batches in zip(prefetchers, sides):
            p.advance(sum(t.nbytes for t in batches[i]))
        source, output = current
        yield [(read, views(source, read.source, k), views(output, read.output, k)) for k, read in enumerate(group)]
        if device.type == "cuda":  # the next batch's reads (other streams) may reuse these buffers' memory
            torch.cuda.current_stream(device).synchronize()
        progress.advance(sum(read.nbytes for read in group), group[-1].pair.name)
        for reader, pending in zip(readers, current):
            reader.recycle(pending.buf)
        del current, pending, source, output


def views(pending, infos: list[TensorInfo], k: int) -> list[torch.Tensor]:
    """Read `k`'s pieces (named "k.j") in the batch buffer, as the tensors they hold."""
    tensors = []
    for j, info in enumerate(infos):
        offset, dtype = pending.offsets[f"{k}.{j}"], torch_dtype(info.dtype)
        if not info.nbytes:
            tensors.append(torch.empty(info.shape, dtype=dtype, device=pending.buf.device))
        else:
            tensors.append(pending.buf[offset : offset + info.nbytes].view(dtype).view(info.shape))
    return tensors


@contextlib.contextmanager
def checkers(device):
    """Where a batch's checks run, results in order: on a GPU here; on a CPU one worker per core with one
    torch thread each, since a check is many small operations on cached tiles: side by side they pay no
    thread-pool synchronisation each, and a core busy with another program holds up one worker only."""
    workers = usable_cores()
    if device.type != "cpu" or workers < 2:
        yield lambda jobs: [job() for job in jobs]
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="fp8convert-verify") as pool:
            yield lambda jobs: list(pool.map(lambda job: job(), jobs))
    finally:
        torch.set_num_threads(threads)
