"""Check an FP8 checkpoint against its source: structure and numbers, with bounded memory.

Both checkpoints are streamed: kept tensors are compared byte for byte in chunks, quantized ones are
read a slab of rows at a time (source weight, codes, the matching slice of the scales), so memory
stays at a few slabs whatever the model. Works for both output formats:

- compressed-tensors: `X.weight` F8_E4M3 + `X.weight_scale` F32 shaped [1] (tensor), [out, 1] (channel)
  or [ceil(out/128), ceil(in/128)] (block);
- fp8 (vLLM/DeepSeek native): `X.weight_scale` F32 [] or [1] (tensor), or `X.weight_scale_inv` F32
  [ceil(out/128), ceil(in/128)] (block);
- compressed-tensors MXFP8: `X.weight_scale` U8 [out, in/32], E8M0 exponent bytes (value 2^(byte-127)).

Power-of-two scales are checked exactly (see `power_of_two_checks`): an MXFP8 exponent, or a block
scale under `scale_fmt: ue8m0`, must be the smallest power of two 2^e with amax <= 448 * 2^e (amax of
its group of 32, or of its 128x128 block floored at 1e-4), and since w / 2^e is exact, every code must
equal the round-to-nearest-even e4m3 value of w / 2^e, ties included.

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

FP8 sources
-----------
When the source is itself FP8, its weights' values are float32(q) * scale. A dequantized output
(`fp8convert dequantize`, or a weight kept with --ignore) must equal that product rounded once to the
output's dtype, element for element, and its scales must be gone. An FP8 output is checked against
those float32 values with the bound above (and, requantized to MXFP8 or UE8M0 blocks, with the exact
power-of-two checks); one whose codes and scale values are the source's (passed through) is exact, its
scales powers of two where the config says scale_fmt ue8m0. A static activation scale in the output must
be the source's, byte for byte.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import FP8ConvertError
from .formats import QuantizedLayout, read_quantization_config
from .formats.sources import FP8Weight
from .options import BLOCK
from .output.card import with_verification
from .output.files import write_atomic
from .output.manifest import Manifest
from .plan.architectures import GENERIC, Architecture, architecture_of
from .plan.cuts import Cut
from .plan.rules import (UnsupportedLayout, default_keep_reason, expert_cuts, fused_group_key, is_linear_weight,
                         module_of)
from .safetensors_io import FLOAT_SOURCE_DTYPES, FP8, INDEX_NAME, TensorInfo, pread_into, read_header, torch_dtype
from .source.checkpoint import Source, index_files, parse_index
from .source.hub import CARD_NAME
from .source.resolve import open_source
CHUNK_ELEMENTS = 1 << 22        # elements per slab of a quantized tensor (a few 16 MB float32 temporaries)
CHUNK_BYTES = 16 << 20          # bytes per piece when comparing kept tensors
FLOAT_SLACK = 1e-5              # float32 arithmetic in dequant / division, far below any real error


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
    failures: list[str] = field(default_factory=list)   # one line each, naming the tensor or file
    warnings: list[str] = field(default_factory=list)
    tensors: list[TensorCheck] = field(default_factory=list)

    def worst(self, n: int = 10) -> list[TensorCheck]:
        """The quantized tensors with the largest relative error (failed ones first)."""
        return sorted(self.tensors, key=lambda t: (t.ok, -_sortable(t.rel_error)))[:n]

    def to_dict(self, worst: int = 10) -> dict:
        """JSON-ready: non-finite numbers become the strings "inf", "-inf", "nan" (strict JSON)."""
        data = asdict(self)
        del data["tensors"]
        data["worst"] = [asdict(t) for t in self.worst(worst)]
        return _json_safe(data)


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


# ---------------------------------------------------------------- reading, one slab at a time

class _Files:
    """Open file descriptors by path, closed together."""

    def __init__(self):
        self.fds: dict[Path, int] = {}

    def pread(self, path: Path, offset: int, length: int) -> bytearray:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        buf = bytearray(length)
        pread_into(self.fds[path], memoryview(buf), offset, path.name)
        return buf

    def rows(self, path: Path, info: TensorInfo, start: int, stop: int):
        """Rows [start, stop) of a tensor with at least one dimension."""
        per_row = info.nbytes // info.shape[0] if info.shape[0] else 0
        return self._tensor(path, info, info.offset + start * per_row, (stop - start, *info.shape[1:]))

    def whole(self, path: Path, info: TensorInfo):
        return self._tensor(path, info, info.offset, info.shape)

    def _tensor(self, path: Path, info: TensorInfo, offset: int, shape: tuple[int, ...]):
        import torch
        dtype = torch_dtype(info.dtype)
        length = math.prod(shape) * dtype.itemsize
        if not length:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.pread(path, offset, length), dtype=torch.uint8).view(dtype).reshape(shape)

    def close(self):
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def read_output_layout(out: Path, report: VerifyReport) -> dict[str, tuple[Path, TensorInfo]]:
    """Every output tensor and where it is, checking the index against the shards' headers."""
    index_path = out / INDEX_NAME
    tensors: dict[str, tuple[Path, TensorInfo]] = {}
    if index_path.is_file():
        try:
            weight_map = parse_index(index_path.read_bytes(), INDEX_NAME)
            index = json.loads(index_path.read_text())
            files = index_files(weight_map)
        except FP8ConvertError as e:
            report.failures.append(str(e))
            return tensors
    elif (out / "model.safetensors").is_file():
        index, weight_map, files = None, None, ["model.safetensors"]
    else:
        report.failures.append(f"{out}: no {INDEX_NAME} (or model.safetensors): the output is incomplete")
        return tensors
    total = 0
    for file in files:
        path = out / file
        if not path.is_file():
            report.failures.append(f"{INDEX_NAME}: names {file}, which does not exist")
            continue
        try:
            header, _ = read_header(str(path), file)
        except FP8ConvertError as e:
            report.failures.append(str(e))
            continue
        for name, info in header.items():
            total += info.nbytes
            if name in tensors:
                report.failures.append(f"tensor {name} appears twice: in {tensors[name][1].file} and {file}")
            elif weight_map is not None and weight_map.get(name) != file:
                report.failures.append(f"{file}: holds tensor {name}, which {INDEX_NAME} "
                                       + (f"places in {weight_map[name]}" if name in weight_map else "does not list"))
            tensors[name] = (path, info)
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors and (out / file).is_file():
                report.failures.append(f"{INDEX_NAME}: names tensor {name} in {file}, but {file} does not hold it")
        declared = (index.get("metadata") or {}).get("total_size") if isinstance(index, dict) else None
        if declared is not None and declared != total:
            report.failures.append(f"{INDEX_NAME}: metadata.total_size is {declared}, the shards hold {total} bytes")
        stray = sorted(p.name for p in out.glob("*.safetensors") if p.name not in files)
        if stray:
            report.warnings.append(f"{out}: safetensors files not in the index: {', '.join(stray)}")
    return tensors


# ---------------------------------------------------------------- the checks

def verify(src: str | Path, out: str | Path, *, revision: str | None = None, token: str | None = None) -> VerifyReport:
    """Verify the FP8 checkpoint in `out` against its source `src` (directory or Hub repo id)."""
    source = open_source(src, revision, token)
    out = Path(out)
    if not out.is_dir():
        raise FP8ConvertError(f"{out}: not a directory")
    report = VerifyReport(str(src), str(out))
    files = _Files()
    try:
        _verify(source, out, report, files)
    finally:
        files.close()
    report.ok = not report.failures
    return report


def _verify(source: Source, out: Path, report: VerifyReport, files: _Files) -> None:
    manifest = Manifest(out)
    try:
        state = manifest.read()
        if state is not None and not state.get("complete"):
            report.failures.append(f"{manifest.path}: the conversion did not finish; rerun it")
    except FP8ConvertError:
        report.failures.append(f"{manifest.path}: unreadable")
    config_path = out / "config.json"
    try:
        config = json.loads(config_path.read_text())
        if not isinstance(config, dict):
            raise FP8ConvertError(f"{config_path}: not a JSON object")
        fmt = None if is_dequantized_output(source, config) else read_quantization_config(config, str(config_path))
    except FileNotFoundError:
        report.failures.append(f"{config_path}: missing: the output is incomplete")
        return
    except ValueError as e:
        report.failures.append(f"{config_path}: not valid JSON ({e})")
        return
    except FP8ConvertError as e:
        report.failures.append(str(e))
        return
    report.format, report.scheme = (fmt.format, fmt.scheme) if fmt else ("dequantized", None)
    rest = {k: v for k, v in config.items() if k != "quantization_config"}
    source_rest = {k: v for k, v in source.config.items() if k not in ("quantization_config", "compression_config")}
    if rest != source_rest:
        keys = sorted(k for k in set(rest) | set(source_rest) if rest.get(k) != source_rest.get(k))
        report.failures.append(f"{config_path}: differs from the source's config.json beyond quantization_config "
                               f"(keys: {', '.join(keys)})")
    for name in source.copy_files:
        copied = out / name
        if not copied.is_file() or copied.read_bytes() != (source.root / name).read_bytes():
            report.warnings.append(f"{copied}: missing or different from the source's {name}")

    outputs = read_output_layout(out, report)
    arch = architecture_of(source.config) or GENERIC
    accounted: set[str] = set()
    group_scales: dict[str, set[float]] = {}
    for want in expected_outputs(source, arch, outputs, report):
        name = want.name
        if name not in outputs:
            report.failures.append(f"{name}: " + (f"missing from the output ({want.where})" if want.cut else
                                                  "source tensor missing from the output"))
            continue
        accounted.add(name)
        path, got = outputs[name]
        fp8_weight = source.quant.weights.get(want.info.name) if source.quant and not want.cut else None
        if fp8_weight is not None:  # an FP8 source's weight: dequantized, requantized or passed through
            scale = _check_fp8_source_weight(source, fp8_weight, path, got, outputs, fmt, arch, report, files, accounted)
            if scale is not None and fmt.scheme == "tensor" and (key := fused_group_key(name, arch.fused)):
                group_scales.setdefault(key, set()).add(scale.reshape(-1)[0].item())
            continue
        if got.dtype == FP8:
            scale_name = fmt.scale_name(name)
            accounted.add(scale_name)
            report.tensors_quantized += 1
            scale = _check_quantized(source, want, path, got, outputs.get(scale_name), scale_name, fmt, report, files)
            if scale is not None and fmt.scheme == "tensor" and (key := fused_group_key(name, arch.fused)):
                group_scales.setdefault(key, set()).add(scale.reshape(-1)[0].item())
        else:
            report.tensors_kept += 1
            _check_kept(source, want, path, got, fmt, arch, report, files)
    for name in sorted(set(outputs) - accounted):
        report.failures.append(f"{name}: in the output ({outputs[name][1].file}) but not derived from any source tensor")
    for key, scales in group_scales.items():
        if len(scales) > 1:
            report.warnings.append(f"{key}: fused members have different per-tensor scales; vLLM re-quantizes "
                                   "them to the largest (a second rounding)")
    if report.tensors:
        report.max_rel_error = max(_sortable(t.rel_error) for t in report.tensors)
        report.min_snr_db = min(t.snr_db if not math.isnan(t.snr_db) else -math.inf for t in report.tensors)


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
    be there one 2-D weight per expert, cut as the registry's layout says."""
    expected = []
    companions = source.quant.companions() if source.quant else set()  # scales: checked with their weights
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
            report.failures.append(str(e))
    return expected


