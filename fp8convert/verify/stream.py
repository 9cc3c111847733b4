"""The data checks: every pair's pieces streamed through quantize's reader (run/verify_stream.py), each
batch's pieces checked by worker threads, and their results recorded into the report in order."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..formats import QuantizationConfig
from ..plan.architectures import GENERIC, Architecture, architecture_of
from ..plan.cuts import Cut
from ..plan.rules import fused_group_key
from ..run.cores import usable_cores
from ..run.device import budget_for, resolve_device
from ..run.numerics import FP8_MAX, powers_of_two
from ..run.prefetch import window_for
from ..run.progress import Progress
from ..run.quantizer import finite_positive
from ..run.verify_stream import Read, verify_stream
from ..source.checkpoint import Source
from ..units import plural
from .numbers import compare_kept, identical, measure_slab, oversized, same_bytes, scale_values, source_values
from .pairs import SOURCE_SCALE_NOT_FINITE, DequantizedPair, KeptPair, QuantizedPair, SameBytesPair, SlabResult
from .report import TensorCheck, VerifyReport


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
    def scheme(self) -> str | None:
        return self.fmt.scheme if self.fmt else None

    @property
    def powers_of_two(self) -> bool:
        """The output's scales are powers of two by rule: MXFP8 exponents, UE8M0 blocks."""
        return bool(self.fmt) and (self.fmt.scheme == "mxfp8" or self.fmt.scale_format == "ue8m0")


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
                results = run_all([lambda item=item: check_piece(*item, checks) for item in batch])
                for (read, _, _), result in zip(batch, results):
                    record(*read.key, result, checks)
                del batch, results
                seconds["wait_read"] += checking - waited
                waited = time.monotonic()
                seconds["check"] += waited - checking
    except (torch.OutOfMemoryError, MemoryError) as e:
        e.max_resident = budget  # the CLI suggests a smaller one
        raise
    finally:
        bar.close()
    check_tensor_scales(checks.groups, report)


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


def check_piece(read, sources, outputs, checks: Checks):
    """The check of one read (a worker runs it): a kept or carried piece's problem, a dequantized slab's
    count of wrong elements, or a quantized slab's result."""
    pair, r0, _ = read.key
    if isinstance(pair, KeptPair):
        piece = sources[0] if pair.cut is None else cut_of(pair.cut, sources[0]).contiguous()
        return compare_kept(piece, outputs[0], pair.origin)
    if isinstance(pair, SameBytesPair):
        return None if identical(sources[0], outputs[0]) else pair.what
    if isinstance(pair, DequantizedPair):
        return count_wrong(*sources, outputs[0], r0, checks.source_scheme)
    return check_quantized_slab(pair, sources, outputs, r0, checks)


def cut_of(cut: Cut, piece):
    """A cut's 2-D weight from what was read of its source: the one expert's rows, or the whole tensor."""
    return cut.apply(piece) if cut.expert is None else cut.across_experts().apply(piece)[0]


def count_wrong(codes, scale, stored, r0: int, source_scheme: str) -> int | None:
    """How many elements of a dequantized slab are not (float32(q) * scale) rounded once to their dtype;
    None when the source's scale is not finite and positive."""
    values = source_values(codes, scale, r0, source_scheme)
    if values is None:
        return None
    size = stored.element_size()
    a = values.to(stored.dtype).contiguous().view(torch.uint8).reshape(-1)
    b = stored.contiguous().view(torch.uint8).reshape(-1)
    return 0 if same_bytes(a, b) else int((a.view(-1, size) != b.view(-1, size)).any(dim=1).sum())


def check_quantized_slab(pair: QuantizedPair, sources, outputs, r0: int, checks: Checks) -> SlabResult:
    """A slab of an FP8 output: its scale, its figures against its source (an FP8 source's dequantized
    values), and for an FP8 source whether its codes (and, in the first slab, its scale) are the source's."""
    q, scale = outputs
    values = scale_values(scale)
    result = SlabResult(finite_positive(values))
    if pair.fp8 is None:
        w = sources[0] if pair.cut is None else cut_of(pair.cut, sources[0])
    else:
        codes, source_scale = sources
        result.same_codes = pair.may_pass and identical(codes, q)
        if r0 == 0:
            result.same_scale = pair.may_pass and identical(source_scale, scale)
            if result.scale_ok:
                result.scale_pow2 = bool(powers_of_two(values).all())
        w = source_values(codes, source_scale, r0, checks.source_scheme)
        result.source_scale_ok = w is not None
    if result.scale_ok and checks.scheme == "tensor":
        result.scale_value = values.reshape(-1)[0].item()
    if w is not None and result.scale_ok and not pair.requantized_problems:
        result.sums = measure_slab(w, q, values, r0, checks.scheme, checks.powers_of_two)
    return result


