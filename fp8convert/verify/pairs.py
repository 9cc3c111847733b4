"""Each output tensor paired with the source tensor it must come from, its structure checked (no torch),
and the pieces in which the pair's bytes are read for its data checks (stream.py).

A fused expert tensor (all experts of a layer in one tensor) that the output holds as one weight per
expert is checked output by output against the slice of the source it must come from, as the
architecture registry lays it out (plan/rules.py expert_cuts). Missing experts, extra tensors and a
wrong slice all fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..formats import QuantizationConfig
from ..formats.sources import FP8Weight
from ..options import BLOCK
from ..plan.architectures import GENERIC, Architecture, architecture_of
from ..plan.cuts import Cut
from ..plan.rules import UnsupportedLayout, default_keep_reason, expert_cuts, is_linear_weight, module_of
from ..safetensors_io import FLOAT_SOURCE_DTYPES, FP8, TensorInfo
from ..source.checkpoint import Source
from .report import ErrorSums, VerifyReport
from .structure import read_output_layout

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


@dataclass
class Expected:
    """An output tensor the source implies: all of a source tensor, or a cut of a fused expert tensor."""

    name: str
    info: TensorInfo
    cut: Cut | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.cut.shape(self.info.shape) if self.cut else self.info.shape

    @property
    def where(self) -> str:
        return self.cut.describe(self.info.name) if self.cut else self.info.name


def expected_outputs(source: Source, arch: Architecture, outputs: dict, report: VerifyReport) -> list[Expected]:
    """Every output the source implies. A fused expert tensor the output does not hold as it is must
    be there one 2-D weight per expert, cut as the registry's layout says. An FP8 source's scales are
    checked with their weights."""
    expected = []
    companions = source.quant.companions() if source.quant else set()
    for info in source.tensors:
        if info.name in companions:
            continue
        fused = arch.expert_tensor(info.name)
        if fused is None or info.name in outputs:
            expected.append(Expected(info.name, info))
            continue
        try:
            expected += [Expected(n, info, cut) for n, cut in expert_cuts(info, *fused, arch, source.config)]
        except UnsupportedLayout as e:
            report.fail_with(e)
    return expected


def pair_tensors(source: Source, out: Path, fmt: QuantizationConfig | None, report: VerifyReport) -> list:
    """Each output the source implies with what the output holds for it (structure checked); missing
    outputs and output tensors nothing in the source explains are problems."""
    layout = read_output_layout(out, report)
    outputs = layout.tensors
    if fmt and fmt.static_activations and not any(n.endswith((".input_scale", ".activation_scale")) for n in outputs):
        report.fail(
            str(out / "config.json"),
            "declares static input activations, but the output holds no "
            "input_scale tensors (engines would read scales that are not there)",
        )
    pairing = Pairing(outputs, fmt, report, architecture_of(source.config) or GENERIC)
    pairs: list = []
    for want in expected_outputs(source, pairing.arch, outputs, report):
        name, got = want.name, outputs.get(want.name)
        if got is None:
            file = layout.placed_in.get(name)
            if file in layout.unreadable:
                report.fail(name, f"not checked: {file} cannot be read", follows_from=file)
            else:
                report.fail(
                    name,
                    f"missing from the output ({want.where})" if want.cut else "source tensor missing from the output",
                )
            continue
        pairing.accounted.add(name)
        fp8_weight = source.quant.weights.get(want.info.name) if source.quant and not want.cut else None
        if got.dtype == FP8 and fmt is None:
            report.fail(name, "still FP8, but the output has no quantization_config")
        elif fp8_weight is not None:
            pairs += pairing.fp8_weight(fp8_weight, got)
        elif got.dtype == FP8:
            pairs += pairing.quantized(want, got)
        else:
            pairs += pairing.kept(want, got)
    for name in sorted(set(outputs) - pairing.accounted):
        report.fail(name, f"in the output ({outputs[name].file}) but not derived from any source tensor")
    return pairs


@dataclass
class Pairing:
    """What pairing each tensor needs: the output's tensors, its layout (None for a dequantized output),
    and the output tensors accounted for so far."""

    outputs: dict[str, TensorInfo]
    fmt: QuantizationConfig | None
    report: VerifyReport
    arch: Architecture
    accounted: set[str] = field(default_factory=set)

    def scale_of(self, name: str) -> tuple[str, TensorInfo | None]:
        scale_name = self.fmt.scale_name(name)
        self.accounted.add(scale_name)
        return scale_name, self.outputs.get(scale_name)

    def kept(self, want: Expected, got: TensorInfo) -> list:
        """Kept in high precision: the dtype and shape of its source (or cut), and not a linear the config
        says is FP8."""
        name, info, fmt = want.name, want.info, self.fmt
        self.report.tensors_kept += 1
        if got.dtype != info.dtype or got.shape != want.shape:
            self.report.fail(
                name,
                f"kept as {got.dtype} {list(got.shape)} but the source ({want.where}) is {info.dtype} "
                f"{list(want.shape)}",
            )
            return []
        reason = default_keep_reason(info, self.arch, fmt.format, fmt.scheme) if fmt and len(info.shape) == 2 else None
        if fmt and is_linear_weight(name, want.shape, info.dtype, reason) and not fmt.ignores(module_of(name)):
            self.report.fail(
                name,
                f"kept in high precision, but {module_of(name)} is not in the ignore list "
                "(engines would expect FP8 weights for it)",
            )
        return [KeptPair(name, info, got, want.cut, want.where if want.cut else "the source")]

    def quantized(self, want: Expected, got: TensorInfo) -> list:
        self.report.tensors_quantized += 1
        scale_name, scale = self.scale_of(want.name)
        if problems := self.structure_problems(want, got, scale, scale_name):
            self.report.fail(want.name, "; ".join(problems))
            return []
        return [QuantizedPair(want.name, want.info, got, scale, scale_name, self.fmt.scheme == "block", want.cut)]

    def structure_problems(
        self, want: Expected, got: TensorInfo, scale: TensorInfo | None, scale_name: str, fp8_source: bool = False
    ) -> list[str]:
        """What is wrong with a quantized tensor's structure: a 2-D float source (or an FP8 source weight),
        the same shape, a module the ignore list does not name, and a scale of the format's dtype and of a
        shape it allows."""
        info, shape, fmt = want.info, want.shape, self.fmt
        problems = []
        if (info.dtype not in FLOAT_SOURCE_DTYPES and not fp8_source) or len(shape) != 2:
            problems.append(
                f"quantized, but the source ({want.where}) is {info.dtype} {list(shape)} (FP8 needs a 2-D float weight)"
            )
        elif got.shape != shape:
            problems.append(f"shape {list(got.shape)} differs from the source's ({want.where}) {list(shape)}")
        if fmt.ignores(module_of(want.name)):
            problems.append(f"quantized, but the ignore list names {module_of(want.name)}")
        if scale is None:
            problems.append(f"its scale {scale_name} is missing")
        elif scale.dtype != fmt.scale_dtype() or (not problems and scale.shape not in fmt.scale_shapes(shape)):
            problems.append(
                f"scale {scale_name} is {scale.dtype} {list(scale.shape)}, expected "
                f"{fmt.scale_dtype()} {shapes_text(fmt.scale_shapes(shape))}"
            )
        return problems

    def fp8_weight(self, weight: FP8Weight, got: TensorInfo) -> list:
        """An FP8 source weight's output: dequantized (exact), or FP8 (passed through: exact; requantized:
        within the e4m3 bound of the dequantized values), with its static activation scale if the output
        has one."""
        name, fmt, report = weight.weight.name, self.fmt, self.report
        if got.dtype != FP8:
            report.tensors_dequantized += 1
            pairs = []
            if got.dtype not in FLOAT_SOURCE_DTYPES or got.shape != weight.weight.shape:
                report.fail(
                    name,
                    f"dequantized as {got.dtype} {list(got.shape)}, but the source is an FP8 weight "
                    f"{list(weight.weight.shape)} (expected BF16, F16 or F32 of that shape)",
                )
            else:
                pairs.append(DequantizedPair(name, weight, got))
            if fmt is not None and not fmt.ignores(module_of(name)):
                report.fail(
                    name,
                    f"dequantized to {got.dtype}, but {module_of(name)} is not in the ignore list "
                    "(engines would expect FP8 weights for it)",
                )
            return pairs
        report.tensors_quantized += 1
        scale_name, scale = self.scale_of(name)
        pairs = self.activation_scale(weight)
        may_pass = (
            scale is not None
            and (scale.dtype, scale.nbytes) == (weight.scale.dtype, weight.scale.nbytes)
            and got.shape == weight.weight.shape
        )
        if not may_pass and scale is not None and scale.dtype != fmt.scale_dtype():
            report.fail(name, not_requantized(scale_name, scale.dtype, fmt))
            return pairs
        problems = self.structure_problems(Expected(name, weight.weight), got, scale, scale_name, fp8_source=True)
        if not may_pass and problems:
            report.fail(name, "; ".join(problems))
            return pairs
        pair = QuantizedPair(name, weight.weight, got, scale, scale_name, True, None, weight, may_pass, problems)
        return [*pairs, pair]

    def activation_scale(self, weight: FP8Weight) -> list:
        """A static activation scale in the output must be the source's, byte for byte."""
        name = weight.weight.name.removesuffix(".weight") + ".input_scale"
        if name not in self.outputs:
            return []
        self.accounted.add(name)
        got, source_scale = self.outputs[name], weight.input_scale
        what = "not the source's static activation scale"
        if source_scale is None or (got.dtype, got.nbytes) != (source_scale.dtype, source_scale.nbytes):
            self.report.fail(name, what + ("" if source_scale else " (the source has none)"))
            return []
        return [SameBytesPair(name, source_scale, got, what)]
