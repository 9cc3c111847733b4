"""What transformers 5 loads back from fp8convert's outputs: never a silently wrong model."""

from __future__ import annotations

import pytest
from checks import ignore_lists
from harness import fp8convert_module, read_json, read_safetensors_dir, run_quantize


@pytest.mark.parametrize("fmt,scheme", [("compressed-tensors", "tensor"), ("fp8", "block")])
def test_hunyuan_moe_router_stays_high_precision_and_listed(fmt, scheme, zoo_source, tmp_path):
    """HunYuan-V1-MoE's router is `mlp.gate.wg`, an nn.Linear under the `gate` module."""
    plan = fp8convert_module().make_plan(str(zoo_source("hunyuan_v1_moe")), format=fmt, scheme=scheme)
    (router,) = [t for t in plan.tensors if t.name == "model.layers.0.mlp.gate.wg.weight"]
    assert not router.quantize and router.reason == "MoE router"
    out = tmp_path / "out"
    run_quantize(zoo_source("hunyuan_v1_moe"), out, format=fmt, scheme=scheme)
    tensors = read_safetensors_dir(out)
    for layer in (0, 1):
        assert str(tensors[f"model.layers.{layer}.mlp.gate.wg.weight"].dtype) != "torch.float8_e4m3fn"
        for lst in ignore_lists(fmt, read_json(out / "config.json")):
            assert f"model.layers.{layer}.mlp.gate.wg" in lst
