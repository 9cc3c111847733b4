"""What verify found, as text or JSON, and its figures in the output's model card."""

from __future__ import annotations

import json
import math
import operator
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..errors import FP8ConvertError
from ..files import write_atomic
from ..options import FP4_SCHEMES, GROUP_SIZE, Scheme
from ..output.card import with_verification
from ..output.manifest import Manifest
from ..source.hub import CARD_NAME
from ..units import listed, plural

FLOAT_SLACK = 1e-5  # float32 arithmetic in dequant / division, far below any real error


class VerifyFailed(FP8ConvertError):
    """The message names the first problem."""


@dataclass
class TensorCheck:
    """The figures of one quantized tensor (the bound: numbers.py docstring)."""

    name: str
    shape: list[int]
    scale_shape: list[int]
    rel_error: float  # ||w - dequant|| / ||w||; 0 when both are zero, inf when only w is zero
    snr_db: float  # 20 log10(||w|| / ||w - dequant||); inf when exact
    bound: float  # largest rel_error e4m3 rounding allows with these scales
    off_grid: int  # codes not within half a step of w / scale
    ok: bool
    off_rule_scales: int = 0  # power-of-two scales that are not the smallest 2^e fitting their amax
    inexact_codes: int = 0  # with power-of-two scales: codes that are not RNE(w / scale)
    oversized_scales: int = 0  # channel and block float scales above twice amax / 448 of theirs

    def problem(self, scheme: str) -> str:
        unit = "row" if scheme == Scheme.CHANNEL else "group" if scheme in GROUP_SIZE else "block"
        values = "E2M1" if scheme in FP4_SCHEMES else "e4m3"  # what a code is
        oversized = f"more than twice amax / 448 of their {unit} (codes lose precision, or round to zero)"
        counts = [
            (self.off_rule_scales, "scale", f"not the smallest power of two that fits their {unit}"),
            (self.oversized_scales, "scale", oversized),
            (self.inexact_codes, "code", "not the round-to-nearest-even e4m3 value of weight/scale"),
            (self.off_grid, "code", f"not the nearest {values} value of weight/scale"),
        ]
        what = [f"{plural(n, word)} {'is' if n == 1 else 'are'} {rest}" for n, word, rest in counts if n]
        if not self.rel_error <= self.bound * (1 + FLOAT_SLACK):
            what.append(f"relative error {self.rel_error:.4g} exceeds the {values} bound {self.bound:.4g}")
        return f"{'; '.join(what)} (SNR {self.snr_db:.1f} dB)"


@dataclass
class ErrorSums:
    """What a quantized tensor's check adds up, slab by slab (the counts as in TensorCheck)."""

    w2: float = 0.0  # sum of w^2
    e2: float = 0.0  # sum of (w - dequant)^2
    bound2: float = 0.0  # sum of max(2^-4 |w|, 2^-10 scale)^2
    off_grid: int = 0
    off_rule: int = 0
    inexact: int = 0
    oversized: int = 0
    amax: float = 0.0  # the largest |w| (the tensor scheme's scale is checked against it)

    def add(self, other: ErrorSums) -> None:
        for f in fields(self):
            combine = max if f.name == "amax" else operator.add
            setattr(self, f.name, combine(getattr(self, f.name), getattr(other, f.name)))

    def check(self, name: str, shape, scale_shape) -> TensorCheck:
        err, norm = math.sqrt(self.e2), math.sqrt(self.w2)
        rel = err / norm if norm else (0.0 if err == 0 else math.inf)
        # An infinite error (a code and scale that read back as Inf) leaves no signal at all
        snr = math.inf if err == 0 else (20 * math.log10(norm / err) if norm and math.isfinite(err) else -math.inf)
        bound = math.sqrt(self.bound2) / norm if norm else math.inf
        counts = (self.off_grid, self.off_rule, self.inexact, self.oversized)
        ok = not any(counts) and self.e2 <= self.bound2 * (1 + FLOAT_SLACK) ** 2
        return TensorCheck(name, list(shape), list(scale_shape), rel, snr, bound, self.off_grid, ok, *counts[1:])


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
    tensors_dequantized: int = 0  # FP8 source weights in high precision, each equal to its one rounding
    max_rel_error: float = 0.0
    min_snr_db: float = math.inf
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    tensors: list[TensorCheck] = field(default_factory=list)
    seconds: float = 0.0
    bytes_read: int = 0
    stage_seconds: dict = field(default_factory=dict)  # where the time went: waiting for reads, checking

    def fail(self, subject: str, what: str, follows_from: str | None = None) -> None:
        self.problems.append(Problem(subject, " ".join(what.split()), follows_from))

    def finish(self, seconds: float) -> None:
        if self.tensors:
            self.max_rel_error = max(_sortable(t.rel_error) for t in self.tensors)
            self.min_snr_db = min(t.snr_db if not math.isnan(t.snr_db) else -math.inf for t in self.tensors)
        self.ok = not self.problems
        self.seconds = seconds
        self.stage_seconds = {k: round(v, 3) for k, v in self.stage_seconds.items()}

    @property
    def failures(self) -> list[str]:
        return [str(p) for p in self.problems]

    def causes(self) -> list[str]:
        """The problems by root cause, one line each (an unreadable file's tensors counted on its line)."""
        roots = {p.subject for p in self.problems if p.follows_from is None}
        consequences = Counter(p.follows_from for p in self.problems if p.follows_from in roots)
        by_what: dict[str, list[str]] = {}
        for p in self.problems:
            if p.follows_from not in roots:
                by_what.setdefault(p.what, []).append(p.subject)
        lines = []
        for what, names in by_what.items():
            followed = sum(consequences[name] for name in names)
            so = f"; so {plural(followed, 'tensor')} in it could not be checked" if followed else ""
            lines.append(f"{listed(names)}: {what}{so}")
        return lines

    def worst(self, n: int) -> list[TensorCheck]:
        return sorted(self.tensors, key=lambda t: (t.ok, -_sortable(t.rel_error)))[:n]

    def to_dict(self, worst: int) -> dict:
        """JSON-ready: non-finite numbers become the strings "inf", "-inf", "nan" (strict JSON)."""
        data = asdict(self)
        del data["tensors"], data["problems"]
        data.update(failures=self.failures, causes=self.causes(), worst=[asdict(t) for t in self.worst(worst)])
        return json.loads(json.dumps(data), parse_constant={"Infinity": "inf", "-Infinity": "-inf", "NaN": "nan"}.get)


