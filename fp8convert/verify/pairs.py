"""A pair: an output tensor (with its scales) and the source tensor or fused-expert cut it must come from,
read in pieces, each checked on a worker thread and recorded in order on the main thread. No torch here:
the structure is checked without it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..formats import QuantizationConfig
from ..formats.sources import FP8Weight
from ..options import BLOCK, ScaleFormat, Scheme
from ..plan.batches import first_axis_slice
from ..plan.plan import Cut
from ..plan.rules import module_of
from ..safetensors_io import TensorInfo
from ..units import plural
from .report import ErrorSums, TensorCheck, VerifyReport

CHUNK_ELEMENTS = 1 << 24  # elements per slab of a weight (one read of the stream)
CHUNK_BYTES = 64 << 20  # bytes per piece when comparing kept tensors

SOURCE_SCALE_NOT_FINITE = "the source's scale is not finite and positive everywhere"


@dataclass
class Found:
    """What one piece of a pair shows. `problem` (subject, what) ends the pair's check."""

    problem: tuple[str, str] | None = None
    wrong: int = 0  # dequantized elements that are not their one rounding
    sums: ErrorSums | None = None
    global_value: float | None = None  # NVFP4's global scale
    scale_ok: bool = True  # the output's scale is finite and positive
    scale_value: float | None = None  # the tensor scheme's one scale
    source_scale_ok: bool = True
    same_scale: bool = False  # the output's scale bytes are the source's (first slab)
    same_codes: bool = False  # the slab's codes are the source's
    scale_pow2: bool = True  # every scale value is a power of two (first slab)


