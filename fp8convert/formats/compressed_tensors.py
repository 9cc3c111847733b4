"""compressed-tensors "float-quantized": read by vLLM, SGLang and (via the compressed-tensors package)
transformers. Per quantized linear X: X.weight float8_e4m3fn and X.weight_scale float32 shaped [1]
(tensor), [out, 1] (channel) or [ceil(out/128), ceil(in/128)] (block)."""
from __future__ import annotations

from ..options import BLOCK


def scale_name(weight_name: str, scheme: str) -> str:
    return weight_name + "_scale"


def scale_shape(shape: tuple[int, int], scheme: str) -> tuple[int, ...]:
    out, inp = shape
    if scheme == "tensor":
        return (1,)
    if scheme == "channel":
        return (out, 1)
    return (-(-out // BLOCK), -(-inp // BLOCK))


def quantization_config(scheme: str, ignore: list[str]) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": scheme, "symmetric": True, "dynamic": False,
               "group_size": None, "block_structure": [BLOCK, BLOCK] if scheme == "block" else None}
    # Activations are quantized on the fly by the engine: per token with per-channel weights, per
    # 128-wide group with block weights, per tensor with per-tensor weights (what vLLM's MoE accepts).
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                   "strategy": {"tensor": "tensor", "channel": "token", "block": "group"}[scheme],
                   "group_size": BLOCK if scheme == "block" else None}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": activations}},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }
