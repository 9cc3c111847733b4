"""The data checks: every pair's pieces read through quantize's reader in batches of at most half the
memory budget (the next batch read while this one is checked)."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..plan.architectures import architecture_of
from ..plan.family import GENERIC, Architecture
from ..plan.rules import fused_group_key
from ..run.device import budget_for, io_threads, resolve_device
from ..run.numerics import FP8_MAX
from ..run.prefetch import Prefetcher, default_threads, usable_cores, window_for
from ..run.progress import Progress
from ..run.reader import BatchReader
from ..safetensors_io import TensorInfo, torch_dtype
from ..source.checkpoint import Source
from .numbers import check_piece, oversized
from .pairs import Pair
from .report import VerifyReport


@dataclass
class Read:
    pair: Pair
    r0: int
    last: bool
    source: list[TensorInfo]
    output: list[TensorInfo]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.source) + sum(t.nbytes for t in self.output)


def check_data(source: Source, out: Path, pairs: list[Pair], report: VerifyReport, settings) -> None:
    dev = resolve_device(settings.device)
    source_scheme = source.quant.scheme if source.quant else None
    reads = []
    for pair in pairs:
        pieces = pair.pieces()
        reads += [Read(pair, r0, i == len(pieces) - 1, src, got) for i, (r0, src, got) in enumerate(pieces)]
    report.bytes_read = sum(r.nbytes for r in reads)
    budget = budget_for(dev, settings.max_resident)
    bar = Progress(report.bytes_read, f"verify {out}", enabled=settings.progress)
    batches = read_batches(reads, (source.root, out), dev, budget, bar, window_for(settings.prefetch))
    seconds = report.stage_seconds
    seconds.update(wait_read=0.0, check=0.0)
    try:
        with contextlib.closing(batches), checkers(dev) as run_all, torch.no_grad():
            waited = time.monotonic()
            for batch in batches:
                checking = time.monotonic()
                jobs = [functools.partial(check_piece, read.pair, s, o, read.r0, source_scheme) for read, s, o in batch]
                for (read, _, _), found in zip(batch, run_all(jobs)):
                    read.pair.record(read.r0, read.last, found, report)
                del batch, jobs
                seconds["wait_read"] += checking - waited
                waited = time.monotonic()
                seconds["check"] += waited - checking
    except (torch.OutOfMemoryError, MemoryError) as e:
        e.max_resident = budget  # the CLI suggests a smaller one
        raise
    finally:
        bar.close()
    check_shared_scales(pairs, architecture_of(source.config) or GENERIC, report)


def check_shared_scales(pairs: list[Pair], arch: Architecture, report: VerifyReport) -> None:
    """vLLM runs a fused group as one GEMM: per-tensor scales requantized to the largest (a warning when
    they differ), and one NVFP4 global scale (it takes the largest, or the gate's in MoE). A tensor scale
    quantized here is held to numbers.OVERSIZE against its fused group's largest |w|."""
    tensor_scales: dict[str, list[Pair]] = {}  # by fused group (or the tensor's own name)
    global_scales: dict[str, set[float]] = {}
    for pair in pairs:
        key = fused_group_key(pair.name, arch.fused) or pair.name
        if pair.verdict and pair.kind == "fp8" and pair.first.scale_value is not None:
            tensor_scales.setdefault(key, []).append(pair)
        elif pair.verdict and pair.global_value is not None:
            global_scales.setdefault(key, set()).add(pair.global_value)
    for key, members in tensor_scales.items():
        if len({p.first.scale_value for p in members}) > 1:
            report.warnings.append(
                f"{key}: fused members have different per-tensor scales; vLLM re-quantizes "
                "them to the largest (a second rounding)"
            )
        measured = [p for p in members if not p.passed_through]
        if not measured:
            continue
        scale, amax = max(p.first.scale_value for p in measured), max(p.sums.amax for p in measured)
        if not oversized(torch.tensor(scale, dtype=torch.float64), torch.tensor(amax, dtype=torch.float64)):
            continue  # compared in float64: the arithmetic of Python's floats
        whose = "its" if len(members) == 1 else "its fused group's"
        for p in members:
            report.fail(
                p.name,
                f"scale {scale:.6g} is more than twice amax / 448 = {amax / FP8_MAX:.6g} of "
                f"{whose} weights (codes lose precision, or round to zero)",
            )
    for key, values in global_scales.items():
        if len(values) > 1:
            report.fail(
                key,
                f"fused members have {len(values)} different global scales; vLLM runs them as one GEMM "
                "with one global scale, so all but one member would be scaled wrongly",
            )


def read_batches(reads, roots: tuple[Path, Path], device, budget: int, progress: Progress, prefetch: int) -> Iterator:
    """Each batch a list of (read, source tensors, output tensors): views of buffers reused for a later
    batch, so done with a batch means done with them."""
    groups: list[list[Read]] = []
    used = 0
    for read in reads:
        if not groups or used + read.nbytes > max(1, budget // 2):
            groups.append([])
            used = 0
        groups[-1].append(read)
        used += read.nbytes
    # each batch's source and output pieces, under names unique within it (read k's j-th is "k.j")
    sides = [
        [
            [replace(t, name=f"{k}.{j}") for k, read in enumerate(group) for j, t in enumerate(getattr(read, side))]
            for group in groups
        ]
        for side in ("source", "output")
    ]
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(BatchReader(root, device, threads=io_threads(device.type)[0])) for root in roots]
        window = max(1, prefetch // 2)
        prefetchers = [
            stack.enter_context(Prefetcher(root, [t for b in batches for t in b], window, threads=default_threads()))
            for root, batches in zip(roots, sides)
            if prefetch
        ]

        def start(i: int) -> list | None:
            return None if i == len(groups) else [reader.start(batches[i]) for reader, batches in zip(readers, sides)]

        ahead = start(0)
        for i, group in enumerate(groups):
            current, ahead = ahead, start(i + 1)  # read the next batch while this one is checked
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
    """On a CPU one worker per core with one torch thread each: a check is many small operations on cached
    tiles, which then pay no thread-pool synchronisation, and a busy core holds up one worker only."""
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
