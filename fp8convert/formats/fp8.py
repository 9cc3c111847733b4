"""vLLM / DeepSeek native "fp8": per-tensor X.weight_scale (a float32 scalar) or, for blocks,
X.weight_scale_inv float32 [ceil(out/128), ceil(in/128)] (historical name: it multiplies).
No per-channel and no MXFP8 scheme in this format.

Power-of-two block scales (--scale-format ue8m0) add "scale_fmt": "ue8m0", DeepSeek-V3.1's spelling.
vLLM reads it (any quant_method) to turn on DeepGEMM's UE8M0 mode; transformers 5.24 reads it as
"scales are 1-byte float8_e8m0fnu" and, on a GPU, casts the float32 scales to that dtype on load: exact
for the powers of two written here (never write scale_fmt over scales that are not). The scales stay
float32 on disk, as DeepSeek-V3.1 ships them.
"""
from __future__ import annotations

from ..errors import FP8ConvertError
from ..options import BLOCK
from .source_config import SourceConfig, declared_scale_fmt

QUANT_METHOD = "fp8"


def scale_name(weight_name: str, scheme: str) -> str:
    return weight_name + ("_scale_inv" if scheme == "block" else "_scale")


def scale_dtype(scheme: str) -> str:
    return "F32"


def scale_shapes(shape: tuple[int, int], scheme: str) -> list[tuple[int, ...]]:
    """The scale shapes a reader accepts for a weight of `shape`; the first is the one written
    (vLLM reads a per-tensor scale shaped [] or [1])."""
    if scheme == "tensor":
        return [(), (1,)]
    if scheme == "block":
        return [(-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))]
    raise ValueError(f"the fp8 format has no {scheme} scheme")  # Options refuses this earlier


def scale_shape(shape: tuple[int, int], scheme: str) -> tuple[int, ...]:
    return scale_shapes(shape, scheme)[0]


def quantization_config(scheme: str, ignore: list[str], scale_format: str = "float",
                        static_activations: bool = False) -> dict:
    """`static_activations`: every FP8 linear has an `input_scale` (carried from an FP8 source)."""
    config = {"quant_method": QUANT_METHOD, "fmt": "e4m3",
              "activation_scheme": "static" if static_activations else "dynamic"}
    if scheme == "block":
        config["weight_block_size"] = [BLOCK, BLOCK]
    if scale_format == "ue8m0":
        config["scale_fmt"] = "ue8m0"
    # vLLM reads ignored_layers; transformers reads modules_to_not_convert.
    config["ignored_layers"] = list(ignore)
    config["modules_to_not_convert"] = list(ignore)
    return config


def read_config(qc: dict, where: str) -> tuple[str, tuple[str, ...]]:
    """(scheme, ignore list): both ignore keys together, as vLLM and transformers each read one."""
    block = qc.get("weight_block_size")
    if block not in (None, [BLOCK, BLOCK]):
        raise FP8ConvertError(f"{where}: weight_block_size {block} is not [{BLOCK}, {BLOCK}]")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise FP8ConvertError(f"{where}: fmt {qc.get('fmt')!r} is not e4m3")
    ignore = tuple(qc.get("ignored_layers") or ()) + tuple(qc.get("modules_to_not_convert") or ())
    return "block" if block else "tensor", tuple(dict.fromkeys(ignore))


def read_scale_format(qc: dict) -> str:
    """"ue8m0" when scale_fmt says the block scales are powers of two, else "float"."""
    return "ue8m0" if qc.get("scale_fmt") == "ue8m0" else "float"


# `fmt` spellings of e4m3 weights: DeepSeek writes "e4m3", MiniMax "float8_e4m3fn".
E4M3_FMTS = (None, "e4m3", "float8_e4m3fn")


def read_source_config(qc: dict, where: str) -> SourceConfig:
    """A native fp8 source's config, as vLLM and transformers read it: block iff `weight_block_size`
    is given, `activation_scheme` dynamic or static, the skip list under `ignored_layers` or else
    `modules_to_not_convert`. Block scales are `weight_scale_inv`; per-tensor scales `weight_scale`
    (vLLM, AutoFP8) or `weight_scale_inv` (transformers, Mistral); static activation scales `input_scale`
    (vLLM) or `activation_scale` (transformers)."""
    if qc.get("fmt") not in E4M3_FMTS:
        raise FP8ConvertError(f"{where}: quantization_config fmt {qc.get('fmt')!r} is not e4m3 (fp8convert reads "
                              "float8_e4m3fn weights only)")
    block = qc.get("weight_block_size")
    if block not in (None, [BLOCK, BLOCK]):
        raise FP8ConvertError(f"{where}: weight_block_size {block} is not [{BLOCK}, {BLOCK}] (the only block size "
                              "fp8convert reads)")
    activations = qc.get("activation_scheme") or "dynamic"
    if activations not in ("dynamic", "static"):
        raise FP8ConvertError(f"{where}: activation_scheme {activations!r} is neither dynamic nor static")
    if qc.get("expert_dtype") not in (None, "fp8"):
        raise FP8ConvertError(f"{where}: expert_dtype {qc.get('expert_dtype')!r}: experts in another format than "
                              "FP8 are not supported")
    ignore = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()
    return SourceConfig("fp8", "block" if block else "tensor", activations == "static", tuple(ignore),
                        ("weight_scale_inv",) if block else ("weight_scale", "weight_scale_inv"),
                        ("input_scale", "activation_scale"), declared_scale_fmt(qc, where))
