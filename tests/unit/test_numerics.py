"""The CPU's row-tiled FP8 quantizing (a stack through one small float32 tile) writes the bytes of the
plain whole-tensor arithmetic, in every scheme, with tiles that end inside a row of blocks and mid-weight;
and verify's byte comparison of what it wrote."""

from __future__ import annotations

import pytest
import torch

from fp8convert.run import numerics
from fp8convert.verify.numbers import identical


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block", "mxfp8"])
@pytest.mark.parametrize("tile_bytes", [1, 4096, 1 << 20])
def test_tiled_cpu_quantizing_writes_the_plain_bytes(scheme, tile_bytes, monkeypatch):
    monkeypatch.setattr(numerics, "CPU_TILE_BYTES", tile_bytes)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 200, 320, generator=g) * torch.logspace(-3, 1, 320)).to(torch.bfloat16)
    w[1, 5] = 0.0
    _, scale = numerics.scales_from_amax(numerics.amax(w, scheme), scheme)
    tiled = numerics.quantize_with_scale(w, scale, scheme)  # a CPU stack: the tiled path
    plain = torch.stack([numerics.quantize_with_scale(w[n], scale[n], scheme) for n in range(3)])  # 2-D: plain
    assert torch.equal(tiled.view(torch.uint8), plain.view(torch.uint8))
    assert bool(tiled.view(torch.uint8).ne(0).any())


@pytest.mark.parametrize("stacked", [True, False])
def test_a_scale_that_would_not_divide_in_float32_is_refused_on_either_path(stacked):
    """A CPU stack goes through the float32 tile, a single weight through the plain division: both check."""
    w, scale = torch.ones(2, 128, 128, dtype=torch.bfloat16), torch.ones(2, 1, 1, dtype=torch.float64)
    with pytest.raises(AssertionError, match="not float32: scale torch.float64"):
        numerics.quantize_with_scale(w if stacked else w[0], scale if stacked else scale[0], "tensor")


def test_verify_byte_comparison_tells_a_shorter_tensor_from_a_prefix():
    """The CPU memcmp must not read past the shorter tensor: here the bytes beyond it match."""
    whole = torch.zeros(16, dtype=torch.uint8)
    assert identical(torch.zeros(16, dtype=torch.uint8), whole)
    assert not identical(torch.zeros(16, dtype=torch.uint8), whole[:8])
    assert not identical(torch.zeros(8, dtype=torch.uint8), whole)
