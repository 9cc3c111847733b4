"""vLLM / DeepSeek native "fp8": per-tensor X.weight_scale (a float32 scalar) or, for blocks,
X.weight_scale_inv float32 [ceil(out/128), ceil(in/128)] (historical name: it multiplies).
No per-channel scheme in this format."""
from __future__ import annotations

from ..options import BLOCK


def scale_name(weight_name: str, scheme: str) -> str:
    return weight_name + ("_scale_inv" if scheme == "block" else "_scale")


def scale_shape(shape: tuple[int, int], scheme: str) -> tuple[int, ...]:
    if scheme == "tensor":
        return ()
    if scheme == "block":
        return (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
    raise ValueError("the fp8 format has no per-channel scheme")  # Options refuses this earlier


def quantization_config(scheme: str, ignore: list[str]) -> dict:
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if scheme == "block":
        config["weight_block_size"] = [BLOCK, BLOCK]
    # vLLM reads ignored_layers; transformers reads modules_to_not_convert.
    config["ignored_layers"] = list(ignore)
    config["modules_to_not_convert"] = list(ignore)
    return config
