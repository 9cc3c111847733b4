"""What an FP8 source's config.json declares, as each format's reader (fp8.py, compressed_tensors.py) finds it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceConfig:
    """The quantization an FP8 checkpoint's config.json declares (its tensors are checked against it)."""

    format: str                          # fp8 | compressed-tensors
    scheme: str                          # tensor | channel | block
    static_activations: bool             # calibrated per-tensor input scales, one per FP8 linear
    ignore: tuple[str, ...]              # the source's own list of modules it left unquantized
    scale_names: tuple[str, ...]         # suffixes a weight's scale may have, e.g. ("weight_scale_inv",)
    input_scale_names: tuple[str, ...]   # suffixes of static activation scales
    scale_fmt: str | None = None         # native fp8's `scale_fmt` (e.g. "ue8m0"), as declared
