"""The output's structure, from headers and files alone, and each output tensor paired with the source
tensor or fused-expert cut it must come from."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import FP8ConvertError
from ..formats import QuantizationConfig, read_quantization_config
from ..formats.sources import FP8Weight
from ..options import CONFIG_DTYPE_KEYS, FP4_SCHEMES, Scheme
from ..output.manifest import Manifest
from ..plan.architectures import architecture_of
from ..plan.family import GENERIC, Architecture
from ..plan.plan import Cut
from ..plan.rules import UnsupportedLayout, default_keep_reason, expert_cuts, is_linear_weight, module_of
from ..safetensors_io import DTYPES, FLOAT_SOURCE_DTYPES, FP8, INDEX_NAME, TensorInfo, read_header
from ..source.checkpoint import Source, index_files, parse_index
from .pairs import Pair, not_requantized, shapes_text
from .report import VerifyReport


@dataclass
class OutputLayout:
    tensors: dict[str, TensorInfo]  # every output tensor (its .file: where it is)
    placed_in: dict[str, str]  # tensor -> file, as the index says
    unreadable: set[str]  # shard files whose header could not be read


def read_output_layout(out: Path, report: VerifyReport) -> OutputLayout:
    """Every output tensor and where it is, the index checked against the shards' headers."""
    layout = OutputLayout({}, {}, set())
    index_path = out / INDEX_NAME
    if indexed := index_path.is_file():
        raw = index_path.read_bytes()
        try:
            layout.placed_in = parse_index(raw, INDEX_NAME)
        except FP8ConvertError as e:
            report.fail(INDEX_NAME, str(e).removeprefix(f"{INDEX_NAME}: "))
            return layout
        metadata = json.loads(raw).get("metadata") or {}
        if not isinstance(metadata, dict):
            report.fail(INDEX_NAME, f"metadata is {metadata!r}, not an object")
            metadata = {}
        declared_total = metadata.get("total_size")
        files = index_files(layout.placed_in)
    elif (out / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        report.fail(str(out), f"no {INDEX_NAME} (or model.safetensors): the output is incomplete")
        return layout
    total, tensors, weight_map = 0, layout.tensors, layout.placed_in
    for file in files:
        path = out / file
        if not path.is_file():
            report.fail(INDEX_NAME, f"names {file}, which does not exist")
            layout.unreadable.add(file)
            continue
        try:
            header = read_header(str(path), file)
        except FP8ConvertError as e:
            report.fail(file, str(e).removeprefix(f"{path}: "))
            layout.unreadable.add(file)
            continue
        for name, info in header.items():
            total += info.nbytes
            if name in tensors:
                report.fail(f"tensor {name}", f"appears twice: in {tensors[name].file} and {file}")
            elif indexed and weight_map.get(name) != file:
                report.fail(
                    file,
                    f"holds tensor {name}, which {INDEX_NAME} "
                    + (f"places in {weight_map[name]}" if name in weight_map else "does not list"),
                )
            tensors[name] = info
    if indexed:
        for name, file in weight_map.items():
            if name not in tensors and file not in layout.unreadable:
                report.fail(INDEX_NAME, f"names tensor {name} in {file}, but {file} does not hold it")
        if declared_total is not None and declared_total != total and not layout.unreadable:
            report.fail(INDEX_NAME, f"metadata.total_size is {declared_total}, the shards hold {total} bytes")
        stray = sorted(p.name for p in out.glob("*.safetensors") if p.name not in files)
        if stray:
            report.warnings.append(f"{out}: safetensors files not in the index: {', '.join(stray)}")
    return layout


def check_config(
    source: Source, out: Path, report: VerifyReport
) -> tuple[bool, QuantizationConfig | None, dict[str, str]]:
    """config.json must be the source's plus a readable quantization_config (none when dequantized, where its
    dtype may name another dtype: returned as {key: name}, for check_renamed_dtype)."""
    config_path = out / "config.json"
    try:
        config = json.loads(config_path.read_text())
        if not isinstance(config, dict):
            raise FP8ConvertError(f"{config_path}: not a JSON object")
        dequantized = source.quant is not None and "quantization_config" not in config  # written by `dequantize`
        fmt = None if dequantized else read_quantization_config(config, str(config_path))
    except (FileNotFoundError, ValueError, FP8ConvertError) as e:
        what = str(e).removeprefix(f"{config_path}: ") if isinstance(e, FP8ConvertError) else f"not valid JSON ({e})"
        report.fail(str(config_path), "missing: the output is incomplete" if isinstance(e, FileNotFoundError) else what)
        return False, None, {}
    for promise in fmt.unkept if fmt else ():  # what loaders act on though no tensor backs it
        report.fail(str(config_path), promise)
    rest = {k: v for k, v in config.items() if k != "quantization_config"}
    source_rest = {k: v for k, v in source.config.items() if k not in ("quantization_config", "compression_config")}
    renamed = {  # `dequantize --dtype` names the dtype it wrote: checked against the weights by check_renamed_dtype
        key: rest[key]
        for key in CONFIG_DTYPE_KEYS
        if dequantized and key in rest and rest[key] != source_rest.get(key) and isinstance(rest[key], str)
    }
    source_rest |= renamed
    if rest != source_rest:
        keys = sorted(k for k in set(rest) | set(source_rest) if rest.get(k) != source_rest.get(k))
        report.fail(
            str(config_path),
            f"differs from the source's config.json beyond quantization_config (keys: {', '.join(keys)})",
        )
    return True, fmt, renamed


def check_renamed_dtype(renamed: dict[str, str], pairs: list[Pair], out: Path, report: VerifyReport) -> None:
    """A dtype a dequantized output's config.json names instead of the source's must be its weights' one."""
    written = sorted({DTYPES[p.outputs[0].dtype][1] for p in pairs if p.kind == "dequantized"})
    for key, name in renamed.items():
        if written != [name]:
            report.fail(
                str(out / "config.json"),
                f"{key} is {name!r}, but the dequantized weights are {', '.join(written) or 'none'}",
            )


def check_manifest_and_side_files(source: Source, out: Path, report: VerifyReport) -> None:
    manifest = Manifest(out)
    try:
        state = manifest.read()
        if state is not None and not state.get("complete"):
            report.fail(str(manifest.path), "the conversion did not finish; rerun it")
    except FP8ConvertError:
        report.fail(str(manifest.path), "unreadable")
    for name in source.copy_files:
        copied = out / name
        if not copied.is_file() or copied.read_bytes() != (source.root / name).read_bytes():
            report.warnings.append(f"{copied}: missing or different from the source's {name}")


@dataclass
class Expected:
    """An output tensor the source implies: all of a source tensor, or a cut of a fused expert tensor."""

    name: str
    info: TensorInfo
    cut: Cut | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.cut.shape(self.info.shape) if self.cut else self.info.shape

    @property
    def where(self) -> str:
        return self.cut.describe(self.info.name) if self.cut else self.info.name


def expected_outputs(source: Source, arch: Architecture, outputs: dict, report: VerifyReport) -> list[Expected]:
    """A fused expert tensor not held as it is implies one cut per expert; an FP8 source's scales are
    checked with their weights."""
    expected = []
    companions = source.quant.companions() if source.quant else set()
    for info in source.tensors:
        if info.name in companions:
            continue
        fused = arch.expert_tensor(info.name)
        if fused is None or info.name in outputs:
            expected.append(Expected(info.name, info))
            continue
        try:
            expected += [Expected(n, info, cut) for n, cut in expert_cuts(info, *fused, arch, source.config)]
        except UnsupportedLayout as e:  # its message: "subject: what"
            subject, _, what = str(e).partition(": ")
            report.fail(subject, what or subject)
    return expected


def pair_tensors(source: Source, out: Path, fmt: QuantizationConfig | None, report: VerifyReport) -> list[Pair]:
    """Each output the source implies with what the output holds for it, the structure checked."""
    layout = read_output_layout(out, report)
    outputs = layout.tensors
    if fmt and fmt.static_activations and not any(n.endswith((".input_scale", ".activation_scale")) for n in outputs):
        report.fail(
            str(out / "config.json"),
            "declares static input activations, but the output holds no "
            "input_scale tensors (engines would read scales that are not there)",
        )
    pairing = Pairing(outputs, report, architecture_of(source.config) or GENERIC)
    pairs: list[Pair] = []
    for want in expected_outputs(source, pairing.arch, outputs, report):
        fp8_weight = source.quant.weights.get(want.info.name) if source.quant and not want.cut else None
        name = fp8_weight.name if fp8_weight else want.name  # an FP4 source's X.weight_packed: X.weight
        tensor_fmt = fmt.for_module(module_of(name)) if fmt else None  # a mixed recipe's scheme for it
        if name not in outputs and name + "_packed" in outputs and tensor_fmt and tensor_fmt.scheme in FP4_SCHEMES:
            pairs += pairing.quantized("fp4", want, pairing.take(name + "_packed"), tensor_fmt, fp8_weight)
            continue
        got = pairing.take(name)
        if got is None:
            file = layout.placed_in.get(name)
            if file in layout.unreadable:
                report.fail(name, f"not checked: {file} cannot be read", follows_from=file)
            elif want.cut:
                report.fail(name, f"missing from the output ({want.where})")
            else:
                report.fail(name, "source tensor missing from the output")
        elif got.dtype == FP8 and fmt is None:
            report.fail(name, "still FP8, but the output has no quantization_config")
        elif fp8_weight is not None:
            pairs += pairing.fp8_weight(fp8_weight, got, tensor_fmt)
        elif got.dtype == FP8:
            pairs += pairing.quantized("fp8", want, got, tensor_fmt)
        else:
            pairs += pairing.kept(want, got, tensor_fmt)
    for name in sorted(set(outputs) - pairing.accounted):
        report.fail(name, f"in the output ({outputs[name].file}) but not derived from any source tensor")
    return pairs


@dataclass
class Pairing:
    """The output's tensors, and those accounted for so far."""

    outputs: dict[str, TensorInfo]
    report: VerifyReport
    arch: Architecture
    accounted: set[str] = field(default_factory=set)

    def take(self, name: str) -> TensorInfo | None:
        """The output tensor `name`, accounted for whether it is there or not."""
        self.accounted.add(name)
        return self.outputs.get(name)

    def kept(self, want: Expected, got: TensorInfo, fmt: QuantizationConfig | None) -> list[Pair]:
        name, info = want.name, want.info
        self.report.tensors_kept += 1
        if got.dtype != info.dtype or got.shape != want.shape:
            self.report.fail(
                name,
                f"kept as {got.dtype} {list(got.shape)} but the source ({want.where}) is {info.dtype} "
                f"{list(want.shape)}",
            )
            return []
        reason = default_keep_reason(info, self.arch, fmt.format, fmt.scheme) if fmt and len(info.shape) == 2 else None
        if fmt and is_linear_weight(name, want.shape, info.dtype, reason) and not fmt.ignores(module_of(name)):
            self.report.fail(name, not_ignored(name, "kept in high precision"))
        differs = f"kept in high precision, but its bytes differ from {want.where if want.cut else 'the source'}"
        return [Pair("kept", name, info, [got], want.cut, differs=differs)]

    def quantized(
        self, kind: str, want: Expected, got: TensorInfo, fmt: QuantizationConfig, fp8_weight: FP8Weight | None = None
    ) -> list[Pair]:
        """FP8 codes and scale, or FP4 packed codes, group scales and (NVFP4) global scale."""
        self.report.tensors_quantized += 1
        scale = self.take(fmt.scale_name(want.name))
        problems = structure_problems(want, got, scale, fmt, fp8_weight is not None, kind == "fp4")
        outputs = [got, scale]
        if kind == "fp4" and fmt.scheme == Scheme.NVFP4A16:
            global_scale = self.take(want.name + "_global_scale")
            if global_scale is None or (global_scale.dtype, global_scale.shape) != ("F32", (1,)):
                found = f"is {global_scale.dtype} {list(global_scale.shape)}" if global_scale else "is missing"
                problems.append(f"its global scale {want.name}_global_scale {found}, expected F32 [1]")
            outputs.append(global_scale)
        if problems:
            self.report.fail(want.name, "; ".join(problems))
            return []
        return [Pair(kind, want.name, want.info, outputs, want.cut, fp8=fp8_weight, fmt=fmt)]

    def fp8_weight(self, weight: FP8Weight, got: TensorInfo, fmt: QuantizationConfig | None) -> list[Pair]:
        """Dequantized, passed through or requantized, with its static activation scale if it has one."""
        name, report = weight.name, self.report
        if got.dtype != FP8:
            report.tensors_dequantized += 1
            readable = got.dtype in FLOAT_SOURCE_DTYPES and got.shape == weight.shape
            if not readable:
                report.fail(
                    name,
                    f"dequantized as {got.dtype} {list(got.shape)}, but the source is an "
                    f"{'FP4' if weight.packed else 'FP8'} weight {list(weight.shape)} (expected BF16, F16 or F32 "
                    "of that shape)",
                )
            if fmt is not None and not fmt.ignores(module_of(name)):
                report.fail(name, not_ignored(name, f"dequantized to {got.dtype}"))
            return [Pair("dequantized", name, weight.weight, [got], fp8=weight)] if readable else []
        report.tensors_quantized += 1
        scale = self.take(fmt.scale_name(name))
        pairs = self.activation_scale(weight)
        may_pass = (
            scale is not None
            and (scale.dtype, scale.nbytes) == (weight.scale.dtype, weight.scale.nbytes)
            and got.shape == weight.weight.shape
        )
        if not may_pass and scale is not None and scale.dtype != fmt.scale_dtype():
            report.fail(name, not_requantized(scale.name, scale.dtype, fmt))
            return pairs
        problems = structure_problems(Expected(name, weight.weight), got, scale, fmt, fp8_source=True, packed=False)
        if not may_pass and problems:
            report.fail(name, "; ".join(problems))
            return pairs
        pair = Pair(
            "fp8",
            name,
            weight.weight,
            [got, scale],
            fp8=weight,
            fmt=fmt,
            may_pass=may_pass,
            requantized_problems=problems,
        )
        return [*pairs, pair]

    def activation_scale(self, weight: FP8Weight) -> list[Pair]:
        """A static activation scale in the output must be the source's, byte for byte."""
        name = weight.weight.name.removesuffix(".weight") + ".input_scale"
        if name not in self.outputs:
            return []
        got, source_scale = self.take(name), weight.input_scale
        what = "not the source's static activation scale"
        if source_scale is None or (got.dtype, got.nbytes) != (source_scale.dtype, source_scale.nbytes):
            self.report.fail(name, what + ("" if source_scale else " (the source has none)"))
            return []
        return [Pair("carried", name, source_scale, [got], differs=what)]


def not_ignored(name: str, done: str) -> str:
    return f"{done}, but {module_of(name)} is not in the ignore list (engines would expect FP8 weights for it)"


def structure_problems(
    want: Expected, got: TensorInfo, scale: TensorInfo | None, fmt: QuantizationConfig, fp8_source: bool, packed: bool
) -> list[str]:
    """What is wrong with a quantized output's dtype, shape and scale. `packed`: FP4 codes, two a byte."""
    info, shape, module = want.info, want.shape, module_of(want.name)
    problems = []
    if (info.dtype not in FLOAT_SOURCE_DTYPES and not fp8_source) or len(shape) != 2:
        problems.append(
            f"quantized, but the source ({want.where}) is {info.dtype} {list(shape)} (FP8 needs a 2-D float weight)"
        )
    elif packed and (got.dtype, got.shape) != ("U8", (shape[0], shape[1] // 2)):
        problems.append(
            f"packed as {got.dtype} {list(got.shape)}, but FP4 codes of the source ({want.where}) "
            f"{list(shape)} are U8 {[shape[0], shape[1] // 2]}"
        )
    elif not packed and got.shape != shape:
        problems.append(f"shape {list(got.shape)} differs from the source's ({want.where}) {list(shape)}")
    if fmt.ignores(module):
        problems.append(f"quantized, but the ignore list names {module}")
    elif not fmt.targets(module):
        problems.append("quantized, but no config group targets its module (engines would load it unquantized)")
    if scale is None:
        problems.append(f"its scale {fmt.scale_name(want.name)} is missing")
    elif scale.dtype != fmt.scale_dtype() or (not problems and scale.shape not in fmt.scale_shapes(shape)):
        problems.append(
            f"scale {scale.name} is {scale.dtype} {list(scale.shape)}, expected "
            f"{fmt.scale_dtype()} {shapes_text(fmt.scale_shapes(shape))}"
        )
    return problems
