"""The data checks: every pair's pieces streamed through quantize's reader (run/verify_stream.py), each
batch's pieces checked by worker threads, and their results recorded into the report in order."""

from __future__ import annotations

import contextlib
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..formats import QuantizationConfig
from ..plan.architectures import GENERIC, Architecture, architecture_of
from ..plan.rules import fused_group_key
from ..run.device import budget_for, resolve_device
from ..run.numerics import FP8_MAX
from ..run.prefetch import usable_cores, window_for
from ..run.progress import Progress
from ..run.verify_stream import Read, verify_stream
from ..source.checkpoint import Source
from .numbers import oversized
from .report import VerifyReport


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

    @property
    def powers_of_two(self) -> bool:
        """The output's scales are powers of two by rule: MXFP8 exponents, UE8M0 blocks."""
        return bool(self.fmt) and (self.fmt.scheme == "mxfp8" or self.fmt.scale_format == "ue8m0")

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
        reads += [
            Read((pair, r0, i == len(pieces) - 1), src, got, pair.name) for i, (r0, src, got) in enumerate(pieces)
        ]
    report.bytes_read = sum(r.nbytes for r in reads)
    budget = budget_for(dev, settings.max_resident)
    bar = Progress(report.bytes_read, f"verify {out}", enabled=settings.progress)
    seconds = report.stage_seconds
    seconds.update(wait_read=0.0, check=0.0)
    try:
        with (
            verify_stream(reads, source.root, out, dev, budget, bar, window_for(settings.prefetch)) as batches,
            checkers(dev) as run_all,
            torch.no_grad(),
        ):
            waited = time.monotonic()
            for batch in batches:
                checking = time.monotonic()
                jobs = [functools.partial(read.key[0].check, s, o, read.key[1], checks) for read, s, o in batch]
                for (read, _, _), result in zip(batch, run_all(jobs)):
                    pair, r0, last = read.key
                    pair.record(r0, last, result, checks)
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


@contextlib.contextmanager
def checkers(device):
    """Where the checks of a batch run, results in order: on a CPU, one worker thread per core, each
    with one torch thread; on a GPU, here. A CPU check is many small operations (tiles that stay in the
    caches): run side by side they pay no thread-pool synchronisation each, and a core busy with
    another program holds up one worker, not every operation."""
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
