"""compressed-tensors "float-quantized": read by vLLM, SGLang and (via the compressed-tensors package)
transformers. Per quantized linear X: X.weight float8_e4m3fn and X.weight_scale float32 shaped [1]
(tensor), [out, 1] (channel) or [ceil(out/128), ceil(in/128)] (block)."""
from __future__ import annotations

from ..errors import FP8ConvertError
from ..options import BLOCK

QUANT_METHOD = "compressed-tensors"


def scale_name(weight_name: str, scheme: str) -> str:
    return weight_name + "_scale"


def scale_shapes(shape: tuple[int, int], scheme: str) -> list[tuple[int, ...]]:
    """The scale shapes a reader accepts for a weight of `shape`; the first is the one written."""
    out, inp = shape
    if scheme == "tensor":
        return [(1,)]
    if scheme == "channel":
        return [(out, 1)]
    return [(-(-out // BLOCK), -(-inp // BLOCK))]


def scale_shape(shape: tuple[int, int], scheme: str) -> tuple[int, ...]:
    return scale_shapes(shape, scheme)[0]


def quantization_config(scheme: str, ignore: list[str]) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": scheme, "symmetric": True, "dynamic": False,
               "group_size": None, "block_structure": [BLOCK, BLOCK] if scheme == "block" else None}
    # Activations are quantized on the fly by the engine: per token with per-channel weights, per
    # 128-wide group with block weights, per tensor with per-tensor weights (what vLLM's MoE accepts).
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                   "strategy": {"tensor": "tensor", "channel": "token", "block": "group"}[scheme],
                   "group_size": BLOCK if scheme == "block" else None}
    return {
        "quant_method": QUANT_METHOD,
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": activations}},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def read_config(qc: dict, where: str) -> tuple[str, tuple[str, ...]]:
    """(scheme, ignore list) of a float-quantized config with one FP8 weight scheme."""
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    weights = [(g.get("weights") or {}) for g in groups]
    strategies = {w.get("strategy") for w in weights}
    if qc.get("format") != "float-quantized" or len(strategies) != 1 or \
            any(w.get("type") != "float" or w.get("num_bits") != 8 for w in weights):
        raise FP8ConvertError(f"{where}: quantization_config is not one FP8 float-quantized group")
    scheme = strategies.pop()
    if scheme not in ("tensor", "channel", "block"):
        raise FP8ConvertError(f"{where}: unsupported weight strategy {scheme!r}")
    if scheme == "block" and any(w.get("block_structure") != [BLOCK, BLOCK] for w in weights):
        raise FP8ConvertError(f"{where}: block_structure is not [{BLOCK}, {BLOCK}]")
    return scheme, tuple(qc.get("ignore") or ())
