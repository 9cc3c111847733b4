"""FP4 (E2M1) weight quantization, as compressed-tensors writes and reads it: pure tensor functions, the
same bytes on CPU and CUDA (every step is exact or one IEEE float32 operation on tensors).

A weight [..., out, in] becomes `weight_packed` uint8 [..., out, in / 2]: element 2j of a row in the low
nibble, 2j + 1 in the high one, each nibble sign << 3 | index into E2M1_VALUES (sign set for values below 0).

- nvfp4a16: global scale G = 448 * 6 / amax over the weight, or over its whole fused set (vLLM runs a
  fused set as one GEMM with one global scale); float32 [1]. Per 16 inputs of a row an FP8 e4m3 scale
  s = e4m3(G * amax_16 / 6), 0.125 where that rounds to 0. Values q = E2M1(w / (s / G)); W = q * s / G.
  G is 1.0 where 448 * 6 / amax is not finite (an all-zero weight).
- mxfp4a16: per 32 inputs of a row the E8M0 byte of 2^(floor(log2 amax_32) - 2), the power of two rounded
  up first when amax's significand is 1.75 or more (compressed-tensors' rule: its rounding clips the
  largest values of a group less often than it loses the small ones); byte 0 for an all-zero group.
  Values q = E2M1(w / 2^(byte - 127)); W = q * 2^(byte - 127).

Both round w / scale, clamped to 6, half to even onto E2M1, all in float32. compressed-tensors' own
model-free path takes the amaxes in the weight's dtype; fp8convert takes them, and divides, in float32.
"""

from __future__ import annotations

import torch

from ..options import GROUP_SIZE, Scheme
from .numerics import FP8_DTYPE, FP8_MAX, e8m0_to_float, group_amax, refuse_unwritable

FP4_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
ZERO_SCALE = 0.125  # compressed-tensors' stand-in for an FP8 group scale that rounds to 0


def _below(value: float) -> float:
    return torch.nextafter(torch.tensor(value), torch.tensor(0.0)).item()


# |v| > edge counts up one index; ties at 0.25, 1.25, 2.5 and 5 round down, at 0.75, 1.75 and 3.5 up (to
# the even E2M1 value): those edges move to the float32 just below them.
INDEX_EDGES = (0.25, _below(0.75), 1.25, _below(1.75), 2.5, _below(3.5), 5.0)


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    floor = torch.finfo(torch.float32).tiny
    scale = torch.full_like(amax, FP8_MAX * FP4_MAX) / amax.float().clamp(min=floor)
    return torch.where(torch.isfinite(scale), scale, torch.ones_like(scale))


def nvfp4_group_scales(amax: torch.Tensor, global_scales: torch.Tensor) -> torch.Tensor:
    scales = (global_scales * (amax / torch.full_like(amax, FP4_MAX))).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return torch.where(scales.float() == 0, torch.full_like(scales, ZERO_SCALE), scales)


def mxfp4_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """The E8M0 bytes from amax's float32 bits; 0 also for amaxes too small for any byte."""
    bits = amax.float().contiguous().view(torch.int32)
    biased, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    return (biased - 2 + (mantissa >= 0x600000).int()).clamp(0, 255).to(torch.uint8)


def encode(v: torch.Tensor) -> torch.Tensor:
    """float32 values already divided by their scale -> packed nibbles, uint8 [..., in / 2]."""
    edges = torch.tensor(INDEX_EDGES, dtype=torch.float32, device=v.device)
    index = torch.bucketize(v.abs().contiguous(), edges, out_int32=True)  # how many edges lie below |v|
    # in uint8, not int32: a quarter of the bytes through memory
    nibbles = index.to(torch.uint8) | ((v < 0).to(torch.uint8) << 3)  # -0.0 stays +0, as compressed-tensors packs it
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def decode(packed: torch.Tensor) -> torch.Tensor:
    """Packed nibbles uint8 [..., in / 2] -> the E2M1 values as float32 [..., in]."""
    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)[nibbles & 7]
    return torch.where(nibbles >= 8, -values, values)


def divisors(scheme: str, scales: torch.Tensor, global_scales: torch.Tensor | None) -> torch.Tensor:
    """What each group's values are divided by, float32: s / G (nvfp4a16) or 2^(byte - 127) (mxfp4a16)."""
    if scheme == Scheme.MXFP4A16:
        return e8m0_to_float(scales)
    return scales.float() / global_scales


def quantize(w: torch.Tensor, divisor: torch.Tensor, size: int) -> torch.Tensor:
    """w [..., out, in] divided per group by `divisor` [..., out, in / size] in float32, packed."""
    v = torch.div(w.unflatten(-1, (w.shape[-1] // size, size)), divisor.unsqueeze(-1)).flatten(-2)
    return encode(v.float())


def dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scales: torch.Tensor | None, scheme: str):
    """float32 weights [..., out, in] from packed values and their scales (global_scales: [..., 1])."""
    size = GROUP_SIZE[scheme]
    gs = None if global_scales is None else global_scales.float().unsqueeze(-1)
    d = divisors(scheme, scales, gs)
    return (decode(packed).unflatten(-1, (-1, size)) * d.unsqueeze(-1)).flatten(-2)


def quantize_fp4_group(members: list[torch.Tensor], scheme: str) -> list[list[torch.Tensor]]:
    """Per member of a fused set (stacks [N, out, in], index n of each one set): [packed, scales] and, for
    nvfp4a16, the set's global scales [N, 1]. Raises NonFiniteWeight for NaN or Inf."""
    size = GROUP_SIZE[scheme]
    amaxes = [group_amax(w, size) for w in members]
    refuse_unwritable(amaxes)
    if scheme == Scheme.MXFP4A16:
        scales = [mxfp4_scale_bytes(a) for a in amaxes]
        return [[quantize(w, e8m0_to_float(s), size), s] for w, s in zip(members, scales)]
    whole = torch.stack([a.flatten(start_dim=1).amax(dim=1) for a in amaxes]).amax(dim=0)  # [N]
    g = global_scale(whole).reshape(-1, 1, 1)
    results = []
    for w, a in zip(members, amaxes):
        s = nvfp4_group_scales(a, g)
        results.append([quantize(w, divisors(scheme, s, g), size), s, g.reshape(-1, 1).clone()])
    return results
