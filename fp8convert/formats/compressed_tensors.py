"""compressed-tensors: read by vLLM, SGLang and (via the compressed-tensors package) transformers.

"float-quantized" (tensor, channel, block): X.weight float8_e4m3fn [out, in] and X.weight_scale float32
shaped [1], [out, 1] or [ceil(out/128), ceil(in/128)].

"mxfp8-quantized", as compressed-tensors 0.20.1 (`MXFP8` preset) writes it and vLLM 0.33 and transformers
5.24 read it: X.weight_scale U8 [out, in / 32], the E8M0 byte of the scale 2^(byte - 127) of each 32 inputs
of a row; never F8_E8M0 (vLLM's parameter is uint8 and copies by value). vLLM takes its MXFP8 path
(`CompressedTensorsConfig._is_mxfp8`) on the weights' args alone, and without scale_dtype it is no FP8
scheme it knows; the args models forbid unknown keys, so only these are written. Its dense layer needs
in % 32 == 0 (per TP rank for row-parallel layers), and transformers' MoE expert path fails on it
(summary.compatibility_warnings warns of both). Never read as a source.

"nvfp4-pack-quantized" and "mxfp4-pack-quantized" (weight-only FP4, the NVFP4A16 and MXFP4A16 presets):
X.weight_packed U8 [out, in / 2], X.weight_scale F8_E4M3 [out, in / 16] or U8 [out, in / 32], and for
NVFP4 X.weight_global_scale F32 [1]; no X.weight (run/fp4.py has the numerics). Sources: `dequantize` only.

Power-of-two block scales (--scale-format ue8m0) add a top-level `scale_fmt`, as in the fp8 format:
vLLM reads it whatever the quant_method, the other readers ignore unknown top-level keys.
"""

from __future__ import annotations

from ..errors import FP8ConvertError
from ..options import BLOCK, MX_GROUP, ScaleFormat, Scheme
from .config import QuantizationConfig, declared_scale_fmt

FLOAT_ARGS = {"num_bits": 8, "type": "float", "symmetric": True}
MX_ARGS = FLOAT_ARGS | {"group_size": MX_GROUP, "strategy": "group", "dynamic": False, "scale_dtype": "torch.uint8"}
# As the presets serialise; scale_dtype (read from compressed-tensors 0.13 on) picks MXFP4's E8M0 path.
FP4_ARGS = {
    Scheme.NVFP4A16: MX_ARGS
    | {"num_bits": 4, "strategy": "tensor_group", "group_size": 16, "scale_dtype": "torch.float8_e4m3fn"},
    Scheme.MXFP4A16: MX_ARGS | {"num_bits": 4},
}
WRITTEN_FORMAT = {
    Scheme.MXFP8: "mxfp8-quantized",
    Scheme.NVFP4A16: "nvfp4-pack-quantized",
    Scheme.MXFP4A16: "mxfp4-pack-quantized",
}
# Dynamic activations per token, per 128-wide group or per tensor (what vLLM's MoE accepts for per-tensor
# weights); static ones (an FP8 source's input_scale, carried in the tensor scheme) are per tensor.
ACTIVATION_STRATEGY = {Scheme.TENSOR: "tensor", Scheme.CHANNEL: "token", Scheme.BLOCK: "group"}

# Formats storing float8_e4m3fn codes and a scale; the others are named so a refusal says what they hold.
FP8_FORMATS = ("float-quantized", "naive-quantized")
OTHER_FORMATS = {
    "pack-quantized": "integer weights packed into int32 (e.g. W4A16)",
    "int-quantized": "int8 weights",
    "nvfp4-pack-quantized": "NVFP4 (4-bit float) weights",
    "mxfp4-pack-quantized": "MXFP4 (4-bit float) weights",
    "mxfp8-quantized": "MXFP8 (FP8 with power-of-two scales per 32 values), which fp8convert writes but does not "
    "read as a source",
    "marlin-24": "2:4 sparse int4 weights (Marlin)",
    "sparse-24-bitmask": "2:4 sparse weights",
    "sparse-bitmask": "sparse weights (bitmask)",
    "dense": "no quantization",
}


def _not_fp8(where: str, what: str) -> FP8ConvertError:
    return FP8ConvertError(
        f"{where}: compressed-tensors checkpoint with {what}; fp8convert reads FP8 (float8_e4m3fn "
        "weights with tensor, channel or block scales) only"
    )


