"""vLLM / DeepSeek native "fp8": per-tensor X.weight_scale (a float32 scalar) or, for blocks,
X.weight_scale_inv float32 [ceil(out/128), ceil(in/128)] (historical name: it multiplies).

Power-of-two block scales (--scale-format ue8m0) add "scale_fmt": "ue8m0", DeepSeek-V3.1's spelling: vLLM
turns on DeepGEMM's UE8M0 mode; transformers 5.24 casts the float32 scales to float8_e8m0fnu on a GPU,
exact only for powers of two (never write scale_fmt over scales that are not).
"""

from __future__ import annotations

from ..errors import FP8ConvertError
from ..options import BLOCK, ScaleFormat, Scheme
from .config import QuantizationConfig, declared_scale_fmt

E4M3_FMTS = (None, "e4m3", "float8_e4m3fn")  # `fmt` spellings of e4m3 weights: DeepSeek's, MiniMax's


class FP8Config(QuantizationConfig):
    format = "fp8"
    source_input_scale_names = ("input_scale", "activation_scale")  # vLLM's, transformers' name

    @property
    def source_scale_names(self) -> tuple[str, ...]:
        """Per tensor `weight_scale` (vLLM, AutoFP8) or `weight_scale_inv` (transformers, Mistral)."""
        return ("weight_scale_inv",) if self.scheme == Scheme.BLOCK else ("weight_scale", "weight_scale_inv")

    def to_dict(self) -> dict:
        config = {"quant_method": "fp8", "fmt": "e4m3"}
        config["activation_scheme"] = "static" if self.static_activations else "dynamic"
        if self.scheme == Scheme.BLOCK:
            config["weight_block_size"] = [BLOCK, BLOCK]
        if self.scale_format == ScaleFormat.UE8M0:
            config["scale_fmt"] = "ue8m0"
        # vLLM reads ignored_layers; transformers reads modules_to_not_convert.
        return config | {"ignored_layers": list(self.ignore), "modules_to_not_convert": list(self.ignore)}

    @classmethod
    def from_dict(cls, qc: dict, where: str, source: bool = False) -> FP8Config:
        """As vLLM and transformers read it, a source and an output alike: block iff `weight_block_size`; the
        skip list under both `ignored_layers` and `modules_to_not_convert` (each engine reads one)."""
        if qc.get("fmt") not in E4M3_FMTS:
            raise FP8ConvertError(
                f"{where}: quantization_config fmt {qc.get('fmt')!r} is not e4m3 (fp8convert reads "
                "float8_e4m3fn weights only)"
            )
        block = qc.get("weight_block_size")
        if block not in (None, [BLOCK, BLOCK]):
            raise FP8ConvertError(
                f"{where}: weight_block_size {block} is not [{BLOCK}, {BLOCK}] (the only block size fp8convert reads)"
            )
        activations = qc.get("activation_scheme") or "dynamic"
        if activations not in ("dynamic", "static"):
            raise FP8ConvertError(f"{where}: activation_scheme {activations!r} is neither dynamic nor static")
        if qc.get("expert_dtype") not in (None, "fp8"):
            raise FP8ConvertError(
                f"{where}: expert_dtype {qc.get('expert_dtype')!r}: experts in another format than "
                "FP8 are not supported"
            )
        ignore = dict.fromkeys([*(qc.get("ignored_layers") or ()), *(qc.get("modules_to_not_convert") or ())])
        scheme = Scheme.BLOCK if block else Scheme.TENSOR
        return cls(scheme, tuple(ignore), declared_scale_fmt(qc, where), activations == "static")
