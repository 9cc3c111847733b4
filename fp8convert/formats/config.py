"""quantization_config as one typed record. Each format (fp8.py, compressed_tensors.py) has a subclass
that parses its dict (`from_dict`, for an FP8 source and for fp8convert's own output alike) and writes
it back (`to_dict`), so nothing else reads the raw dict."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from ..errors import FP8ConvertError


@dataclass(frozen=True)
class QuantizationConfig:
    """What a checkpoint's quantization_config declares. A subclass adds its format's tensor names:
    scale_name/scale_dtype/scale_shapes as it writes them, source_scale_names as a source may have them."""

    format: ClassVar[str]  # fp8 | compressed-tensors (also its quant_method)
    source_input_scale_names: ClassVar[tuple[str, ...]]  # a source's static activation scale suffixes
    scheme: str  # tensor | channel | block | mxfp8
    ignore: tuple[str, ...] = ()  # modules left unquantized, as engines match them
    scale_fmt: str | None = None  # `scale_fmt` as declared: "ue8m0" (block scales are powers of two)
    static_activations: bool = False  # calibrated per-tensor input scales, one per FP8 linear
    unkept: tuple[str, ...] = ()  # what it declares that loaders act on but fp8convert writes no tensor for

    @property
    def scale_format(self) -> str:
        return "ue8m0" if self.scale_fmt == "ue8m0" else "float"

    def ignores(self, module: str) -> bool:
        """Exact module name (vLLM's `prefix in ignored_layers`) or a compressed-tensors `re:` pattern."""
        return any(module == p or (p.startswith("re:") and re.match(p[3:], module)) for p in self.ignore)


def declared_scale_fmt(qc: dict, where: str) -> str | None:
    """A config's top-level `scale_fmt` (DeepSeek-V3.1's native fp8 has it; fp8convert writes it in both
    formats for --scale-format ue8m0): absent, "float" or "ue8m0"."""
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "float", "ue8m0"):
        raise FP8ConvertError(f"{where}: scale_fmt {scale_fmt!r} is neither float nor ue8m0")
    return scale_fmt
