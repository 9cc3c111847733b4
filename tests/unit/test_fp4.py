"""FP4 numerics (run/fp4.py) against compressed-tensors' own quantization helpers and compressors: the same
global and group scales, the same packed bytes, the same decode, on weights with every edge in them."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

from fp8convert.run import fp4

CT_COMPRESSOR = {"nvfp4a16": NVFP4PackedCompressor, "mxfp4a16": MXFP4PackedCompressor}


def edge_weights(out=64, inp=256, seed=0) -> torch.Tensor:
    """Laplace-like BF16 weights with outlier columns, an all-zero group, a row of -0.0, exact E2M1 ties
    (values at group amax * k / 6, the amax being 6), and a subnormal group."""
    g = torch.Generator().manual_seed(seed)
    w = torch.distributions.Laplace(0.0, 0.02).sample((out, inp)) if seed else torch.randn(out, inp, generator=g)
    w[:, 7] *= 40  # outlier column
    w[3, :32] = 0.0  # all-zero groups (16 and 32 wide)
    w[4] = -0.0
    w[5, :16] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0])
    w[6, :32] = 1e-40  # subnormal (bfloat16 has float32's exponent range)
    return w.to(torch.bfloat16)


def ct_reference(w: torch.Tensor, scheme: str, global_amax: torch.Tensor | None = None):
    """compressed-tensors' scales (from float32 amaxes) and its compressor's output for one weight."""
    preset = preset_name_to_scheme(scheme.upper(), ["Linear"])
    args = preset.weights
    size = args.group_size
    groups = w.float().unflatten(-1, (-1, size))
    gmin, gmax = groups.amin(dim=-1), groups.amax(dim=-1)
    g = None
    if scheme == "nvfp4a16":
        amax = global_amax if global_amax is not None else w.float().abs().amax()
        g = generate_gparam(-amax.reshape(1), amax.reshape(1))
    scales, _ = calculate_qparams(gmin, gmax, args, global_scale=g)
    state = {"weight": w, "weight_scale": scales} | ({"weight_global_scale": g} if g is not None else {})
    return CT_COMPRESSOR[scheme].compress(state, preset), preset


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_scales_and_bytes_match_compressed_tensors(scheme, seed):
    w = edge_weights(seed=seed)
    ours = fp4.quantize_fp4_group([w.unsqueeze(0)], scheme)[0]
    theirs, _ = ct_reference(w, scheme)
    assert torch.equal(ours[0][0], theirs["weight_packed"])
    assert torch.equal(ours[1][0].view(torch.uint8), theirs["weight_scale"].view(torch.uint8))
    if scheme == "nvfp4a16":
        assert ours[1].dtype == torch.float8_e4m3fn and ours[2].dtype == torch.float32
        assert torch.equal(ours[2][0], theirs["weight_global_scale"])
    else:
        assert len(ours) == 2 and ours[1].dtype == torch.uint8
        assert ours[1][0, 3, 0] == 0  # the all-zero group's byte


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_decode_matches_compressed_tensors_and_stays_within_the_format_bound(scheme):
    w = edge_weights(seed=1)
    packed, scales, *rest = (t[0] for t in fp4.quantize_fp4_group([w.unsqueeze(0)], scheme)[0])
    ours = fp4.dequantize(packed, scales, rest[0] if rest else None, scheme)
    _, preset = ct_reference(w, scheme)
    state = {"weight_packed": packed, "weight_scale": scales} | ({"weight_global_scale": rest[0]} if rest else {})
    theirs = CT_COMPRESSOR[scheme].decompress(state, preset)["weight"]
    assert torch.equal(ours.to(theirs.dtype), theirs)
    # Each value is off by at most half a step of E2M1 at its group's scale (the top step, 4 -> 6, is 2),
    # plus, for nvfp4a16, the group scale's own e4m3 rounding (2^-4 relative) applied to the group amax.
    size = fp4.GROUP_SIZE[scheme]
    amax = w.float().unflatten(-1, (-1, size)).abs().amax(dim=-1, keepdim=True)
    step = amax / 6 * (2.0 if scheme == "mxfp4a16" else 1.0 + 2.0**-3)  # MX scales are up to 2x the amax's
    err = (ours.unflatten(-1, (-1, size)) - w.float().unflatten(-1, (-1, size))).abs()
    assert bool((err <= step + 1e-30).all())


def test_one_global_scale_for_a_fused_set_each_member_its_own_group_scales():
    q, k = edge_weights(seed=0), edge_weights(seed=1) * 0.01
    out_q, out_k = fp4.quantize_fp4_group([q.unsqueeze(0), k.unsqueeze(0)], "nvfp4a16")
    assert torch.equal(out_q[2], out_k[2])
    shared = torch.maximum(q.float().abs().amax(), k.float().abs().amax())
    theirs_k, _ = ct_reference(k, "nvfp4a16", global_amax=shared)
    assert torch.equal(out_k[0][0], theirs_k["weight_packed"])
    assert torch.equal(out_k[1][0].view(torch.uint8), theirs_k["weight_scale"].view(torch.uint8))
    alone = fp4.quantize_fp4_group([k.unsqueeze(0)], "nvfp4a16")[0]
    assert not torch.equal(alone[2], out_k[2])  # a global scale of its own would differ


def test_all_zero_weight_gets_global_scale_one_and_decodes_to_zero():
    w = torch.zeros(1, 16, 32, dtype=torch.bfloat16)
    packed, scales, g = fp4.quantize_fp4_group([w], "nvfp4a16")[0]
    assert g.item() == 1.0 and bool((packed == 0).all()) and bool((scales.float() == 0.125).all())
    assert bool((fp4.dequantize(packed[0], scales[0], g[0], "nvfp4a16") == 0).all())


def test_mx_scale_rule_rounds_up_from_significand_one_point_seven_five():
    amax = torch.tensor([1.0, 1.74, 1.75, 6.0, 7.0, 0.0, 2.0**-130])
    assert fp4.mxfp4_scale_bytes(amax).tolist() == [125, 125, 126, 127, 128, 0, 0]