class CompressedTensorsConfig(QuantizationConfig):
    format = "compressed-tensors"
    source_scale_names = ("weight_scale",)
    source_input_scale_names = ("input_scale",)

    def to_dict(self) -> dict:
        """One config group per scheme: the default targets "Linear", a recipe's others name their modules
        (an exact name outranks a class in every reader); a mixed config says each group's format."""
        mixed = bool(self.groups)
        groups = {}
        for i, (scheme, targets) in enumerate([(self.scheme, ("Linear",)), *self.groups]):
            weights, activations = _group_args(scheme, self.static_activations and scheme == Scheme.TENSOR)
            group = {"targets": list(targets), "weights": weights, "input_activations": activations}
            groups[f"group_{i}"] = group | ({"format": WRITTEN_FORMAT.get(scheme, "float-quantized")} if mixed else {})
        config = {
            "quant_method": self.format,
            "format": "mixed-precision" if mixed else WRITTEN_FORMAT.get(self.scheme, "float-quantized"),
            "quantization_status": "compressed",
            "config_groups": groups,
            "ignore": list(self.ignore),
            "kv_cache_scheme": None,
        }
        return config | ({"scale_fmt": "ue8m0"} if self.scale_format == ScaleFormat.UE8M0 else {})

    @classmethod
    def from_dict(cls, qc: dict, where: str, source: bool = False) -> CompressedTensorsConfig:
        """Every config group: symmetric 8-bit float weights of one strategy (tensor, channel, 128x128 block;
        in an output also MXFP8) or FP4, and dynamic, absent or static per-tensor input activations. A source
        must hold what fp8convert reads (no MXFP8, KV-cache scheme, zero points or uncompressed weights); an
        output lists these in `unkept` instead, for verify to report."""
        readable = [*FP8_FORMATS, *WRITTEN_FORMAT.values(), "mixed-precision", None]
        if source:
            readable.remove(WRITTEN_FORMAT[Scheme.MXFP8])
        groups = {name: g for name, g in (qc.get("config_groups") or {}).items() if isinstance(g, dict)}
        for fmt in [qc.get("format")] + [g["format"] for g in groups.values() if g.get("format")]:
            if fmt not in readable:
                raise _not_fp8(where, f"format {fmt!r} ({OTHER_FORMATS.get(fmt, 'not an FP8 format')})")
        for key in ("sparsity_config", "transform_config"):
            if qc.get(key):
                raise _not_fp8(where, f"a {key} (sparse or transformed weights)")
        unkept = []
        if qc.get("kv_cache_scheme"):
            if source:
                raise FP8ConvertError(
                    f"{where}: kv_cache_scheme is set: FP8 KV-cache scales (k_scale, v_scale) are "
                    "not supported in a source"
                )
            unkept.append("declares a kv_cache_scheme, but fp8convert writes no KV-cache scales")
        if (status := qc.get("quantization_status")) not in (None, "compressed"):
            if source:
                raise FP8ConvertError(
                    f"{where}: quantization_status {status!r}: the weights are not stored compressed (FP8)"
                )
            unkept.append(f"quantization_status is {status!r}, not 'compressed'")
        if not groups:
            raise FP8ConvertError(f"{where}: compressed-tensors quantization_config has no config_groups")
        strategies, static, targets = set(), set(), []
        for name, group in groups.items():
            w = group.get("weights") or {}
            if (w.get("type"), w.get("num_bits")) == ("float", 4):  # a source: read by `dequantize` only
                scheme = _written_scheme(w, where, FP4_ARGS, scale_dtype_optional=source)
            elif w.get("type") != "float" or w.get("num_bits") != 8:
                raise _not_fp8(where, f"config group {name}: {w.get('type')} {w.get('num_bits')}-bit weights")
            elif not source and (
                w.get("strategy") == "group" or group.get("format", qc.get("format")) == "mxfp8-quantized"
            ):
                scheme = _written_scheme(w, where, {Scheme.MXFP8: MX_ARGS})
            else:
                scheme = _weight_strategy(name, w, where, source, unkept)
            strategies.add(scheme)
            targets.append((scheme, tuple(group.get("targets") or ())))
            if group.get("output_activations"):
                raise _not_fp8(where, f"config group {name}: quantized output activations")
            a = group.get("input_activations") or {}
            is_static = bool(a) and not a.get("dynamic")
            kind = (a.get("strategy"), a.get("type"), a.get("num_bits"), a.get("symmetric") is not False)
            if is_static and kind != ("tensor", "float", 8, True):
                raise _not_fp8(
                    where,
                    f"config group {name}: static input activations of strategy {a.get('strategy')!r} (only "
                    "per-tensor FP8 ones are read)",
                )
            static.add(is_static)
        if source and (len(strategies) > 1 or len(static) > 1) or len(strategies) == 1 and len(static) > 1:
            raise FP8ConvertError(
                f"{where}: config groups mix weight strategies or activation schemes "
                f"({', '.join(sorted(strategies))}); fp8convert reads one FP8 scheme per checkpoint"
            )
        default, others = next(iter(strategies)), ()
        if len(strategies) > 1:  # an output of a mixed recipe: the group targeting "Linear" takes what no other names
            default = next((scheme for scheme, names in targets if "Linear" in names), targets[0][0])
            others = tuple((scheme, names) for scheme, names in targets if "Linear" not in names)
        scale_fmt = declared_scale_fmt(qc, where)
        ignore = tuple(qc.get("ignore") or ())
        targeted = tuple(t for _, names in targets for t in names)
        return cls(default, ignore, scale_fmt, any(static), tuple(unkept), groups=others, targeted=targeted)


