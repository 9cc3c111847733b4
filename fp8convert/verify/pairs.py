"""The kinds of pair an output tensor makes with the source tensor it must come from (no torch): the
pieces in which a pair's bytes are read for its data checks (stream.py), and a quantized pair's verdict
once they are in."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..formats import QuantizationConfig
from ..formats.sources import FP8Weight
from ..options import BLOCK
from ..plan.cuts import Cut
from ..plan.rules import module_of
from ..safetensors_io import TensorInfo
from .report import ErrorSums

CHUNK_ELEMENTS = 1 << 24  # elements per slab of a quantized tensor (one read of the stream)
CHUNK_BYTES = 64 << 20  # bytes per piece when comparing kept tensors

# One read of a pair: (first row, source pieces, output pieces). A kept tensor is read in pieces of
# CHUNK_BYTES (its "rows" counted in bytes), a quantized one in slabs of rows, each with the whole
# (small) scales; a cut of a fused expert tensor, or a carried tensor, in one read.
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

    def pieces(self) -> list[Piece]:
        if self.cut is not None:
            return cut_read(self.source, self.cut, [self.codes, self.scale])
        extra = [self.fp8.scale] if self.fp8 else []
        return [
            (r0, [rows_of(self.source, r0, n), *extra], [rows_of(self.codes, r0, n), self.scale])
            for r0, n in slabs(*self.codes.shape, self.whole_blocks)
        ]


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
        return [
            (r0, [rows_of(weight.weight, r0, n), weight.scale], [rows_of(out, r0, n)])
            for r0, n in slabs(*out.shape, whole_blocks=True)
        ]


@dataclass(eq=False)
class SameBytesPair:
    """A tensor carried as it is (a static activation scale): the source's bytes, or `what` fails."""

    name: str
    source: TensorInfo
    output: TensorInfo
    what: str
    failed: bool = False

    def pieces(self) -> list[Piece]:
        return [(0, [self.source], [self.output])]


def rows_of(info: TensorInfo, r0: int, n: int) -> TensorInfo:
    """Rows [r0, r0 + n) of a tensor with at least one dimension, as a piece of its file."""
    per_row = info.nbytes // max(info.shape[0], 1)
    return replace(info, offset=info.offset + r0 * per_row, nbytes=n * per_row, shape=(n, *info.shape[1:]))


def bytes_of(info: TensorInfo, start: int, n: int, item: int) -> TensorInfo:
    """Bytes [start, start + n) of a tensor whose elements are `item` bytes (n cut at its end), as a flat
    piece of its file."""
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
    return [(0, [info if cut.expert is None else rows_of(info, cut.expert, 1)], output)]


def shapes_text(shapes: list[tuple[int, ...]]) -> str:
    return " or ".join(str(list(s)) for s in shapes)


def not_requantized(scale_name: str, dtype: str, fmt: QuantizationConfig) -> str:
    return (
        f"scale {scale_name} is {dtype}, but its codes and scale are not the source's (a requantized scale "
        f"is {fmt.scale_dtype()})"
    )
