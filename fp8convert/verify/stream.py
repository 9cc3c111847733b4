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
from ..plan.rules import fused_group_key, module_of
from ..run.cores import usable_cores
from ..run.device import budget_for, resolve_device
from ..run.numerics import FP8_MAX, powers_of_two
from ..run.prefetch import window_for
from ..run.progress import Progress
from ..run.quantizer import finite_positive
from ..run.verify_stream import Read, VerifyStream
from ..source.checkpoint import Source
from ..units import plural
from .numbers import compare_kept, identical, measure_slab, oversized, same_bytes, scale_values, source_values
from .pairs import DequantizedPair, KeptPair, QuantizedPair, SameBytesPair
from .report import ErrorSums, TensorCheck, VerifyReport


def check_data(
    source: Source, out: Path, pairs: list, fmt: QuantizationConfig | None, report: VerifyReport, settings
) -> None:
    """Stream every pair's bytes and check them; the problems and figures go into `report`."""
    dev = resolve_device(settings.device)
    how = Checking(fmt, source.quant.scheme if source.quant else None)
    reads = [
        Read((pair, r0, r1), sources, outputs, pair.name)
        for pair in pairs
        for r0, r1, sources, outputs in pair.pieces(how.scheme)
    ]
    report.bytes_read = sum(r.nbytes for r in reads)
    bar = Progress(report.bytes_read, f"verify {out}", enabled=settings.progress)
    group_scales: dict[str, SharedScale] = {}
    arch = architecture_of(source.config) or GENERIC
    seconds = report.stage_seconds
    seconds.update(wait_read=0.0, check=0.0)
    try:
        budget = budget_for(dev, settings.max_resident)
        with (
            VerifyStream(reads, source.root, out, dev, budget, bar, window_for(settings.prefetch)) as stream,
            checkers(dev) as run_all,
            torch.no_grad(),
        ):
            waited = time.monotonic()
            for batch in stream:
                checking = time.monotonic()
                results = run_all([lambda item=item: check_piece(*item, how) for item in batch])
                for (read, _, _), result in zip(batch, results):
                    record(*read.key, result, how, report, group_scales, arch)
                del batch, results
                seconds["wait_read"] += checking - waited
                waited = time.monotonic()
                seconds["check"] += waited - checking
    except (torch.OutOfMemoryError, MemoryError) as e:
        e.max_resident = budget_for(dev, settings.max_resident)  # the CLI suggests a smaller one
        raise
    finally:
        bar.close()
    check_tensor_scales(group_scales, report)


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


@dataclass(frozen=True)
class Checking:
    """What every check needs to know of the output and the source: the output's layout (None for a
    dequantized output) and an FP8 source's scheme."""

    fmt: QuantizationConfig | None
    source_scheme: str | None

    @property
    def scheme(self) -> str | None:
        return self.fmt.scheme if self.fmt else None

    @property
    def powers_of_two(self) -> bool:
        """The output's scales are powers of two by rule: MXFP8 exponents, UE8M0 blocks."""
        return bool(self.fmt) and (self.fmt.scheme == "mxfp8" or self.fmt.scale_format == "ue8m0")


@dataclass
class SlabResult:
    """What one slab of a quantized tensor shows."""

    scale_ok: bool
    scale_value: float | None  # the tensor scheme's one scale
    sums: ErrorSums | None
    # FP8 sources only
    source_scale_ok: bool = True
    same_scale: bool = False
    same_codes: bool = False
    scale_pow2: bool = True


def check_piece(read, sources, outputs, how: Checking):
    """The check of one read (a worker runs it): a kept piece's problem, a carried tensor's sameness, a
    dequantized slab's count of wrong elements, or a quantized slab's result."""
    pair, r0, _ = read.key
    if isinstance(pair, KeptPair):
        if pair.cut is None:
            return compare_kept(sources[0], outputs[0])
        return compare_kept(cut_of(pair.cut, sources[0]).contiguous(), outputs[0], pair.where)
    if isinstance(pair, SameBytesPair):
        return identical(sources[0], outputs[0])
    if isinstance(pair, DequantizedPair):
        return check_dequantized_slab(*sources, outputs[0], r0, how.source_scheme)
    if pair.fp8 is not None:
        return check_fp8_source_slab(pair, *sources, *outputs, r0, how)
    w = sources[0] if pair.cut is None else cut_of(pair.cut, sources[0])
    return check_quantized_slab(w, *outputs, r0, how)


def cut_of(cut: Cut, piece):
    """A cut's 2-D weight from what was read of its source: the one expert's rows, or the whole tensor."""
    return cut.apply(piece) if cut.expert is None else cut.across_experts().apply(piece)[0]


def check_quantized_slab(w, q, scale, r0: int, how: Checking) -> SlabResult:
    values = scale_values(scale)
    if not finite_positive(values):
        return SlabResult(False, None, None)
    value = values.reshape(-1)[0].item() if how.scheme == "tensor" else None
    return SlabResult(True, value, measure_slab(w, q, values, r0, how.scheme, how.powers_of_two))


def check_dequantized_slab(codes, scale, stored, r0: int, source_scheme: str) -> int | None:
    """How many elements of a dequantized slab are not (float32(q) * scale) rounded once to their dtype;
    None when the source's scale is not finite and positive."""
    values = source_values(codes, scale, r0, source_scheme)
    if values is None:
        return None
    expected = values.to(stored.dtype).contiguous()
    size = stored.element_size()
    a, b = expected.view(torch.uint8).reshape(-1), stored.contiguous().view(torch.uint8).reshape(-1)
    if same_bytes(a, b):
        return 0
    return int((a.view(-1, size) != b.view(-1, size)).any(dim=1).sum())


def check_fp8_source_slab(pair: QuantizedPair, codes, source_scale, q, scale, r0: int, how: Checking) -> SlabResult:
    """A slab of an FP8 output made from an FP8 source weight: whether its codes (and, in the first slab,
    its scale) are the source's, and its figures against the source's dequantized values."""
    result = SlabResult(True, None, None)
    result.same_codes = pair.may_pass and identical(codes, q)
    if r0 == 0 and pair.may_pass:
        result.same_scale = identical(source_scale, scale)
    values = scale_values(scale)
    result.scale_ok = finite_positive(values)
    if r0 == 0 and result.scale_ok:
        result.scale_pow2 = bool(powers_of_two(values).all())
        if how.scheme == "tensor":
            result.scale_value = values.reshape(-1)[0].item()
    w = source_values(codes, source_scale, r0, how.source_scheme)
    result.source_scale_ok = w is not None
    if w is not None and result.scale_ok and pair.measured:
        result.sums = measure_slab(w, q, values, r0, how.scheme, how.powers_of_two)
    return result


def record(
    pair,
    r0: int,
    r1: int,
    result,
    how: Checking,
    report: VerifyReport,
    group_scales: dict[str, SharedScale],
    arch: Architecture,
) -> None:
    """A piece's result into the report, in the order of the pieces (the main thread): a tensor's
    problem once, and a quantized tensor's figures after its last slab."""
    if pair.failed:
        return
    if isinstance(pair, KeptPair):
        if result:
            pair.failed = True
            report.fail(pair.name, result)
        return
    if isinstance(pair, SameBytesPair):
        if not result:
            pair.failed = True
            report.fail(pair.name, pair.what)
        return
    if isinstance(pair, DequantizedPair):
        if result is None:
            pair.failed = True
            report.fail(pair.fp8.scale.name, "the source's scale is not finite and positive everywhere")
            return
        pair.wrong += result
        if r1 == pair.output.shape[0] and pair.wrong:
            report.fail(
                pair.name,
                f"{plural(pair.wrong, 'element')} {'differs' if pair.wrong == 1 else 'differ'} "
                f"from float32(q) * scale rounded once to {pair.output.dtype}",
            )
        return
    if pair.fp8 is not None:
        record_fp8_source_slab(pair, r0, r1, result, how, report, group_scales, arch)
        return
    if not result.scale_ok:
        pair.failed = True
        report.fail(pair.name, f"scale {pair.scale_name} is not finite and positive everywhere")
        return
    if r0 == 0:
        pair.scale_value = result.scale_value
    pair.sums.add(result.sums)
    if r1 == pair.codes.shape[0]:
        add_group_scale(pair, how, group_scales, arch, measured=True)
        finish_quantized(pair, how, report)


def finish_quantized(pair: QuantizedPair, how: Checking, report: VerifyReport) -> None:
    check = pair.sums.check(pair.name, pair.codes.shape, pair.scale.shape)
    report.tensors.append(check)
    if not check.ok:
        report.fail(check.name, check.problem(how.scheme))


