"""The kinds of pair an output tensor makes with the source tensor it must come from. Each reads its
bytes in pieces (`pieces`), checks a piece on a worker thread (`check`, no shared state touched) and
records the result into the report in the order of the pieces (`record`, the main thread). The checks
import torch when they first run, so that the structure (structure.py) is checked without it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..formats import QuantizationConfig
from ..formats.sources import FP8Weight
from ..options import BLOCK
from ..plan.batches import first_axis_slice
from ..plan.plan import Cut
from ..plan.rules import module_of
from ..safetensors_io import TensorInfo
from ..units import plural
from .report import ErrorSums, TensorCheck

CHUNK_ELEMENTS = 1 << 24  # elements per slab of a quantized tensor (one read of the stream)
CHUNK_BYTES = 64 << 20  # bytes per piece when comparing kept tensors

# One read of a pair: (first row, source pieces, output pieces). A kept or carried tensor is read in
# pieces of CHUNK_BYTES (its "rows" counted in bytes), a quantized one in slabs of rows, each with the
# whole (small) scales; a cut of a fused expert tensor in one read.
Piece = tuple[int, list[TensorInfo], list[TensorInfo]]

SOURCE_SCALE_NOT_FINITE = "the source's scale is not finite and positive everywhere"


@dataclass(eq=False)
class KeptPair:
    """An output kept in high precision: all of a source tensor, or one expert's cut of a fused one."""

    name: str
    source: TensorInfo
    output: TensorInfo
    cut: Cut | None = None
    origin: str = "the source"  # what its bytes must be, as the problem names it
    failed: bool = False

    def pieces(self) -> list[Piece]:
        if self.cut is not None:
            return cut_read(self.source, self.cut, [self.output])
        info = self.source
        item = max(1, info.nbytes // max(info.numel, 1))
        step = max(item, CHUNK_BYTES // item * item)
        return [
            (start, [bytes_of(info, start, step, item)], [bytes_of(self.output, start, step, item)])
            for start in range(0, info.nbytes, step)
        ] or [(0, [info], [self.output])]

    def check(self, sources, outputs, r0: int, checks) -> str | None:
        from .numbers import compare_kept

        piece = sources[0] if self.cut is None else cut_of(self.cut, sources[0]).contiguous()
        return compare_kept(piece, outputs[0], self.origin)

    def record(self, r0: int, last: bool, problem: str | None, checks) -> None:
        if problem and not self.failed:
            self.failed = True
            checks.report.fail(self.name, problem)


@dataclass(eq=False)
class SameBytesPair(KeptPair):
    """A tensor carried as it is (a static activation scale): the source's bytes, or `what` fails."""

    what: str = ""

    def check(self, sources, outputs, r0: int, checks) -> str | None:
        from .numbers import identical

        return None if identical(sources[0], outputs[0]) else self.what


@dataclass(eq=False)
class DequantizedPair:
    """An FP8 source weight written in high precision: every element its one rounding."""

    name: str
    fp8: FP8Weight
    output: TensorInfo
    wrong: int = 0
    failed: bool = False

    def pieces(self) -> list[Piece]:
        weight, out = self.fp8, self.output
        if weight.packed:  # FP4: each row's group scales, and NVFP4's global scale
            extra = [weight.global_scale] if weight.global_scale else []
            return [
                (
                    r0,
                    [first_axis_slice(weight.weight, r0, n), first_axis_slice(weight.scale, r0, n), *extra],
                    [first_axis_slice(out, r0, n)],
                )
                for r0, n in slabs(*out.shape, whole_blocks=False)
            ]
        return [
            (r0, [first_axis_slice(weight.weight, r0, n), weight.scale], [first_axis_slice(out, r0, n)])
            for r0, n in slabs(*out.shape, whole_blocks=True)
        ]

    def check(self, sources, outputs, r0: int, checks) -> int | None:
        from .numbers import count_wrong

        return count_wrong(*sources, outputs[0], r0, source_scheme=checks.source_scheme)

    def record(self, r0: int, last: bool, wrong: int | None, checks) -> None:
        if self.failed:
            return
        if wrong is None:
            self.failed = True
            checks.report.fail(self.fp8.scale.name, SOURCE_SCALE_NOT_FINITE)
            return
        self.wrong += wrong
        if last and self.wrong:
            checks.report.fail(
                self.name,
                f"{plural(self.wrong, 'element')} {'differs' if self.wrong == 1 else 'differ'} "
                f"from float32(q) * scale rounded once to {self.output.dtype}",
            )


@dataclass
class SlabResult:
    """What one slab of a quantized tensor shows (the FP8 source's fields only for an FP8 source)."""

    scale_ok: bool  # the output's scale is finite and positive
    scale_value: float | None = None  # the tensor scheme's one scale
    sums: ErrorSums | None = None
    source_scale_ok: bool = True
    same_scale: bool = False  # the output's scale bytes are the source's (first slab)
    same_codes: bool = False  # the slab's codes are the source's
    scale_pow2: bool = True  # every scale value is a power of two (first slab)


@dataclass(eq=False)
class QuantizedPair:
    """An FP8 output and the source weight it was made from: a high-precision weight, one expert's cut
    of a fused one, or an FP8 source weight (`fp8`: the source's values are float32(q) * scale, and the
    output may be those codes and scale passed through)."""

    name: str
    source: TensorInfo
    codes: TensorInfo
    scale: TensorInfo
    scale_name: str
    whole_blocks: bool  # slabs start on 128-row blocks, so each slab's scale rows expand on their own
    cut: Cut | None = None
    fp8: FP8Weight | None = None
    may_pass: bool = False  # the scale's dtype and size are the source's: passed through if its bytes are
    requantized_problems: list[str] = field(default_factory=list)  # structure, unless passed through
    sums: ErrorSums = field(default_factory=ErrorSums)
    first: SlabResult | None = None
    same_codes: bool = True  # every slab's codes are the source's
    source_scale_ok: bool = True
    fmt: QuantizationConfig | None = None  # the output's config as it applies to this tensor

    @property
    def powers_of_two(self) -> bool:
        """Its scales are powers of two by rule: MXFP8 exponents, UE8M0 blocks."""
        return self.fmt.scheme == "mxfp8" or self.fmt.scale_format == "ue8m0"

    def pieces(self) -> list[Piece]:
        if self.cut is not None:
            return cut_read(self.source, self.cut, [self.codes, self.scale])
        extra = [self.fp8.scale] if self.fp8 else []
        return [
            (r0, [first_axis_slice(self.source, r0, n), *extra], [first_axis_slice(self.codes, r0, n), self.scale])
            for r0, n in slabs(*self.codes.shape, self.whole_blocks)
        ]

    def check(self, sources, outputs, r0: int, checks) -> SlabResult:
        from .numbers import finite_positive, identical, measure_slab, powers_of_two, scale_values, source_values

        q, scale = outputs
        values = scale_values(scale)
        result = SlabResult(finite_positive(values))
        if self.fp8 is None:
            w = sources[0] if self.cut is None else cut_of(self.cut, sources[0])
        else:
            codes, source_scale = sources
            result.same_codes = self.may_pass and identical(codes, q)
            if r0 == 0:
                result.same_scale = self.may_pass and identical(source_scale, scale)
                result.scale_pow2 = not result.scale_ok or bool(powers_of_two(values).all())
            w = source_values(codes, source_scale, r0, checks.source_scheme)
            result.source_scale_ok = w is not None
        if result.scale_ok and self.fmt.scheme == "tensor":
            result.scale_value = values.reshape(-1)[0].item()
        if w is not None and result.scale_ok and not self.requantized_problems:
            result.sums = measure_slab(w, q, values, r0, self.fmt.scheme, self.powers_of_two)
        return result

    def record(self, r0: int, last: bool, result: SlabResult, checks) -> None:
        """A slab; after the last, the tensor's verdict: passed through (exact) or measured."""
        if r0 == 0:
            self.first = result
        self.same_codes &= result.same_codes
        self.source_scale_ok &= result.source_scale_ok
        if result.sums is not None:
            self.sums.add(result.sums)
        if not last:
            return
        report = checks.report
        if problem := self.problem(self.fmt):
            report.fail(*problem)
        elif self.passed_through:
            shape, scale_shape = list(self.codes.shape), list(self.scale.shape)
            report.tensors.append(TensorCheck(self.name, shape, scale_shape, 0.0, math.inf, 0.0, 0, True))
            checks.add_tensor_scale(self, measured=False)
        else:
            checks.add_tensor_scale(self, measured=True)
            check = self.sums.check(self.name, self.codes.shape, self.scale.shape)
            report.tensors.append(check)
            if not check.ok:
                report.fail(self.name, check.problem(self.fmt.scheme))

    @property
    def passed_through(self) -> bool:
        """An FP8 source's codes and scale, unchanged: exact, and not measured."""
        return self.may_pass and self.first.same_scale and self.same_codes

    def problem(self, fmt: QuantizationConfig) -> tuple[str, str] | None:
        """What fails once every slab is in, as (subject, what); None: its figures decide."""
        name, scale_name, first = self.name, self.scale_name, self.first
        not_finite = f"scale {scale_name} is not finite and positive everywhere"
        if self.passed_through:
            shapes = fmt.scale_shapes(self.codes.shape)
            if self.scale.shape not in shapes:
                return name, f"scale {scale_name} shaped {list(self.scale.shape)}, expected {shapes_text(shapes)}"
            if not first.scale_ok:
                return name, not_finite
            if fmt.scale_format == "ue8m0" and not first.scale_pow2:
                return name, (
                    f"scale {scale_name} passed through from the source is not a power of two "
                    "everywhere, but the config says scale_fmt ue8m0"
                )
            if fmt.ignores(module_of(name)):
                return name, f"passed through in FP8, but the ignore list names {module_of(name)}"
            return None
        if self.fp8 and self.scale.dtype != fmt.scale_dtype():
            return name, not_requantized(scale_name, self.scale.dtype, fmt)
        if not self.source_scale_ok:
            return self.fp8.scale.name, SOURCE_SCALE_NOT_FINITE
        if self.requantized_problems:
            return name, "; ".join(self.requantized_problems)
        return None if first.scale_ok else (name, not_finite)


@dataclass(eq=False)
class FP4Pair:
    """An FP4 output (X.weight_packed, X.weight_scale and, for NVFP4, X.weight_global_scale) and the source
    weight it was made from: a high-precision weight, one expert's cut of a fused one, or an FP8 weight."""

    name: str  # X.weight, the source's name
    source: TensorInfo
    packed: TensorInfo
    scale: TensorInfo
    global_scale: TensorInfo | None
    cut: Cut | None = None
    fp8: FP8Weight | None = None
    sums: ErrorSums = field(default_factory=ErrorSums)
    global_value: float | None = None
    failed: bool = False
    fmt: QuantizationConfig | None = None  # the output's config as it applies to this tensor

    def pieces(self) -> list[Piece]:
        outputs = [self.packed, self.scale] + ([self.global_scale] if self.global_scale else [])
        if self.cut is not None:
            return cut_read(self.source, self.cut, outputs)
        extra = [self.fp8.scale] if self.fp8 else []
        return [
            (
                r0,
                [first_axis_slice(self.source, r0, n), *extra],
                [first_axis_slice(outputs[0], r0, n), first_axis_slice(outputs[1], r0, n), *outputs[2:]],
            )
            for r0, n in slabs(self.source.shape[0], self.source.shape[1], self.fp8 is not None)
        ]

    def check(self, sources, outputs, r0: int, checks) -> tuple[ErrorSums, float | None] | None:
        """The slab's figures and the global scale (NVFP4); None when a scale is not finite and positive."""
        from .numbers import fp4_sums, source_values

        packed, scale, *global_scale = outputs
        if self.fp8 is None:
            w = sources[0] if self.cut is None else cut_of(self.cut, sources[0])
        elif (w := source_values(*sources, r0, checks.source_scheme)) is None:
            return None
        g = global_scale[0] if global_scale else None
        sums = fp4_sums(w, packed, scale, g, self.fmt.scheme)
        return None if sums is None else (sums, None if g is None else g.float().reshape(-1)[0].item())

    def record(self, r0: int, last: bool, result: tuple[ErrorSums, float | None] | None, checks) -> None:
        if self.failed:
            return
        if result is None:
            self.failed = True
            checks.report.fail(self.name, f"scale {self.scale.name} or its global scale is not finite and positive")
            return
        self.sums.add(result[0])
        self.global_value = result[1]
        if not last:
            return
        check = self.sums.check(self.name, self.packed.shape, self.scale.shape)
        checks.report.tensors.append(check)
        if not check.ok:
            checks.report.fail(self.name, check.problem(self.fmt.scheme))
        if self.global_value is not None:
            checks.add_global_scale(self.name, self.global_value)


def cut_of(cut: Cut, piece):
    """A cut's 2-D weight from what was read of its source: the one expert's rows, or the whole tensor."""
    return cut.apply(piece) if cut.expert is None else cut.across_experts().apply(piece)[0]


def bytes_of(info: TensorInfo, start: int, n: int, item: int) -> TensorInfo:
    """Bytes [start, start + n) of a tensor of `item`-byte elements (n cut at its end), as a flat piece."""
    n = min(n, info.nbytes - start)
    return replace(info, offset=info.offset + start, nbytes=n, shape=(n // item,))


def slabs(rows: int, cols: int, whole_blocks: bool) -> list[tuple[int, int]]:
    """(first row, row count) of each slab of about CHUNK_ELEMENTS; one empty slab for a tensor without rows."""
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    if whole_blocks:
        step = max(BLOCK, step // BLOCK * BLOCK)
    return [(r0, min(step, rows - r0)) for r0 in range(0, rows, step)] or [(0, 0)]


def cut_read(info: TensorInfo, cut: Cut, output: list[TensorInfo]) -> list[Piece]:
    """A cut of a fused expert tensor in one read: the expert's rows of the source (all of it for a cut
    that picks no expert), and the whole output."""
    return [(0, [info if cut.expert is None else first_axis_slice(info, cut.expert, 1)], output)]


def shapes_text(shapes: list[tuple[int, ...]]) -> str:
    return " or ".join(str(list(s)) for s in shapes)


def not_requantized(scale_name: str, dtype: str, fmt: QuantizationConfig) -> str:
    return (
        f"scale {scale_name} is {dtype}, but its codes and scale are not the source's (a requantized scale "
        f"is {fmt.scale_dtype()})"
    )
