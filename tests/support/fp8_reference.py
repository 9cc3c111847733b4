"""FP8 checkpoints written the way other tools write them, independently of fp8convert.

`write_fp8(src, out, layout)` turns a BF16 test checkpoint into an FP8 one: DeepSeek-V3's native
`fp8` with 128x128 `weight_scale_inv` blocks (power-of-two scales, as V3.1's `scale_fmt: ue8m0`),
Qwen3-FP8's with bfloat16 or float16 block scales, AutoFP8's per-tensor `weight_scale` with static
`input_scale` (scale = 1 / bf16(448 / amax), not amax / 448), and llm-compressor's compressed-tensors
tensor / channel / block presets (bfloat16 scales, as the observed dtype gives). Which weights become
FP8 follows tests/support/reference.py's reading of DESIGN's rules (routers, heads, MTP eh_proj stay BF16), so
a correct requantization keeps every FP8 weight FP8. Shards, index, side files and config are written
as those tools write them. Shares no code with fp8convert; uses tests/support/reference.py's dequant.

`dequantized(fp8_dir)` gives each FP8 weight's float32 values (float32(q) * scale), the source of
truth the tests hold dequantize and requantize to.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import reference as R
import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Layout:
    """How a tool stores FP8 weights."""

    format: str  # "fp8" (native) or "compressed-tensors"
    scheme: str  # tensor | channel | block
    scale_dtype: torch.dtype = torch.float32
    scale_rule: str = "amax"  # amax: amax / 448; pow2: 2^ceil(log2(amax / 448)); autofp8: 1 / bf16(448 / amax)
    static: bool = False  # static per-tensor input scales
    skip_list: bool = False  # native: write modules_to_not_convert (Qwen3-FP8 style)
    scale_fmt: str | None = None  # native: "ue8m0" (DeepSeek-V3.1)


LAYOUTS = {
    "deepseek-native-block-ue8m0": Layout("fp8", "block", scale_rule="pow2", scale_fmt="ue8m0"),
    "qwen-native-block-bf16": Layout("fp8", "block", torch.bfloat16, skip_list=True),
    "qwen-native-block-fp16": Layout("fp8", "block", torch.float16, skip_list=True),
    "autofp8-native-tensor-static": Layout("fp8", "tensor", scale_rule="autofp8", static=True),
    "ct-tensor-static-bf16": Layout("compressed-tensors", "tensor", torch.bfloat16, static=True),
    "ct-channel-bf16": Layout("compressed-tensors", "channel", torch.bfloat16),
    "ct-block-f32": Layout("compressed-tensors", "block"),
}


def _scale_of(amax: float, rule: str, dtype: torch.dtype) -> torch.Tensor:
    """One scale value, in float32 first and then stored as `dtype`."""
    if amax == 0.0:
        return torch.tensor(1.0, dtype=dtype)
    if rule == "pow2":
        value = torch.tensor(2.0 ** math.ceil(math.log2(amax / FP8_MAX)), dtype=torch.float32)
    elif rule == "autofp8":  # AutoFP8: scale = 1 / (finfo.max / amax) with the division in the weight dtype
        value = 1.0 / (torch.tensor(FP8_MAX, dtype=torch.bfloat16) / torch.tensor(amax, dtype=torch.bfloat16)).float()
    else:
        value = torch.tensor(amax, dtype=torch.float32) / torch.tensor(FP8_MAX, dtype=torch.float32)
    return value.to(dtype)


def quantize_weight(w: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, stored scale): the scale in its stored dtype, codes = clamp(w / float32(stored scale)) in e4m3."""
    w = w.to(torch.float32)
    rows, cols = w.shape
    if layout.scheme == "tensor":
        scale = _scale_of(w.abs().max().item(), layout.scale_rule, layout.scale_dtype)
        full = scale.float()
        scale = scale.reshape(() if layout.format == "fp8" else (1,))
    elif layout.scheme == "channel":
        scale = torch.stack(
            [_scale_of(w[r].abs().max().item(), layout.scale_rule, layout.scale_dtype) for r in range(rows)]
        ).reshape(rows, 1)
        full = scale.float()
    else:
        gr, gc = R.block_grid(w.shape)
        scale = torch.stack(
            [
                torch.stack(
                    [
                        _scale_of(
                            w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max().item(),
                            layout.scale_rule,
                            layout.scale_dtype,
                        )
                        for j in range(gc)
                    ]
                )
                for i in range(gr)
            ]
        )
        full = scale.float().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    codes = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def quantization_config(layout: Layout, skipped: list[str]) -> dict:
    if layout.format == "fp8":
        qc = {"activation_scheme": "static" if layout.static else "dynamic", "fmt": "e4m3", "quant_method": "fp8"}
        if layout.scheme == "block":
            qc["weight_block_size"] = [128, 128]
        if layout.scale_fmt:
            qc["scale_fmt"] = layout.scale_fmt
        if layout.skip_list:
            qc["modules_to_not_convert"] = skipped
        elif layout.static:  # AutoFP8 writes ignored_layers
            qc["ignored_layers"] = ["lm_head"]
        return qc
    weights = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": layout.scheme,
        "dynamic": False,
        "group_size": None,
        "block_structure": [128, 128] if layout.scheme == "block" else None,
        "actorder": None,
        "observer": "minmax",
    }
    activations = (
        {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "tensor",
            "dynamic": False,
            "observer": "static_minmax",
        }
        if layout.static
        else {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "dynamic": True,
            "strategy": {"tensor": "tensor", "channel": "token", "block": "group"}[layout.scheme],
            "group_size": 128 if layout.scheme == "block" else None,
        }
    )
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations,
                "output_activations": None,
            }
        },
        "ignore": skipped,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "version": "0.12.2",
    }


