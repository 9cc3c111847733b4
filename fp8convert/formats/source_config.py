"""What an FP8 source's config.json declares, as each format's reader (fp8.py, compressed_tensors.py) finds it."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import FP8ConvertError


@dataclass(frozen=True)
class SourceConfig:
    """The quantization an FP8 checkpoint's config.json declares (its tensors are checked against it)."""

    format: str                          # fp8 | compressed-tensors
    scheme: str                          # tensor | channel | block
    static_activations: bool             # calibrated per-tensor input scales, one per FP8 linear
    ignore: tuple[str, ...]              # the source's own list of modules it left unquantized
    scale_names: tuple[str, ...]         # suffixes a weight's scale may have, e.g. ("weight_scale_inv",)
    input_scale_names: tuple[str, ...]   # suffixes of static activation scales
    scale_fmt: str | None = None         # `scale_fmt` as declared: "ue8m0" (block scales are powers of two)


def declared_scale_fmt(qc: dict, where: str) -> str | None:
    """A config's top-level `scale_fmt` (DeepSeek-V3.1's native fp8 has it; fp8convert writes it in both
    formats for --scale-format ue8m0): absent, "float" or "ue8m0"."""
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "float", "ue8m0"):
        raise FP8ConvertError(f"{where}: scale_fmt {scale_fmt!r} is neither float nor ue8m0")
    return scale_fmt
