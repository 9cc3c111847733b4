"""compressed-tensors "float-quantized": read by vLLM, SGLang and (via the compressed-tensors package)
transformers. Per quantized linear X: X.weight float8_e4m3fn and X.weight_scale float32 shaped [1]
(tensor), [out, 1] (channel) or [ceil(out/128), ceil(in/128)] (block)."""
from __future__ import annotations

from ..errors import FP8ConvertError
from ..options import BLOCK
from .source_config import SourceConfig

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


def quantization_config(scheme: str, ignore: list[str], static_activations: bool = False) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": scheme, "symmetric": True, "dynamic": False,
               "group_size": None, "block_structure": [BLOCK, BLOCK] if scheme == "block" else None}
    # Activations are quantized on the fly by the engine: per token with per-channel weights, per
    # 128-wide group with block weights, per tensor with per-tensor weights (what vLLM's MoE accepts).
    # Static ones (an FP8 source's calibrated input_scale, carried in the tensor scheme) are per tensor.
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static_activations,
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


# compressed-tensors formats that store FP8 weights as they are (float8_e4m3fn codes and a scale); the
# others pack integers or 4-bit floats, named here so a refusal says what the checkpoint holds.
FP8_FORMATS = ("float-quantized", "naive-quantized")
OTHER_FORMATS = {
    "pack-quantized": "integer weights packed into int32 (e.g. W4A16)",
    "int-quantized": "int8 weights",
    "nvfp4-pack-quantized": "NVFP4 (4-bit float) weights",
    "mxfp4-pack-quantized": "MXFP4 (4-bit float) weights",
    "mxfp8-quantized": "MXFP8 (FP8 with power-of-two scales per 32 values)",
    "marlin-24": "2:4 sparse int4 weights (Marlin)",
    "sparse-24-bitmask": "2:4 sparse weights",
    "sparse-bitmask": "sparse weights (bitmask)",
    "dense": "no quantization",
}


def _not_fp8(where: str, what: str) -> FP8ConvertError:
    return FP8ConvertError(f"{where}: compressed-tensors checkpoint with {what}; fp8convert reads FP8 (float8_e4m3fn "
                           "weights with tensor, channel or block scales) only")


def read_source_config(qc: dict, where: str) -> SourceConfig:
    """A compressed-tensors source whose every config group holds symmetric 8-bit float weights with one
    strategy (tensor, channel or 128x128 block) and dynamic, absent (weight-only) or static per-tensor
    input activations. Anything else is refused with what it is."""
    formats = [qc.get("format")] + [g.get("format") for g in (qc.get("config_groups") or {}).values()
                                    if isinstance(g, dict) and g.get("format")]
    for fmt in formats:
        if fmt not in (*FP8_FORMATS, "mixed-precision", None):
            raise _not_fp8(where, f"format {fmt!r} ({OTHER_FORMATS.get(fmt, 'not an FP8 format')})")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise _not_fp8(where, f"a {key} (sparse or transformed weights)")
    if qc.get("kv_cache_scheme"):
        raise FP8ConvertError(f"{where}: kv_cache_scheme is set: FP8 KV-cache scales (k_scale, v_scale) are not "
                              "supported in a source")
    if qc.get("quantization_status") not in (None, "compressed"):
        raise FP8ConvertError(f"{where}: quantization_status {qc.get('quantization_status')!r}: the weights are not "
                              "stored compressed (FP8)")
    groups = {name: g for name, g in (qc.get("config_groups") or {}).items() if isinstance(g, dict)}
    if not groups:
        raise FP8ConvertError(f"{where}: compressed-tensors quantization_config has no config_groups")
    strategies, static = set(), set()
    for name, group in groups.items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise _not_fp8(where, f"config group {name}: {w.get('type')} {w.get('num_bits')}-bit weights")
        if w.get("strategy") == "group" and w.get("group_size") == 32:
            raise _not_fp8(where, f"config group {name}: MXFP8-style weights (one scale per 32 values)")
        if w.get("strategy") not in ("tensor", "channel", "block"):
            raise _not_fp8(where, f"config group {name}: weight strategy {w.get('strategy')!r}")
        if w.get("symmetric") is False or w.get("dynamic"):
            raise _not_fp8(where, f"config group {name}: asymmetric or dynamic weights")
        if w.get("strategy") == "block" and w.get("block_structure") != [BLOCK, BLOCK]:
            raise FP8ConvertError(f"{where}: config group {name}: block_structure {w.get('block_structure')} is not "
                                  f"[{BLOCK}, {BLOCK}] (the only block size fp8convert reads)")
        strategies.add(w["strategy"])
        if group.get("output_activations"):
            raise _not_fp8(where, f"config group {name}: quantized output activations")
        a = group.get("input_activations")
        if a and not a.get("dynamic"):
            if a.get("strategy") != "tensor" or a.get("type") != "float" or a.get("num_bits") != 8 or \
                    a.get("symmetric") is False:
                raise _not_fp8(where, f"config group {name}: static input activations of strategy "
                                      f"{a.get('strategy')!r} (only per-tensor FP8 ones are read)")
            static.add(True)
        else:
            static.add(False)
    if len(strategies) > 1 or len(static) > 1:
        raise FP8ConvertError(f"{where}: config groups mix weight strategies or activation schemes "
                              f"({', '.join(sorted(strategies))}); fp8convert reads one FP8 scheme per checkpoint")
    return SourceConfig("compressed-tensors", strategies.pop(), static.pop(), tuple(qc.get("ignore") or ()),
                        ("weight_scale",), ("input_scale",))