def source_weight(source: Source, want: Expected, files: "_Files"):
    """rows(r0, r1) -> float32 rows [r0, r1) of the source weight an output was made from. A cut
    reads its one expert (all of the fused tensor's rows for that expert) and views it."""
    info = want.info
    if want.cut is None:
        return lambda r0, r1: files.rows(source.root / info.file, info, r0, r1).float()
    expert = files.rows(source.root / info.file, info, want.cut.expert, want.cut.expert + 1)
    weight = want.cut.across_experts().apply(expert)[0]
    return lambda r0, r1: weight[r0:r1].float()


def _check_kept(source: Source, want: Expected, path: Path, got: TensorInfo, fmt: QuantizedLayout,
                arch: Architecture, report: VerifyReport, files: _Files) -> None:
    name, info = want.name, want.info
    if got.dtype != info.dtype or got.shape != want.shape:
        report.failures.append(f"{name}: kept as {got.dtype} {list(got.shape)} but the source "
                               f"({want.where}) is {info.dtype} {list(want.shape)}")
        return
    reason = default_keep_reason(info, arch, fmt.format, fmt.scheme) if fmt and len(info.shape) == 2 else None
    if fmt and is_linear_weight(name, want.shape, info.dtype, reason) and not fmt.ignores(module_of(name)):
        report.failures.append(f"{name}: kept in high precision, but {module_of(name)} is not in the ignore list "
                               "(engines would expect FP8 weights for it)")
    import torch
    dtype = torch_dtype(info.dtype)
    if want.cut:  # one expert's member: compare it whole (it is one expert's share of the source)
        expected = source_weight(source, want, files)(0, want.shape[0]).to(dtype).contiguous()
        stored = files.whole(path, got)
        if not torch.equal(expected.view(torch.uint8), stored.contiguous().view(torch.uint8)):
            report.failures.append(f"{name}: kept in high precision, but its bytes differ from {want.where}")
        elif dtype.is_floating_point and not bool(torch.isfinite(stored).all()):
            report.failures.append(f"{name}: contains NaN or Inf")
        return
    for start in range(0, info.nbytes, CHUNK_BYTES):
        n = min(CHUNK_BYTES, info.nbytes - start)
        a = files.pread(source.root / info.file, info.offset + start, n)
        b = files.pread(path, got.offset + start, n)
        if a != b:
            report.failures.append(f"{name}: kept in high precision, but its bytes differ from the source")
            return
        if dtype is not None and dtype.is_floating_point and \
                not bool(torch.isfinite(torch.frombuffer(b, dtype=torch.uint8).view(dtype)).all()):
            report.failures.append(f"{name}: contains NaN or Inf")
            return


