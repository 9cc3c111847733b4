"""The CUDA path: same bytes as the CPU path, whatever the batching. Skipped where there is no GPU
(CI); run on a GPU machine with `python3 -m pytest -q tests/gpu`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fp8convert

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

COMBOS = [
    ("tensor", "compressed-tensors"),
    ("channel", "compressed-tensors"),
    ("block", "compressed-tensors"),
    ("tensor", "fp8"),
    ("block", "fp8"),
]
FP4_COMBOS = [("nvfp4a16", "compressed-tensors"), ("mxfp4a16", "compressed-tensors")]


def output_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("scheme,fmt", COMBOS + FP4_COMBOS)
def test_cuda_writes_the_same_bytes_as_cpu(source_model, tmp_path, kind, scheme, fmt):
    src = source_model(kind)
    cpu = fp8convert.quantize(src, tmp_path / "cpu", scheme=scheme, format=fmt, device="cpu", max_shard_size="150KB")
    cuda = fp8convert.quantize(src, tmp_path / "cuda", scheme=scheme, format=fmt, device="cuda", max_shard_size="150KB")
    assert cuda.device.startswith("cuda") and cuda.peak_device_bytes > 0
    assert cpu.shards == cuda.shards > 1
    assert output_bytes(tmp_path / "cuda") == output_bytes(tmp_path / "cpu")


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize(
    "scheme,recipe",
    [
        ("block", {r"re:.*mlp\.experts\..*": "nvfp4a16"}),
        ("channel", {r"re:.*mlp\.experts\..*": "mxfp4a16"}),
        ("tensor", {r"re:.*self_attn\..*": "block", r"re:.*\.mlp\..*": "nvfp4a16"}),
    ],
    ids=["block+nvfp4-experts", "channel+mxfp4-experts", "block-attention+nvfp4-mlp"],
)
def test_cuda_writes_a_mixed_recipe_as_cpu_does(source_model, tmp_path, kind, scheme, recipe):
    """Each stack quantized in its own scheme on CUDA gives the CPU's bytes, FP8 and FP4 in one batch."""
    src = source_model(kind)
    kw = {"scheme": scheme, "recipe": recipe, "max_shard_size": "150KB", "write_unloadable": True}
    fp8convert.quantize(src, tmp_path / "cpu", device="cpu", **kw)
    fp8convert.quantize(src, tmp_path / "cuda", device="cuda", **kw)
    assert output_bytes(tmp_path / "cuda") == output_bytes(tmp_path / "cpu")
    config = json.loads((tmp_path / "cuda" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision" and len(config["config_groups"]) == len({scheme, *recipe.values()})


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "scheme,fmt", [("tensor", "compressed-tensors"), ("channel", "compressed-tensors"), ("block", "fp8")]
)
def test_cuda_fp16_and_fp32_sources_give_the_bytes_of_cpu(source_model, tmp_path, dtype, scheme, fmt):
    src = source_model("qwen3_moe", dtype)
    fp8convert.quantize(src, tmp_path / "cpu", scheme=scheme, format=fmt, device="cpu", max_shard_size="150KB")
    fp8convert.quantize(src, tmp_path / "cuda", scheme=scheme, format=fmt, device="cuda", max_shard_size="150KB")
    assert output_bytes(tmp_path / "cuda") == output_bytes(tmp_path / "cpu")


@pytest.mark.parametrize("max_resident", ["16KB", "100KB"])
def test_cuda_split_batches_change_nothing(source_model, tmp_path, max_resident):
    """Layers split to fit a small budget (never inside a fused group) give the same output."""
    src = source_model("qwen3_moe")
    fp8convert.quantize(src, tmp_path / "whole", device="cuda", max_shard_size="150KB")
    fp8convert.quantize(src, tmp_path / "split", device="cuda", max_shard_size="150KB", max_resident=max_resident)
    assert output_bytes(tmp_path / "split") == output_bytes(tmp_path / "whole")


def test_cuda_refuses_nan_naming_the_tensor(tmp_path):
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    w[3, 5] = float("nan")
    save_file(
        {
            "model.layers.0.mlp.down_proj.weight": w,
            "model.layers.0.mlp.up_proj.weight": torch.randn(64, 64).bfloat16(),
            "model.layers.0.mlp.gate_proj.weight": torch.randn(64, 64).bfloat16(),
        },
        str(src / "model.safetensors"),
    )
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(fp8convert.FP8ConvertError, match="model.layers.0.mlp.down_proj.weight"):
        fp8convert.quantize(src, tmp_path / "out", device="cuda")


@pytest.mark.parametrize("scheme,fmt", COMBOS + FP4_COMBOS)
def test_cuda_verify_gives_the_figures_of_cpu(source_model, tmp_path, scheme, fmt, monkeypatch):
    """verify --device cuda reads through the CUDA reader and measures on the GPU: the same verdicts
    and figures as on the CPU, every honest code on the fast path."""
    from fp8convert import verify as verify_mod
    from fp8convert.verify import numbers as verify_numbers

    src = source_model("qwen3_moe")
    out = tmp_path / "out"
    fp8convert.quantize(src, out, scheme=scheme, format=fmt, device="cpu", max_shard_size="150KB")
    cpu = verify_mod.verify(src, out, device="cpu")

    def refuse(*args):
        raise AssertionError("exact_sums used on an honest conversion")

    monkeypatch.setattr(verify_numbers, "exact_sums", refuse)
    cuda = verify_mod.verify(src, out, device="cuda", max_resident="64KB")
    assert cpu.ok and cuda.ok and len(cuda.tensors) == len(cpu.tensors) > 0
    by_name = {t.name: t for t in cpu.tensors}
    for t in cuda.tensors:
        assert t.rel_error == pytest.approx(by_name[t.name].rel_error, rel=1e-9)
        assert t.bound == pytest.approx(by_name[t.name].bound, rel=1e-9) and t.off_grid == 0


def test_cuda_verify_finds_one_corrupted_code(source_model, tmp_path):
    import struct

    from fp8convert import verify as verify_mod

    src = source_model("llama")
    out = tmp_path / "out"
    fp8convert.quantize(src, out, device="cpu")
    shard = next(out.glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F8_E4M3")
    at = 8 + n + header[name]["data_offsets"][0] + 7
    data[at] ^= 0x01 if data[at] & 0x7F not in (0x7E, 0x7F) else 0x02
    shard.write_bytes(bytes(data))
    report = verify_mod.verify(src, out, device="cuda")
    assert not report.ok and any(f.startswith(name) and "nearest e4m3" in f for f in report.failures)


@pytest.mark.parametrize("arch", ["llama4", "granitemoe", "qwen3_vl_moe", "gemma4"])
@pytest.mark.parametrize("scheme,fmt", COMBOS + FP4_COMBOS)
def test_cuda_cuts_fused_experts_like_cpu(zoo_source, tmp_path, arch, scheme, fmt):
    """Experts cut from fused 3-D tensors (strided views: transposed, halves) give the CPU's bytes."""
    src = zoo_source(arch)
    fp8convert.quantize(src, tmp_path / "cpu", scheme=scheme, format=fmt, device="cpu")
    fp8convert.quantize(src, tmp_path / "cuda", scheme=scheme, format=fmt, device="cuda")
    assert output_bytes(tmp_path / "cuda") == output_bytes(tmp_path / "cpu")


@pytest.mark.parametrize(
    "layout",
    ["deepseek-native-block-ue8m0", "qwen-native-block-fp16", "ct-channel-bf16", "autofp8-native-tensor-static"],
)
def test_cuda_dequantizes_and_requantizes_fp8_sources_like_cpu(tmp_path, layout):
    """FP8 sources: the CPU's table lookup and CUDA's float32 product give the same bytes, in every
    dtype, and so do requantizations, to MXFP8 and UE8M0 blocks too (dims of 192 and 320: partial
    128x128 blocks)."""
    import fp8_reference as F
    from tiny_ckpt import llama_tensors, write_checkpoint

    bf16 = write_checkpoint(tmp_path / "bf16", llama_tensors(layers=3, hidden=192, inter=320))
    src = F.write_fp8(bf16, tmp_path / "src", F.LAYOUTS[layout])
    runs = [("dequantize", {"dtype": d}) for d in ("bf16", "fp16", "fp32")]
    runs += [
        ("quantize", {"scheme": s, "format": "compressed-tensors"}) for s in ("tensor", "channel", "block", "mxfp8")
    ]
    runs += [("quantize", {"scheme": "block", "format": "fp8", "scale_format": "ue8m0"})]
    for n, (command, options) in enumerate(runs):
        convert = getattr(fp8convert, command)
        convert(src, tmp_path / f"cpu{n}", device="cpu", max_shard_size="150KB", **options)
        convert(src, tmp_path / f"cuda{n}", device="cuda", max_shard_size="150KB", **options)
        assert output_bytes(tmp_path / f"cuda{n}") == output_bytes(tmp_path / f"cpu{n}"), (command, options)


# MXFP8 and power-of-two block scales: the exponents come from integer bit arithmetic and every division is
# by a power of two, so CUDA must give the CPU's bytes here too.
BLACKWELL = [
    ("mxfp8", "compressed-tensors", "float"),
    ("block", "compressed-tensors", "ue8m0"),
    ("block", "fp8", "ue8m0"),
]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("scheme,fmt,scale_format", BLACKWELL)
def test_cuda_mxfp8_and_ue8m0_bytes_equal_cpu(source_model, tmp_path, kind, scheme, fmt, scale_format):
    src = source_model(kind)
    for device in ("cpu", "cuda"):
        fp8convert.quantize(
            src,
            tmp_path / device,
            scheme=scheme,
            format=fmt,
            scale_format=scale_format,
            device=device,
            max_shard_size="150KB",
        )
    assert output_bytes(tmp_path / "cuda") == output_bytes(tmp_path / "cpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("scheme,fmt,scale_format", BLACKWELL)
def test_cuda_mxfp8_and_ue8m0_from_fp16_and_fp32_sources(source_model, tmp_path, dtype, scheme, fmt, scale_format):
    src = source_model("qwen3_moe", dtype)
    for device in ("cpu", "cuda"):
        fp8convert.quantize(
            src,
            tmp_path / device,
            scheme=scheme,
            format=fmt,
            scale_format=scale_format,
            device=device,
            max_shard_size="150KB",
        )
    assert output_bytes(tmp_path / "cuda") == output_bytes(tmp_path / "cpu")


def test_cuda_mxfp8_edge_groups_equal_cpu():
    """amax exactly 1.75 * 2^k, subnormal, huge and zero groups (mxfp8_inputs.edge_groups), fp32 just
    above 448 * 2^k: the CUDA path's exponents and codes are the CPU path's."""
    from mxfp8_inputs import edge_groups

    from fp8convert.run.numerics import quantize_group

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = edge_groups(dtype)
        cpu_codes, cpu_scales = quantize_group([w], "mxfp8")
        gpu_codes, gpu_scales = quantize_group([w.cuda()], "mxfp8")
        assert torch.equal(gpu_scales[0].cpu(), cpu_scales[0])
        assert torch.equal(gpu_codes[0].cpu().view(torch.uint8), cpu_codes[0].view(torch.uint8))


@pytest.mark.parametrize("arch", ["llama4", "granitemoe", "qwen3_vl_moe", "gemma4"])
def test_cuda_mxfp8_experts_cut_from_fused_tensors_like_cpu(tmp_path, arch):
    """MXFP8 experts cut from fused 3-D tensors (96 wide, so they are quantized) give the CPU's bytes."""
    import zoo
    from mxfp8_inputs import wide_experts

    src = zoo.make(arch, tmp_path / "src", config_overrides=wide_experts(arch))
    fp8convert.quantize(src, tmp_path / "cpu", scheme="mxfp8", device="cpu")
    fp8convert.quantize(src, tmp_path / "cuda", scheme="mxfp8", device="cuda")
    assert output_bytes(tmp_path / "cuda") == output_bytes(tmp_path / "cpu")