@dataclass(eq=False)
class Pair:
    """kind, and what its output must be:
    - "kept": the source's bytes (all of a source tensor, or one expert's cut of a fused one), finite;
    - "carried": a static activation scale, the source's bytes (`differs` otherwise);
    - "dequantized": an FP8 or FP4 source weight (`fp8`) in high precision, every element its one rounding;
    - "fp8", "fp4": codes and scales made from the source (a high-precision weight, a cut, or an FP8 weight
      `fp8`, whose FP8 codes and scale may also be passed through: `may_pass`).
    `outputs`: the output tensor, then its scale and NVFP4's global scale."""

    kind: str
    name: str
    source: TensorInfo  # the tensor read in pieces: an FP8 source's weight, a fused tensor for a cut
    outputs: list[TensorInfo]
    cut: Cut | None = None
    fp8: FP8Weight | None = None
    fmt: QuantizationConfig | None = None  # the output's config as it applies to this tensor
    differs: str = ""  # kept or carried: the problem when the bytes differ
    may_pass: bool = False  # the scale's dtype and size are the source's: passed through if its bytes are
    requantized_problems: list[str] = field(default_factory=list)  # structure, unless passed through
    # what the pieces showed so far
    failed: bool = False
    wrong: int = 0
    sums: ErrorSums = field(default_factory=ErrorSums)
    first: Found | None = None
    same_codes: bool = True  # every slab's codes are the source's
    source_scale_ok: bool = True
    global_value: float | None = None
    verdict: TensorCheck | None = None  # its figures, once every piece is in and no problem ends it first

    def pieces(self) -> list[tuple[int, list[TensorInfo], list[TensorInfo]]]:
        """(first row, source pieces, output pieces) of each read: a cut in one; a kept tensor in pieces of
        CHUNK_BYTES ("rows" counted in bytes); a weight in slabs of rows, scales whole but for FP4's group scales."""
        if self.cut is not None:
            expert = self.cut.expert
            return [(0, [self.source if expert is None else first_axis_slice(self.source, expert, 1)], self.outputs)]
        if self.kind in ("kept", "carried"):
            info, out = self.source, self.outputs[0]
            item = max(1, info.nbytes // max(info.numel, 1))
            step = max(item, CHUNK_BYTES // item * item)
            return [
                (start, [bytes_of(info, start, step, item)], [bytes_of(out, start, step, item)])
                for start in range(0, info.nbytes, step)
            ] or [(0, [info], [out])]
        weight = self.fp8
        if weight and weight.packed:  # an FP4 source: each row's group scales, and NVFP4's global scale
            sliced, whole = [weight.weight, weight.scale], [weight.global_scale] if weight.global_scale else []
        else:
            sliced, whole = [self.source], [weight.scale] if weight else []
        out_sliced = 2 if self.kind == "fp4" else 1
        # slabs start on 128-row blocks where an FP8 block scale is taken a slab's rows at a time
        whole_blocks = (weight is not None and not weight.packed) or (
            self.kind == "fp8" and self.fmt.scheme == Scheme.BLOCK
        )
        rows, cols = weight.shape if weight else self.source.shape
        return [
            (
                r0,
                [*(first_axis_slice(t, r0, n) for t in sliced), *whole],
                [*(first_axis_slice(t, r0, n) for t in self.outputs[:out_sliced]), *self.outputs[out_sliced:]],
            )
            for r0, n in slabs(rows, cols, whole_blocks)
        ]

    def record(self, r0: int, last: bool, found: Found, report: VerifyReport) -> None:
        if self.failed:
            return
        if found.problem:
            self.failed = True
            report.fail(*found.problem)
            return
        if r0 == 0:
            self.first = found
        self.wrong += found.wrong
        self.same_codes &= found.same_codes
        self.source_scale_ok &= found.source_scale_ok
        self.global_value = found.global_value
        if found.sums is not None:
            self.sums.add(found.sums)
        if not last or self.kind in ("kept", "carried"):
            return
        out = self.outputs[0]
        if self.kind == "dequantized":
            if self.wrong:
                report.fail(
                    self.name,
                    f"{plural(self.wrong, 'element')} {'differs' if self.wrong == 1 else 'differ'} "
                    f"from float32(q) * scale rounded once to {out.dtype}",
                )
            return
        scale = self.outputs[1]
        if problem := self.problem():
            report.fail(*problem)
            return
        if self.passed_through:  # exact, and not measured
            self.verdict = TensorCheck(self.name, list(out.shape), list(scale.shape), 0.0, math.inf, 0.0, 0, True)
        else:
            self.verdict = self.sums.check(self.name, out.shape, scale.shape)
        report.tensors.append(self.verdict)
        if not self.verdict.ok:
            report.fail(self.name, self.verdict.problem(self.fmt.scheme))

    @property
    def passed_through(self) -> bool:
        """An FP8 source's codes and scale, unchanged."""
        return self.may_pass and self.first.same_scale and self.same_codes

    def problem(self) -> tuple[str, str] | None:
        """(subject, what) once every slab of an FP8 output is in; None: its figures decide."""
        name, fmt, first, (codes, scale) = self.name, self.fmt, self.first, self.outputs[:2]
        not_finite = f"scale {scale.name} is not finite and positive everywhere"
        if self.passed_through:
            shapes = fmt.scale_shapes(codes.shape)
            if scale.shape not in shapes:
                return name, f"scale {scale.name} shaped {list(scale.shape)}, expected {shapes_text(shapes)}"
            if not first.scale_ok:
                return name, not_finite
            if fmt.scale_format == ScaleFormat.UE8M0 and not first.scale_pow2:
                return name, (
                    f"scale {scale.name} passed through from the source is not a power of two "
                    "everywhere, but the config says scale_fmt ue8m0"
                )
            if fmt.ignores(module_of(name)):
                return name, f"passed through in FP8, but the ignore list names {module_of(name)}"
            return None
        if self.fp8 and scale.dtype != fmt.scale_dtype():
            return name, not_requantized(scale.name, scale.dtype, fmt)
        if not self.source_scale_ok:
            return self.fp8.scale.name, SOURCE_SCALE_NOT_FINITE
        if self.requantized_problems:
            return name, "; ".join(self.requantized_problems)
        return None if first.scale_ok else (name, not_finite)


def bytes_of(info: TensorInfo, start: int, n: int, item: int) -> TensorInfo:
    n = min(n, info.nbytes - start)
    return replace(info, offset=info.offset + start, nbytes=n, shape=(n // item,))


def slabs(rows: int, cols: int, whole_blocks: bool) -> list[tuple[int, int]]:
    """(first row, row count) of each slab; one empty slab for a tensor without rows."""
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    if whole_blocks:
        step = max(BLOCK, step // BLOCK * BLOCK)
    return [(r0, min(step, rows - r0)) for r0 in range(0, rows, step)] or [(0, 0)]


def shapes_text(shapes: list[tuple[int, ...]]) -> str:
    return " or ".join(str(list(s)) for s in shapes)


def not_requantized(scale_name: str, dtype: str, fmt: QuantizationConfig) -> str:
    return (
        f"scale {scale_name} is {dtype}, but its codes and scale are not the source's (a requantized scale "
        f"is {fmt.scale_dtype()})"
    )
