"""Check an FP8 checkpoint against its source: structure and numbers, at the speed of the disk.

First the structure, from headers and config alone: every source tensor accounted for, dtypes, shapes,
scale names and shapes, config, ignore list, index. Then the data: every tensor pair is streamed
through quantize's reader (run/verify_stream.py: batches within the memory budget, the next one read
while this one is checked, CPU or CUDA, with the same progress display) and checked by the functions
of the "per-tensor checks" section below. Works for both output formats:

- compressed-tensors: `X.weight` F8_E4M3 + `X.weight_scale` F32 shaped [1] (tensor), [out, 1] (channel)
  or [ceil(out/128), ceil(in/128)] (block);
- fp8 (vLLM/DeepSeek native): `X.weight_scale` F32 [] or [1] (tensor), or `X.weight_scale_inv` F32
  [ceil(out/128), ceil(in/128)] (block).

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
match, every code is the round-to-nearest code, so none is off the grid, and float32(code) comes from
the code's bits; the sums are the same float64 sums of the same float32 values. Where any code differs
(or a weight is not finite), that piece is measured by `exact_sums`, element by element.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import FP8ConvertError
from .formats import QuantizedLayout, read_quantization_config
from .options import BLOCK, DEFAULT_PREFETCH
from .output.card import with_verification
from .output.files import write_atomic
from .output.manifest import Manifest
from .plan.rules import default_keep_reason, fused_group_key, is_linear_weight, module_of
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
            report.fail(file, str(e).removeprefix(f"{file}: "))
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


def check_config(source: Source, out: Path, report: VerifyReport) -> QuantizedLayout | None:
    """The output's config.json: the source's plus a quantization_config this module can read."""
    config_path = out / "config.json"
    try:
        config = json.loads(config_path.read_text())
        if not isinstance(config, dict):
            raise FP8ConvertError(f"{config_path}: not a JSON object")
        fmt = read_quantization_config(config, str(config_path))
    except FileNotFoundError:
        report.fail(str(config_path), "missing: the output is incomplete")
        return None
    except ValueError as e:
        report.fail(str(config_path), f"not valid JSON ({e})")
        return None
    except FP8ConvertError as e:
        report.fail(str(config_path), str(e).removeprefix(f"{config_path}: "))
        return None
    rest = {k: v for k, v in config.items() if k != "quantization_config"}
    if rest != source.config:
        keys = sorted(k for k in set(rest) | set(source.config) if rest.get(k) != source.config.get(k))
        report.fail(str(config_path), f"differs from the source's config.json beyond quantization_config "
                                      f"(keys: {', '.join(keys)})")
    return fmt


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


# ---------------------------------------------------------------- per-tensor checks: structure

@dataclass
class KeptPair:
    source: TensorInfo
    output: TensorInfo
    failed: bool = False


@dataclass
class QuantizedPair:
    source: TensorInfo
    codes: TensorInfo
    scale: TensorInfo
    scale_name: str
    sums: "ErrorSums" = None
    failed: bool = False


def check_kept_structure(info: TensorInfo, got: TensorInfo, fmt: QuantizedLayout, report: VerifyReport) -> bool:
    """A tensor kept in high precision: same dtype and shape, and not a linear the config says is FP8."""
    name = info.name
    if got.dtype != info.dtype or got.shape != info.shape:
        report.fail(name, f"kept as {got.dtype} {list(got.shape)} but the source is {info.dtype} {list(info.shape)}")
        return False
    if len(info.shape) == 2 and is_linear_weight(info, default_keep_reason(info)) \
            and not fmt.ignores(module_of(name)):
        report.fail(name, f"kept in high precision, but {module_of(name)} is not in the ignore list "
                          "(engines would expect FP8 weights for it)")
    return True


def check_quantized_structure(info: TensorInfo, got: TensorInfo, scale: TensorInfo | None, scale_name: str,
                              fmt: QuantizedLayout, report: VerifyReport) -> bool:
    """A quantized tensor: a 2-D float source, the same shape, a module the ignore list does not name,
    and a float32 scale of a shape the format allows."""
    problems = []
    if info.dtype not in FLOAT_SOURCE_DTYPES or len(info.shape) != 2:
        problems.append(f"quantized, but the source is {info.dtype} {list(info.shape)} (FP8 needs a 2-D float weight)")
    elif got.shape != info.shape:
        problems.append(f"shape {list(got.shape)} differs from the source's {list(info.shape)}")
    if fmt.ignores(module_of(info.name)):
        problems.append(f"quantized, but the ignore list names {module_of(info.name)}")
    if scale is None:
        problems.append(f"its scale {scale_name} is missing")
    elif scale.dtype != "F32" or (not problems and scale.shape not in fmt.scale_shapes(info.shape)):
        problems.append(f"scale {scale_name} is {scale.dtype} {list(scale.shape)}, expected F32 "
                        f"{' or '.join(str(list(s)) for s in fmt.scale_shapes(info.shape))}")
    if problems:
        report.fail(info.name, "; ".join(problems))
    return not problems


# ---------------------------------------------------------------- per-tensor checks: data

def compare_kept(source, output) -> str | None:
    """A piece of a kept tensor: byte-identical to the source's, and finite. The problem, or None."""
    import torch

    from .run.quantizer import all_finite
    a, b = source.reshape(-1), output.reshape(-1)
    if not same_bytes(a.view(torch.uint8), b.view(torch.uint8)):
        return "kept in high precision, but its bytes differ from the source"
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

    def add(self, other: "ErrorSums") -> None:
        self.w2 += other.w2
        self.e2 += other.e2
        self.bound2 += other.bound2
        self.off_grid += other.off_grid


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


