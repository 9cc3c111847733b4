"""Inputs that put MXFP8 at its edges: weights on the exponent rule's edges, and zoo experts wide
enough (a multiple of 32) to be quantized rather than kept."""

from __future__ import annotations

import torch

from fp8convert.run import numerics


def edge_groups(dtype: torch.dtype) -> torch.Tensor:
    """[2, 6, 64] weights whose 32-element groups (and 128x128 blocks, for ue8m0) sit on the rule's
    edges: amax exactly 1.75 * 2^k = 448 * 2^(k-8) (max code 448, not 224), just above and below it,
    zero groups, subnormal and huge amax, negative maxima, a lone outlier."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 6, 64, generator=g) * 0.01
    finfo = torch.finfo(dtype)
    w[0, 0, :32] *= 0.5
    w[0, 0, 5] = 1.75 * 2.0**-4  # exactly 448 * 2^-12
    w[0, 0, 32 + 7] = -1.75 * 2.0**3  # negative, exactly 448 * 2^-5
    w[0, 1, :32] = 0.0  # all zero: byte 0
    w[0, 1, 40] = 1.7421875 * 2.0**-4  # just below 1.75 * 2^-4 (bf16's previous value)
    w[0, 2, 3] = 1.7578125 * 2.0**-4  # just above (next bf16 value)
    w[0, 3, :32] = 0.0
    w[0, 3, 9] = finfo.tiny / 4 if dtype != torch.float16 else 2.0**-24  # subnormal amax
    # huge amax: f16's largest; in bf16 and f32 the largest below 248 * 2^120, whose code 256 under scale
    # 2^120 would read back as Inf (numerics.POW2_OVERFLOW_AMAX): 3.28e38 in bf16, code 240
    w[0, 4, 33] = (
        finfo.max
        if dtype == torch.float16
        else torch.nextafter(torch.tensor(numerics.POW2_OVERFLOW_AMAX, dtype=dtype), torch.tensor(0.0, dtype=dtype))
    )
    w[0, 5, 0] = 448.0  # code 448 exactly at scale 1
    w[1, 0, 60] = 1000.0  # an outlier among small values
    w[1, 2, :] = -w[1, 2, :].abs()  # every value negative
    if dtype == torch.float32:
        w[1, 4, 4] = 448.0 * 2.0**-10 * (1 + 2.0**-23)  # float32 log2 rounds this one's ceil down
    return w.to(dtype)


def wide_experts(arch: str) -> dict:
    """Config overrides that make the zoo model's experts 96 wide (a multiple of 32, unlike the zoo's 48):
    MXFP8 then quantizes experts cut from fused 3-D tensors instead of keeping them."""
    key = {"granitemoe": "intermediate_size", "llama4": "text_config.intermediate_size"}.get(
        arch, "text_config.moe_intermediate_size"
    )
    return {key: 96}