def _group_args(scheme: str, static: bool) -> tuple[dict, dict | None]:
    if scheme == Scheme.MXFP8:
        return dict(MX_ARGS), MX_ARGS | {"dynamic": True}
    if scheme in FP4_ARGS:
        return dict(FP4_ARGS[scheme]), None
    block = scheme == Scheme.BLOCK
    weights = {"num_bits": 8, "type": "float", "strategy": scheme, "symmetric": True, "dynamic": False}
    weights |= {"group_size": None, "block_structure": [BLOCK, BLOCK] if block else None}
    activations = FLOAT_ARGS | {"dynamic": not static}
    activations |= {"strategy": ACTIVATION_STRATEGY[scheme], "group_size": BLOCK if block else None}
    return weights, activations


def _weight_strategy(name: str, w: dict, where: str, source: bool, unkept: list[str]) -> str:
    """A config group's float-quantized weights: their strategy (tensor, channel or 128x128 block)."""
    if source and w.get("strategy") == "group" and w.get("group_size") == MX_GROUP:
        raise _not_fp8(where, f"config group {name}: MXFP8-style weights (one scale per 32 values)")
    if w.get("strategy") not in ("tensor", "channel", "block"):
        raise _not_fp8(where, f"config group {name}: weight strategy {w.get('strategy')!r}")
    if source and (w.get("symmetric") is False or w.get("dynamic")):
        raise _not_fp8(where, f"config group {name}: asymmetric or dynamic weights")
    if w.get("symmetric") is False:
        unkept.append(f"config group {name} declares asymmetric weights, but the output has no zero points")
    if w.get("strategy") == "block" and w.get("block_structure") != [BLOCK, BLOCK]:
        raise FP8ConvertError(
            f"{where}: config group {name}: block_structure {w.get('block_structure')} is not "
            f"[{BLOCK}, {BLOCK}] (the only block size fp8convert reads)"
        )
    return w["strategy"]


def _written_scheme(w: dict, where: str, schemes: dict[str, dict], scale_dtype_optional: bool = False) -> str:
    """An output's MXFP8 or FP4 weights: the scheme whose args they hold where vLLM keys on them. A source
    may leave scale_dtype out (compressed-tensors wrote none before 0.13: strategy and group size decide)."""
    keys = ("num_bits", "strategy", "group_size", "symmetric")
    dtype = str(w.get("scale_dtype")).removeprefix("torch.")
    for scheme, args in schemes.items():
        dtype_ok = dtype == args["scale_dtype"].removeprefix("torch.") or (scale_dtype_optional and dtype == "None")
        if all(w.get(k) == args[k] for k in keys) and dtype_ok:
            return scheme
    wanted = " or ".join(
        f"strategy {a['strategy']}, group_size {a['group_size']}, scale_dtype {a['scale_dtype'].removeprefix('torch.')}"
        for a in schemes.values()
    )
    raise FP8ConvertError(
        f"{where}: {'/'.join(s.upper() for s in schemes)} weights need {w.get('num_bits')}-bit symmetric weights "
        f"with {wanted} (what vLLM keys on)"
    )
