"""FP8 e4m3 quantization math: pure tensor functions, the same bytes on CPU and CUDA because every step
is exact (abs, max, integer bit arithmetic) or one IEEE float32 operation (divide, nearest-even cast).
Weights are [..., out, in]: one 2-D weight, or a stack of same-shaped ones, each with its own scales.

Scales
- tensor, channel, block: amax / 448 in float32.
- block with scale format "ue8m0": the smallest 2^e with max(amax, 1e-4) <= 448 * 2^e, the rule DeepGEMM
  re-derives at load (vLLM `per_block_cast_to_fp8`), so it finds nothing to change.
- mxfp8: per row, one 2^e per 32 input elements, stored as the E8M0 byte e + 127, e the smallest integer
  with amax <= 448 * 2^e (vLLM's MXFP8 quantizer, DeepGEMM, FlashInfer); amax = 0 gives byte 0. e comes
  from amax's float32 bits: log2 can round across the boundary just above 448 * 2^k.
"""

from __future__ import annotations

import functools

import torch

from ..options import BLOCK, MX_GROUP, ScaleFormat, Scheme

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
UE8M0_MIN_AMAX = 1e-4  # DeepGEMM's per_block_cast_to_fp8 clamps block amax here (as float32)
# With power-of-two scales, amax from 248 * 2^120 (within 3% of float32's maximum) gets code 256 under
# scale 2^120, and 256 * 2^120 = 2^128 reads back as Inf.
POW2_OVERFLOW_AMAX = 248.0 * 2.0**120


class NonFiniteWeight(ValueError):
    """A weight holds NaN or Inf, or (`overflows`) values whose power-of-two scale reads back as Inf.
    `member` indexes the list given to quantize_group, `index` the stack."""

    def __init__(self, member: int, index: int, overflows: bool = False):
        super().__init__(member, index)
        self.member, self.index, self.overflows = member, index, overflows


def finite_positive(values: torch.Tensor) -> bool:
    return bool((torch.isfinite(values) & (values > 0)).all())


def all_finite(values: torch.Tensor) -> bool:
    """No NaN or Inf: aminmax propagates NaN and shows an Inf, with no full-size temporary."""
    return not values.numel() or bool(torch.isfinite(torch.stack(torch.aminmax(values))).all())


