"""The early quantizer's math (run/early.py), in numpy: run/numerics.py's bytes for BF16 weights, whole,
per tensor, per row or per 128x128 block, without torch. Imported by the early quantizer's processes
after they are forked, so the run's own start (and its first reads) does not wait for numpy's import.

The steps are numerics.py's, exactly: the amax from the weights' bits (the largest magnitude; an exponent
of all ones is NaN or Inf), one float32 division for the scale and one per element, clamping to +-448,
and round-to-nearest-even into e4m3 (here by integer arithmetic on the float32 bits). Per tensor, those
steps run once over all 65,536 BF16 bit patterns (codes_table), and each element is looked up.
tests/test_early.py compares the two.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import POW2_OVERFLOW, FP8ConvertError
from ..options import BLOCK
from ..plan.plan import Plan, TensorPlan
from ..plan.runs import Run, output_runs
from ..safetensors_io import pread_into

FP8_MAX = np.float32(448.0)
UE8M0_MIN_AMAX = np.float32(1e-4)   # numerics.UE8M0_MIN_AMAX
TILE_ELEMENTS = 1 << 18             # rows per step: a 1 MB float32 tile, which stays in a core's cache
INF_BITS = 0x7F80                   # a BF16 magnitude at or above this is Inf or NaN
POW2_OVERFLOW_BITS = 0x7F78         # 248 * 2^120 in BF16 bits: numerics.POW2_OVERFLOW_AMAX
SMALLEST_NORMAL_BITS = 0x3C800000   # 2^-6 as float32 bits: e4m3's smallest normal


def magnitudes_max(bits: np.ndarray, scheme: str) -> np.ndarray:
    """The largest BF16 magnitude's bits of `bits` (uint16 [rows, in], whole rows; for blocks, whole
    128-row blocks but at the end): [1, 1] per tensor, [rows, 1] per row, [row blocks, column blocks]."""
    magnitude = np.bitwise_and(bits, np.uint16(0x7FFF))
    if scheme == "tensor":
        return magnitude.max(keepdims=True).reshape(1, 1)
    if scheme == "channel":
        return magnitude.max(axis=1, keepdims=True)
    rows, cols = magnitude.shape
    row_blocks, col_blocks = -(-rows // BLOCK), -(-cols // BLOCK)
    if rows % BLOCK or cols % BLOCK:  # partial edge blocks: zeros never raise a max
        magnitude = np.pad(magnitude, ((0, row_blocks * BLOCK - rows), (0, col_blocks * BLOCK - cols)))
    return magnitude.reshape(row_blocks, BLOCK, col_blocks, BLOCK).max(axis=(1, 3))


def as_float32(bf16_bits: np.ndarray) -> np.ndarray:
    """BF16 values (their uint16 bits) as float32, exactly: the top half of a float32."""
    return (bf16_bits.astype(np.uint32) << 16).view(np.float32)


def scale_from_amax(amax: np.ndarray, scale_format: str = "float") -> np.ndarray:
    """numerics.scale_from_amax (amax / 448, 1.0 where that is 0) or, with "ue8m0", ue8m0_block_scale
    (the smallest 2^e with max(amax, 1e-4) <= 448 * 2^e), float32."""
    if scale_format == "ue8m0":
        bits = np.maximum(amax, UE8M0_MIN_AMAX).view(np.int32)
        biased, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        exponent = np.clip(biased - 135 + (mantissa > 0x600000), -127, 127)  # numerics.pow2_exponent
        byte = exponent + 127                                                # 1..254: never 0 or 255 here
        return (byte.astype(np.int32) << 23).view(np.float32)
    scale = amax / FP8_MAX
    return np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)


class Tile:
    """Scratch arrays for one thread's steps of up to `size` elements, reused from chunk to chunk (fresh
    temporaries for every numpy operation halved the speed)."""

    def __init__(self, size: int):
        self.values = np.empty(size, dtype=np.float32)
        self.sign = np.empty(size, dtype=np.uint32)
        self.lowest = np.empty(size, dtype=np.uint32)
        self.small = np.empty(size, dtype=np.float32)
        self.subnormal = np.empty(size, dtype=bool)

    def take(self, shape: tuple[int, ...]) -> "Tile":
        """Views of the first prod(shape) elements, shaped."""
        n = int(np.prod(shape))
        view = Tile.__new__(Tile)
        for name in ("values", "sign", "lowest", "small", "subnormal"):
            setattr(view, name, getattr(self, name)[:n].reshape(shape))
        return view


def e4m3_codes(values: np.ndarray, out: np.ndarray, tile: Tile | None = None) -> None:
    """Write into `out` (uint8) the e4m3fn codes of float32 `values` in [-448, 448] (no NaN), rounded to
    nearest even as torch's cast rounds them. Overwrites `values`. Below e4m3's smallest normal (2^-6)
    a code is round(|v| * 2^9) (exact scaling, then numpy's round-half-even); 8 is 2^-6's own code. From
    there on, the float32 significand is rounded to 3 bits at bit 20 (adding 0x7FFFF and the kept lowest
    bit carries into the exponent as it should) and the exponent rebiased from 127 to 7. `tile`: scratch
    of at least values' size."""
    tile = (tile or Tile(values.size)).take(values.shape)
    bits = values.view(np.uint32)
    np.right_shift(bits, 24, out=tile.sign)
    np.bitwise_and(tile.sign, 0x80, out=tile.sign)
    np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=bits)  # values now holds |v|
    np.less(bits, SMALLEST_NORMAL_BITS, out=tile.subnormal)
    np.multiply(values, np.float32(512.0), out=tile.small)
    np.rint(tile.small, out=tile.small)
    np.right_shift(bits, 20, out=tile.lowest)
    np.bitwise_and(tile.lowest, 1, out=tile.lowest)
    bits += np.uint32(0x7FFFF)
    bits += tile.lowest
    bits -= np.uint32(120 << 23)  # wraps below 2^-6, where the small codes are taken instead
    bits >>= 20
    np.copyto(bits, tile.small, where=tile.subnormal, casting="unsafe")
    bits |= tile.sign
    np.copyto(out, bits, casting="unsafe")


