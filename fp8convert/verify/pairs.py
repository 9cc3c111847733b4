"""Each output tensor paired with the source tensor it must come from, its structure checked (no torch),
and the reads that bring a pair's bytes in for its data checks.

A fused expert tensor (all experts of a layer in one tensor) that the output holds as one weight per
expert is checked output by output against the slice of the source it must come from, as the
architecture registry lays it out (plan/rules.py expert_cuts): the expert, its gate or up half, in
nn.Linear orientation. Missing experts, extra tensors and a wrong slice all fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..formats import QuantizationConfig
from ..formats.sources import FP8Weight
from ..options import BLOCK
from ..plan.architectures import GENERIC, Architecture, architecture_of
from ..plan.cuts import Cut
from ..plan.rules import default_keep_reason, is_linear_weight, module_of
from ..safetensors_io import FLOAT_SOURCE_DTYPES, FP8, TensorInfo
from ..source.checkpoint import Source
from .report import ErrorSums, VerifyReport
from .structure import Expected, expected_outputs, read_output_layout

CHUNK_ELEMENTS = 1 << 24  # elements per slab of a quantized tensor (one read of the stream)
CHUNK_BYTES = 64 << 20  # bytes per piece when comparing kept tensors

# One read of a pair: (first row, end row, source pieces, output pieces). A kept tensor is read in pieces
# of CHUNK_BYTES (its "rows" counted in bytes), a quantized one in slabs of rows, each slab with the whole
# (small) scales; a cut of a fused expert tensor (see cut_read), or a carried tensor, in one read.
Piece = tuple[int, int, list[TensorInfo], list[TensorInfo]]


@dataclass(eq=False)
class KeptPair:
    """An output kept in high precision: all of a source tensor, or one expert's cut of a fused one."""

    name: str
    source: TensorInfo
    output: TensorInfo
    cut: Cut | None = None
    where: str = ""
    failed: bool = False

    def pieces(self, scheme: str | None) -> list[Piece]:
        if self.cut is not None:
            return cut_read(self.source, self.cut, [self.output])
        info = self.source
        item = max(1, info.nbytes // max(info.numel, 1))
        step = max(item, CHUNK_BYTES // item * item)
        reads = []
        for start in range(0, info.nbytes, step):
            n = min(step, info.nbytes - start)
            reads.append((start, start + n, [bytes_of(info, start, n, item)], [bytes_of(self.output, start, n, item)]))
        return reads or [(0, 0, [info], [self.output])]


@dataclass(eq=False)
class QuantizedPair:
    """An FP8 output and the source weight it was made from: a high-precision weight, one expert's cut
    of a fused one, or an FP8 source weight (`fp8`: then the source's values are float32(q) * scale,
    and the output may be those codes and scales passed through)."""

    name: str
    source: TensorInfo
    codes: TensorInfo
    scale: TensorInfo
    scale_name: str
    sums: ErrorSums = field(default_factory=ErrorSums)
    cut: Cut | None = None
    fp8: FP8Weight | None = None
    failed: bool = False
    # FP8 sources only
    may_pass: bool = False  # the scale's dtype and size are the source's: passed through if its bytes are
    same_scale: bool = False  # the output's scale bytes are the source's
    same_codes: bool = True  # every slab's codes are the source's
    source_scale_ok: bool = True
    scale_ok: bool = True  # the output's scale is finite and positive
    scale_pow2: bool = True  # ... and every value a power of two
    scale_value: float | None = None  # the tensor scheme's one scale
    requantized_problems: list[str] = field(default_factory=list)  # structure, if it was not passed through

    @property
    def measured(self) -> bool:
        """Whether the slabs measure the error (not for a structure that only a pass-through explains)."""
        return not self.requantized_problems

    def pieces(self, scheme: str | None) -> list[Piece]:
        if self.cut is not None:
            return cut_read(self.source, self.cut, [self.codes, self.scale])
        extra = [self.fp8.scale] if self.fp8 else []
        return [
            (r0, r0 + n, [rows_of(self.source, r0, n)] + extra, [rows_of(self.codes, r0, n), self.scale])
            for r0, n in slabs(*self.codes.shape, whole_blocks=scheme == "block" or self.fp8 is not None)
        ]


@dataclass(eq=False)
class DequantizedPair:
    """An FP8 source weight written in high precision: every element its one rounding."""

    name: str
    fp8: FP8Weight
    output: TensorInfo
    wrong: int = 0
    failed: bool = False

    def pieces(self, scheme: str | None) -> list[Piece]:
        weight, out = self.fp8, self.output
        return [
            (r0, r0 + n, [rows_of(weight.weight, r0, n), weight.scale], [rows_of(out, r0, n)])
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

    def pieces(self, scheme: str | None) -> list[Piece]:
        return [(0, 0, [self.source], [self.output])]


def rows_of(info: TensorInfo, r0: int, n: int) -> TensorInfo:
    """Rows [r0, r0 + n) of a tensor with at least one dimension, as a piece of its file."""
    per_row = info.nbytes // max(info.shape[0], 1)
    return replace(info, offset=info.offset + r0 * per_row, nbytes=n * per_row, shape=(n, *info.shape[1:]))


def bytes_of(info: TensorInfo, start: int, n: int, item: int) -> TensorInfo:
    """Bytes [start, start + n) of a tensor whose elements are `item` bytes, as a flat piece of its file."""
    return replace(info, offset=info.offset + start, nbytes=n, shape=(n // item,))


def slabs(rows: int, cols: int, whole_blocks: bool) -> list[tuple[int, int]]:
    """(first row, row count) of each slab of about CHUNK_ELEMENTS; one empty slab for a tensor without
    rows. `whole_blocks`: slabs start on block rows, so that each slab's scale rows expand on their own."""
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    if whole_blocks:
        step = max(BLOCK, step // BLOCK * BLOCK)
    return [(r0, min(step, rows - r0)) for r0 in range(0, rows, step)] or [(0, 0)]


def cut_read(info: TensorInfo, cut: Cut, output: list[TensorInfo]) -> list[Piece]:
    """A cut of a fused expert tensor in one read: the expert's rows of the source (all of it for a cut
    that picks no expert), and the whole output."""
    source = info if cut.expert is None else rows_of(info, cut.expert, 1)
    rows = output[0].shape[0] if output[0].shape else 0
    return [(0, rows, [source], output)]


def check_kept_structure(
    want: Expected, got: TensorInfo, fmt: QuantizationConfig | None, arch: Architecture, report: VerifyReport
) -> bool:
    """A tensor kept in high precision: the dtype and shape of its source (or cut), and not a linear the
    config says is FP8."""
    name, info = want.name, want.info
    if got.dtype != info.dtype or got.shape != want.shape:
        report.fail(
            name,
            f"kept as {got.dtype} {list(got.shape)} but the source ({want.where}) is {info.dtype} {list(want.shape)}",
        )
        return False
    reason = default_keep_reason(info, arch, fmt.format, fmt.scheme) if fmt and len(info.shape) == 2 else None
    if fmt and is_linear_weight(name, want.shape, info.dtype, reason) and not fmt.ignores(module_of(name)):
        report.fail(
            name,
            f"kept in high precision, but {module_of(name)} is not in the ignore list "
            "(engines would expect FP8 weights for it)",
        )
    return True


def quantized_structure_problems(
    want: Expected,
    got: TensorInfo,
    scale: TensorInfo | None,
    scale_name: str,
    fmt: QuantizationConfig,
    fp8_source: bool = False,
) -> list[str]:
    """What is wrong with a quantized tensor's structure: a 2-D float source (or an FP8 source weight),
    the same shape, a module the ignore list does not name, and a scale of the format's dtype and of a
    shape it allows."""
    info, shape = want.info, want.shape
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
            f"{fmt.scale_dtype()} {' or '.join(str(list(s)) for s in fmt.scale_shapes(shape))}"
        )
    return problems


def pair_fp8_weight(
    weight: FP8Weight,
    got: TensorInfo,
    outputs: dict,
    fmt: QuantizationConfig | None,
    report: VerifyReport,
    accounted: set[str],
) -> list:
    """The pairs that check an FP8 source weight's output: dequantized (exact), or FP8 (passed through:
    exact; requantized: within the e4m3 bound of the dequantized values), with its static activation
    scale if the output has one. Structure problems are reported here."""
    name = weight.weight.name
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
    scale_name = fmt.scale_name(name)
    accounted.add(scale_name)
    pairs = pair_activation_scale(weight, outputs, report, accounted)
    scale = outputs.get(scale_name)
    may_pass = (
        scale is not None
        and scale.dtype == weight.scale.dtype
        and scale.nbytes == weight.scale.nbytes
        and got.shape == weight.weight.shape
    )
    if not may_pass and scale is not None and scale.dtype != fmt.scale_dtype():
        report.fail(
            name,
            f"scale {scale_name} is {scale.dtype}, but its codes and scale are not the source's (a "
            f"requantized scale is {fmt.scale_dtype()})",
        )
        return pairs
    problems = quantized_structure_problems(Expected(name, weight.weight), got, scale, scale_name, fmt, True)
    if not may_pass and problems:
        report.fail(name, "; ".join(problems))
        return pairs
    return pairs + [
        QuantizedPair(
            name, weight.weight, got, scale, scale_name, fp8=weight, may_pass=may_pass, requantized_problems=problems
        )
    ]


def pair_activation_scale(weight: FP8Weight, outputs: dict, report: VerifyReport, accounted: set[str]) -> list:
    """A static activation scale in the output must be the source's, byte for byte."""
    name = weight.weight.name[: -len(".weight")] + ".input_scale"
    if name not in outputs:
        return []
    accounted.add(name)
    got, source_scale = outputs[name], weight.input_scale
    what = "not the source's static activation scale"
    if source_scale is None or got.dtype != source_scale.dtype or got.nbytes != source_scale.nbytes:
        report.fail(name, what + ("" if source_scale else " (the source has none)"))
        return []
    return [SameBytesPair(name, source_scale, got, what)]


def pair_tensors(source: Source, out: Path, fmt: QuantizationConfig | None, report: VerifyReport) -> list:
    """Each output the source implies with what the output holds for it (structure checked); missing
    outputs and output tensors nothing in the source explains are problems."""
    layout = read_output_layout(out, report)
    outputs = layout.tensors
    if (
        fmt is not None
        and fmt.static_activations
        and not any(name.endswith((".input_scale", ".activation_scale")) for name in outputs)
    ):
        report.fail(
            str(out / "config.json"),
            "declares static input activations, but the output holds no "
            "input_scale tensors (engines would read scales that are not there)",
        )
    arch = architecture_of(source.config) or GENERIC
    accounted: set[str] = set()
    pairs: list = []
    for want in expected_outputs(source, arch, outputs, report):
        name = want.name
        if name not in outputs:
            file = layout.placed_in.get(name)
            if file in layout.unreadable:
                report.fail(name, f"not checked: {file} cannot be read", follows_from=file)
            else:
                report.fail(
                    name,
                    f"missing from the output ({want.where})" if want.cut else "source tensor missing from the output",
                )
            continue
        accounted.add(name)
        got = outputs[name]
        fp8_weight = source.quant.weights.get(want.info.name) if source.quant and not want.cut else None
        if got.dtype == FP8 and fmt is None:
            report.fail(name, "still FP8, but the output has no quantization_config")
        elif fp8_weight is not None:
            pairs += pair_fp8_weight(fp8_weight, got, outputs, fmt, report, accounted)
        elif got.dtype == FP8:
            scale_name = fmt.scale_name(name)
            accounted.add(scale_name)
            report.tensors_quantized += 1
            scale = outputs.get(scale_name)
            problems = quantized_structure_problems(want, got, scale, scale_name, fmt)
            if problems:
                report.fail(name, "; ".join(problems))
            else:
                pairs.append(QuantizedPair(name, want.info, got, scale, scale_name, cut=want.cut))
        else:
            report.tensors_kept += 1
            if check_kept_structure(want, got, fmt, arch, report):
                pairs.append(KeptPair(name, want.info, got, want.cut, want.where))
    for name in sorted(set(outputs) - accounted):
        report.fail(name, f"in the output ({outputs[name].file}) but not derived from any source tensor")
    return pairs