def group_amax(w: torch.Tensor, size: int) -> torch.Tensor:
    """max |w| in float32 per `size` consecutive inputs of a row: [..., out, in / size]."""
    groups = w.unflatten(-1, (w.shape[-1] // size, size))
    return torch.maximum(groups.amax(dim=-1), groups.amin(dim=-1).neg()).float()


def amax(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """Largest |w| in float32 per tensor, row, 32-group or 128x128 block: no full-size |w|, NaN propagates."""
    if scheme == Scheme.MXFP8:
        return group_amax(w, MX_GROUP)
    if scheme == Scheme.TENSOR:
        dims = (-2, -1)
    elif scheme == Scheme.CHANNEL:
        dims = (-1,)
    else:
        out, inp = w.shape[-2:]
        rows, cols = -(-out // BLOCK), -(-inp // BLOCK)
        if out % BLOCK or inp % BLOCK:  # edge blocks are partial: pad with zeros, which never raise a max
            w = torch.nn.functional.pad(w, (0, cols * BLOCK - inp, 0, rows * BLOCK - out))
        w = w.reshape(*w.shape[:-2], rows, BLOCK, cols, BLOCK)
        dims = (-3, -1)
    keep = scheme in (Scheme.TENSOR, Scheme.CHANNEL)
    return torch.maximum(w.amax(dim=dims, keepdim=keep), w.amin(dim=dims, keepdim=keep).neg()).float()


def mx_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """The E8M0 byte e + 127, e the smallest integer with amax <= 448 * 2^e clamped to [-127, 127], from
    amax's bits: E - 135, plus one when the significand exceeds 1.75 (448 = 1.75 * 2^8)."""
    bits = amax.float().contiguous().view(torch.int32)
    biased, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    return ((biased - 135 + (mantissa > 0x600000).int()).clamp(-127, 127) + 127).to(torch.uint8)


def e8m0_to_float(scale_bytes: torch.Tensor) -> torch.Tensor:
    """2^(byte - 127) as float32, exactly, from its bits (byte 0: the subnormal 2^-127; 255: NaN)."""
    b = scale_bytes.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x400000), b << 23)
    return torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits).view(torch.float32)


def powers_of_two(values: torch.Tensor) -> torch.Tensor:
    """Elementwise: the value is a positive 2^e (frexp's significand exactly 1/2)."""
    mantissa, _ = torch.frexp(values.float())
    return mantissa == 0.5


def expand_scale(scale: torch.Tensor, shape: tuple[int, ...], scheme: str) -> torch.Tensor:
    """A per-element scale that broadcasts against a weight of `shape` ([..., out, in])."""
    if scheme == Scheme.MXFP8:
        return scale.repeat_interleave(MX_GROUP, dim=-1)
    if scheme != Scheme.BLOCK:
        return scale
    out, inp = shape[-2:]
    return scale.repeat_interleave(BLOCK, dim=-2)[..., :out, :].repeat_interleave(BLOCK, dim=-1)[..., :inp]


def quantize_with_scale(w: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """clamp(float32(w) / scale, -448, 448) cast to e4m3 (nearest even); `w` is left as it was."""
    # Divided in float32, torch's result type of w and scale, in both paths; the plain one straight from w's dtype.
    if (quotient := torch.result_type(w, scale)) != torch.float32:
        raise AssertionError(f"quotient in {quotient}, not float32: scale {scale.dtype} {tuple(scale.shape)}")
    if w.device.type == "cpu" and w.dim() == 3:
        return _quantize_rows(w, scale, scheme)
    if scheme == Scheme.MXFP8:  # each group of 32 divided by its scale, without a full-size scale tensor
        q = torch.div(w.unflatten(-1, (w.shape[-1] // MX_GROUP, MX_GROUP)), scale.unsqueeze(-1)).flatten(-2)
    else:
        q = torch.div(w, expand_scale(scale, tuple(w.shape), scheme))
    return q.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


CPU_TILE_BYTES = 2 << 20  # float32 working tile per two of torch's threads: each core's share stays in its L2


def _quantize_rows(w: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """Through one float32 tile in cache: a full-size quotient costs more in page faults than the division."""
    stack, out, inp = w.shape
    rows = max(1, CPU_TILE_BYTES * max(1, torch.get_num_threads() // 2) // (4 * inp))
    if scheme == Scheme.BLOCK:  # a power of 2 <= 128, so no tile spans two rows of blocks
        rows = 1 << min(7, rows.bit_length() - 1)
    tile = torch.empty(min(rows, out), inp, dtype=torch.float32)
    q = torch.empty(w.shape, dtype=FP8_DTYPE)
    for n in range(stack):
        for r in range(0, out, rows):
            part = tile[: min(rows, out - r)]
            part.copy_(w[n, r : r + rows])
            if scheme == Scheme.MXFP8:
                part.unflatten(-1, (inp // MX_GROUP, MX_GROUP)).div_(scale[n, r : r + rows].unsqueeze(-1))
            elif scheme == Scheme.TENSOR:
                part.div_(scale[n])
            elif scheme == Scheme.CHANNEL:
                part.div_(scale[n, r : r + rows])
            else:
                part.div_(scale[n, r // BLOCK].repeat_interleave(BLOCK)[:inp])
            part.clamp_(-FP8_MAX, FP8_MAX)
            q[n, r : r + rows].copy_(part)
    return q


def dequantize(q: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """float32(q) * scale; MXFP8 scales given as E8M0 bytes are decoded first."""
    if scale.dtype == torch.uint8:
        scale = e8m0_to_float(scale)
    return q.float() * expand_scale(scale.float(), tuple(q.shape), scheme)


def scale_as_stored(scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """An FP8 source's scale as float32 that broadcasts against its weight: [1, 1] per tensor, else as stored."""
    s = scale.to(torch.float32)
    return s.reshape(1, 1) if scheme == Scheme.TENSOR else s


def dequantize_to(
    q: torch.Tensor, scale: torch.Tensor, scheme: str, dtype: torch.dtype, cpu_path: bool | None = None
) -> torch.Tensor:
    """(float32(q) * scale).to(dtype) with scale_as_stored's scales: one float32 product rounded once, as
    DeepSeek's and transformers' dequantizers compute it. On a CPU by table lookup: the same bytes, faster."""
    if cpu_path or (cpu_path is None and q.device.type == "cpu"):
        return _dequantize_by_table(q, scale, scheme, dtype)
    return dequantize(q, scale, scheme).to(dtype)


def _dequantize_by_table(q: torch.Tensor, scale: torch.Tensor, scheme: str, dtype: torch.dtype) -> torch.Tensor:
    """Per scale, a table of the 256 float32(code) * scale in `dtype`: torch's float8 cast is slow on a CPU."""
    out, inp = q.shape[-2:]
    codes = q.view(torch.uint8).reshape(-1, out, inp)
    count = codes.shape[0]
    code_values = torch.arange(256, dtype=torch.uint8, device=q.device).view(FP8_DTYPE).to(torch.float32)
    tables = (scale.reshape(count, *scale.shape[-2:]).unsqueeze(-1) * code_values).to(dtype)
    tables = tables.reshape(count, -1)  # weight n's tables in row n, 256 entries each
    arange = functools.partial(torch.arange, dtype=torch.int32, device=q.device)
    offsets = None
    if scheme == Scheme.CHANNEL:  # row r's table starts at r * 256
        offsets = (arange(out) * 256).unsqueeze(1).expand(out, inp).contiguous()
    elif scheme == Scheme.BLOCK:  # block (i, j)'s at (i * C + j) * 256
        offsets = (arange(out) // BLOCK * (-(-inp // BLOCK) * 256)).unsqueeze(1) + arange(inp) // BLOCK * 256
    index = torch.empty(out, inp, dtype=torch.int32, device=q.device)
    result = torch.empty(codes.shape, dtype=dtype, device=q.device)
    for n in range(count):  # (in-place int32 ops over a stack broadcast slowly on a CPU; per weight they do not)
        index.copy_(codes[n])
        if offsets is not None:
            index += offsets
        torch.index_select(tables[n], 0, index.view(-1), out=result[n].view(-1))
    return result.view(q.shape)


def scales_from_amax(amax: torch.Tensor, scheme: str, scale_format: str = "float") -> tuple[torch.Tensor, torch.Tensor]:
    """(scale as written, scale divided by): E8M0 bytes and their value for mxfp8, else one tensor twice."""
    if scheme == Scheme.MXFP8:
        stored = mx_scale_bytes(amax)
        return stored, e8m0_to_float(stored)
    if scale_format == ScaleFormat.UE8M0:  # the smallest 2^e with max(amax, 1e-4) <= 448 * 2^e
        floor = torch.full_like(amax, UE8M0_MIN_AMAX, dtype=torch.float32)
        scale = e8m0_to_float(mx_scale_bytes(torch.maximum(amax.float(), floor)))
        return scale, scale
    # amax / 448, divided by a tensor, not a Python number: CUDA turns division by a scalar into
    # multiplication by its reciprocal, which rounds differently from the CPU's true division. 1.0 where
    # amax is 0 (finite and positive, and every code is 0 anyway).
    scale = amax.float() / torch.full_like(amax, FP8_MAX, dtype=torch.float32)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, scale


def refuse_unwritable(amaxes: list[torch.Tensor], pow2: bool = False) -> None:
    """NonFiniteWeight for the first weight holding NaN or Inf, or with `pow2` an amax >= POW2_OVERFLOW_AMAX."""
    for j, a in enumerate(amaxes):
        unwritable = ~torch.isfinite(a)
        if pow2:  # in the same test: one wait for the device per member, as without it
            unwritable |= a >= POW2_OVERFLOW_AMAX
        per_weight = unwritable.flatten(start_dim=1).any(dim=1)
        if bool(per_weight.any()):
            index = int(per_weight.nonzero()[0, 0])
            raise NonFiniteWeight(j, index, overflows=bool(torch.isfinite(a[index]).all()))


def quantize_group(
    members: list[torch.Tensor], scheme: str, scale_format: str = "float"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(codes, scales as written) per member of a fused group (stacks [N, out, in]). In the tensor scheme
    members share the max amax: vLLM re-quantizes a fused layer to its largest scale."""
    amaxes = [amax(w, scheme) for w in members]
    refuse_unwritable(amaxes, pow2=scheme == Scheme.MXFP8 or scale_format == ScaleFormat.UE8M0)
    if scheme == Scheme.TENSOR and len(members) > 1:
        shared = torch.stack(amaxes).amax(dim=0)
        amaxes = [shared] * len(members)
    pairs = [scales_from_amax(a, scheme, scale_format) for a in amaxes]
    codes = [quantize_with_scale(w, divisor, scheme) for w, (_, divisor) in zip(members, pairs)]
    return codes, [stored for stored, _ in pairs]
