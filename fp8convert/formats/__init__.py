"""Output formats: how quantized tensors are named, the shapes of their scales, and what
`quantization_config` says, both written (quantize) and read back (verify). One module each."""
from __future__ import annotations

import re
from dataclasses import dataclass
from types import ModuleType

from ..errors import FP8ConvertError
from ..options import regex_error
from . import compressed_tensors, fp8

FORMATS: dict[str, ModuleType] = {"compressed-tensors": compressed_tensors, "fp8": fp8}


def get_format(name: str) -> ModuleType:
    return FORMATS[name]


@dataclass(frozen=True)
class QuantizedLayout:
    """What an FP8 checkpoint's config says it is."""

    format: str                 # compressed-tensors | fp8
    scheme: str                 # tensor | channel | block | mxfp8
    ignore: tuple[str, ...]     # modules left unquantized, as engines match them
    scale_format: str = "float"  # "ue8m0": block scales are powers of two (scale_fmt)
    static_activations: bool = False  # each quantized weight then needs its input_scale

    def scale_name(self, weight: str) -> str:
        return get_format(self.format).scale_name(weight, self.scheme)

    def scale_dtype(self) -> str:
        return get_format(self.format).scale_dtype(self.scheme)

    def scale_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        return get_format(self.format).scale_shapes(shape, self.scheme)

    def ignores(self, module: str) -> bool:
        """Exact module name (vLLM's `prefix in ignored_layers`) or a compressed-tensors `re:` pattern."""
        return any(module == p or (p.startswith("re:") and re.match(p[3:], module)) for p in self.ignore)


def read_quantization_config(config: dict, where: str) -> QuantizedLayout:
    """The layout a config.json declares; one line naming `where` if it is not an FP8 layout we know."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise FP8ConvertError(f"{where}: has no quantization_config; not an FP8 checkpoint")
    method = qc.get("quant_method")
    for name, module in FORMATS.items():
        if method == module.QUANT_METHOD:
            scheme, ignore = module.read_config(qc, where)
            for pattern in ignore:
                if problem := regex_error(pattern):
                    raise FP8ConvertError(f"{where}: quantization_config's ignore entry {pattern!r} is not a valid "
                                          f"regular expression ({problem})")
            scale_format = module.read_scale_format(qc)
            if scale_format == "ue8m0" and scheme != "block":
                raise FP8ConvertError(f"{where}: scale_fmt ue8m0 with {scheme} scales (it describes block scales)")
            return QuantizedLayout(name, scheme, ignore, scale_format, declares_static_activations(qc))
    raise FP8ConvertError(f"{where}: quant_method {method!r} is neither compressed-tensors nor fp8")


def declares_static_activations(qc: dict) -> bool:
    """Static input activations, in either format (fp8's activation_scheme, a compressed-tensors config
    group's input_activations that are not dynamic)."""
    if qc.get("activation_scheme") == "static":
        return True
    groups = qc.get("config_groups") if isinstance(qc.get("config_groups"), dict) else {}
    return any(isinstance(g, dict) and isinstance(g.get("input_activations"), dict)
               and g["input_activations"].get("dynamic") is False for g in groups.values())