def quantize_rows(bits: np.ndarray, scale: np.ndarray, scheme: str, out: np.ndarray, tile: Tile | None = None) -> None:
    """Codes of BF16 rows `bits` (uint16 [rows, in]) divided by `scale` (this chunk's part: [1, 1], [rows, 1]
    or [row blocks, column blocks]) into `out` (uint8 [rows, in]). `tile`: scratch of at least bits' size."""
    tile = tile or Tile(bits.size)
    values = tile.values[:bits.size].reshape(bits.shape)
    np.left_shift(bits, 16, out=values.view(np.uint32), dtype=np.uint32, casting="unsafe")
    rows, cols = bits.shape
    if scheme == "block" and rows % BLOCK == 0 and cols % BLOCK == 0:  # each block divided by its own scale
        blocks = values.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
        np.divide(blocks, scale[:, None, :, None], out=blocks)
    elif scheme == "block":  # partial edge blocks: the scales spread over the elements
        divisor = np.repeat(np.repeat(scale, BLOCK, axis=0)[:rows], BLOCK, axis=1)[:, :cols]
        np.divide(values, divisor, out=values)
    else:
        np.divide(values, scale, out=values)
    np.clip(values, -FP8_MAX, FP8_MAX, out=values)
    e4m3_codes(values, out, tile)


def codes_table(scale: np.ndarray) -> np.ndarray:
    """The e4m3 code of every BF16 bit pattern divided by one float32 `scale` ([1, 1]), by quantize_rows'
    own steps: with one scale for a whole tensor, a lookup per element replaces a dozen passes over it
    (1.10 against 0.48 GB/s of BF16 input on one core of the 2-core machine). The patterns of NaN and Inf
    get some code: a weight holding one is refused before."""
    table = np.empty((1, 1 << 16), dtype=np.uint8)
    with np.errstate(over="ignore", invalid="ignore"):  # the patterns beyond this tensor's amax overflow
        quantize_rows(np.arange(1 << 16, dtype=np.uint16).reshape(1, -1), scale, "tensor", table)
    return table[0]


