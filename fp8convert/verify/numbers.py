"""The numeric checks of a slab of a tensor. The bound: rounding x = w / scale to e4m3 moves x by at most
2^-4 |x| where x is normal (|x| >= 2^-6) and 2^-10 where it is subnormal, so each element's error is at
most max(2^-4 |w|, 2^-10 scale) and ||w - dequant|| at most the root of the sum of their squares. A norm
cannot see one corrupted code, so each code must also lie within half an e4m3 step of w / scale (in
float32, as the quantizer divides). Power-of-two scales (MXFP8, UE8M0 blocks) must be the smallest 2^e
that fits their amax, and every code RNE(w / 2^e) exactly; float scales at most OVERSIZE x amax / 448.

FP4 (`fp4_sums`): each code must be the E2M1 value nearest x = w / d (d a group's scale, clamped to
+-6), so each element is off by at most half the gap between E2M1 values around |x| (0.25, 0.5 or 1
times d) plus what the clamp cut off; the bound is the root of the sum of their squares.
"""

from __future__ import annotations

import ctypes
import math

import torch

from ..options import BLOCK, FP4_SCHEMES, GROUP_SIZE, ScaleFormat, Scheme
from ..plan.plan import Cut
from ..run import fp4
from ..run.numerics import (
    FP8_MAX,
    UE8M0_MIN_AMAX,
    all_finite,
    amax,
    dequantize,
    e8m0_to_float,
    expand_scale,
    finite_positive,
    powers_of_two,
    quantize_with_scale,
    scale_as_stored,
)
from .pairs import SOURCE_SCALE_NOT_FINITE, Found, Pair
from .report import FLOAT_SLACK, ErrorSums

TILE_ELEMENTS = 1 << 17  # on a CPU, a slab is measured a tile at a time, in the cores' caches


def check_piece(pair: Pair, sources: list, outputs: list, r0: int, source_scheme: str | None) -> Found:
    """Touches no shared state: runs on the worker threads."""
    if pair.kind in ("kept", "carried"):
        piece = sources[0] if pair.cut is None else cut_of(pair.cut, sources[0]).contiguous()
        if not identical(piece, outputs[0]):
            return Found((pair.name, pair.differs))
        if pair.kind == "kept" and outputs[0].dtype.is_floating_point and not all_finite(outputs[0]):
            return Found((pair.name, "contains NaN or Inf"))
        return Found()
    # the source's values: an FP8 or FP4 weight's float32(q) * scale (None for a bad scale), else as read
    w = source_values(sources, r0, source_scheme) if pair.fp8 else sources[0]
    if w is None and pair.kind in ("dequantized", "fp4"):  # an FP8 output reports it with its own checks
        return Found((pair.fp8.scale.name, SOURCE_SCALE_NOT_FINITE))
    if pair.kind == "dequantized":
        return Found(wrong=count_wrong(w, outputs[0]))
    if pair.cut is not None:
        w = cut_of(pair.cut, w)
    fmt = pair.fmt
    if pair.kind == "fp4":
        if (sums := fp4_sums(w, outputs, fmt.scheme)) is None:
            return Found((pair.name, f"scale {pair.outputs[1].name} or its global scale is not finite and positive"))
        return Found(sums=sums, global_value=outputs[2].item() if len(outputs) == 3 else None)  # F32 [1]
    q, scale = outputs
    values = e8m0_to_float(scale) if scale.dtype == torch.uint8 else scale.float()  # MXFP8: E8M0 bytes
    found = Found(scale_ok=finite_positive(values))
    if pair.fp8 is not None:  # its codes and scale may pass through
        codes, source_scale = sources
        found.same_codes = pair.may_pass and identical(codes, q)
        if r0 == 0:
            found.same_scale = pair.may_pass and identical(source_scale, scale)
            found.scale_pow2 = not found.scale_ok or bool(powers_of_two(values).all())
        found.source_scale_ok = w is not None
    if found.scale_ok and fmt.scheme == Scheme.TENSOR:
        found.scale_value = values.reshape(-1)[0].item()
    if w is not None and found.scale_ok and not pair.requantized_problems:
        powers = fmt.scheme == Scheme.MXFP8 or fmt.scale_format == ScaleFormat.UE8M0  # MXFP8 exponents, UE8M0 blocks
        found.sums = measure_slab(w, q, values, r0, fmt.scheme, powers)
    return found


