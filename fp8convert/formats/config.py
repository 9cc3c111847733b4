"""quantization_config as one typed record, and how its format names, types and shapes a weight's scale.
Each format subclasses it: `from_dict` (an FP8 source and fp8convert's output alike), `to_dict`."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import ClassVar

from ..errors import FP8ConvertError
from ..options import BLOCK, GROUP_SIZE, Format, Scheme


@dataclass(frozen=True)
class QuantizationConfig:
    """What a checkpoint's quantization_config declares; a subclass adds its format's source tensor names."""

    format: ClassVar[str]  # fp8 | compressed-tensors (also its quant_method)
    source_input_scale_names: ClassVar[tuple[str, ...]]  # a source's static activation scale suffixes
    scheme: str  # tensor | channel | block | mxfp8 | nvfp4a16 | mxfp4a16
    ignore: tuple[str, ...] = ()  # modules left unquantized, as engines match them
    scale_fmt: str | None = None  # `scale_fmt` as declared: "ue8m0" (block scales are powers of two)
    static_activations: bool = False  # calibrated per-tensor input scales, one per FP8 linear
    unkept: tuple[str, ...] = ()  # what it declares that loaders act on but fp8convert writes no tensor for
    # a mixed recipe's other config groups: (scheme, targets); `scheme` is the group targeting "Linear"
    groups: tuple[tuple[str, tuple[str, ...]], ...] = ()
    targeted: tuple[str, ...] = ("Linear",)  # every config group's targets (the fp8 format targets every linear)

    @property
    def schemes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([self.scheme, *(scheme for scheme, _ in self.groups)]))

    def for_module(self, module: str) -> QuantizationConfig:
        """This config as engines apply it to `module`, in one scheme: a group's naming it exactly, else one's
        whose `re:` target matches it, else the default (vLLM and compressed-tensors rank matches so)."""
        for exact in (True, False):
            for scheme, targets in self.groups:
                if any(module == t if exact else t.startswith("re:") and re.match(t[3:], module) for t in targets):
                    return replace(self, scheme=scheme, groups=())
        return replace(self, groups=()) if self.groups else self

    @property
    def scale_format(self) -> str:
        return "ue8m0" if self.scale_fmt == "ue8m0" else "float"

    def scale_name(self, weight: str) -> str:
        """fp8 names block scales `weight_scale_inv` (they multiply all the same), others `weight_scale`."""
        return weight + ("_scale_inv" if self.format == Format.FP8 and self.scheme == Scheme.BLOCK else "_scale")

    def scale_dtype(self) -> str:
        return {Scheme.MXFP8: "U8", Scheme.MXFP4A16: "U8", Scheme.NVFP4A16: "F8_E4M3"}.get(self.scheme, "F32")

    def scale_shapes(self, shape: tuple[int, int], source: bool = False) -> list[tuple[int, ...]]:
        """The scale shapes a reader accepts for a weight of `shape`, the written one first. A per-tensor
        scale may be [] or [1] in fp8 (vLLM reads either) and in any source."""
        out, inp = shape
        if self.scheme == Scheme.TENSOR:
            return [(1,)] if self.format == Format.COMPRESSED_TENSORS and not source else [(), (1,)]
        if self.scheme in GROUP_SIZE:
            return [(out, inp // GROUP_SIZE[self.scheme])]
        return [{Scheme.CHANNEL: (out, 1), Scheme.BLOCK: (-(-out // BLOCK), -(-inp // BLOCK))}[self.scheme]]

    def targets(self, module: str) -> bool:
        """Whether a config group targets `module`, a linear layer: "Linear" names them all, else its exact name
        or a matching `re:` pattern. Engines load a quantized weight no group targets as an unquantized layer."""
        return any(t in ("Linear", module) or t.startswith("re:") and re.match(t[3:], module) for t in self.targeted)

    def ignores(self, module: str) -> bool:
        """Exact module name (vLLM's `prefix in ignored_layers`) or a compressed-tensors `re:` pattern."""
        return any(module == p or (p.startswith("re:") and re.match(p[3:], module)) for p in self.ignore)


def declared_scale_fmt(qc: dict, where: str) -> str | None:
    """A config's top-level `scale_fmt` (DeepSeek-V3.1's fp8, or --scale-format ue8m0 in either format)."""
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "float", "ue8m0"):
        raise FP8ConvertError(f"{where}: scale_fmt {scale_fmt!r} is neither float nor ue8m0")
    return scale_fmt