def chunk_rows(scheme: str, cols: int) -> int:
    """Rows per step: a tile of about TILE_ELEMENTS, whole 128-row blocks in the block scheme."""
    rows = max(1, TILE_ELEMENTS // max(1, cols))
    return max(1, rows // BLOCK) * BLOCK if scheme == "block" else rows


class GroupQuantizer:
    """Quantizes scale groups of `plan` from the source's files into `writer` (run, bytes), a chunk of rows
    at a time (so memory stays a few MB whatever the tensor)."""

    def __init__(self, plan: Plan, writer):
        self.plan, self.writer = plan, writer
        self.scheme, self.scale_format = plan.options.scheme, plan.options.scale_format
        self.root = Path(plan.source.root)

    def quantize_group(self, group: list[TensorPlan], files) -> None:
        """`files.fd(name)`: an open descriptor of the source file `name`."""
        if self.scheme != "tensor":
            for t in group:
                self._quantize_by_rows(t, files)
            return
        # one scale for the group: every member read once for it first, then coded by one table
        amax = max(self._tensor_amax(t, files) for t in group)
        scale = scale_from_amax(as_float32(np.array([[amax]], dtype=np.uint16)), self.scale_format)
        table = codes_table(scale)
        for t in group:
            codes_run, scale_run = self._runs(t)
            self.writer.write(scale_run, scale.tobytes())
            codes = np.empty(min(chunk_rows(self.scheme, t.shape[1]), t.shape[0]) * t.shape[1], dtype=np.uint8)
            for first, bits in self._chunks(t, files):
                out = codes[:bits.size].reshape(bits.shape)
                np.take(table, bits, out=out)
                self.writer.write(Run(codes_run.shard, codes_run.start + first * t.shape[1], bits.size, ()), out)

    def _chunks(self, t: TensorPlan, files):
        """(first row, uint16 [rows, in]) of `t`'s source, a chunk at a time (the buffer is reused)."""
        out, cols = t.shape
        step = chunk_rows(self.scheme, cols)
        buf = np.empty(min(step, out) * cols, dtype=np.uint16)
        for first in range(0, out, step):
            rows = min(step, out - first)
            view = buf[:rows * cols]
            pread_into(files.fd(t.source.file), memoryview(view).cast("B"), t.source.offset + first * cols * 2,
                       str(self.root / t.source.file))
            yield first, view.reshape(rows, cols)

    def _tensor_amax(self, t: TensorPlan, files) -> int:
        largest = 0
        for _, bits in self._chunks(t, files):
            largest = max(largest, int(magnitudes_max(bits, "tensor")[0, 0]))
        self._refuse_non_finite(t, largest)
        return largest

    def _refuse_non_finite(self, t: TensorPlan, largest_bits) -> None:
        """NaN or Inf; or, under power-of-two scales, values whose codes would read back as Inf."""
        largest = np.asarray(largest_bits)
        if np.any(largest >= INF_BITS):
            raise FP8ConvertError(f"{self.root / t.source.file}: tensor {t.source.name} contains NaN or Inf; "
                                  "refusing to quantize it")
        if self.scale_format == "ue8m0" and np.any(largest >= POW2_OVERFLOW_BITS):
            raise FP8ConvertError(f"{self.root / t.source.file}: tensor {t.source.name} {POW2_OVERFLOW}")

    def _runs(self, t: TensorPlan) -> tuple[Run, Run]:
        """`t`'s codes and scale runs in its shard."""
        runs = {run.pieces[0].name: run for run in output_runs(self.plan, [t], merge=False)}
        return runs[t.name], runs[t.scale_name]

    def _quantize_by_rows(self, t: TensorPlan, files) -> None:
        """Per row or per block: each chunk's scales from its own rows."""
        codes_run, scale_run = self._runs(t)
        cols = t.shape[1]
        codes = np.empty(min(chunk_rows(self.scheme, cols), t.shape[0]) * cols, dtype=np.uint8)
        tile = Tile(codes.size)
        for first, bits in self._chunks(t, files):
            largest = magnitudes_max(bits, self.scheme)
            self._refuse_non_finite(t, largest)
            scale = scale_from_amax(as_float32(largest), self.scale_format)
            scale_bytes = scale.tobytes()
            at = first * 4 if self.scheme == "channel" else first // BLOCK * scale.shape[1] * 4
            self.writer.write(Run(scale_run.shard, scale_run.start + at, len(scale_bytes), ()), scale_bytes)
            out = codes[:bits.size].reshape(bits.shape)
            quantize_rows(bits, scale, self.scheme, out, tile)
            self.writer.write(Run(codes_run.shard, codes_run.start + first * cols, bits.size, ()), out)