def _sortable(x: float) -> float:
    return math.inf if math.isnan(x) else x


def render(report: VerifyReport, worst: int, every_problem: bool) -> str:
    scheme = report.scheme or "?"
    what = f"{report.format or '?'} format, {scheme} scheme" + ("s" if "," in scheme else "")
    if report.format == "dequantized":
        what = "dequantized"
    dequantized = report.tensors_dequantized
    lines = [
        f"verify {report.src} -> {report.out}: {what}",
        f"  {plural(report.tensors_quantized, 'tensor')} quantized, {report.tensors_kept} kept"
        + (f", {dequantized} dequantized (each equal to its one rounding)" if dequantized else ""),
    ]
    if report.tensors:
        lines.append(f"  relative error max {report.max_rel_error:.4g}, SNR min {report.min_snr_db:.1f} dB")
        lines += ["  worst tensors:"] if worst else []
        for t in report.worst(worst):
            lines.append(
                f"    {t.name:<60} rel {t.rel_error:.4g} (bound {t.bound:.4g})  SNR {t.snr_db:6.1f} dB"
                + ("" if t.ok else "  FAILED")
            )
    lines += [f"  warning: {w}" for w in report.warnings]
    if report.ok:
        return "\n".join([*lines, "  OK"])
    causes, failures = report.causes(), report.failures
    shown = failures if every_problem else causes
    more = "" if len(shown) == len(failures) else f" ({len(failures)} findings in all; --all lists each)"
    lines.append(f"  FAILED: {plural(len(causes), 'problem')}{more}")
    lines += [f"    - {f}" for f in shown]
    return "\n".join(lines)


def record_in_card(report: VerifyReport, out: str | Path) -> str | None:
    """After a passing verify, put its figures in the model card of OUT when it is fp8convert's own output
    (it has a manifest; not a link into a download cache). A warning when the card cannot be written."""
    card = Path(out) / CARD_NAME
    if not card.is_file() or card.is_symlink() or not Manifest(out).path.is_file():
        return None
    figures = {"tensors quantized": report.tensors_quantized} if report.format != "dequantized" else {}
    figures["tensors kept (byte-identical)"] = report.tensors_kept
    if report.format != "dequantized":
        figures.update({"worst relative error": report.max_rel_error, "lowest SNR (dB)": report.min_snr_db})
    if report.tensors_dequantized:
        figures["tensors dequantized (every element its one rounding)"] = report.tensors_dequantized
    try:
        write_atomic(card, with_verification(card.read_text(), figures).encode())
    except (OSError, FP8ConvertError) as e:  # write_atomic says what failed in the OSError it was raised from
        cause = e.__cause__ if isinstance(e.__cause__, OSError) else e
        return (
            f"{card}: the verification figures were not added to the model card "
            f"({getattr(cause, 'strerror', None) or cause})"
        )
    return None
