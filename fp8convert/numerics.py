"""FP8 e4m3 quantization math. Pure tensor functions; identical bytes on CPU and CUDA because every
step is exact (abs, max) or a single IEEE float32 operation (divide, round-to-nearest-even cast).

Weights are [..., out, in]: a single 2-D weight, or a stack of same-shaped weights (e.g. the experts
of a MoE layer) quantized in one launch chain, each with its own scales.
"""
from __future__ import annotations

import torch

from .options import BLOCK

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


class NonFiniteWeight(ValueError):
    """A weight holds NaN or Inf. `member` indexes the list given to quantize_group, `index` the stack."""

    def __init__(self, member: int, index: int):
        super().__init__(member, index)
        self.member, self.index = member, index


def amax(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """Largest magnitude in float32, per tensor [..., 1, 1], per row [..., out, 1] or per 128x128
    block [..., ceil(out/128), ceil(in/128)]."""
    a = w.abs()
    if scheme == "tensor":
        return a.amax(dim=(-2, -1), keepdim=True).float()
    if scheme == "channel":
        return a.amax(dim=-1, keepdim=True).float()
    out, inp = w.shape[-2:]
    rows, cols = -(-out // BLOCK), -(-inp // BLOCK)
    if out % BLOCK or inp % BLOCK:  # edge blocks are partial: pad with zeros, which never raise a max
        a = torch.nn.functional.pad(a, (0, cols * BLOCK - inp, 0, rows * BLOCK - out))
    return a.reshape(*w.shape[:-2], rows, BLOCK, cols, BLOCK).amax(dim=(-3, -1)).float()


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """scale = amax / 448 in float32. An all-zero tensor (or block/row) gets scale 1.0: finite and
    positive, so consumers can divide or multiply by it, and every code is 0 anyway."""
    # Divide by a tensor, not a Python number: CUDA turns division by a scalar into multiplication by
    # its reciprocal, which rounds differently from the CPU's true division.
    scale = amax.float() / torch.full_like(amax, FP8_MAX, dtype=torch.float32)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def expand_scale(scale: torch.Tensor, shape: tuple[int, ...], scheme: str) -> torch.Tensor:
    """A per-element scale that broadcasts against a weight of `shape` ([..., out, in])."""
    if scheme != "block":
        return scale
    out, inp = shape[-2:]
    return scale.repeat_interleave(BLOCK, dim=-2)[..., :out, :].repeat_interleave(BLOCK, dim=-1)[..., :inp]


def quantize_with_scale(w: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """q = clamp(float32(w) / scale, -448, 448) cast to e4m3 (round to nearest even)."""
    q = w.float().div_(expand_scale(scale, tuple(w.shape), scheme))
    return q.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(q: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """w' = float32(q) * scale."""
    return q.float() * expand_scale(scale.float(), tuple(q.shape), scheme)


def quantize_group(members: list[torch.Tensor], scheme: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Quantize the members of a fused group together. Each member is a stack [N, out, in]; index n
    of every member belongs to the same group (N = 1 for a single group). In the tensor scheme members share the max
    amax (vLLM re-quantizes a fused layer to its largest scale, which sharing makes a no-op); per-row
    and per-block scales need no sharing. Returns (codes, scales), one per member.

    Raises NonFiniteWeight for NaN or Inf: amax propagates both, so checking the small amax tensor
    finds them without another pass over the weights.
    """
    amaxes = [amax(w, scheme) for w in members]
    for j, a in enumerate(amaxes):
        finite = torch.isfinite(a).flatten(start_dim=1).all(dim=1)
        if not bool(finite.all()):
            raise NonFiniteWeight(j, int((~finite).nonzero()[0, 0]))
    if scheme == "tensor" and len(members) > 1:
        shared = torch.stack(amaxes).amax(dim=0)
        amaxes = [shared] * len(members)
    scales = [scale_from_amax(a) for a in amaxes]
    return [quantize_with_scale(w, s, scheme) for w, s in zip(members, scales)], scales
