"""FP8 e4m3 quantization math. Pure tensor functions; identical bytes on CPU and CUDA because every
step is exact (abs, max) or a single IEEE float32 operation (divide, round-to-nearest-even cast).

Weights are [..., out, in]: a single 2-D weight, or a stack of same-shaped weights (e.g. the experts
of a MoE layer) quantized in one launch chain, each with its own scales.
"""
from __future__ import annotations

import functools

import torch

from ..options import BLOCK

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


class NonFiniteWeight(ValueError):
    """A weight holds NaN or Inf. `member` indexes the list given to quantize_group, `index` the stack."""

    def __init__(self, member: int, index: int):
        super().__init__(member, index)
        self.member, self.index = member, index


def use_cpu_path(w: torch.Tensor, cpu_path: bool | None) -> bool:
    """`cpu_path` None means: the path made for w's device. Tests pass True or False to run both
    paths on a CPU (they must give the same bytes)."""
    return w.device.type == "cpu" if cpu_path is None else cpu_path


def amax(w: torch.Tensor, scheme: str, cpu_path: bool | None = None) -> torch.Tensor:
    """Largest magnitude in float32, per tensor [..., 1, 1], per row [..., out, 1] or per 128x128
    block [..., ceil(out/128), ceil(in/128)]. max|w| = max(max w, -min w): no full-size |w|
    temporary, and NaN propagates through both."""
    if scheme == "tensor" and use_cpu_path(w, cpu_path):
        # One aminmax pass per weight: on a CPU about twice as fast as amax and amin over two dims.
        pairs = [torch.aminmax(x) for x in w.reshape(-1, w.shape[-2] * w.shape[-1])]
        return torch.stack([torch.maximum(hi, lo.neg()) for lo, hi in pairs]).float().reshape(*w.shape[:-2], 1, 1)
    if scheme == "tensor":
        dims = (-2, -1)
    elif scheme == "channel":
        dims = (-1,)
    else:
        out, inp = w.shape[-2:]
        rows, cols = -(-out // BLOCK), -(-inp // BLOCK)
        if out % BLOCK or inp % BLOCK:  # edge blocks are partial: pad with zeros, which never raise a max
            w = torch.nn.functional.pad(w, (0, cols * BLOCK - inp, 0, rows * BLOCK - out))
        w = w.reshape(*w.shape[:-2], rows, BLOCK, cols, BLOCK)
        dims = (-3, -1)
    return torch.maximum(w.amax(dim=dims, keepdim=scheme != "block"),
                         w.amin(dim=dims, keepdim=scheme != "block").neg()).float()


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


def quantize_with_scale(w: torch.Tensor, scale: torch.Tensor, scheme: str, cpu_path: bool | None = None
                        ) -> torch.Tensor:
    """q = clamp(float32(w) / scale, -448, 448) cast to e4m3 (round to nearest even). `w` is left as it
    was (a float32 weight is copied, not divided in place: it may be a view of the read buffer)."""
    if use_cpu_path(w, cpu_path) and w.dim() == 3:
        return _quantize_rows(w, scale, scheme)
    q = w.to(torch.float32, copy=True).div_(expand_scale(scale, tuple(w.shape), scheme))
    return q.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


CPU_TILE_BYTES = 2 << 20  # float32 working tile per two of torch's threads: each core's share stays in its L2


def cpu_tile_bytes() -> int:
    """The tile grows with the threads that split it (2 MB measured best on 2 cores, 16 MB on 16)."""
    return CPU_TILE_BYTES * max(1, torch.get_num_threads() // 2)


def _quantize_rows(w: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """The same arithmetic as above, a few rows at a time through one small float32 tile: on a CPU,
    three passes over a tile in cache are about 3x faster than three passes over main memory."""
    stack, out, inp = w.shape
    rows = max(1, cpu_tile_bytes() // (4 * inp))
    if scheme == "block":  # a power of 2 <= 128, so no tile spans two rows of blocks
        rows = 1 << min(7, rows.bit_length() - 1)
    tile = torch.empty(min(rows, out), inp, dtype=torch.float32, device=w.device)
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    for n in range(stack):
        for r in range(0, out, rows):
            part = tile[:min(rows, out - r)]
            if scheme == "tensor":
                s = scale[n]
            elif scheme == "channel":
                s = scale[n, r:r + rows]
            else:
                s = scale[n, r // BLOCK].repeat_interleave(BLOCK)[:inp]
            part.copy_(w[n, r:r + rows]).div_(s).clamp_(-FP8_MAX, FP8_MAX)
            q[n, r:r + rows].copy_(part)
    return q


def dequantize(q: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """w' = float32(q) * scale."""
    return q.float() * expand_scale(scale.float(), tuple(q.shape), scheme)


def scale_as_stored(scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """An FP8 source's scale (float32, bfloat16 or float16: all exact in float32) as float32 shaped to
    broadcast against its weight: [1, 1] per tensor (stored [] or [1]), [out, 1] per row, the block grid."""
    s = scale.to(torch.float32)
    return s.reshape(1, 1) if scheme == "tensor" else s


def dequantize_to(q: torch.Tensor, scale: torch.Tensor, scheme: str, dtype: torch.dtype,
                  cpu_path: bool | None = None) -> torch.Tensor:
    """(float32(q) * float32(scale)).to(dtype) for FP8 weights [..., out, in] (one, or a stack of
    same-shaped ones with their scales stacked alike): one float32 product, rounded once to `dtype`
    (nearest even), as DeepSeek's and transformers' own dequantizers compute it. Block scales are
    expanded over their 128x128 tiles, the edge tiles cut to the weight. `scale` is scale_as_stored's."""
    if not use_cpu_path(q, cpu_path):
        return (q.to(torch.float32) * expand_scale(scale, tuple(q.shape), scheme)).to(dtype)
    return _dequantize_by_table(q, scale, scheme, dtype)


def code_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """The float32 value of each of the 256 e4m3 codes (NaN for the two NaN codes)."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(FP8_DTYPE).to(torch.float32)


def _dequantize_by_table(q: torch.Tensor, scale: torch.Tensor, scheme: str, dtype: torch.dtype) -> torch.Tensor:
    """The same bytes by lookup. One scale covers a weight, a row or a 128x128 block, so each output is
    table[code] of that scale's table: the 256 products float32(code) * scale rounded to `dtype`. Every
    element is still that one float32 product and rounding, but no code is converted to float32 (torch's
    float8 conversion is the slowest step on a CPU, about 10x a plain cast). Weight by weight, three
    passes: codes into an int32 index buffer, plus each element's table offset, one gather."""
    out, inp = q.shape[-2:]
    codes = q.view(torch.uint8).reshape(-1, out, inp)
    count = codes.shape[0]
    tables = (scale.reshape(count, *scale.shape[-2:]).unsqueeze(-1) * code_values(q.device)).to(dtype)
    tables = tables.reshape(count, -1)               # weight n's tables in row n, 256 entries each
    arange = functools.partial(torch.arange, dtype=torch.int32, device=q.device)
    offsets = None
    if scheme == "channel":      # row r's table starts at r * 256
        offsets = (arange(out) * 256).unsqueeze(1).expand(out, inp).contiguous()
    elif scheme == "block":      # block (i, j)'s at (i * C + j) * 256
        offsets = (arange(out) // BLOCK * (-(-inp // BLOCK) * 256)).unsqueeze(1) + arange(inp) // BLOCK * 256
    index = torch.empty(out, inp, dtype=torch.int32, device=q.device)
    result = torch.empty(codes.shape, dtype=dtype, device=q.device)
    for n in range(count):       # (in-place int32 ops over a stack broadcast slowly on a CPU; per weight they do not)
        index.copy_(codes[n])
        if offsets is not None:
            index += offsets
        torch.index_select(tables[n], 0, index.view(-1), out=result[n].view(-1))
    return result.view(q.shape)


def quantize_group(members: list[torch.Tensor], scheme: str, cpu_path: bool | None = None
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Quantize the members of a fused group together. Each member is a stack [N, out, in]; index n
    of every member belongs to the same group (N = 1 for a single group). In the tensor scheme members share the max
    amax (vLLM re-quantizes a fused layer to its largest scale, which sharing makes a no-op); per-row
    and per-block scales need no sharing. Returns (codes, scales), one per member. `cpu_path`: see
    use_cpu_path.

    Raises NonFiniteWeight for NaN or Inf: amax propagates both, so checking the small amax tensor
    finds them without another pass over the weights.
    """
    amaxes = [amax(w, scheme, cpu_path) for w in members]
    for j, a in enumerate(amaxes):
        finite = torch.isfinite(a).flatten(start_dim=1).all(dim=1)
        if not bool(finite.all()):
            raise NonFiniteWeight(j, int((~finite).nonzero()[0, 0]))
    if scheme == "tensor" and len(members) > 1:
        shared = torch.stack(amaxes).amax(dim=0)
        amaxes = [shared] * len(members)
    scales = [scale_from_amax(a) for a in amaxes]
    return [quantize_with_scale(w, s, scheme, cpu_path) for w, s in zip(members, scales)], scales
