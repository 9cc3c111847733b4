"""Check an FP8 checkpoint against its source: the structure from headers and config alone, then every
pair's bytes, streamed and held to numbers.py's bound."""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import FP8ConvertError
from ..options import AUTO, HubAccess, Settings, python_spelling
from ..source import open_source
from .report import VerifyFailed, VerifyReport, record_in_card, render
from .structure import check_config, check_manifest_and_side_files, check_renamed_dtype, pair_tensors

__all__ = ["VerifyFailed", "VerifyReport", "record_in_card", "render", "verify"]


@python_spelling
def verify(
    src: str | Path,
    out: str | Path,
    *,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | None = None,
    device: str = "auto",
    max_resident: int | str | None = None,
    prefetch: int | str = AUTO,
    progress: bool = False,
) -> VerifyReport:
    """Verify the FP8 (or dequantized) checkpoint in `out` against its source `src` (directory or Hub
    repo id), reading both on `device` within `max_resident` bytes a batch."""
    started = time.monotonic()
    settings = Settings(device=device, max_resident=max_resident, prefetch=prefetch, progress=progress)
    source = open_source(src, HubAccess(revision, token, cache_dir))
    out = Path(out)
    if not out.is_dir():
        raise FP8ConvertError(f"{out}: not a directory")
    report = VerifyReport(str(src), str(out))
    check_manifest_and_side_files(source, out, report)
    readable, fmt, renamed_dtype = check_config(source, out, report)
    if readable:
        report.format, report.scheme = (fmt.format, ", ".join(fmt.schemes)) if fmt else ("dequantized", None)
        pairs = pair_tensors(source, out, fmt, report)
        check_renamed_dtype(renamed_dtype, pairs, out, report)
        from .stream import check_data  # torch and the reader: only once the structure could be read

        check_data(source, out, pairs, report, settings)
    report.finish(time.monotonic() - started)
    return report
