"""FP8 e4m3 quantization math. Pure tensor functions; identical bytes on CPU and CUDA because every
step is exact (abs, max) or a single IEEE float32 operation (divide, round-to-nearest-even cast)."""
from __future__ import annotations

import torch

from .options import BLOCK

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def amax(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """Largest magnitude, float32: shape [1] (tensor), [out, 1] (channel), [ceil(out/128), ceil(in/128)] (block)."""
    a = w.abs()
    if scheme == "tensor":
        return a.amax().float().reshape(1)
    if scheme == "channel":
        return a.amax(dim=1, keepdim=True).float()
    out, inp = w.shape
    rows, cols = -(-out // BLOCK), -(-inp // BLOCK)
    if out % BLOCK or inp % BLOCK:  # edge blocks are partial: pad with zeros, which never raise a max
        a = torch.nn.functional.pad(a, (0, cols * BLOCK - inp, 0, rows * BLOCK - out))
    return a.reshape(rows, BLOCK, cols, BLOCK).amax(dim=(1, 3)).float()


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """scale = amax / 448 in float32. An all-zero tensor (or block/row) gets scale 1.0: finite and
    positive, so consumers can divide or multiply by it, and every code is 0 anyway."""
    # Divide by a tensor, not a Python number: CUDA turns division by a scalar into multiplication by
    # its reciprocal, which rounds differently from the CPU's true division.
    scale = amax.float() / torch.full_like(amax, FP8_MAX, dtype=torch.float32)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], scheme: str) -> torch.Tensor:
    """Broadcastable per-element scale for a weight of `shape`."""
    if scheme != "block":
        return scale
    out, inp = shape
    return scale.repeat_interleave(BLOCK, dim=0)[:out].repeat_interleave(BLOCK, dim=1)[:, :inp]


def quantize_with_scale(w: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """q = clamp(float32(w) / scale, -448, 448) cast to e4m3 (round to nearest even)."""
    q = w.float().div_(expand_scale(scale, tuple(w.shape), scheme))
    return q.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(q: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """w' = float32(q) * scale."""
    return q.float() * expand_scale(scale.reshape(-1, 1) if scheme == "tensor" else scale, tuple(q.shape), scheme)


def quantize_group(weights: list[torch.Tensor], scheme: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Quantize tensors that share scales (a fused group in the tensor scheme shares the max amax; in
    the other schemes scales are per row/block and need no sharing). Returns (codes, scales).

    Raises ValueError(index) if a weight holds NaN or Inf: amax propagates both, so checking the
    (small) scale tensor finds them without another pass over the weight.
    """
    amaxes = [amax(w, scheme) for w in weights]
    for i, a in enumerate(amaxes):
        if not torch.isfinite(a).all():
            raise ValueError(i)
    if scheme == "tensor" and len(weights) > 1:
        shared = torch.stack(amaxes).amax(dim=0)
        amaxes = [shared] * len(weights)
    scales = [scale_from_amax(a) for a in amaxes]
    return [quantize_with_scale(w, s, scheme) for w, s in zip(weights, scales)], scales