def record(pair, r0: int, last: bool, result, checks: Checks) -> None:
    """A piece's result into the report, in the order of the pieces (the main thread): a tensor's
    problem once, and its figures after its last piece."""
    report = checks.report
    if isinstance(pair, QuantizedPair):
        record_quantized(pair, r0, last, result, checks)
    elif pair.failed:
        return
    elif isinstance(pair, DequantizedPair):
        if result is None:
            pair.failed = True
            report.fail(pair.fp8.scale.name, SOURCE_SCALE_NOT_FINITE)
            return
        pair.wrong += result
        if last and pair.wrong:
            report.fail(
                pair.name,
                f"{plural(pair.wrong, 'element')} {'differs' if pair.wrong == 1 else 'differ'} "
                f"from float32(q) * scale rounded once to {pair.output.dtype}",
            )
    elif result:  # a kept or carried piece's problem
        pair.failed = True
        report.fail(pair.name, result)


def record_quantized(pair: QuantizedPair, r0: int, last: bool, result: SlabResult, checks: Checks) -> None:
    """A quantized tensor's slab; once all are in, its verdict: passed through from an FP8 source (its
    codes and scale the source's: exact), or measured against its source."""
    if r0 == 0:
        pair.first = result
    pair.same_codes &= result.same_codes
    pair.source_scale_ok &= result.source_scale_ok
    if result.sums is not None:
        pair.sums.add(result.sums)
    if not last:
        return
    report = checks.report
    if problem := pair.problem(checks.fmt):
        report.fail(*problem)
    elif pair.passed_through:
        shape, scale_shape = list(pair.codes.shape), list(pair.scale.shape)
        report.tensors.append(TensorCheck(pair.name, shape, scale_shape, 0.0, math.inf, 0.0, 0, True))
        add_group_scale(pair, checks, measured=False)
    else:
        add_group_scale(pair, checks, measured=True)
        check = pair.sums.check(pair.name, pair.codes.shape, pair.scale.shape)
        report.tensors.append(check)
        if not check.ok:
            report.fail(pair.name, check.problem(checks.scheme))


def add_group_scale(pair: QuantizedPair, checks: Checks, measured: bool) -> None:
    """A finished tensor-scheme weight's scale, under its fused group (or its own name); `measured`: its
    codes were quantized here, and its largest |w| counts toward what the scale must fit."""
    value = pair.first.scale_value
    if checks.scheme != "tensor" or value is None:
        return
    shared = checks.groups.setdefault(fused_group_key(pair.name, checks.arch.fused) or pair.name, SharedScale())
    shared.scales.add(value)
    shared.names.append(pair.name)
    if measured:
        shared.measured_scale = max(shared.measured_scale or 0.0, value)
        shared.amax = max(shared.amax, pair.sums.amax)


def check_tensor_scales(groups: dict[str, SharedScale], report: VerifyReport) -> None:
    """The tensor scheme's one scale must be at most OVERSIZE x amax / 448 of what it scales (a fused
    group's largest |w|), or 1 for all-zero weights (numbers.OVERSIZE). Passed-through scales are the
    source's own and are not held to it. Fused members with different scales are a warning."""
    for key, shared in groups.items():
        if len(shared.scales) > 1:
            report.warnings.append(
                f"{key}: fused members have different per-tensor scales; vLLM re-quantizes "
                "them to the largest (a second rounding)"
            )
    as_double = functools.partial(torch.tensor, dtype=torch.float64)  # the arithmetic of Python's floats
    for shared in groups.values():
        scale = shared.measured_scale
        if scale is None or not oversized(as_double(scale), as_double(shared.amax)):
            continue
        whose = "its" if len(shared.names) == 1 else "its fused group's"
        for name in shared.names:
            report.fail(
                name,
                f"scale {scale:.6g} is more than twice amax / 448 = {shared.amax / FP8_MAX:.6g} of "
                f"{whose} weights (codes lose precision, or round to zero)",
            )
