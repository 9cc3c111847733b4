"""FP8 checkpoints as sources, from headers alone: read only if FP8 as vLLM and transformers read it (native
`fp8`: DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8, MiniMax-M2, AutoFP8; or compressed-tensors FP8). Every
float8_e4m3fn weight must have exactly one scale, named and shaped as its format and scheme say; anything
else is refused naming the tensor or method (a `.scale` read as no scale gives weights thousands of times
off). The scales' values are checked when they are read.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import FP8ConvertError
from ..options import FP4_SCHEMES, Scheme
from ..safetensors_io import FP8, TensorInfo
from . import CONFIGS
from .config import QuantizationConfig

SCALE_DTYPES = ("F32", "BF16", "F16")  # every value of these is exact in float32
# quant_method -> what it is, for refusals (transformers' QuantizationMethod and vLLM's names).
# fmt: off
OTHER_METHODS = {
    "gptq": "GPTQ integer weights", "awq": "AWQ integer weights", "bitsandbytes": "bitsandbytes 4/8-bit weights",
    "mxfp4": "MXFP4 (4-bit float) weights", "mxfp8": "MXFP8 weights", "nvfp4": "NVFP4 (4-bit float) weights",
    "modelopt": "NVIDIA ModelOpt quantization", "fbgemm_fp8": "FBGEMM FP8 (per-channel, not read here)",
    "gguf": "GGUF", "hqq": "HQQ", "eetq": "EETQ int8", "aqlm": "AQLM", "quanto": "optimum-quanto",
    "torchao": "torchao", "auto-round": "AutoRound", "quark": "AMD Quark", "higgs": "HIGGS", "vptq": "VPTQ",
    "spqr": "SpQR", "bitnet": "BitNet", "fp_quant": "FP-Quant",
}
# fmt: on
# Tensor names only other quantization layouts have: found in a checkpoint, they name what it is.
FOREIGN_SUFFIXES = tuple(
    ".qweight .qzeros .g_idx .scales .weight_packed .weight_shape .weight_zero_point .weight_scale_2 "
    ".weight_global_scale .input_global_scale .input_zero_point .absmax .SCB _blocks .k_scale .v_scale "
    ".qscale_weight .qscale_act".split()
)
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")  # either format's, whatever the scheme
# Other tools' scale names: an FP8 weight with one of these and none of its format's is refused naming it.
OTHER_SCALE_SUFFIXES = (".scale", ".weight.scale", *SCALE_SUFFIXES, ".scale_inv", ".qscale_weight")


@dataclass(frozen=True)
class FP8Weight:
    """One FP8 (or FP4) weight of a source with the tensors that give its values."""

    weight: TensorInfo  # FP4: X.weight_packed, two values a byte
    scale: TensorInfo
    input_scale: TensorInfo | None = None  # static activations: carried or dropped, never used to dequantize
    global_scale: TensorInfo | None = None  # NVFP4

    @property
    def packed(self) -> bool:
        return self.weight.dtype == "U8"

    @property
    def name(self) -> str:
        """The weight's name in high precision: X.weight."""
        return self.weight.name.removesuffix("_packed")

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape in high precision."""
        out, inp = self.weight.shape
        return (out, inp * 2) if self.packed else (out, inp)


@dataclass(frozen=True)
class SourceQuantization:
    """How an FP8 source is quantized, and each FP8 weight's scale."""

    config: QuantizationConfig
    weights: dict[str, FP8Weight]  # by the weight's name

    @property
    def scheme(self) -> str:
        return self.config.scheme

    def companions(self) -> set[str]:
        """The scale tensors: inputs of their weights' outputs, never outputs of their own."""
        return {
            t.name for w in self.weights.values() for t in (w.scale, w.input_scale, w.global_scale) if t is not None
        }

    def describe(self) -> str:
        """One line for inspect and the model card, e.g. `fp8 block (weight_scale_inv F32), 120 FP8 weights`."""
        c = self.config
        names = sorted({w.scale.name.rsplit(".", 1)[-1] for w in self.weights.values()})
        dtypes = sorted({w.scale.dtype for w in self.weights.values()})
        text = (
            f"{c.format} {c.scheme} ({', '.join(names)} {'/'.join(dtypes)}), {len(self.weights)} "
            f"{'FP4' if c.scheme in FP4_SCHEMES else 'FP8'} weights, "
            f"{'static' if c.static_activations else 'dynamic'} activations"
        )
        return text + (f", scale_fmt {c.scale_fmt}" if c.scale_fmt else "")