def scale_suffix(layout: Layout) -> str:
    return "weight_scale_inv" if layout.format == "fp8" and layout.scheme == "block" else "weight_scale"


def write_fp8(src: Path, out: Path, layout: Layout, arch: str | None = None) -> Path:
    """An FP8 copy of the BF16 checkpoint `src` in `out`, shard by shard (same shard names)."""
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    index = json.loads((src / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    tensors = {f: load_file(str(src / f)) for f in shards}
    shapes = {n: tuple(t.shape) for ts in tensors.values() for n, t in ts.items()}
    quant = R.expected_quantized(
        shapes, layout.scheme, extra_keep=R.arch_keep(arch, layout.format, layout.scheme) if arch else None
    )
    g = torch.Generator().manual_seed(5)
    weight_map, total = {}, 0
    for f in shards:
        written = {}
        for name, t in tensors[f].items():
            if name not in quant:
                written[name] = t
                continue
            codes, scale = quantize_weight(t, layout)
            module = name[: -len(".weight")]
            written[name] = codes
            written[f"{module}.{scale_suffix(layout)}"] = scale.contiguous()
            if layout.static:  # a calibrated activation scale: any positive value will do here
                value = (0.01 + torch.rand((), generator=g)).to(layout.scale_dtype)
                written[f"{module}.input_scale"] = value.reshape(() if layout.format == "fp8" else (1,))
        save_file(written, str(out / f), metadata={"format": "pt"})
        weight_map.update({n: f for n in written})
        total += sum(t.numel() * t.element_size() for t in written.values())
    (out / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
    )
    for p in src.iterdir():
        if p.is_file() and p.name not in (INDEX, "config.json") and not p.name.endswith(".safetensors"):
            shutil.copy(p, out / p.name)
    config = json.loads((src / "config.json").read_text())
    skipped = sorted(
        {n[: -len(".weight")] for n, s in shapes.items() if n.endswith(".weight") and len(s) == 2 and n not in quant}
        | {"lm_head"}
    )
    config["quantization_config"] = quantization_config(layout, skipped)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def read_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def fp8_weights(tensors: dict, scheme: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{weight name: (codes, scale)} of an FP8 checkpoint's tensors (scale `weight_scale_inv` or `weight_scale`)."""
    found = {}
    for name, t in tensors.items():
        if t.dtype == FP8:
            module = name[: -len(".weight")]
            found[name] = (
                t,
                next(tensors[module + s] for s in (".weight_scale_inv", ".weight_scale") if module + s in tensors),
            )
    return found


def dequantized(tensors: dict, scheme: str) -> dict[str, torch.Tensor]:
    """Every FP8 weight's float32 values, float32(q) * float32(scale) (tests/support/reference.py's dequant)."""
    return {n: R.dequant(q, s.float(), scheme) for n, (q, s) in fp8_weights(tensors, scheme).items()}