def record_fp8_source_slab(
    pair: QuantizedPair,
    r0: int,
    r1: int,
    result: SlabResult,
    how: Checking,
    report: VerifyReport,
    group_scales: dict[str, SharedScale],
    arch: Architecture,
) -> None:
    """An FP8 source weight's FP8 output, slab by slab; once all are in: passed through (its codes and
    scale the source's: exact) or requantized (measured against the source's dequantized values)."""
    if r0 == 0:
        pair.same_scale, pair.scale_ok, pair.scale_pow2 = result.same_scale, result.scale_ok, result.scale_pow2
        pair.scale_value = result.scale_value
    pair.same_codes &= result.same_codes
    pair.source_scale_ok &= result.source_scale_ok
    if result.sums is not None:
        pair.sums.add(result.sums)
    if r1 != pair.codes.shape[0]:
        return
    fmt, name, scale_name = how.fmt, pair.name, pair.scale_name
    if pair.may_pass and pair.same_scale and pair.same_codes:  # passed through
        if pair.scale.shape not in fmt.scale_shapes(pair.codes.shape):
            report.fail(
                name,
                f"scale {scale_name} shaped {list(pair.scale.shape)}, expected "
                f"{' or '.join(str(list(s)) for s in fmt.scale_shapes(pair.codes.shape))}",
            )
        elif not pair.scale_ok:
            report.fail(name, f"scale {scale_name} is not finite and positive everywhere")
        elif fmt.scale_format == "ue8m0" and not pair.scale_pow2:
            report.fail(
                name,
                f"scale {scale_name} passed through from the source is not a power of two "
                "everywhere, but the config says scale_fmt ue8m0",
            )
        elif fmt.ignores(module_of(name)):
            report.fail(name, f"passed through in FP8, but the ignore list names {module_of(name)}")
        else:
            report.tensors.append(
                TensorCheck(name, list(pair.codes.shape), list(pair.scale.shape), 0.0, math.inf, 0.0, 0, True)
            )
            add_group_scale(pair, how, group_scales, arch)
        return
    if pair.scale.dtype != fmt.scale_dtype():
        report.fail(
            name,
            f"scale {scale_name} is {pair.scale.dtype}, but its codes and scale are not the source's "
            f"(a requantized scale is {fmt.scale_dtype()})",
        )
    elif not pair.source_scale_ok:
        report.fail(pair.fp8.scale.name, "the source's scale is not finite and positive everywhere")
    elif pair.requantized_problems:
        report.fail(name, "; ".join(pair.requantized_problems))
    elif not pair.scale_ok:
        report.fail(name, f"scale {scale_name} is not finite and positive everywhere")
    else:
        add_group_scale(pair, how, group_scales, arch, measured=True)
        finish_quantized(pair, how, report)


@dataclass
class SharedScale:
    """The tensor scheme's scales of one fused group (or of one tensor outside any group): the scales its
    members carry, the largest |w| among those quantized here, and their names."""

    scales: set[float] = field(default_factory=set)
    names: list[str] = field(default_factory=list)
    measured_scale: float | None = None  # the largest scale of members quantized here (not passed through)
    amax: float = 0.0  # ... and their largest |w|


def add_group_scale(
    pair: QuantizedPair, how: Checking, group_scales: dict[str, SharedScale], arch: Architecture, measured: bool = False
) -> None:
    """A finished tensor-scheme weight's scale, under its fused group (or its own name); `measured`: its
    codes were quantized here, and its largest |w| counts toward what the scale must fit."""
    if how.scheme != "tensor" or pair.scale_value is None:
        return
    shared = group_scales.setdefault(fused_group_key(pair.name, arch.fused) or pair.name, SharedScale())
    shared.scales.add(pair.scale_value)
    shared.names.append(pair.name)
    if measured:
        shared.measured_scale = max(shared.measured_scale or 0.0, pair.scale_value)
        shared.amax = max(shared.amax, pair.sums.amax)


def check_tensor_scales(group_scales: dict[str, SharedScale], report: VerifyReport) -> None:
    """The tensor scheme's one scale must be at most OVERSIZE x amax / 448 of what it scales (a fused
    group's largest |w|), or 1 for all-zero weights (see OVERSIZE). Passed-through scales are the source's
    own and are not held to it. Fused members with different scales are a warning."""
    for key, shared in group_scales.items():
        if len(shared.scales) > 1:
            report.warnings.append(
                f"{key}: fused members have different per-tensor scales; vLLM re-quantizes "
                "them to the largest (a second rounding)"
            )
    as_double = functools.partial(torch.tensor, dtype=torch.float64)  # the arithmetic of Python's floats
    for shared in group_scales.values():
        scale = shared.measured_scale
        if scale is None:
            continue
        if oversized(as_double(scale), as_double(shared.amax)):
            whose = "its" if len(shared.names) == 1 else "its fused group's"
            for name in shared.names:
                report.fail(
                    name,
                    f"scale {scale:.6g} is more than twice amax / 448 = {shared.amax / FP8_MAX:.6g} of "
                    f"{whose} weights (codes lose precision, or round to zero)",
                )