def _check_quantized(source: Source, want: Expected, path: Path, got: TensorInfo,
                     scale_at: tuple[Path, TensorInfo] | None, scale_name: str, fmt: QuantizedLayout,
                     report: VerifyReport, files: _Files, source_rows=None):
    """Structure, then numbers, of one quantized tensor. Returns its scales (None when unusable).
    `source_rows`: the source's values (an FP8 source's dequantized ones); default: source_weight's."""
    name, info, shape = want.name, want.info, want.shape
    problems = []
    if (info.dtype not in FLOAT_SOURCE_DTYPES and source_rows is None) or len(shape) != 2:
        problems.append(f"quantized, but the source ({want.where}) is {info.dtype} {list(shape)} (FP8 needs a 2-D "
                        "float weight)")
    elif got.shape != shape:
        problems.append(f"shape {list(got.shape)} differs from the source's ({want.where}) {list(shape)}")
    if fmt.ignores(module_of(name)):
        problems.append(f"quantized, but the ignore list names {module_of(name)}")
    if scale_at is None:
        problems.append(f"its scale {scale_name} is missing")
    elif scale_at[1].dtype != fmt.scale_dtype() or (not problems and scale_at[1].shape not in fmt.scale_shapes(shape)):
        problems.append(f"scale {scale_name} is {scale_at[1].dtype} {list(scale_at[1].shape)}, expected "
                        f"{fmt.scale_dtype()} {' or '.join(str(list(s)) for s in fmt.scale_shapes(shape))}")
    if problems:
        report.failures.append(f"{name}: {'; '.join(problems)}")
        return None
    import torch

    from .run.numerics import e8m0_to_float
    scale = files.whole(*scale_at)
    if scale.dtype == torch.uint8:  # MXFP8: E8M0 bytes; 255 (E8M0's NaN) decodes to NaN and fails below
        scale = e8m0_to_float(scale)
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        report.failures.append(f"{name}: scale {scale_name} is not finite and positive everywhere")
        return None
    check = _numbers(name, source_rows or source_weight(source, want, files), path, got, scale, fmt.scheme, files,
                     fmt.scale_format)
    report.tensors.append(check)
    if not check.ok:
        what = []
        if check.off_rule_scales:
            what.append(f"{check.off_rule_scales} scale(s) are not the smallest power of two that fits their "
                        + ("group" if fmt.scheme == "mxfp8" else "block"))
        if check.inexact_codes:
            what.append(f"{check.inexact_codes} code(s) are not the round-to-nearest-even e4m3 value of weight/scale")
        if check.off_grid:
            what.append(f"{check.off_grid} code(s) are not the nearest e4m3 value of weight/scale")
        if not check.rel_error <= check.bound * (1 + FLOAT_SLACK):
            what.append(f"relative error {check.rel_error:.4g} exceeds the e4m3 bound {check.bound:.4g}")
        report.failures.append(f"{name}: {'; '.join(what)} (SNR {check.snr_db:.1f} dB)")
    return scale


