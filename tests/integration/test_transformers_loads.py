"""What transformers 5 loads back from fp8convert's outputs: never a silently wrong model."""

from __future__ import annotations

import pytest
import torch
import zoo
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


@pytest.mark.parametrize("scheme", ["tensor", "channel"])
def test_mllama_vision_tower_loads_in_transformers_as_written(scheme, zoo_source, tmp_path):
    """transformers loads Mllama's legacy names under model.* (model.vision_model.*) and compressed-tensors
    there matches the ignore list against those names: the kept vision tower and projector are listed so,
    and every parameter loads within e4m3 rounding of the source's."""
    from fp8convert.plan.family import Caveat
    from fp8convert.plan.summary import compatibility_warnings

    out = tmp_path / "out"
    run_quantize(zoo_source("mllama"), out, scheme=scheme)
    source = zoo.load(zoo_source("mllama"))
    want = {n: p.detach().float() for n, p in source.named_parameters()}
    model = zoo.load(out)
    logits = zoo.logits(model)  # compressed-tensors decompresses the weights on the first forward
    have = dict(model.named_parameters())
    bad = [n for n, w in want.items() if not (have[n].detach().float() - w).norm() <= 2.0**-4 * 1.02 * w.norm()]
    assert not bad, bad[:5]
    cos = torch.nn.functional.cosine_similarity(zoo.logits(source).flatten(), logits.flatten(), dim=0)
    assert cos.item() >= 0.99
    plan = fp8convert_module().make_plan(str(zoo_source("mllama")), scheme=scheme)
    assert Caveat.VLLM_CANNOT_LOAD in {w.caveat for w in compatibility_warnings(plan)}


@pytest.mark.parametrize(
    "arch,fmt,scheme", [("granitemoe", "compressed-tensors", "tensor"), ("llama4", "fp8", "block")]
)
def test_split_experts_transformers_leaves_initialised_are_named_everywhere(arch, fmt, scheme, zoo_source, tmp_path):
    """transformers has no rule merging these families' per-expert weights (Llama-4's only under
    compressed-tensors): it loads the output without an error, its fused experts randomly initialised. The
    plan, `inspect`, the quantize report and the model card all say so; the layout is vLLM's."""
    from fp8convert.plan.family import Caveat
    from fp8convert.plan.summary import compatibility_warnings, describe, render

    out = tmp_path / "out"
    report = run_quantize(zoo_source(arch), out, format=fmt, scheme=scheme)
    _, info = zoo.load(out, output_loading_info=True)
    assert any(k.endswith("experts.gate_up_proj") for k in info["missing_keys"]), info["missing_keys"]
    plan = fp8convert_module().make_plan(str(zoo_source(arch)), format=fmt, scheme=scheme)
    cannot = [w.text for w in compatibility_warnings(plan) if w.caveat is Caveat.TRANSFORMERS_CANNOT_LOAD]
    assert cannot and "without an error but with the experts randomly initialised" in cannot[0]
    assert f"transformers: no: {cannot[0]}" in render(describe(plan, 1 << 30, "cpu"))
    assert cannot[0] in report.warnings
    assert f"Not loadable in transformers: {cannot[0]}" in (out / "README.md").read_text()
