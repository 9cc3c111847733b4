"""The CUDA path: same bytes as the CPU path, whatever the batching. Skipped where there is no GPU
(CI); run on a GPU machine with `python3 -m pytest -q tests/test_gpu.py`."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fp8convert

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

COMBOS = [("tensor", "compressed-tensors"), ("channel", "compressed-tensors"), ("block", "compressed-tensors"),
          ("tensor", "fp8"), ("block", "fp8")]


def output_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("scheme,fmt", COMBOS)
def test_cuda_writes_the_same_bytes_as_cpu(source_model, tmp_path, kind, scheme, fmt):
    src = source_model(kind)
    cpu = fp8convert.quantize(src, tmp_path / "cpu", scheme=scheme, format=fmt, device="cpu", max_shard_size="150KB")
    cuda = fp8convert.quantize(src, tmp_path / "cuda", scheme=scheme, format=fmt, device="cuda",
                               max_shard_size="150KB")
    assert cuda.device.startswith("cuda") and cuda.peak_device_bytes > 0
    assert cpu.shards == cuda.shards > 1
    assert output_bytes(tmp_path / "cuda") == output_bytes(tmp_path / "cpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("scheme,fmt", [("tensor", "compressed-tensors"), ("channel", "compressed-tensors"),
                                        ("block", "fp8")])
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
    import json
    src = tmp_path / "src"
    src.mkdir()
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    w[3, 5] = float("nan")
    save_file({"model.layers.0.mlp.down_proj.weight": w, "model.layers.0.mlp.up_proj.weight": torch.randn(64, 64).bfloat16(),
               "model.layers.0.mlp.gate_proj.weight": torch.randn(64, 64).bfloat16()}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(fp8convert.FP8ConvertError, match="model.layers.0.mlp.down_proj.weight"):
        fp8convert.quantize(src, tmp_path / "out", device="cuda")


@pytest.mark.parametrize("arch", ["llama4", "granitemoe", "qwen3_vl_moe", "gemma4"])
@pytest.mark.parametrize("scheme,fmt", COMBOS)
def test_cuda_cuts_fused_experts_like_cpu(zoo_source, tmp_path, arch, scheme, fmt):
    """Experts cut from fused 3-D tensors (strided views: transposed, halves) give the CPU's bytes."""
    src = zoo_source(arch)
    fp8convert.quantize(src, tmp_path / "cpu", scheme=scheme, format=fmt, device="cpu")
    fp8convert.quantize(src, tmp_path / "cuda", scheme=scheme, format=fmt, device="cuda")
    assert output_bytes(tmp_path / "cuda") == output_bytes(tmp_path / "cpu")


@pytest.mark.parametrize("layout", ["deepseek-native-block-ue8m0", "qwen-native-block-fp16", "ct-channel-bf16",
                                    "autofp8-native-tensor-static"])
def test_cuda_dequantizes_and_requantizes_fp8_sources_like_cpu(tmp_path, layout):
    """FP8 sources: the CPU's table lookup and CUDA's float32 product give the same bytes, in every
    dtype, and so do requantizations (dims of 192 and 320: partial 128x128 blocks)."""
    import fp8_reference as F
    from tiny_ckpt import llama_tensors, write_checkpoint
    bf16 = write_checkpoint(tmp_path / "bf16", llama_tensors(layers=3, hidden=192, inter=320))
    src = F.write_fp8(bf16, tmp_path / "src", F.LAYOUTS[layout])
    runs = [("dequantize", {"dtype": d}) for d in ("bf16", "fp16", "fp32")]
    runs += [("quantize", {"scheme": s, "format": "compressed-tensors"}) for s in ("tensor", "channel", "block")]
    for n, (command, options) in enumerate(runs):
        convert = getattr(fp8convert, command)
        convert(src, tmp_path / f"cpu{n}", device="cpu", max_shard_size="150KB", **options)
        convert(src, tmp_path / f"cuda{n}", device="cuda", max_shard_size="150KB", **options)
        assert output_bytes(tmp_path / f"cuda{n}") == output_bytes(tmp_path / f"cpu{n}"), (command, options)