def read_source_quantization(
    config: dict, tensors: list[TensorInfo], where: str, files: list[str]
) -> SourceQuantization | None:
    """None for a high-precision checkpoint, the FP8 layout of an FP8 one, else refused. `files`: its other
    top-level files (ModelOpt keeps its config in hf_quant_config.json)."""
    if "hf_quant_config.json" in files:
        raise FP8ConvertError(
            f"{where}/hf_quant_config.json: the model is quantized with NVIDIA ModelOpt; fp8convert "
            "reads BF16/FP16/FP32 checkpoints and FP8 ones (quant_method fp8 or compressed-tensors)"
        )
    declared = _declared(config, f"{where}/config.json")
    if declared is None:  # then no tensor may be quantized
        for t in tensors:
            if t.dtype.startswith("F8") or t.name.endswith((*FOREIGN_SUFFIXES, *SCALE_SUFFIXES, ".input_scale")):
                raise FP8ConvertError(
                    f"{where}/{t.file}: tensor {t.name} ({t.dtype}) shows the model is already quantized, but "
                    "config.json has no quantization_config saying how; fp8convert needs a "
                    "BF16/FP16/FP32 source or an FP8 one with its quantization_config"
                )
        return None
    try:
        weights = match_fp4(declared, tensors) if declared.scheme in FP4_SCHEMES else match_scales(declared, tensors)
    except FP8ConvertError as e:  # each begins with the shard's name
        raise FP8ConvertError(f"{where}/{e}") from None
    if not weights:
        raise FP8ConvertError(
            f"{where}/config.json: declares {declared.format} quantization, but no tensor is "
            f"{FP8} (float8_e4m3fn): nothing to read as FP8"
        )
    return SourceQuantization(declared, weights)


