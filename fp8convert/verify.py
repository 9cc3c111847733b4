"""Check an FP8 checkpoint against its source: structure and numbers, at the speed of the disk.

First the structure, from headers and config alone: every source tensor accounted for, dtypes, shapes,
scale names and shapes, config, ignore list, index. Then the data: every tensor pair is streamed
through quantize's reader (run/verify_stream.py: batches within the memory budget, the next one read
while this one is checked, CPU or CUDA, with the same progress display) and checked by the functions
of the "per-tensor checks" sections below. Works for both output formats:

- compressed-tensors: `X.weight` F8_E4M3 + `X.weight_scale` F32 shaped [1] (tensor), [out, 1] (channel)
  or [ceil(out/128), ceil(in/128)] (block);
- fp8 (vLLM/DeepSeek native): `X.weight_scale` F32 [] or [1] (tensor), or `X.weight_scale_inv` F32
  [ceil(out/128), ceil(in/128)] (block);
- compressed-tensors MXFP8: `X.weight_scale` U8 [out, in/32], E8M0 exponent bytes (value 2^(byte-127)).

Power-of-two scales are checked exactly (see `power_of_two_checks`): an MXFP8 exponent, or a block
scale under `scale_fmt: ue8m0`, must be the smallest power of two 2^e with amax <= 448 * 2^e (amax of
its group of 32, or of its 128x128 block floored at 1e-4), and since w / 2^e is exact, every code must
equal the round-to-nearest-even e4m3 value of w / 2^e, ties included. Float scales (fp8convert writes
amax / 448) must be at most twice amax / 448 of the weights they scale, a fused group's in the tensor
scheme (see `OVERSIZE`): the codes are checked against the stored scale, so without this a scale far
too large, with every code rounded to zero for it, would pass.

A fused expert tensor (all experts of a layer in one tensor) that the output holds as one weight per
expert is checked output by output against the slice of the source it must come from, as the
architecture registry lays it out (plan/rules.py expert_cuts): the expert, its gate or up half, in
nn.Linear orientation. Missing experts, extra tensors and a wrong slice all fail.

The numeric bound (why a conversion passes or fails)
---------------------------------------------------
e4m3 keeps 3 mantissa bits, so rounding x = w / scale to the nearest code moves x by at most half a
step: 2^-4 * |x| where x is a normal number (|x| >= 2^-6), and 2^-10 where it is subnormal (fixed
spacing 2^-9 below 2^-6). In weight units every element's error is therefore at most
max(2^-4 * |w|, 2^-10 * scale), and ||w - dequant|| at most sqrt(sum of those squared). When every
element is normal that is exactly 2^-4 = 6.25 % of ||w||; a per-tensor (or shared fused-group) scale
pushes small elements into the subnormal range, and the second term is the exact allowance for them,
not a guessed slack. A tensor whose relative error exceeds its bound is not a rounding of its source.

A norm cannot see one corrupted code among millions, so each element is also checked on its own:
the code must lie within half an e4m3 step of w / scale (computed in float32 exactly as the quantizer
does). Round-to-nearest always satisfies this; any other code, and a NaN code, does not.

How the numbers are computed (the same values, faster)
------------------------------------------------------
`exact_sums` computes the figures above element by element, in float64 where it sums. `fast_sums`
gets the same values with fewer passes, and is used only where it can vouch for them: it re-rounds
w / scale to e4m3 exactly as the quantizer does and compares the codes byte for byte. Where they all
match, every code is the round-to-nearest code, so none is off the grid (nor, with power-of-two
scales, off round-to-nearest-even), and float32(code) comes from the code's bits; the sums are the
same float64 sums of the same float32 values. Where any code differs (or a weight is not finite), that
piece is measured by `exact_sums`, element by element, and its codes by `power_of_two_checks` too.

FP8 sources
-----------
When the source is itself FP8, its weights' values are float32(q) * scale. A dequantized output
(`fp8convert dequantize`, or a weight kept with --ignore) must equal that product rounded once to the
output's dtype, element for element, and its scales must be gone. An FP8 output is checked against
those float32 values with the bound above (and, requantized to MXFP8 or UE8M0 blocks, with the exact
power-of-two checks); one whose codes and scale values are the source's (passed through) is exact, its
scales powers of two where the config says scale_fmt ue8m0. A static activation scale in the output must
be the source's, byte for byte. All of it is read through the same stream, in slabs of whole 128-row
blocks.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .errors import FP8ConvertError
from .formats import QuantizedLayout, read_quantization_config
from .formats.sources import FP8Weight
from .options import AUTO, BLOCK, python_spelling
from .output.card import with_verification
from .output.files import write_atomic
from .output.manifest import Manifest
from .plan.architectures import GENERIC, Architecture, architecture_of
from .plan.cuts import Cut
from .plan.rules import (UnsupportedLayout, default_keep_reason, expert_cuts, fused_group_key, is_linear_weight,
                         module_of)
from .run.cores import usable_cores
from .safetensors_io import FLOAT_SOURCE_DTYPES, FP8, INDEX_NAME, TensorInfo, read_header
from .source.checkpoint import Source, index_files, parse_index
from .source.hub import CARD_NAME
from .source.resolve import open_source
from .units import plural

CHUNK_ELEMENTS = 1 << 24        # elements per slab of a quantized tensor (one read of the stream)
CHUNK_BYTES = 64 << 20          # bytes per piece when comparing kept tensors
TILE_ELEMENTS = 1 << 17         # on a CPU, a slab is measured a tile at a time, in the cores' caches
FLOAT_SLACK = 1e-5              # float32 arithmetic in dequant / division, far below any real error
NAMED = 3                       # a grouped line names this many of its tensors


class VerifyFailed(FP8ConvertError):
    """Verification found problems; the message names the first."""


@dataclass
class TensorCheck:
    """The numbers of one quantized tensor."""

    name: str
    shape: list[int]
    scale_shape: list[int]
    rel_error: float          # ||w - dequant|| / ||w||; 0 when both are zero, inf when only w is zero
    snr_db: float             # 20 log10(||w|| / ||w - dequant||); inf when exact
    bound: float              # largest rel_error e4m3 rounding allows with these scales (module docstring)
    off_grid: int             # elements whose code is not within half a step of w / scale (must be 0)
    ok: bool
    off_rule_scales: int = 0  # power-of-two scales that are not the smallest 2^e fitting their amax (must be 0)
    inexact_codes: int = 0    # with power-of-two scales: codes that are not RNE(w / scale) exactly (must be 0)
    oversized_scales: int = 0  # channel and block float scales above twice amax / 448 of theirs (must be 0)


@dataclass
class Problem:
    """One thing wrong, about one tensor or file. `follows_from`: the subject of the problem it is a
    consequence of (the tensors of an unreadable shard), so that one root cause reads as one line."""

    subject: str
    what: str
    follows_from: str | None = None

    def __str__(self) -> str:
        return f"{self.subject}: {self.what}"


@dataclass
class VerifyReport:
    src: str
    out: str
    format: str | None = None
    scheme: str | None = None
    ok: bool = False
    tensors_quantized: int = 0
    tensors_kept: int = 0
    tensors_dequantized: int = 0      # FP8 source weights in high precision, each equal to its one rounding
    max_rel_error: float = 0.0
    min_snr_db: float = math.inf
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    tensors: list[TensorCheck] = field(default_factory=list)
    seconds: float = 0.0
    bytes_read: int = 0
    stage_seconds: dict = field(default_factory=dict)   # where the time went: waiting for reads, checking

    def fail(self, subject: str, what: str, follows_from: str | None = None) -> None:
        self.problems.append(Problem(subject, " ".join(what.split()), follows_from))

    def fail_with(self, error: FP8ConvertError) -> None:
        """An error whose message is 'subject: what' (as fp8convert's errors name their tensor or file)."""
        subject, _, what = str(error).partition(": ")
        self.fail(subject, what or subject)

    @property
    def failures(self) -> list[str]:
        """Every problem, one line each, naming the tensor or file."""
        return [str(p) for p in self.problems]

    def causes(self) -> list[str]:
        """The problems by root cause, one line each: the tensors of an unreadable file are counted on
        the file's line, and tensors with the same problem share one line."""
        return group_problems(self.problems)

    def worst(self, n: int = 10) -> list[TensorCheck]:
        """The quantized tensors with the largest relative error (failed ones first)."""
        return sorted(self.tensors, key=lambda t: (t.ok, -_sortable(t.rel_error)))[:n]

    def to_dict(self, worst: int = 10) -> dict:
        """JSON-ready: non-finite numbers become the strings "inf", "-inf", "nan" (strict JSON)."""
        data = asdict(self)
        del data["tensors"], data["problems"]
        data["failures"] = self.failures
        data["causes"] = self.causes()
        data["worst"] = [asdict(t) for t in self.worst(worst)]
        return _json_safe(data)


def group_problems(problems: list[Problem]) -> list[str]:
    roots = [p for p in problems if p.follows_from is None or not any(
        r.subject == p.follows_from and r.follows_from is None for r in problems)]
    consequences: dict[str, int] = {}
    for p in problems:
        if p not in roots:
            consequences[p.follows_from] = consequences.get(p.follows_from, 0) + 1
    by_what: dict[str, list[Problem]] = {}
    for p in roots:
        by_what.setdefault(p.what, []).append(p)
    lines = []
    for what, same in by_what.items():
        names = [p.subject for p in same]
        subject = ", ".join(names[:NAMED]) + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")
        line = f"{subject}: {what}"
        followed = sum(consequences.get(name, 0) for name in names)
        if followed:
            line += f"; so {plural(followed, 'tensor')} in it could not be checked"
        lines.append(line)
    return lines


def _sortable(x: float) -> float:
    return math.inf if math.isnan(x) else x


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


# ---------------------------------------------------------------- the structure (headers, config, index)

@dataclass
class OutputLayout:
    tensors: dict[str, tuple[Path, TensorInfo]]       # every output tensor and where it is
    placed_in: dict[str, str]                          # tensor -> file, as the index says
    unreadable: set[str]                               # shard files whose header could not be read


def read_output_layout(out: Path, report: VerifyReport) -> OutputLayout:
    """Every output tensor and where it is, checking the index against the shards' headers."""
    index_path = out / INDEX_NAME
    layout = OutputLayout({}, {}, set())
    if index_path.is_file():
        try:
            weight_map = parse_index(index_path.read_bytes(), INDEX_NAME)
            index = json.loads(index_path.read_text())
            files = index_files(weight_map)
        except FP8ConvertError as e:
            report.fail(INDEX_NAME, str(e).removeprefix(f"{INDEX_NAME}: "))
            return layout
        layout.placed_in = dict(weight_map)
    elif (out / "model.safetensors").is_file():
        index, weight_map, files = None, None, ["model.safetensors"]
    else:
        report.fail(str(out), f"no {INDEX_NAME} (or model.safetensors): the output is incomplete")
        return layout
    total = 0
    tensors = layout.tensors
    for file in files:
        path = out / file
        if not path.is_file():
            report.fail(INDEX_NAME, f"names {file}, which does not exist")
            layout.unreadable.add(file)
            continue
        try:
            header, _ = read_header(str(path), file)
        except FP8ConvertError as e:
            report.fail(file, str(e).removeprefix(f"{path}: "))
            layout.unreadable.add(file)
            continue
        for name, info in header.items():
            total += info.nbytes
            if name in tensors:
                report.fail(f"tensor {name}", f"appears twice: in {tensors[name][1].file} and {file}")
            elif weight_map is not None and weight_map.get(name) != file:
                report.fail(file, f"holds tensor {name}, which {INDEX_NAME} "
                                  + (f"places in {weight_map[name]}" if name in weight_map else "does not list"))
            tensors[name] = (path, info)
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors and file not in layout.unreadable:
                report.fail(INDEX_NAME, f"names tensor {name} in {file}, but {file} does not hold it")
        declared = (index.get("metadata") or {}).get("total_size") if isinstance(index, dict) else None
        if declared is not None and declared != total and not layout.unreadable:
            report.fail(INDEX_NAME, f"metadata.total_size is {declared}, the shards hold {total} bytes")
        stray = sorted(p.name for p in out.glob("*.safetensors") if p.name not in files)
        if stray:
            report.warnings.append(f"{out}: safetensors files not in the index: {', '.join(stray)}")
    return layout


def check_config(source: Source, out: Path, report: VerifyReport) -> tuple[bool, QuantizedLayout | None]:
    """The output's config.json: the source's plus a quantization_config this module can read, or, for
    an FP8 source's dequantized output, the source's without one. (readable, layout): layout None for a
    dequantized output."""
    config_path = out / "config.json"
    try:
        config = json.loads(config_path.read_text())
        if not isinstance(config, dict):
            raise FP8ConvertError(f"{config_path}: not a JSON object")
        fmt = None if is_dequantized_output(source, config) else read_quantization_config(config, str(config_path))
    except FileNotFoundError:
        report.fail(str(config_path), "missing: the output is incomplete")
        return False, None
    except ValueError as e:
        report.fail(str(config_path), f"not valid JSON ({e})")
        return False, None
    except FP8ConvertError as e:
        report.fail(str(config_path), str(e).removeprefix(f"{config_path}: "))
        return False, None
    if fmt is not None:
        for promise in unkept_promises(config["quantization_config"]):
            report.fail(str(config_path), promise)
    rest = {k: v for k, v in config.items() if k != "quantization_config"}
    source_rest = {k: v for k, v in source.config.items() if k not in ("quantization_config", "compression_config")}
    if rest != source_rest:
        keys = sorted(k for k in set(rest) | set(source_rest) if rest.get(k) != source_rest.get(k))
        report.fail(str(config_path), f"differs from the source's config.json beyond quantization_config "
                                      f"(keys: {', '.join(keys)})")
    return True, fmt


def unkept_promises(qc: dict) -> list[str]:
    """What a quantization_config declares that no fp8convert output holds, and loaders act on: a KV-cache
    scheme (k_scale, v_scale), asymmetric weights (zero points), weights not stored compressed. Static
    input activations are checked against the tensors (pair_tensors). transformers ran such configs
    into NaN logits."""
    found = []
    if qc.get("kv_cache_scheme"):
        found.append("declares a kv_cache_scheme, but fp8convert writes no KV-cache scales")
    if qc.get("quantization_status") not in (None, "compressed"):
        found.append(f"quantization_status is {qc.get('quantization_status')!r}, not 'compressed'")
    groups = qc.get("config_groups") if isinstance(qc.get("config_groups"), dict) else {}
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and weights.get("symmetric") is False:
            found.append(f"config group {name} declares asymmetric weights, but the output has no zero points")
    return found


def is_dequantized_output(source: Source, config: dict) -> bool:
    """An FP8 source's output without a quantization_config: written by `dequantize`."""
    return source.quant is not None and "quantization_config" not in config


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


# ---------------------------------------------------------------- what the source implies

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
    """Every output the source implies. A fused expert tensor the output does not hold as it is must
    be there one 2-D weight per expert, cut as the registry's layout says. An FP8 source's scales are
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
            expected += [Expected(name, info, cut) for name, cut in
                         expert_cuts(info, fused[0], fused[1], arch, source.config)]
        except UnsupportedLayout as e:
            report.fail_with(e)
    return expected


# ---------------------------------------------------------------- per-tensor checks: structure

@dataclass(eq=False)
class KeptPair:
    """An output kept in high precision: all of a source tensor, or one expert's cut of a fused one."""

    name: str
    source: TensorInfo
    output: TensorInfo
    cut: Cut | None = None
    where: str = ""
    failed: bool = False


@dataclass(eq=False)
class QuantizedPair:
    """An FP8 output and the source weight it was made from: a high-precision weight, one expert's cut
    of a fused one, or an FP8 source weight (`fp8`: then the source's values are float32(q) * scale,
    and the output may be those codes and scales passed through)."""

    name: str
    source: TensorInfo
    codes: TensorInfo
    scale: TensorInfo
    scale_name: str
    sums: "ErrorSums"
    cut: Cut | None = None
    fp8: FP8Weight | None = None
    failed: bool = False
    # FP8 sources only
    may_pass: bool = False            # the scale's dtype and size are the source's: passed through if its bytes are
    same_scale: bool = False          # the output's scale bytes are the source's
    same_codes: bool = True           # every slab's codes are the source's
    source_scale_ok: bool = True
    scale_ok: bool = True             # the output's scale is finite and positive
    scale_pow2: bool = True           # ... and every value a power of two
    scale_value: float | None = None  # the tensor scheme's one scale
    requantized_problems: list[str] = field(default_factory=list)  # structure, if it was not passed through

    @property
    def measured(self) -> bool:
        """Whether the slabs measure the error (not for a structure that only a pass-through explains)."""
        return not self.requantized_problems


@dataclass(eq=False)
class DequantizedPair:
    """An FP8 source weight written in high precision: every element its one rounding."""

    name: str
    fp8: FP8Weight
    output: TensorInfo
    wrong: int = 0
    failed: bool = False


@dataclass(eq=False)
class SameBytesPair:
    """A tensor carried as it is (a static activation scale): the source's bytes, or `what` fails."""

    name: str
    source: TensorInfo
    output: TensorInfo
    what: str
    failed: bool = False


def check_kept_structure(want: Expected, got: TensorInfo, fmt: QuantizedLayout | None, arch: Architecture,
                         report: VerifyReport) -> bool:
    """A tensor kept in high precision: the dtype and shape of its source (or cut), and not a linear the
    config says is FP8."""
    name, info = want.name, want.info
    if got.dtype != info.dtype or got.shape != want.shape:
        report.fail(name, f"kept as {got.dtype} {list(got.shape)} but the source ({want.where}) is "
                          f"{info.dtype} {list(want.shape)}")
        return False
    reason = default_keep_reason(info, arch, fmt.format, fmt.scheme) if fmt and len(info.shape) == 2 else None
    if fmt and is_linear_weight(name, want.shape, info.dtype, reason) and not fmt.ignores(module_of(name)):
        report.fail(name, f"kept in high precision, but {module_of(name)} is not in the ignore list "
                          "(engines would expect FP8 weights for it)")
    return True


def quantized_structure_problems(want: Expected, got: TensorInfo, scale: TensorInfo | None, scale_name: str,
                                 fmt: QuantizedLayout, fp8_source: bool = False) -> list[str]:
    """What is wrong with a quantized tensor's structure: a 2-D float source (or an FP8 source weight),
    the same shape, a module the ignore list does not name, and a scale of the format's dtype and of a
    shape it allows."""
    info, shape = want.info, want.shape
    problems = []
    if (info.dtype not in FLOAT_SOURCE_DTYPES and not fp8_source) or len(shape) != 2:
        problems.append(f"quantized, but the source ({want.where}) is {info.dtype} {list(shape)} (FP8 needs a 2-D "
                        "float weight)")
    elif got.shape != shape:
        problems.append(f"shape {list(got.shape)} differs from the source's ({want.where}) {list(shape)}")
    if fmt.ignores(module_of(want.name)):
        problems.append(f"quantized, but the ignore list names {module_of(want.name)}")
    if scale is None:
        problems.append(f"its scale {scale_name} is missing")
    elif scale.dtype != fmt.scale_dtype() or (not problems and scale.shape not in fmt.scale_shapes(shape)):
        problems.append(f"scale {scale_name} is {scale.dtype} {list(scale.shape)}, expected "
                        f"{fmt.scale_dtype()} {' or '.join(str(list(s)) for s in fmt.scale_shapes(shape))}")
    return problems


def pair_fp8_weight(weight: FP8Weight, got: TensorInfo, outputs: dict, fmt: QuantizedLayout | None,
                    report: VerifyReport, accounted: set[str]) -> list:
    """The pairs that check an FP8 source weight's output: dequantized (exact), or FP8 (passed through:
    exact; requantized: within the e4m3 bound of the dequantized values), with its static activation
    scale if the output has one. Structure problems are reported here."""
    name = weight.weight.name
    if got.dtype != FP8:
        report.tensors_dequantized += 1
        pairs = []
        if got.dtype not in FLOAT_SOURCE_DTYPES or got.shape != weight.weight.shape:
            report.fail(name, f"dequantized as {got.dtype} {list(got.shape)}, but the source is an FP8 weight "
                              f"{list(weight.weight.shape)} (expected BF16, F16 or F32 of that shape)")
        else:
            pairs.append(DequantizedPair(name, weight, got))
        if fmt is not None and not fmt.ignores(module_of(name)):
            report.fail(name, f"dequantized to {got.dtype}, but {module_of(name)} is not in the ignore list "
                              "(engines would expect FP8 weights for it)")
        return pairs
    if fmt is None:
        report.fail(name, "still FP8, but the output has no quantization_config")
        return []
    report.tensors_quantized += 1
    scale_name = fmt.scale_name(name)
    accounted.add(scale_name)
    pairs = pair_activation_scale(weight, outputs, report, accounted)
    scale = outputs.get(scale_name, (None, None))[1]
    may_pass = scale is not None and scale.dtype == weight.scale.dtype and scale.nbytes == weight.scale.nbytes \
        and got.shape == weight.weight.shape
    if not may_pass and scale is not None and scale.dtype != fmt.scale_dtype():
        report.fail(name, f"scale {scale_name} is {scale.dtype}, but its codes and scale are not the source's (a "
                          f"requantized scale is {fmt.scale_dtype()})")
        return pairs
    problems = quantized_structure_problems(Expected(name, weight.weight), got, scale, scale_name, fmt, True)
    if not may_pass and problems:
        report.fail(name, "; ".join(problems))
        return pairs
    return pairs + [QuantizedPair(name, weight.weight, got, scale, scale_name, ErrorSums(), fp8=weight,
                                  may_pass=may_pass, requantized_problems=problems)]


def pair_activation_scale(weight: FP8Weight, outputs: dict, report: VerifyReport, accounted: set[str]) -> list:
    """A static activation scale in the output must be the source's, byte for byte."""
    name = weight.weight.name[: -len(".weight")] + ".input_scale"
    if name not in outputs:
        return []
    accounted.add(name)
    got, source_scale = outputs[name][1], weight.input_scale
    what = "not the source's static activation scale"
    if source_scale is None or got.dtype != source_scale.dtype or got.nbytes != source_scale.nbytes:
        report.fail(name, what + ("" if source_scale else " (the source has none)"))
        return []
    return [SameBytesPair(name, source_scale, got, what)]


# ---------------------------------------------------------------- per-tensor checks: data

def compare_kept(source, output, origin: str = "the source") -> str | None:
    """A piece of a kept tensor: byte-identical to the source's, and finite. The problem, or None."""
    import torch

    from .run.quantizer import all_finite
    a, b = source.reshape(-1), output.reshape(-1)
    if not same_bytes(a.view(torch.uint8), b.view(torch.uint8)):
        return f"kept in high precision, but its bytes differ from {origin}"
    if b.dtype.is_floating_point and not all_finite(b):
        return "contains NaN or Inf"
    return None


@dataclass
class ErrorSums:
    """What a quantized tensor's check adds up, slab by slab (module docstring)."""

    w2: float = 0.0           # sum of w^2
    e2: float = 0.0           # sum of (w - dequant)^2
    bound2: float = 0.0       # sum of max(2^-4 |w|, 2^-10 scale)^2
    off_grid: int = 0         # codes not within half an e4m3 step of w / scale
    off_rule: int = 0         # power-of-two scales that are not the smallest 2^e fitting their amax
    inexact: int = 0          # with power-of-two scales: codes that are not RNE(w / scale) exactly
    oversized: int = 0        # channel and block float scales above twice amax / 448 of their row or block
    amax: float = 0.0         # the largest |w| (the tensor scheme's scale is checked against it)

    def add(self, other: "ErrorSums") -> None:
        self.w2 += other.w2
        self.e2 += other.e2
        self.bound2 += other.bound2
        self.off_grid += other.off_grid
        self.off_rule += other.off_rule
        self.inexact += other.inexact
        self.oversized += other.oversized
        self.amax = max(self.amax, other.amax)


def exact_sums(w, q, s) -> ErrorSums:
    """The figures of one piece, element by element. `w` the source rows, `q` their codes, `s` the
    scale broadcastable to them (float32)."""
    import torch

    from .run.numerics import FP8_MAX
    w = w.float()
    dq = q.float() * s                    # float32(q) * scale, as run.numerics.dequantize
    e2 = float((w.double() - dq.double()).square().sum())
    w2 = float(w.double().square().sum())
    # per element: max(2^-4 |w|, 2^-10 scale), the worst e4m3 rounding (module docstring)
    bound2 = float(torch.maximum(w.abs() * 2.0**-4, (s * 2.0**-10).expand_as(w)).double().square().sum())
    # the code must be within half an e4m3 step of x = w / scale, computed as the quantizer does
    x = (w / s).clamp(-FP8_MAX, FP8_MAX)
    _, exponent = torch.frexp(x)  # |x| = m * 2^exponent, m in [0.5, 1): binade floor(log2|x|) = exponent - 1
    binade = torch.where(x == 0, torch.full_like(exponent, -6), (exponent - 1).clamp(min=-6))
    half_step = torch.ldexp(torch.ones_like(x), binade - 4)
    off_grid = int((~((x - q.float()).abs() <= half_step)).sum())
    return ErrorSums(w2, e2, bound2, off_grid)


class Scratch:
    """The buffers `fast_sums` works in, allocated once and reused by every tile: a fresh temporary per
    operation would cost more in page faults than the arithmetic itself."""

    KINDS = ("float32", "float32", "float64", "uint8", "int16", "float8_e4m3fn")

    def __init__(self):
        self.buffers: list = []
        self.views: tuple = ((), None, [])  # the last shape and device asked for, and its views

    def take(self, shape, device) -> list:
        """One tensor per KINDS entry, shaped `shape` (views of buffers grown as needed)."""
        import torch
        if self.views[:2] == (shape, device):
            return self.views[2]
        n = math.prod(shape)
        if not self.buffers or self.buffers[0].numel() < n or self.buffers[0].device != device:
            self.buffers = [torch.empty(n, dtype=getattr(torch, kind), device=device) for kind in self.KINDS]
        self.views = (shape, device, [b[:n].view(shape) for b in self.buffers])
        return self.views[2]


def fast_sums(w, q, s, scratch: Scratch | None = None) -> ErrorSums | None:
    """The same figures as `exact_sums` when every code is the round-to-nearest code of w / scale (then
    none is off the grid); None when some code is not, or a weight is not finite (module docstring)."""
    import torch

    from .run.numerics import FP8_MAX
    wf, x, wide, magnitude, bits, x8 = (scratch or Scratch()).take(tuple(w.shape), w.device)
    wf.copy_(w)
    torch.div(wf, s, out=x).clamp_(-FP8_MAX, FP8_MAX)  # float32, exactly as the quantizer divides
    x8.copy_(x)
    codes = q.view(torch.uint8)
    if not same_bytes(x8.view(torch.uint8), codes):
        return None
    # |float32(q)|: the 7 magnitude bits of an e4m3 code, moved into a float16's exponent and mantissa,
    # are the code's magnitude / 2^8 (subnormals included); exact, and no NaN code is left at this point
    torch.bitwise_and(codes, 0x7F, out=magnitude)
    bits.copy_(magnitude).bitwise_left_shift_(7)
    dq = x  # x is done with: its buffer takes |dequant|
    dq.copy_(bits.view(torch.float16)).mul_(s * 256.0)   # |float32(q) * scale|: one rounding, as dequantize
    # q has the sign of x = w / scale, so |w - dequant| = ||w| - |dequant||; float32 holds that
    # difference exactly here (it is at most half a step, far below both), and its square in float64
    wf.abs_()
    dq.sub_(wf)
    flat = wide.view(-1)
    wide.copy_(dq)
    e2 = float(torch.dot(flat, flat))
    wide.copy_(wf)
    w2 = float(torch.dot(flat, flat))
    if not (math.isfinite(w2) and math.isfinite(e2)):
        return None
    # bound: sum of max(|w|, t)^2 / 2^8 with t = scale / 2^6 (module docstring). Where every |w| >= t
    # that is w2 / 2^8; a w below t has |w / scale| < 2^-6, so its code is at most 2^-6 (magnitude bits
    # <= 0x08), and only then is the sum taken again with |w| raised to t (exact in float64: t is a
    # float32 times a power of two).
    bound2 = w2
    if int(magnitude.min()) <= 0x08:
        if s.numel() == 1:
            wide.clamp_(min=s.item() * 2.0**-6)
        else:
            torch.maximum(wide, (s * 2.0**-6).double(), out=wide)
        bound2 = float(torch.dot(flat, flat))
    return ErrorSums(w2, e2, bound2 * 2.0**-8, 0)


def same_bytes(a, b) -> bool:
    """Two uint8 tensors of one length hold the same bytes. On a CPU that is the C library's memcmp:
    several times faster than torch.equal, which builds an elementwise comparison."""
    import torch
    if a.device.type != "cpu" or not (a.is_contiguous() and b.is_contiguous()):
        return torch.equal(a, b)
    return memcmp()(a.data_ptr(), b.data_ptr(), a.numel()) == 0


@functools.cache
def memcmp():
    import ctypes
    function = ctypes.CDLL(None).memcmp  # the process's own symbols: the C library is among them
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return function


def tile_scale(scale, r0: int, r1: int, scheme: str):
    """The scale values of rows [r0, r1), as stored per scheme (float32): [1, 1], rows, MXFP8 groups of
    rows, or the block rows those rows lie in (r0 on a block row)."""
    if scheme == "tensor":
        return scale.reshape(1, 1)
    if scheme in ("channel", "mxfp8"):
        return scale[r0:r1]
    return scale[r0 // BLOCK: -(-r1 // BLOCK)]


def slab_scale(scale, r0: int, r1: int, cols: int, scheme: str):
    """The scale of rows [r0, r1), broadcastable to them (float32)."""
    from .run.numerics import expand_scale
    s = tile_scale(scale, r0, r1, scheme)
    return expand_scale(s, (r1 - r0, cols), scheme) if scheme in ("block", "mxfp8") else s


def measure_slab(w, q, scale, r0: int, scheme: str, powers: bool = False) -> ErrorSums:
    """The figures of rows r0.. of a tensor (`w` source rows, `q` their codes, `scale` the tensor's
    whole scale as float32 values), a tile at a time on a CPU (tiles that stay in the caches; block
    tiles start on block rows), in one piece on a GPU. `powers`: the scales are powers of two (MXFP8,
    UE8M0 blocks), checked exactly as well."""
    rows, cols = w.shape
    step = rows if w.device.type != "cpu" else max(1, TILE_ELEMENTS // max(cols, 1))
    if scheme == "block":
        step = max(BLOCK, step // BLOCK * BLOCK)
    sums = ErrorSums()
    scratch = Scratch()
    for t0 in range(0, rows, step):
        t1 = min(rows, t0 + step)
        s = slab_scale(scale, r0 + t0, r0 + t1, cols, scheme)
        w_tile, q_tile = w[t0:t1], q[t0:t1]
        fast = fast_sums(w_tile, q_tile, s, scratch)
        tile = fast or exact_sums(w_tile, q_tile, s)
        stored = tile_scale(scale, r0 + t0, r0 + t1, scheme)
        if powers:  # where fast_sums answered, every code is RNE(w / scale) byte for byte: none inexact
            tile.off_rule, tile.inexact = power_of_two_checks(w_tile.float(), q_tile, stored, scheme,
                                                              codes=fast is None)
        else:
            tile.oversized, tile.amax = float_scale_checks(w_tile, stored, scheme)
        sums.add(tile)
    return sums


# Codes are checked against whatever scale is stored beside them, so a scale far too large (every code
# rounding to zero) would pass that check; the scale itself is held to at most OVERSIZE x amax / 448 of
# what it scales (or 1 where amax is 0). fp8convert writes amax / 448 exactly; a checkpoint whose float
# scales were rounded up to powers of two (less than 2x) still passes, a scale that wastes more than one
# binade of the e4m3 range does not. A scale too small shows in the codes instead (they saturate).
OVERSIZE = 2.0


def float_scale_checks(w, s, scheme: str) -> tuple[int, float]:
    """(channel or block scales over OVERSIZE x amax / 448 of their rows or blocks, the tensor scheme's
    largest |w|) for one slab with float scales. The tensor scheme's scale may be a fused group's, so its
    comparison waits for every member (check_tensor_scales)."""
    import torch

    from .run.numerics import amax
    if scheme == "tensor":  # one pass, in the weight's own dtype (its largest magnitude is exact in float32)
        if not w.numel():
            return 0, 0.0
        lo, hi = torch.aminmax(w)
        return 0, float(torch.maximum(hi, lo.neg()))
    return int(oversized(s, amax(w, scheme)).sum()), 0.0


def oversized(scale, amax):
    """Which scales are over OVERSIZE x amax / 448 of the weights they scale (tensors, compared element
    by element); a scale of 1 over all-zero weights is the rule's one exception."""
    from .run.numerics import FP8_MAX
    return (scale > amax / FP8_MAX * OVERSIZE * (1 + FLOAT_SLACK)) & ~((amax == 0) & (scale == 1))


def power_of_two_checks(w, q, s, scheme: str, codes: bool = True) -> tuple[int, int]:
    """(scales off the rule, codes off RNE) for one slab of rows with power-of-two scales: MXFP8 exponents
    ([rows, in/32]) or UE8M0 block scales (block rows of the slab). `w`: float32 source rows; `q`: their
    codes; `s`: float32 scale values. `codes` False: the codes are known to be RNE(w / scale) already.

    The rule is written as a property, independently of how the quantizer computes it: s = 2^e must
    satisfy A <= 448 * s (no code overflows) and A > 224 * s (2^(e-1) would overflow), where A is the
    group's amax, or the block's amax floored at 1e-4 (DeepGEMM's clamp). An MXFP8 exponent at its
    lowest byte (2^-127) only needs the first. Both products are exact in float32."""
    import torch

    from .run.numerics import FP8_DTYPE, FP8_MAX, UE8M0_MIN_AMAX, amax, expand_scale, powers_of_two
    a = amax(w, scheme)
    if scheme != "mxfp8":
        a = torch.maximum(a, torch.full_like(a, UE8M0_MIN_AMAX))
    fits = powers_of_two(s) & (a <= FP8_MAX * s)
    smallest = a > (FP8_MAX / 2) * s
    if scheme == "mxfp8":
        smallest |= s == 2.0**-127
    off_rule = int((~(fits & smallest)).sum())
    if not codes:
        return off_rule, 0
    x = (w / expand_scale(s, tuple(w.shape), scheme)).clamp(-FP8_MAX, FP8_MAX)
    inexact = int((x.to(FP8_DTYPE).float() != q.float()).sum())  # compared as values: -0 == +0
    return off_rule, inexact


def tensor_check(pair: QuantizedPair) -> TensorCheck:
    """The figures of a quantized tensor once every slab is summed."""
    sums = pair.sums
    err, norm = math.sqrt(sums.e2), math.sqrt(sums.w2)
    rel = err / norm if norm else (0.0 if err == 0 else math.inf)
    # An infinite error (a code and scale that read back as Inf) leaves no signal at all
    snr = math.inf if err == 0 else (20 * math.log10(norm / err) if norm and math.isfinite(err) else -math.inf)
    bound = math.sqrt(sums.bound2) / norm if norm else math.inf
    ok = sums.off_grid == 0 and sums.off_rule == 0 and sums.inexact == 0 and sums.oversized == 0 and \
        sums.e2 <= sums.bound2 * (1 + FLOAT_SLACK) ** 2
    return TensorCheck(pair.name, list(pair.codes.shape), list(pair.scale.shape), rel, snr, bound, sums.off_grid, ok,
                       sums.off_rule, sums.inexact, sums.oversized)


def check_scale(scale) -> bool:
    import torch
    return bool((torch.isfinite(scale) & (scale > 0)).all())


def numbers_problem(check: TensorCheck, scheme: str) -> str:
    def are(n: int) -> str:
        return "is" if n == 1 else "are"
    what = []
    if check.off_rule_scales:
        what.append(f"{plural(check.off_rule_scales, 'scale')} {are(check.off_rule_scales)} not the smallest power "
                    f"of two that fits their {'group' if scheme == 'mxfp8' else 'block'}")
    if check.oversized_scales:
        what.append(f"{plural(check.oversized_scales, 'scale')} {are(check.oversized_scales)} more than twice "
                    f"amax / 448 of their {'row' if scheme == 'channel' else 'block'} (codes lose precision, or round "
                    "to zero)")
    if check.inexact_codes:
        what.append(f"{plural(check.inexact_codes, 'code')} {are(check.inexact_codes)} not the round-to-nearest-even "
                    "e4m3 value of weight/scale")
    if check.off_grid:
        what.append(f"{plural(check.off_grid, 'code')} {are(check.off_grid)} not the nearest e4m3 value of "
                    "weight/scale")
    if not check.rel_error <= check.bound * (1 + FLOAT_SLACK):
        what.append(f"relative error {check.rel_error:.4g} exceeds the e4m3 bound {check.bound:.4g}")
    return f"{'; '.join(what)} (SNR {check.snr_db:.1f} dB)"


# ---------------------------------------------------------------- the run

@python_spelling
def verify(src: str | Path, out: str | Path, *, revision: str | None = None, token: str | None = None,
           cache_dir: str | None = None, device: str = "auto", max_resident: int | str | None = None,
           prefetch: int | str = AUTO, progress: bool = False) -> VerifyReport:
    """Verify the FP8 checkpoint in `out` (or an FP8 source's dequantized one) against its source `src`
    (directory or Hub repo id), reading both through the conversion's reader on `device` within
    `max_resident` bytes a batch."""
    from .options import Settings
    started = time.monotonic()
    settings = Settings(device=device, max_resident=max_resident, prefetch=prefetch, progress=progress)
    source = open_source(src, revision, token, cache_dir)
    out = Path(out)
    if not out.is_dir():
        raise FP8ConvertError(f"{out}: not a directory")
    report = VerifyReport(str(src), str(out))
    check_manifest_and_side_files(source, out, report)
    readable, fmt = check_config(source, out, report)
    if readable:
        report.format, report.scheme = (fmt.format, fmt.scheme) if fmt else ("dequantized", None)
        pairs = pair_tensors(source, out, fmt, report)
        check_data(source, out, pairs, fmt, report, settings)
    if report.tensors:
        report.max_rel_error = max(_sortable(t.rel_error) for t in report.tensors)
        report.min_snr_db = min(t.snr_db if not math.isnan(t.snr_db) else -math.inf for t in report.tensors)
    report.ok = not report.problems
    report.seconds = time.monotonic() - started
    report.stage_seconds = {k: round(v, 3) for k, v in report.stage_seconds.items()}
    return report


def pair_tensors(source: Source, out: Path, fmt: QuantizedLayout | None, report: VerifyReport) -> list:
    """Each output the source implies with what the output holds for it (structure checked); missing
    outputs and output tensors nothing in the source explains are problems."""
    layout = read_output_layout(out, report)
    outputs = layout.tensors
    if fmt is not None and fmt.static_activations and \
            not any(name.endswith((".input_scale", ".activation_scale")) for name in outputs):
        report.fail(str(out / "config.json"), "declares static input activations, but the output holds no "
                                              "input_scale tensors (engines would read scales that are not there)")
    arch = architecture_of(source.config) or GENERIC
    accounted: set[str] = set()
    pairs: list = []
    for want in expected_outputs(source, arch, outputs, report):
        name = want.name
        if name not in outputs:
            file = layout.placed_in.get(name)
            if file in layout.unreadable:
                report.fail(name, f"not checked: {file} cannot be read", follows_from=file)
            else:
                report.fail(name, f"missing from the output ({want.where})" if want.cut else
                            "source tensor missing from the output")
            continue
        accounted.add(name)
        _, got = outputs[name]
        fp8_weight = source.quant.weights.get(want.info.name) if source.quant and not want.cut else None
        if fp8_weight is not None:
            pairs += pair_fp8_weight(fp8_weight, got, outputs, fmt, report, accounted)
        elif got.dtype == FP8 and fmt is None:
            report.fail(name, "still FP8, but the output has no quantization_config")
        elif got.dtype == FP8:
            scale_name = fmt.scale_name(name)
            accounted.add(scale_name)
            report.tensors_quantized += 1
            scale = outputs.get(scale_name, (None, None))[1]
            problems = quantized_structure_problems(want, got, scale, scale_name, fmt)
            if problems:
                report.fail(name, "; ".join(problems))
            else:
                pairs.append(QuantizedPair(name, want.info, got, scale, scale_name, ErrorSums(), cut=want.cut))
        else:
            report.tensors_kept += 1
            if check_kept_structure(want, got, fmt, arch, report):
                pairs.append(KeptPair(name, want.info, got, want.cut, want.where))
    for name in sorted(set(outputs) - accounted):
        report.fail(name, f"in the output ({outputs[name][1].file}) but not derived from any source tensor")
    return pairs


def rows_of(info: TensorInfo, r0: int, n: int) -> TensorInfo:
    """Rows [r0, r0 + n) of a tensor with at least one dimension, as a piece of its file."""
    per_row = info.nbytes // max(info.shape[0], 1)
    return replace(info, offset=info.offset + r0 * per_row, nbytes=n * per_row, shape=(n, *info.shape[1:]))


def slab_starts(rows: int, step: int) -> list[tuple[int, int]]:
    """(first row, row count) of each slab; one empty slab for a tensor without rows."""
    return [(r0, min(step, rows - r0)) for r0 in range(0, rows, step)] or [(0, 0)]


def pieces(pair, scheme: str | None) -> list[tuple[int, int, list[TensorInfo], list[TensorInfo]]]:
    """(first row, end row, source pieces, output pieces) for each read of a pair: a kept tensor in
    pieces of CHUNK_BYTES (counted in bytes); a quantized one in slabs of rows of about CHUNK_ELEMENTS
    (whole 128-row blocks for the block scheme, and for every FP8 source), each slab with the whole
    (small) scales; a cut of a fused expert tensor, or a carried tensor, in one read (the expert's
    rows of the source, the whole output)."""
    if isinstance(pair, SameBytesPair):
        return [(0, 0, [pair.source], [pair.output])]
    if isinstance(pair, KeptPair) and pair.cut is None:
        info = pair.source
        item = max(1, info.nbytes // max(info.numel, 1))
        step = max(item, CHUNK_BYTES // item * item)
        return [(start, start + n, [replace(info, offset=info.offset + start, nbytes=n, shape=(n // item,))],
                 [replace(pair.output, offset=pair.output.offset + start, nbytes=n, shape=(n // item,))])
                for start in range(0, info.nbytes, step) for n in [min(step, info.nbytes - start)]] or \
            [(0, 0, [info], [pair.output])]
    if isinstance(pair, (KeptPair, QuantizedPair)) and pair.cut is not None:
        info, cut = pair.source, pair.cut
        source = info if cut.expert is None else rows_of(info, cut.expert, 1)
        output = [pair.output] if isinstance(pair, KeptPair) else [pair.codes, pair.scale]
        rows = output[0].shape[0] if output[0].shape else 0
        return [(0, rows, [source], output)]
    if isinstance(pair, DequantizedPair):
        weight, out = pair.fp8, pair.output
        rows, cols = out.shape
        step = max(BLOCK, CHUNK_ELEMENTS // max(cols, 1) // BLOCK * BLOCK)
        return [(r0, r0 + n, [rows_of(weight.weight, r0, n), weight.scale], [rows_of(out, r0, n)])
                for r0, n in slab_starts(rows, step)]
    rows, cols = pair.codes.shape
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    if scheme == "block" or pair.fp8:  # slabs start on block rows, so each slab's scale rows expand on their own
        step = max(BLOCK, step // BLOCK * BLOCK)
    extra = [pair.fp8.scale] if pair.fp8 else []
    return [(r0, r0 + n, [rows_of(pair.source, r0, n)] + extra, [rows_of(pair.codes, r0, n), pair.scale])
            for r0, n in slab_starts(rows, step)]


def check_data(source: Source, out: Path, pairs: list, fmt: QuantizedLayout | None, report: VerifyReport,
               settings) -> None:
    """Stream every pair's bytes and check them; the problems and figures go into `report`."""
    import torch

    from .run.device import budget_for, resolve_device
    from .run.prefetch import window_for
    from .run.progress import Progress
    from .run.verify_stream import Read, VerifyStream
    dev = resolve_device(settings.device)
    scheme = fmt.scheme if fmt else None
    reads = [Read((pair, r0, r1), sources, outputs, pair.name)
             for pair in pairs for r0, r1, sources, outputs in pieces(pair, scheme)]
    report.bytes_read = sum(r.nbytes for r in reads)
    bar = Progress(report.bytes_read, f"verify {out}", enabled=settings.progress)
    group_scales: dict[str, SharedScale] = {}
    arch = architecture_of(source.config) or GENERIC
    how = Checking(fmt, source.quant.scheme if source.quant else None)
    seconds = report.stage_seconds
    seconds.update(wait_read=0.0, check=0.0)
    try:
        budget = budget_for(dev, settings.max_resident)
        with VerifyStream(reads, source.root, out, dev, budget, bar, window_for(settings.prefetch)) as stream, \
                checkers(dev) as run_all, torch.no_grad():
            waited = time.monotonic()
            for batch in stream:
                checking = time.monotonic()
                results = run_all([lambda item=item: check_piece(*item, how) for item in batch])
                for (read, _, _), result in zip(batch, results):
                    record(*read.key, result, how, report, group_scales, arch)
                del batch, results
                seconds["wait_read"] += checking - waited
                waited = time.monotonic()
                seconds["check"] += waited - checking
    except (torch.OutOfMemoryError, MemoryError) as e:
        e.max_resident = budget_for(dev, settings.max_resident)  # the CLI suggests a smaller one
        raise
    finally:
        bar.close()
    for key, shared in group_scales.items():
        if len(shared.scales) > 1:
            report.warnings.append(f"{key}: fused members have different per-tensor scales; vLLM re-quantizes "
                                   "them to the largest (a second rounding)")
    check_tensor_scales(group_scales.values(), report)


@dataclass
class SharedScale:
    """The tensor scheme's scales of one fused group (or of one tensor outside any group): the scales its
    members carry, the largest |w| among those quantized here, and their names."""

    scales: set[float] = field(default_factory=set)
    names: list[str] = field(default_factory=list)
    measured_scale: float | None = None  # the largest scale of members quantized here (not passed through)
    amax: float = 0.0                    # ... and their largest |w|


def check_tensor_scales(shared_scales, report: VerifyReport) -> None:
    """The tensor scheme's one scale must be at most OVERSIZE x amax / 448 of what it scales (a fused
    group's largest |w|), or 1 for all-zero weights (see OVERSIZE). Passed-through scales are the source's
    own and are not held to it."""
    import torch

    from .run.numerics import FP8_MAX
    as_double = functools.partial(torch.tensor, dtype=torch.float64)  # the arithmetic of Python's floats
    for shared in shared_scales:
        scale = shared.measured_scale
        if scale is None:
            continue
        if oversized(as_double(scale), as_double(shared.amax)):
            whose = "its" if len(shared.names) == 1 else "its fused group's"
            for name in shared.names:
                report.fail(name, f"scale {scale:.6g} is more than twice amax / 448 = {shared.amax / FP8_MAX:.6g} of "
                                  f"{whose} weights (codes lose precision, or round to zero)")


CPU_WORKERS = None  # checking threads on a CPU; None: one per core


@contextlib.contextmanager
def checkers(device):
    """Where the checks of a batch run, results in order: on a CPU, one worker thread per core, each
    with one torch thread; on a GPU, here. A CPU check is many small operations (tiles that stay in the
    caches): run side by side they pay no thread-pool synchronisation each, and a core busy with
    another program holds up one worker, not every operation."""
    import torch
    workers = CPU_WORKERS or usable_cores()
    if device.type != "cpu" or workers < 2:
        yield lambda jobs: [job() for job in jobs]
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="fp8convert-verify") as pool:
            yield lambda jobs: list(pool.map(lambda job: job(), jobs))
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class Checking:
    """What every check needs to know of the output and the source: the output's layout (None for a
    dequantized output) and an FP8 source's scheme."""

    fmt: QuantizedLayout | None
    source_scheme: str | None

    @property
    def scheme(self) -> str | None:
        return self.fmt.scheme if self.fmt else None

    @property
    def powers_of_two(self) -> bool:
        """The output's scales are powers of two by rule: MXFP8 exponents, UE8M0 blocks."""
        return bool(self.fmt) and (self.fmt.scheme == "mxfp8" or self.fmt.scale_format == "ue8m0")


@dataclass
class SlabResult:
    """What one slab of a quantized tensor shows."""

    scale_ok: bool
    scale_value: float | None       # the tensor scheme's one scale
    sums: ErrorSums | None
    # FP8 sources only
    source_scale_ok: bool = True
    same_scale: bool = False
    same_codes: bool = False
    scale_pow2: bool = True


def check_piece(read, sources, outputs, how: Checking):
    """The check of one read (a worker runs it): a kept piece's problem, a carried tensor's sameness, a
    dequantized slab's count of wrong elements, or a quantized slab's result."""
    import torch
    pair, r0, _ = read.key
    if isinstance(pair, KeptPair):
        if pair.cut is None:
            return compare_kept(sources[0], outputs[0])
        return compare_kept(cut_of(pair.cut, sources[0]).contiguous(), outputs[0], pair.where)
    if isinstance(pair, SameBytesPair):
        return same_bytes(sources[0].reshape(-1).view(torch.uint8), outputs[0].reshape(-1).view(torch.uint8))
    if isinstance(pair, DequantizedPair):
        return check_dequantized_slab(*sources, outputs[0], r0, how.source_scheme)
    if pair.fp8 is not None:
        return check_fp8_source_slab(pair, *sources, *outputs, r0, how)
    w = sources[0] if pair.cut is None else cut_of(pair.cut, sources[0])
    return check_quantized_slab(w, *outputs, r0, how)


def cut_of(cut: Cut, piece):
    """A cut's 2-D weight from what was read of its source: the one expert's rows, or the whole tensor."""
    return cut.apply(piece) if cut.expert is None else cut.across_experts().apply(piece)[0]


def scale_values(scale):
    """A stored output scale as float32 values: MXFP8's E8M0 bytes decoded (255, E8M0's NaN, to NaN)."""
    import torch

    from .run.numerics import e8m0_to_float
    return e8m0_to_float(scale) if scale.dtype == torch.uint8 else scale.float()


def check_quantized_slab(w, q, scale, r0: int, how: Checking) -> SlabResult:
    values = scale_values(scale)
    if not check_scale(values):
        return SlabResult(False, None, None)
    value = values.reshape(-1)[0].item() if how.scheme == "tensor" else None
    return SlabResult(True, value, measure_slab(w, q, values, r0, how.scheme, how.powers_of_two))


def source_values(codes, scale, r0: int, source_scheme: str):
    """An FP8 source slab's values, float32(q) * scale (float32), or None when its scale is not finite
    and positive everywhere."""
    from .run.numerics import dequantize, scale_as_stored
    s = scale_as_stored(scale, source_scheme)
    if not check_scale(s):
        return None
    return dequantize(codes, tile_scale(s, r0, r0 + codes.shape[0], source_scheme), source_scheme)


def check_dequantized_slab(codes, scale, stored, r0: int, source_scheme: str) -> int | None:
    """How many elements of a dequantized slab are not (float32(q) * scale) rounded once to their dtype;
    None when the source's scale is not finite and positive."""
    import torch
    values = source_values(codes, scale, r0, source_scheme)
    if values is None:
        return None
    expected = values.to(stored.dtype).contiguous()
    size = stored.element_size()
    a, b = expected.view(torch.uint8).reshape(-1), stored.contiguous().view(torch.uint8).reshape(-1)
    if same_bytes(a, b):
        return 0
    return int((a.view(-1, size) != b.view(-1, size)).any(dim=1).sum())


def check_fp8_source_slab(pair: QuantizedPair, codes, source_scale, q, scale, r0: int, how: Checking
                          ) -> SlabResult:
    """A slab of an FP8 output made from an FP8 source weight: whether its codes (and, in the first slab,
    its scale) are the source's, and its figures against the source's dequantized values."""
    import torch
    result = SlabResult(True, None, None)
    result.same_codes = pair.may_pass and same_bytes(codes.reshape(-1).view(torch.uint8),
                                                     q.reshape(-1).view(torch.uint8))
    if r0 == 0 and pair.may_pass:
        result.same_scale = same_bytes(source_scale.reshape(-1).view(torch.uint8),
                                       scale.reshape(-1).view(torch.uint8))
    values = scale_values(scale)
    result.scale_ok = check_scale(values)
    if r0 == 0 and result.scale_ok:
        from .run.numerics import powers_of_two
        result.scale_pow2 = bool(powers_of_two(values).all())
        if how.scheme == "tensor":
            result.scale_value = values.reshape(-1)[0].item()
    w = source_values(codes, source_scale, r0, how.source_scheme)
    result.source_scale_ok = w is not None
    if w is not None and result.scale_ok and pair.measured:
        result.sums = measure_slab(w, q, values, r0, how.scheme, how.powers_of_two)
    return result


def record(pair, r0: int, r1: int, result, how: Checking, report: VerifyReport,
           group_scales: dict[str, SharedScale], arch: Architecture) -> None:
    """A piece's result into the report, in the order of the pieces (the main thread): a tensor's
    problem once, and a quantized tensor's figures after its last slab."""
    if pair.failed:
        return
    if isinstance(pair, KeptPair):
        if result:
            pair.failed = True
            report.fail(pair.name, result)
        return
    if isinstance(pair, SameBytesPair):
        if not result:
            pair.failed = True
            report.fail(pair.name, pair.what)
        return
    if isinstance(pair, DequantizedPair):
        if result is None:
            pair.failed = True
            report.fail(pair.fp8.scale.name, "the source's scale is not finite and positive everywhere")
            return
        pair.wrong += result
        if r1 == pair.output.shape[0] and pair.wrong:
            report.fail(pair.name, f"{plural(pair.wrong, 'element')} {'differs' if pair.wrong == 1 else 'differ'} "
                                   f"from float32(q) * scale rounded once to {pair.output.dtype}")
        return
    if pair.fp8 is not None:
        record_fp8_source_slab(pair, r0, r1, result, how, report, group_scales, arch)
        return
    if not result.scale_ok:
        pair.failed = True
        report.fail(pair.name, f"scale {pair.scale_name} is not finite and positive everywhere")
        return
    if r0 == 0:
        pair.scale_value = result.scale_value
    pair.sums.add(result.sums)
    if r1 == pair.codes.shape[0]:
        add_group_scale(pair, how, group_scales, arch, measured=True)
        finish_quantized(pair, how, report)


def finish_quantized(pair: QuantizedPair, how: Checking, report: VerifyReport) -> None:
    check = tensor_check(pair)
    report.tensors.append(check)
    if not check.ok:
        report.fail(check.name, numbers_problem(check, how.scheme))


def record_fp8_source_slab(pair: QuantizedPair, r0: int, r1: int, result: SlabResult, how: Checking,
                           report: VerifyReport, group_scales: dict[str, SharedScale], arch: Architecture) -> None:
    """An FP8 source weight's FP8 output, slab by slab; once all are in: passed through (its codes and
    scale the source's: exact) or requantized (measured against the source's dequantized values)."""
    if r0 == 0:
        pair.same_scale, pair.scale_ok, pair.scale_pow2 = result.same_scale, result.scale_ok, result.scale_pow2
        pair.scale_value = result.scale_value
    pair.same_codes &= result.same_codes
    pair.source_scale_ok &= result.source_scale_ok
    if result.sums is not None:
        pair.sums.add(result.sums)
    if r1 != pair.codes.shape[0]:
        return
    fmt, name, scale_name = how.fmt, pair.name, pair.scale_name
    if pair.may_pass and pair.same_scale and pair.same_codes:  # passed through
        if pair.scale.shape not in fmt.scale_shapes(pair.codes.shape):
            report.fail(name, f"scale {scale_name} shaped {list(pair.scale.shape)}, expected "
                              f"{' or '.join(str(list(s)) for s in fmt.scale_shapes(pair.codes.shape))}")
        elif not pair.scale_ok:
            report.fail(name, f"scale {scale_name} is not finite and positive everywhere")
        elif fmt.scale_format == "ue8m0" and not pair.scale_pow2:
            report.fail(name, f"scale {scale_name} passed through from the source is not a power of two "
                              "everywhere, but the config says scale_fmt ue8m0")
        elif fmt.ignores(module_of(name)):
            report.fail(name, f"passed through in FP8, but the ignore list names {module_of(name)}")
        else:
            report.tensors.append(TensorCheck(name, list(pair.codes.shape), list(pair.scale.shape), 0.0, math.inf,
                                              0.0, 0, True))
            add_group_scale(pair, how, group_scales, arch)
        return
    if pair.scale.dtype != fmt.scale_dtype():
        report.fail(name, f"scale {scale_name} is {pair.scale.dtype}, but its codes and scale are not the source's "
                          f"(a requantized scale is {fmt.scale_dtype()})")
    elif not pair.source_scale_ok:
        report.fail(pair.fp8.scale.name, "the source's scale is not finite and positive everywhere")
    elif pair.requantized_problems:
        report.fail(name, "; ".join(pair.requantized_problems))
    elif not pair.scale_ok:
        report.fail(name, f"scale {scale_name} is not finite and positive everywhere")
    else:
        add_group_scale(pair, how, group_scales, arch, measured=True)
        finish_quantized(pair, how, report)


def add_group_scale(pair: QuantizedPair, how: Checking, group_scales: dict[str, SharedScale],
                    arch: Architecture, measured: bool = False) -> None:
    """A finished tensor-scheme weight's scale, under its fused group (or its own name); `measured`: its
    codes were quantized here, and its largest |w| counts toward what the scale must fit."""
    if how.scheme != "tensor" or pair.scale_value is None:
        return
    shared = group_scales.setdefault(fused_group_key(pair.name, arch.fused) or pair.name, SharedScale())
    shared.scales.add(pair.scale_value)
    shared.names.append(pair.name)
    if measured:
        shared.measured_scale = max(shared.measured_scale or 0.0, pair.scale_value)
        shared.amax = max(shared.amax, pair.sums.amax)


# ---------------------------------------------------------------- presenting it

def render(report: VerifyReport, worst: int = 10, every_problem: bool = False) -> str:
    what = f"{report.format or '?'} format, {report.scheme or '?'} scheme" if report.format != "dequantized" \
        else "dequantized"
    lines = [f"verify {report.src} -> {report.out}: {what}",
             f"  {plural(report.tensors_quantized, 'tensor')} quantized, {report.tensors_kept} kept"
             + (f", {report.tensors_dequantized} dequantized (each equal to its one rounding)"
                if report.tensors_dequantized else "")]
    if report.tensors:
        lines.append(f"  relative error max {report.max_rel_error:.4g}, SNR min {report.min_snr_db:.1f} dB")
        lines.append("  worst tensors:")
        for t in report.worst(worst):
            lines.append(f"    {t.name:<60} rel {t.rel_error:.4g} (bound {t.bound:.4g})  SNR {t.snr_db:6.1f} dB"
                         + ("" if t.ok else "  FAILED"))
    for w in report.warnings:
        lines.append(f"  warning: {w}")
    if report.ok:
        lines.append("  OK")
        return "\n".join(lines)
    causes = report.causes()
    shown = report.failures if every_problem else causes
    more = "" if every_problem or len(shown) == len(report.failures) else \
        f" ({len(report.failures)} findings in all; --all lists each)"
    lines.append(f"  FAILED: {plural(len(causes), 'problem')}{more}")
    lines += [f"    - {f}" for f in shown]
    return "\n".join(lines)


def record_in_card(report: VerifyReport, out: str | Path) -> str | None:
    """After a passing verify, put its figures in OUT's model card (README.md), so they travel with a
    push: only when OUT is fp8convert's own output (it has a manifest), never someone else's checkpoint
    or a link into a download cache. Returns a warning when the card cannot be written (a read-only
    output still passes), else None."""
    card = Path(out) / CARD_NAME
    if not card.is_file() or card.is_symlink() or not Manifest(out).path.is_file():
        return None
    figures = {"tensors quantized": report.tensors_quantized, "tensors kept (byte-identical)": report.tensors_kept,
               "worst relative error": report.max_rel_error, "lowest SNR (dB)": report.min_snr_db}
    if report.tensors_dequantized:
        figures["tensors dequantized (every element its one rounding)"] = report.tensors_dequantized
    if report.format == "dequantized":
        figures = {k: v for k, v in figures.items() if k not in ("tensors quantized", "worst relative error",
                                                                  "lowest SNR (dB)")}
    try:
        write_atomic(card, with_verification(card.read_text(), figures).encode())
    except (OSError, FP8ConvertError) as e:  # write_atomic says what failed in the OSError it was raised from
        cause = e.__cause__ if isinstance(e.__cause__, OSError) else e
        return (f"{card}: the verification figures were not added to the model card "
                f"({getattr(cause, 'strerror', None) or cause})")
    return None
