"""Output formats: quantized tensors' names, their scales' shapes, and quantization_config, written and read."""

from __future__ import annotations

from ..errors import FP8ConvertError
from ..options import ScaleFormat, Scheme, regex_error
from .compressed_tensors import CompressedTensorsConfig
from .config import QuantizationConfig
from .fp8 import FP8Config

# by format name, which is also the quant_method in config.json (look up str(quant_method): it may be any JSON)
CONFIGS: dict[str, type[QuantizationConfig]] = {"compressed-tensors": CompressedTensorsConfig, "fp8": FP8Config}


def read_quantization_config(config: dict, where: str) -> QuantizationConfig:
    """The quantization an output's config.json declares, refused if not an FP8 layout we know."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise FP8ConvertError(f"{where}: has no quantization_config; not an FP8 checkpoint")
    kind = CONFIGS.get(str(qc.get("quant_method")))
    if kind is None:
        raise FP8ConvertError(f"{where}: quant_method {qc.get('quant_method')!r} is neither compressed-tensors nor fp8")
    declared = kind.from_dict(qc, where)
    for pattern in declared.ignore:
        if problem := regex_error(pattern):
            raise FP8ConvertError(
                f"{where}: quantization_config's ignore entry {pattern!r} is not a valid regular expression ({problem})"
            )
    if declared.scale_format == ScaleFormat.UE8M0 and declared.scheme != Scheme.BLOCK:
        raise FP8ConvertError(f"{where}: scale_fmt ue8m0 with {declared.scheme} scales (it describes block scales)")
    return declared