def _declared(config: dict, where: str) -> QuantizationConfig | None:
    qc = config.get("quantization_config") or config.get("compression_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise FP8ConvertError(f"{where}: quantization_config is not an object")
    method = qc.get("quant_method")
    if method is None and (qc.get("load_in_4bit") or qc.get("load_in_8bit")):
        method = "bitsandbytes"  # transformers' reading of a config without quant_method
    if kind := CONFIGS.get(str(method)):
        return kind.from_dict(qc, where, source=True)
    what = OTHER_METHODS.get(str(method), "not an FP8 method fp8convert reads")
    raise FP8ConvertError(
        f"{where}: the model is quantized with quant_method {method!r} ({what}); fp8convert reads "
        "BF16/FP16/FP32 checkpoints and FP8 ones (quant_method fp8, or compressed-tensors with FP8 "
        "weights)"
    )


def match_scales(declared: QuantizationConfig, tensors: list[TensorInfo]) -> dict[str, FP8Weight]:
    """Every FP8 weight with its one scale (and static activation scale), each checked from its header."""
    by_name = {t.name: t for t in tensors}
    scale_names, input_scale_names = declared.source_scale_names, declared.source_input_scale_names
    weights: dict[str, FP8Weight] = {}
    used: set[str] = set()
    for t in tensors:
        if t.name.endswith(FOREIGN_SUFFIXES):
            raise FP8ConvertError(
                f"{t.file}: tensor {t.name} ({t.dtype}) belongs to a quantization layout fp8convert "
                f"does not read (the config says {declared.format})"
            )
        if t.dtype in ("F8_E5M2", "F8_E8M0"):
            raise FP8ConvertError(
                f"{t.file}: tensor {t.name} is {t.dtype}; fp8convert reads float8_e4m3fn weights with float scales only"
            )
        if t.dtype != FP8:
            continue
        if not t.name.endswith(".weight") or len(t.shape) != 2:
            raise FP8ConvertError(
                f"{t.file}: tensor {t.name} {list(t.shape)} is {FP8}, but only 2-D `.weight` "
                "tensors are read as FP8 weights"
            )
        module = t.name.removesuffix(".weight")
        scale = _one(by_name, t, scale_names, "scale")
        if scale is None:
            wanted = " or ".join(f"{module}.{s}" for s in scale_names)
            others = ", ".join(module + s for s in OTHER_SCALE_SUFFIXES if module + s in by_name)
            hint = f"; {others} is not a scale name of this format, and fp8convert will not guess that it is one"
            raise FP8ConvertError(f"{t.file}: FP8 weight {t.name} has no scale ({wanted}){hint if others else ''}")
        if scale.dtype not in SCALE_DTYPES:
            raise FP8ConvertError(
                f"{scale.file}: scale {scale.name} is {scale.dtype}; fp8convert reads {', '.join(SCALE_DTYPES)} scales"
            )
        shapes = declared.scale_shapes(t.shape, source=True)
        if scale.shape not in shapes:
            raise FP8ConvertError(
                f"{scale.file}: scale {scale.name} is shaped {list(scale.shape)}, but a {declared.scheme}"
                f" scale of the {list(t.shape)} weight {t.name} is {' or '.join(map(str, map(list, shapes)))}"
            )
        input_scale = _one(by_name, t, input_scale_names, "static activation scale")
        if input_scale is not None and (input_scale.shape not in [(), (1,)] or input_scale.dtype not in SCALE_DTYPES):
            raise FP8ConvertError(
                f"{input_scale.file}: activation scale {input_scale.name} is {input_scale.dtype} "
                f"{list(input_scale.shape)}; a per-tensor float scale was expected"
            )
        if declared.static_activations and input_scale is None:
            raise FP8ConvertError(
                f"{t.file}: FP8 weight {t.name} has no {module}.{input_scale_names[0]}, but "
                "the config declares static activations"
            )
        if input_scale is not None and not declared.static_activations:
            raise FP8ConvertError(
                f"{input_scale.file}: tensor {input_scale.name} is a static activation scale, but "
                "the config declares dynamic activations"
            )
        weights[t.name] = FP8Weight(t, scale, input_scale)
        used.update(x.name for x in (scale, input_scale) if x is not None)
    suffixes = tuple("." + s for s in scale_names + input_scale_names) + SCALE_SUFFIXES
    for t in tensors:
        if t.name.endswith(suffixes) and t.name not in used:
            weight = t.name.rsplit(".", 1)[0] + ".weight"
            if weight in weights:
                raise FP8ConvertError(
                    f"{t.file}: tensor {t.name} is not a scale name of {declared.format} "
                    f"{declared.scheme} (the FP8 weight {weight} has its scale "
                    f"{weights[weight].scale.name}); one scale per weight is expected"
                )
            has = f"is {by_name[weight].dtype}" if weight in by_name else "does not exist"
            raise FP8ConvertError(
                f"{t.file}: tensor {t.name} is a scale, but its weight {weight} {has}: not an FP8 "
                f"weight with this scale (the config says {declared.format} {declared.scheme})"
            )
    return weights


def _one(by_name: dict[str, TensorInfo], weight: TensorInfo, suffixes: tuple[str, ...], what: str) -> TensorInfo | None:
    """The one tensor `module.<suffix>` of the FP8 `weight` among `suffixes`, if any; two are an error."""
    module = weight.name.removesuffix(".weight")
    found = [by_name[f"{module}.{s}"] for s in suffixes if f"{module}.{s}" in by_name]
    if len(found) > 1:
        raise FP8ConvertError(
            f"{weight.file}: FP8 weight {weight.name} has {len(found)} {what}s "
            f"({', '.join(f.name for f in found)}); exactly one is expected"
        )
    return found[0] if found else None


def match_fp4(declared: QuantizationConfig, tensors: list[TensorInfo]) -> dict[str, FP8Weight]:
    """Every FP4 weight with its group scales and (NVFP4) global scale, by its X.weight_packed name."""
    by_name = {t.name: t for t in tensors}
    nvfp4 = declared.scheme == Scheme.NVFP4A16
    weights: dict[str, FP8Weight] = {}
    for t in tensors:
        if not t.name.endswith(".weight_packed"):
            continue
        module = t.name.removesuffix(".weight_packed")
        if t.dtype != "U8" or len(t.shape) != 2:
            raise FP8ConvertError(f"{t.file}: tensor {t.name} is {t.dtype} {list(t.shape)}; FP4 codes are 2-D U8")
        shape = (t.shape[0], t.shape[1] * 2)
        wanted = [("weight_scale", declared.scale_dtype(), declared.scale_shapes(shape, source=True))]
        wanted += [("weight_global_scale", "F32", [(1,), ()])] if nvfp4 else []
        found = []
        for suffix, dtype, shapes in wanted:
            info = by_name.get(f"{module}.{suffix}")
            if info is None or info.dtype != dtype or info.shape not in shapes:
                got = f"is {info.dtype} {list(info.shape)}" if info else "is missing"
                raise FP8ConvertError(
                    f"{t.file}: FP4 weight {t.name}'s {module}.{suffix} {got}; a {declared.scheme} weight of "
                    f"{list(shape)} has a {dtype} {list(shapes[0])} one"
                )
            found.append(info)
        weights[t.name] = FP8Weight(t, found[0], None, found[1] if nvfp4 else None)
    for t in tensors:
        companion = t.name.endswith((".weight_scale", ".weight_global_scale"))
        if t.dtype == FP8 or companion or t.name.endswith(".input_scale"):
            if not companion or t.name.rsplit(".", 1)[0] + ".weight_packed" not in weights:
                raise FP8ConvertError(
                    f"{t.file}: tensor {t.name} ({t.dtype}) is not part of an FP4 weight, but the config says "
                    f"{declared.format} {declared.scheme} (fp8convert reads one scheme per checkpoint)"
                )
    return weights