def cut_of(cut: Cut, piece):
    return cut.apply(piece) if cut.expert is None else cut.across_experts().apply(piece)[0]


def count_wrong(values, stored) -> int:
    """Elements of `stored` that are not `values` rounded once to their dtype."""
    size = stored.element_size()
    a = values.to(stored.dtype).contiguous().view(torch.uint8).reshape(-1)
    b = stored.contiguous().view(torch.uint8).reshape(-1)
    return 0 if same_bytes(a, b) else int((a.view(-1, size) != b.view(-1, size)).any(dim=1).sum())


def exact_sums(w, q, s) -> ErrorSums:
    w = w.float()
    dq = q.float() * s  # float32(q) * scale, as run.numerics.dequantize
    e2 = float((w.double() - dq.double()).square().sum())
    w2 = float(w.double().square().sum())
    # per element: max(2^-4 |w|, 2^-10 scale), the worst e4m3 rounding (module docstring)
    bound2 = float(torch.maximum(w.abs() * 2.0**-4, (s * 2.0**-10).expand_as(w)).double().square().sum())
    # the code must be within half an e4m3 step of x = w / scale, computed as the quantizer does
    x = (w / s).clamp(-FP8_MAX, FP8_MAX)
    _, exponent = torch.frexp(x)  # |x| = m * 2^exponent, m in [0.5, 1): binade floor(log2|x|) = exponent - 1
    binade = torch.where(x == 0, torch.full_like(exponent, -6), (exponent - 1).clamp(min=-6))
    half_step = torch.ldexp(torch.ones_like(x), binade - 4)
    off_grid = int((~((x - q.float()).abs() <= half_step)).sum())
    return ErrorSums(w2, e2, bound2, off_grid)


def scratch_for(n: int, device) -> list:
    """`fast_sums`' buffers, allocated once a slab and reused by every tile (fresh temporaries cost page faults)."""
    dtypes = (torch.float32, torch.float32, torch.float64, torch.uint8, torch.int16, torch.float8_e4m3fn)
    return [torch.empty(n, dtype=dtype, device=device) for dtype in dtypes]


def fast_sums(w, q, s, scratch: list | None = None) -> ErrorSums | None:
    """`exact_sums`' figures from the codes' bits, where every code is RNE(w / scale) byte for byte (else
    None, as for a weight not finite)."""
    n = w.numel()
    wf, x, wide, magnitude, bits, x8 = (b[:n].view(w.shape) for b in scratch or scratch_for(n, w.device))
    wf.copy_(w)
    torch.div(wf, s, out=x).clamp_(-FP8_MAX, FP8_MAX)  # float32, exactly as the quantizer divides
    x8.copy_(x)
    codes = q.view(torch.uint8)
    if not same_bytes(x8.view(torch.uint8), codes):
        return None
    # |float32(q)|: the 7 magnitude bits of an e4m3 code, moved into a float16's exponent and mantissa,
    # are the code's magnitude / 2^8 (subnormals included); exact, and no NaN code is left at this point
    torch.bitwise_and(codes, 0x7F, out=magnitude)
    bits.copy_(magnitude).bitwise_left_shift_(7)
    dq = x  # x is done with: its buffer takes |dequant|
    dq.copy_(bits.view(torch.float16)).mul_(s * 256.0)  # |float32(q) * scale|: one rounding, as dequantize
    # q has the sign of x = w / scale, so |w - dequant| = ||w| - |dequant||; float32 holds that
    # difference exactly here (it is at most half a step, far below both), and its square in float64
    wf.abs_()
    dq.sub_(wf)
    flat = wide.view(-1)
    wide.copy_(dq)
    e2 = float(torch.dot(flat, flat))
    wide.copy_(wf)
    w2 = float(torch.dot(flat, flat))
    if not (math.isfinite(w2) and math.isfinite(e2)):
        return None
    # bound: sum of max(|w|, t)^2 / 2^8, t = scale / 2^6; w2 / 2^8 unless some |w| < t, whose code is then
    # at most 2^-6 (magnitude bits <= 0x08): only then is it summed again with |w| raised to t
    bound2 = w2
    if int(magnitude.min()) <= 0x08:
        if s.numel() == 1:
            wide.clamp_(min=s.item() * 2.0**-6)
        else:
            torch.maximum(wide, (s * 2.0**-6).double(), out=wide)
        bound2 = float(torch.dot(flat, flat))
    return ErrorSums(w2, e2, bound2 * 2.0**-8, 0)