def _numbers(name: str, source_rows, path: Path, got: TensorInfo, scale, scheme: str, files: _Files,
             scale_format: str = "float") -> TensorCheck:
    """`source_rows(r0, r1)`: float32 rows of the source weight (source_weight); `scale`: float32 values
    (MXFP8 bytes decoded)."""
    import torch

    from .run.numerics import FP8_MAX, dequantize, expand_scale

    rows, cols = got.shape
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    if scheme == "block":  # slabs start on block rows, so each slab's scale rows expand on their own
        step = max(BLOCK, step // BLOCK * BLOCK)
    w2 = e2 = bound2 = 0.0
    off_grid = off_rule = inexact = 0
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w = source_rows(r0, r1)
        q = files.rows(path, got, r0, r1)
        if scheme == "tensor":
            s = scale.reshape(1, 1)
        elif scheme in ("channel", "mxfp8"):
            s = scale[r0:r1]
        else:
            s = scale[r0 // BLOCK: -(-r1 // BLOCK)]
        s_full = expand_scale(s, (r1 - r0, cols), scheme)
        dq = dequantize(q, s, scheme)
        e2 += float((w.double() - dq.double()).square().sum())
        w2 += float(w.double().square().sum())
        # per element: max(2^-4 |w|, 2^-10 scale), the worst e4m3 rounding (module docstring)
        bound2 += float(torch.maximum(w.abs() * 2.0**-4, (s_full * 2.0**-10).expand_as(w)).double().square().sum())
        # the code must be within half an e4m3 step of x = w / scale, computed as the quantizer does
        x = (w / s_full).clamp(-FP8_MAX, FP8_MAX)
        _, exponent = torch.frexp(x)  # |x| = m * 2^exponent, m in [0.5, 1): binade floor(log2|x|) = exponent - 1
        binade = torch.where(x == 0, torch.full_like(exponent, -6), (exponent - 1).clamp(min=-6))
        half_step = torch.ldexp(torch.ones_like(x), binade - 4)
        off_grid += int((~((x - q.float()).abs() <= half_step)).sum())
        if scheme == "mxfp8" or scale_format == "ue8m0":
            bad_scales, bad_codes = power_of_two_checks(w, q, s, scheme)
            off_rule += bad_scales
            inexact += bad_codes
    err, norm = math.sqrt(e2), math.sqrt(w2)
    rel = err / norm if norm else (0.0 if err == 0 else math.inf)
    snr = math.inf if err == 0 else (20 * math.log10(norm / err) if norm else -math.inf)
    bound = math.sqrt(bound2) / norm if norm else math.inf
    ok = off_grid == 0 and off_rule == 0 and inexact == 0 and e2 <= bound2 * (1 + FLOAT_SLACK) ** 2
    return TensorCheck(name, list(got.shape), list(scale.shape), rel, snr, bound, off_grid, ok, off_rule, inexact)


def power_of_two_checks(w, q, s, scheme: str) -> tuple[int, int]:
    """(scales off the rule, codes off RNE) for one slab of rows with power-of-two scales: MXFP8 exponents
    ([rows, in/32]) or UE8M0 block scales (block rows of the slab). `w`: float32 source rows; `q`: their
    codes; `s`: float32 scale values.

    The rule is written as a property, independently of how the quantizer computes it: s = 2^e must
    satisfy A <= 448 * s (no code overflows) and A > 224 * s (2^(e-1) would overflow), where A is the
    group's amax, or the block's amax floored at 1e-4 (DeepGEMM's clamp). An MXFP8 exponent at its
    lowest byte (2^-127) only needs the first. Both products are exact in float32."""
    import torch

    from .run.numerics import FP8_MAX, FP8_DTYPE, UE8M0_MIN_AMAX, amax, expand_scale, powers_of_two
    a = amax(w, scheme)
    if scheme != "mxfp8":
        a = torch.maximum(a, torch.full_like(a, UE8M0_MIN_AMAX))
    fits = powers_of_two(s) & (a <= FP8_MAX * s)
    smallest = a > (FP8_MAX / 2) * s
    if scheme == "mxfp8":
        smallest |= s == 2.0**-127
    off_rule = int((~(fits & smallest)).sum())
    x = (w / expand_scale(s, tuple(w.shape), scheme)).clamp(-FP8_MAX, FP8_MAX)
    inexact = int((x.to(FP8_DTYPE).float() != q.float()).sum())  # compared as values: -0 == +0
    return off_rule, inexact


# ---------------------------------------------------------------- FP8 sources

def is_dequantized_output(source: Source, config: dict) -> bool:
    """An FP8 source's output without a quantization_config: written by `dequantize`."""
    return source.quant is not None and "quantization_config" not in config


def fp8_source_rows(source: Source, weight: FP8Weight, files: _Files, dtype=None):
    """rows(r0, r1) -> an FP8 source weight's rows [r0, r1) dequantized: float32(q) * scale, in float32
    or rounded once to `dtype`. The scale is read whole (it is small) and must be finite and positive."""
    import torch

    from .run.numerics import dequantize, scale_as_stored
    scheme = source.quant.scheme
    scale = scale_as_stored(files.whole(source.root / weight.scale.file, weight.scale), scheme)
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise FP8ConvertError(f"{weight.scale.name}: the source's scale is not finite and positive everywhere")

    def rows(r0: int, r1: int):
        q = files.rows(source.root / weight.weight.file, weight.weight, r0, r1)
        s = scale if scheme == "tensor" else scale[r0:r1] if scheme == "channel" else scale[r0 // BLOCK:-(-r1 // BLOCK)]
        w = dequantize(q, s, scheme)
        return w if dtype is None else w.to(dtype)
    return rows


def _check_fp8_source_weight(source: Source, weight: FP8Weight, path: Path, got: TensorInfo, outputs: dict,
                             fmt: QuantizedLayout | None, arch: Architecture, report: VerifyReport, files: _Files,
                             accounted: set[str]):
    """One FP8 source weight's output: dequantized (exact), or FP8 (passed through: exact; requantized:
    within the e4m3 bound of the dequantized values), with its static activation scale if it has one.
    Returns the output's scale when it is FP8 and its scale is usable."""
    name = weight.weight.name
    if got.dtype != FP8:
        report.tensors_dequantized += 1
        _check_dequantized(source, weight, path, got, report, files)
        if fmt is not None and not fmt.ignores(module_of(name)):
            report.failures.append(f"{name}: dequantized to {got.dtype}, but {module_of(name)} is not in the ignore "
                                   "list (engines would expect FP8 weights for it)")
        return None
    if fmt is None:
        report.failures.append(f"{name}: still FP8, but the output has no quantization_config")
        return None
    report.tensors_quantized += 1
    scale_name = fmt.scale_name(name)
    accounted.add(scale_name)
    _check_activation_scale(source, weight, outputs, report, files, accounted)
    scale_at = outputs.get(scale_name)
    if scale_at is not None and _passed_through(source, weight, path, got, scale_at, fmt, report, files):
        return files.whole(*scale_at).float()
    try:
        rows = fp8_source_rows(source, weight, files)
    except FP8ConvertError as e:
        report.failures.append(str(e))
        return None
    return _check_quantized(source, Expected(name, weight.weight), path, got, scale_at, scale_name, fmt, report, files,
                            source_rows=rows)


def _check_dequantized(source: Source, weight: FP8Weight, path: Path, got: TensorInfo, report: VerifyReport,
                       files: _Files) -> None:
    """Every element equal to (float32(q) * scale) rounded once to the output's dtype."""
    import torch
    name = weight.weight.name
    if got.dtype not in FLOAT_SOURCE_DTYPES or got.shape != weight.weight.shape:
        report.failures.append(f"{name}: dequantized as {got.dtype} {list(got.shape)}, but the source is an FP8 "
                               f"weight {list(weight.weight.shape)} (expected BF16, F16 or F32 of that shape)")
        return
    dtype = torch_dtype(got.dtype)
    try:
        rows = fp8_source_rows(source, weight, files, dtype)
    except FP8ConvertError as e:
        report.failures.append(str(e))
        return
    cols = got.shape[1]
    step = max(BLOCK, CHUNK_ELEMENTS // max(cols, 1) // BLOCK * BLOCK)
    wrong = 0
    for r0 in range(0, got.shape[0], step):
        r1 = min(got.shape[0], r0 + step)
        expected, stored = rows(r0, r1).contiguous(), files.rows(path, got, r0, r1).contiguous()
        wrong += int((expected.view(torch.uint8).view(-1, dtype.itemsize) !=
                      stored.view(torch.uint8).view(-1, dtype.itemsize)).any(dim=1).sum())
    if wrong:
        report.failures.append(f"{name}: {wrong} element(s) differ from float32(q) * scale rounded once to {got.dtype}")


def _passed_through(source: Source, weight: FP8Weight, path: Path, got: TensorInfo, scale_at: tuple[Path, TensorInfo],
                    fmt: QuantizedLayout, report: VerifyReport, files: _Files) -> bool:
    """Whether the output's codes and scale are the source's (then it is exact, and recorded so); a
    scale that is not the source's and not of the format's scale dtype is a failure, and so is a passed
    scale that is not a power of two under scale_fmt ue8m0."""
    import torch

    from .run.numerics import powers_of_two
    scale_path, scale = scale_at
    same_scale = (scale.dtype == weight.scale.dtype and scale.nbytes == weight.scale.nbytes
                  and files.pread(scale_path, scale.offset, scale.nbytes)
                  == files.pread(source.root / weight.scale.file, weight.scale.offset, weight.scale.nbytes))
    same_codes = same_scale and got.shape == weight.weight.shape and all(
        files.pread(path, got.offset + start, min(CHUNK_BYTES, got.nbytes - start))
        == files.pread(source.root / weight.weight.file, weight.weight.offset + start,
                       min(CHUNK_BYTES, got.nbytes - start))
        for start in range(0, got.nbytes, CHUNK_BYTES))
    name = weight.weight.name
    if not (same_scale and same_codes):
        if scale.dtype != fmt.scale_dtype():
            report.failures.append(f"{name}: scale {fmt.scale_name(name)} is {scale.dtype}, but its codes and scale are "
                                   f"not the source's (a requantized scale is {fmt.scale_dtype()})")
            return True
        return False
    if scale.shape not in fmt.scale_shapes(got.shape):
        report.failures.append(f"{name}: scale {fmt.scale_name(name)} shaped {list(scale.shape)}, expected "
                               f"{' or '.join(str(list(s)) for s in fmt.scale_shapes(got.shape))}")
        return True
    values = files.whole(scale_path, scale).float()
    if not bool((torch.isfinite(values) & (values > 0)).all()):
        report.failures.append(f"{name}: scale {fmt.scale_name(name)} is not finite and positive everywhere")
        return True
    if fmt.scale_format == "ue8m0" and not bool(powers_of_two(values).all()):
        report.failures.append(f"{name}: scale {fmt.scale_name(name)} passed through from the source is not a power "
                               "of two everywhere, but the config says scale_fmt ue8m0")
        return True
    report.tensors.append(TensorCheck(name, list(got.shape), list(scale.shape), 0.0, math.inf, 0.0, 0, True))
    return True


def _check_activation_scale(source: Source, weight: FP8Weight, outputs: dict, report: VerifyReport, files: _Files,
                            accounted: set[str]) -> None:
    """A static activation scale in the output must be the source's, byte for byte."""
    name = weight.weight.name[: -len(".weight")] + ".input_scale"
    if name not in outputs:
        return
    accounted.add(name)
    path, got = outputs[name]
    source_scale = weight.input_scale
    if source_scale is None or got.dtype != source_scale.dtype or got.nbytes != source_scale.nbytes or \
            files.pread(path, got.offset, got.nbytes) != files.pread(source.root / source_scale.file,
                                                                     source_scale.offset, source_scale.nbytes):
        report.failures.append(f"{name}: not the source's static activation scale"
                               + ("" if source_scale else " (the source has none)"))


def render(report: VerifyReport, worst: int = 10) -> str:
    lines = [f"verify {report.src} -> {report.out}: " + (f"{report.format or '?'} format, {report.scheme or '?'} scheme"
                                                         if report.format != "dequantized" else "dequantized"),
             f"  {report.tensors_quantized} tensors quantized, {report.tensors_kept} kept"
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
    else:
        lines.append(f"  FAILED: {len(report.failures)} problem(s)")
        lines += [f"    - {f}" for f in report.failures]
    return "\n".join(lines)


def record_in_card(report: VerifyReport, out: str | Path) -> None:
    """After a passing verify, put its figures in OUT's model card (README.md), so they travel with a push."""
    card = Path(out) / CARD_NAME
    if not card.is_file():
        return
    figures = {"tensors quantized": report.tensors_quantized, "tensors kept (byte-identical)": report.tensors_kept,
               "worst relative error": report.max_rel_error, "lowest SNR (dB)": report.min_snr_db}
    if report.tensors_dequantized:
        figures["tensors dequantized (every element its one rounding)"] = report.tensors_dequantized
    if report.format == "dequantized":
        figures = {k: v for k, v in figures.items() if k not in ("tensors quantized", "worst relative error",
                                                                  "lowest SNR (dB)")}
    write_atomic(card, with_verification(card.read_text(), figures).encode())