def slab_scale(scale, r0: int, r1: int, cols: int, scheme: str):
    """The scale of rows [r0, r1), broadcastable to them (float32)."""
    from .run.numerics import expand_scale
    if scheme == "tensor":
        return scale.reshape(1, 1)
    if scheme == "channel":
        return scale[r0:r1]
    return expand_scale(scale[r0 // BLOCK: -(-r1 // BLOCK)], (r1 - r0, cols), "block")


def measure_slab(w, q, scale, r0: int, scheme: str) -> ErrorSums:
    """The figures of rows r0.. of a tensor (`w` source rows, `q` their codes, `scale` the tensor's
    whole scale), a tile at a time on a CPU (tiles that stay in the caches; block tiles start on block
    rows), in one piece on a GPU."""
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
        sums.add(fast_sums(w_tile, q_tile, s, scratch) or exact_sums(w_tile, q_tile, s))
    return sums


def tensor_check(pair: QuantizedPair) -> TensorCheck:
    """The figures of a quantized tensor once every slab is summed."""
    sums = pair.sums
    err, norm = math.sqrt(sums.e2), math.sqrt(sums.w2)
    rel = err / norm if norm else (0.0 if err == 0 else math.inf)
    snr = math.inf if err == 0 else (20 * math.log10(norm / err) if norm else -math.inf)
    bound = math.sqrt(sums.bound2) / norm if norm else math.inf
    ok = sums.off_grid == 0 and sums.e2 <= sums.bound2 * (1 + FLOAT_SLACK) ** 2
    return TensorCheck(pair.source.name, list(pair.source.shape), list(pair.scale.shape), rel, snr, bound,
                       sums.off_grid, ok)


def check_scale(scale) -> bool:
    import torch
    return bool((torch.isfinite(scale) & (scale > 0)).all())


def numbers_problem(check: TensorCheck) -> str:
    what = []
    if check.off_grid:
        verb = "is" if check.off_grid == 1 else "are"
        what.append(f"{plural(check.off_grid, 'code')} {verb} not the nearest e4m3 value of weight/scale")
    if not check.rel_error <= check.bound * (1 + FLOAT_SLACK):
        what.append(f"relative error {check.rel_error:.4g} exceeds the e4m3 bound {check.bound:.4g}")
    return f"{'; '.join(what)} (SNR {check.snr_db:.1f} dB)"


# ---------------------------------------------------------------- the run

def verify(src: str | Path, out: str | Path, *, revision: str | None = None, token: str | None = None,
           cache_dir: str | None = None, device: str = "auto", max_resident: int | str | None = None,
           prefetch: int | str = DEFAULT_PREFETCH, progress: bool = False) -> VerifyReport:
    """Verify the FP8 checkpoint in `out` against its source `src` (directory or Hub repo id), reading
    both through the conversion's reader on `device` within `max_resident` bytes a batch."""
    from .options import Settings
    started = time.monotonic()
    settings = Settings(device=device, max_resident=max_resident, prefetch=prefetch, progress=progress)
    source = open_source(src, revision, token, cache_dir)
    out = Path(out)
    if not out.is_dir():
        raise FP8ConvertError(f"{out}: not a directory")
    report = VerifyReport(str(src), str(out))
    check_manifest_and_side_files(source, out, report)
    fmt = check_config(source, out, report)
    if fmt is not None:
        report.format, report.scheme = fmt.format, fmt.scheme
        pairs = pair_tensors(source, out, fmt, report)
        check_data(source, out, pairs, fmt, report, settings)
    if report.tensors:
        report.max_rel_error = max(_sortable(t.rel_error) for t in report.tensors)
        report.min_snr_db = min(t.snr_db if not math.isnan(t.snr_db) else -math.inf for t in report.tensors)
    report.ok = not report.problems
    report.seconds = time.monotonic() - started
    report.stage_seconds = {k: round(v, 3) for k, v in report.stage_seconds.items()}
    return report


def pair_tensors(source: Source, out: Path, fmt: QuantizedLayout, report: VerifyReport) -> list:
    """Each source tensor with what the output holds for it (structure checked); unpaired tensors and
    output tensors no source tensor explains are problems."""
    layout = read_output_layout(out, report)
    outputs = layout.tensors
    accounted: set[str] = set()
    pairs: list = []
    for info in source.tensors:
        name = info.name
        if name not in outputs:
            file = layout.placed_in.get(name)
            if file in layout.unreadable:
                report.fail(name, f"not checked: {file} cannot be read", follows_from=file)
            else:
                report.fail(name, "source tensor missing from the output")
            continue
        accounted.add(name)
        _, got = outputs[name]
        if got.dtype == FP8:
            scale_name = fmt.scale_name(name)
            accounted.add(scale_name)
            report.tensors_quantized += 1
            scale = outputs.get(scale_name, (None, None))[1]
            if check_quantized_structure(info, got, scale, scale_name, fmt, report):
                pairs.append(QuantizedPair(info, got, scale, scale_name, ErrorSums()))
        else:
            report.tensors_kept += 1
            if check_kept_structure(info, got, fmt, report):
                pairs.append(KeptPair(info, got))
    for name in sorted(set(outputs) - accounted):
        report.fail(name, f"in the output ({outputs[name][1].file}) but not derived from any source tensor")
    return pairs


def pieces(pair, scheme: str) -> list[tuple[int, TensorInfo, list[TensorInfo]]]:
    """(first row, source piece, output pieces) for each read of a pair: a kept tensor in pieces of
    CHUNK_BYTES, a quantized one in slabs of rows of about CHUNK_ELEMENTS (whole 128-row blocks for
    the block scheme), each slab with the whole (small) scale."""
    from dataclasses import replace
    info = pair.source
    if isinstance(pair, KeptPair):
        item = max(1, info.nbytes // max(info.numel, 1))
        step = max(item, CHUNK_BYTES // item * item)
        return [(start, replace(info, offset=info.offset + start, nbytes=n, shape=(n // item,)),
                 [replace(pair.output, offset=pair.output.offset + start, nbytes=n, shape=(n // item,))])
                for start in range(0, info.nbytes, step) for n in [min(step, info.nbytes - start)]] or \
            [(0, info, [pair.output])]
    rows, cols = info.shape
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    if scheme == "block":  # slabs start on block rows, so each slab's scale rows expand on their own
        step = max(BLOCK, step // BLOCK * BLOCK)
    src_row, code_row = info.nbytes // max(rows, 1), pair.codes.nbytes // max(rows, 1)
    return [(r0, replace(info, offset=info.offset + r0 * src_row, nbytes=n * src_row, shape=(n, cols)),
             [replace(pair.codes, offset=pair.codes.offset + r0 * code_row, nbytes=n * code_row, shape=(n, cols)),
              pair.scale])
            for r0 in range(0, rows, step) for n in [min(step, rows - r0)]] or [(0, info, [pair.codes, pair.scale])]


def check_data(source: Source, out: Path, pairs: list, fmt: QuantizedLayout, report: VerifyReport,
               settings) -> None:
    """Stream every pair's bytes and check them; the problems and figures go into `report`."""
    import torch

    from .run.device import budget_for, resolve_device
    from .run.progress import Progress
    from .run.verify_stream import Read, VerifyStream
    dev = resolve_device(settings.device)
    reads = [Read((pair, r0, r0 + (piece.shape[0] if piece.shape else 0)), [piece], outs, pair.source.name)
             for pair in pairs for r0, piece, outs in pieces(pair, fmt.scheme)]
    report.bytes_read = sum(r.nbytes for r in reads)
    bar = Progress(report.bytes_read, f"verify {out}", enabled=settings.progress)
    group_scales: dict[str, set[float]] = {}
    seconds = report.stage_seconds
    seconds.update(wait_read=0.0, check=0.0)
    try:
        with VerifyStream(reads, source.root, out, dev, budget_for(dev, settings.max_resident), bar,
                          settings.prefetch) as stream, checkers(dev) as run_all, torch.no_grad():
            waited = time.monotonic()
            for batch in stream:
                checking = time.monotonic()
                results = run_all([lambda item=item: check_piece(*item, fmt.scheme) for item in batch])
                for (read, _, _), result in zip(batch, results):
                    record(*read.key, result, fmt.scheme, report, group_scales)
                del batch, results
                seconds["wait_read"] += checking - waited
                waited = time.monotonic()
                seconds["check"] += waited - checking
    except (torch.OutOfMemoryError, MemoryError) as e:
        e.max_resident = budget_for(dev, settings.max_resident)  # the CLI suggests a smaller one
        raise
    finally:
        bar.close()
    for key, scales in group_scales.items():
        if len(scales) > 1:
            report.warnings.append(f"{key}: fused members have different per-tensor scales; vLLM re-quantizes "
                                   "them to the largest (a second rounding)")


CPU_WORKERS = None  # checking threads on a CPU; None: one per core


@contextlib.contextmanager
def checkers(device):
    """Where the checks of a batch run, results in order: on a CPU, one worker thread per core, each
    with one torch thread; on a GPU, here. A CPU check is many small operations (tiles that stay in the
    caches): run side by side they pay no thread-pool synchronisation each, and a core busy with
    another program holds up one worker, not every operation."""
    import torch
    workers = CPU_WORKERS or os.cpu_count() or 1
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


@dataclass
class SlabResult:
    """What one slab of a quantized tensor shows."""

    scale_ok: bool
    scale_value: float | None       # the tensor scheme's one scale
    sums: ErrorSums | None


def check_piece(read, sources, outputs, scheme: str):
    """The check of one read (a worker runs it): a kept piece's problem, or a quantized slab's result."""
    pair, r0, _ = read.key
    if isinstance(pair, KeptPair):
        return compare_kept(sources[0], outputs[0])
    return check_quantized_slab(sources[0], *outputs, r0, scheme)


def check_quantized_slab(w, q, scale, r0: int, scheme: str) -> SlabResult:
    if not check_scale(scale):
        return SlabResult(False, None, None)
    value = scale.reshape(-1)[0].item() if scheme == "tensor" else None
    return SlabResult(True, value, measure_slab(w, q, scale.float(), r0, scheme))


def record(pair, r0: int, r1: int, result, scheme: str, report: VerifyReport,
           group_scales: dict[str, set[float]]) -> None:
    """A piece's result into the report, in the order of the pieces (the main thread): a tensor's
    problem once, and a quantized tensor's figures after its last slab."""
    if pair.failed:
        return
    if isinstance(pair, KeptPair):
        if result:
            pair.failed = True
            report.fail(pair.source.name, result)
        return
    if not result.scale_ok:
        pair.failed = True
        report.fail(pair.source.name, f"scale {pair.scale_name} is not finite and positive everywhere")
        return
    if r0 == 0 and scheme == "tensor" and (key := fused_group_key(pair.source.name)):
        group_scales.setdefault(key, set()).add(result.scale_value)
    pair.sums.add(result.sums)
    if r1 == pair.source.shape[0]:
        check = tensor_check(pair)
        report.tensors.append(check)
        if not check.ok:
            report.fail(check.name, numbers_problem(check))


# ---------------------------------------------------------------- presenting it

def render(report: VerifyReport, worst: int = 10, every_problem: bool = False) -> str:
    lines = [f"verify {report.src} -> {report.out}: {report.format or '?'} format, {report.scheme or '?'} scheme",
             f"  {plural(report.tensors_quantized, 'tensor')} quantized, {report.tensors_kept} kept"]
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


def record_in_card(report: VerifyReport, out: str | Path) -> None:
    """After a passing verify, put its figures in OUT's model card (README.md), so they travel with a push."""
    card = Path(out) / CARD_NAME
    if not card.is_file():
        return
    figures = {"tensors quantized": report.tensors_quantized, "tensors kept (byte-identical)": report.tensors_kept,
               "worst relative error": report.max_rel_error, "lowest SNR (dB)": report.min_snr_db}
    write_atomic(card, with_verification(card.read_text(), figures).encode())