# The C library's memcmp: on a CPU several times faster than torch.equal's elementwise comparison.
memcmp = ctypes.CDLL(None).memcmp
memcmp.restype, memcmp.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def same_bytes(a, b) -> bool:
    if a.device.type != "cpu" or not (a.is_contiguous() and b.is_contiguous()):
        return torch.equal(a, b)
    return a.numel() == b.numel() and memcmp(a.data_ptr(), b.data_ptr(), a.numel()) == 0


def identical(a, b) -> bool:
    return same_bytes(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def tile_scale(scale, r0: int, r1: int, scheme: str):
    """The stored scales of rows [r0, r1) (r0 on a block row)."""
    if scheme == Scheme.TENSOR:
        return scale.reshape(1, 1)
    if scheme in (Scheme.CHANNEL, Scheme.MXFP8):
        return scale[r0:r1]
    return scale[r0 // BLOCK : -(-r1 // BLOCK)]


def slab_scale(scale, r0: int, r1: int, cols: int, scheme: str):
    return expand_scale(tile_scale(scale, r0, r1, scheme), (r1 - r0, cols), scheme)


def measure_slab(w, q, scale, r0: int, scheme: str, powers: bool) -> ErrorSums:
    """The figures of rows r0.. of a tensor (`scale`: all of it), a tile at a time in a CPU's caches, in one
    piece on a GPU. `powers`: the scales are powers of two, checked exactly as well."""
    rows, cols = w.shape
    step = rows if w.device.type != "cpu" else max(1, TILE_ELEMENTS // max(cols, 1))
    if scheme == Scheme.BLOCK:
        step = max(BLOCK, step // BLOCK * BLOCK)
    sums = ErrorSums()
    scratch = scratch_for(min(rows, step) * cols, w.device)
    for t0 in range(0, rows, step):
        t1 = min(rows, t0 + step)
        s = slab_scale(scale, r0 + t0, r0 + t1, cols, scheme)
        w_tile, q_tile = w[t0:t1], q[t0:t1]
        fast = fast_sums(w_tile, q_tile, s, scratch)
        tile = fast or exact_sums(w_tile, q_tile, s)
        stored = tile_scale(scale, r0 + t0, r0 + t1, scheme)
        if powers:  # where fast_sums answered, every code is RNE(w / scale) byte for byte: none inexact
            tile.off_rule, tile.inexact = power_of_two_checks(w_tile.float(), q_tile, stored, scheme, fast is None)
        elif scheme == Scheme.TENSOR:  # the scale may be a fused group's: stream.check_shared_scales
            tile.amax = float(amax(w_tile, scheme)) if w_tile.numel() else 0.0
        else:
            tile.oversized = int(oversized(stored, amax(w_tile, scheme)).sum())
        sums.add(tile)
    return sums


# A scale far too large (every code rounding to zero) passes the code checks, so a float scale is held to
# at most OVERSIZE x amax / 448 (or 1 where amax is 0): float scales rounded up to powers of two pass, one
# wasting more than a binade of the e4m3 range does not. A scale too small shows in the codes (they saturate).
OVERSIZE = 2.0


def oversized(scale, amax):
    """Elementwise; a scale of 1 over all-zero weights is the rule's one exception."""
    return (scale > amax / FP8_MAX * OVERSIZE * (1 + FLOAT_SLACK)) & ~((amax == 0) & (scale == 1))


def power_of_two_checks(w, q, s, scheme: str, codes: bool) -> tuple[int, int]:
    """(scales off the rule, codes off RNE) for a slab with power-of-two scales; `codes` False: the codes
    are known to be RNE(w / scale). The rule, independent of how the quantizer computes it: s = 2^e with
    A <= 448 s (no code overflows) and A > 224 s (2^(e-1) would), A the group's amax or the block's floored
    at 1e-4 (DeepGEMM's clamp); MXFP8's lowest exponent (2^-127) needs only the first."""
    a = amax(w, scheme)
    if scheme != Scheme.MXFP8:
        a = torch.maximum(a, torch.full_like(a, UE8M0_MIN_AMAX))
    fits = powers_of_two(s) & (a <= FP8_MAX * s)
    smallest = a > (FP8_MAX / 2) * s
    if scheme == Scheme.MXFP8:
        smallest |= s == 2.0**-127
    inexact = int((quantize_with_scale(w, s, scheme).float() != q.float()).sum()) if codes else 0  # -0 == +0
    return int((~(fits & smallest)).sum()), inexact


def fp4_values(tensors: list, scheme: str):
    """(E2M1 values [rows, groups, size], each group's divisor [rows, groups, 1]) of [packed codes, group
    scales, NVFP4's global scale]; None where a scale or the global scale is not finite and positive."""
    packed, scale, *global_scale = tensors
    g = global_scale[0].float().reshape(1, 1) if global_scale else None
    d = fp4.divisors(scheme, scale, g)
    if not finite_positive(d) or (g is not None and not finite_positive(g)):
        return None
    return fp4.decode(packed).unflatten(-1, (-1, GROUP_SIZE[scheme])), d.unsqueeze(-1)


def fp4_sums(w, outputs: list, scheme: str) -> ErrorSums | None:
    """The figures of an FP4 slab against its source values `w` [rows, in]; None for a bad scale."""
    if (values := fp4_values(outputs, scheme)) is None:
        return None
    q, d = values
    wf = w.float().unflatten(-1, (-1, q.shape[-1]))
    x = (wf / d).clamp(-fp4.FP4_MAX, fp4.FP4_MAX)
    nearest = torch.stack([(x.abs() - v).abs() for v in fp4.E2M1_VALUES]).amin(dim=0)
    half_gap = torch.where(x.abs() < 2, 0.25, torch.where(x.abs() < 4, 0.5, 1.0))
    bound = half_gap * d + (wf.abs() - fp4.FP4_MAX * d).clamp(min=0)
    e = wf - q * d
    return ErrorSums(
        w2=float(wf.double().square().sum()),
        e2=float(e.double().square().sum()),
        bound2=float(bound.double().square().sum()),
        off_grid=int(((q - x).abs() > nearest).sum()),
    )


def source_values(sources: list, r0: int, scheme: str):
    """The source weight's values (rows r0..): float32(q) * scale, or FP4 codes times their group's divisor;
    None where a scale is not finite and positive."""
    if scheme in FP4_SCHEMES:
        values = fp4_values(sources, scheme)
        return None if values is None else (values[0] * values[1]).flatten(-2)  # as fp4.dequantize
    codes, scale = sources
    s = scale_as_stored(scale, scheme)
    if not finite_positive(s):
        return None
    return dequantize(codes, tile_scale(s, r0, r0 + codes.shape[0], scheme), scheme)
