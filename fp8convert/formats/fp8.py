"""vLLM / DeepSeek native "fp8": per-tensor X.weight_scale (a float32 scalar) or, for blocks,
X.weight_scale_inv float32 [ceil(out/128), ceil(in/128)] (historical name: it multiplies).
No per-channel scheme in this format."""
from __future__ import annotations

from ..errors import FP8ConvertError
from ..options import BLOCK

QUANT_METHOD = "fp8"


def scale_name(weight_name: str, scheme: str) -> str:
    return weight_name + ("_scale_inv" if scheme == "block" else "_scale")


def scale_shapes(shape: tuple[int, int], scheme: str) -> list[tuple[int, ...]]:
    """The scale shapes a reader accepts for a weight of `shape`; the first is the one written
    (vLLM reads a per-tensor scale shaped [] or [1])."""
    if scheme == "tensor":
        return [(), (1,)]
    if scheme == "block":
        return [(-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))]
    raise ValueError("the fp8 format has no per-channel scheme")  # Options refuses this earlier


def scale_shape(shape: tuple[int, int], scheme: str) -> tuple[int, ...]:
    return scale_shapes(shape, scheme)[0]


def quantization_config(scheme: str, ignore: list[str]) -> dict:
    config = {"quant_method": QUANT_METHOD, "fmt": "e4m3", "activation_scheme": "dynamic"}
    if scheme == "block":
        config["weight_block_size"] = [BLOCK, BLOCK]
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
