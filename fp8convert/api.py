"""The Python API. The CLI is a thin layer over these functions; tests and other tools call them too.

torch is imported only once the plan is made and the prefetcher is reading: importing it takes
seconds, which the disk spends better reading the checkpoint.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .errors import FP8ConvertError
from .options import Options, parse_size
from .output import WORK_DIR, finalize, prepare_output
from .plan import Plan, build_plan, make_batches
from .prefetch import Prefetcher
from .progress import Progress
from .source import Source, open_local
from .summary import compatibility_warnings

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_RESIDENT = {"cuda": 4 * 2**30, "cpu": 1 * 2**30}
DEFAULT_PREFETCH = 8 * 2**30  # page cache read ahead of the reader (reclaimable; not resident memory)


@dataclass
class Report:
    """What a conversion did."""

    out_dir: str
    source: str
    scheme: str
    format: str
    device: str
    shards: int
    shards_resumed: int
    tensors_quantized: int
    tensors_kept: int
    bytes_in: int
    bytes_out: int
    seconds: float
    peak_device_bytes: int | None
    ignore: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    already_complete: bool = False
    stage_seconds: dict = field(default_factory=dict)


def resolve_device(device: str) -> "torch.device":
    import torch
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise FP8ConvertError(f"--device {device!r}: not a device (auto, cpu, cuda or cuda:N)") from e
    if dev.type not in ("cpu", "cuda"):
        raise FP8ConvertError(f"--device {device!r}: only cpu and cuda are supported")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise FP8ConvertError(f"--device {device}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise FP8ConvertError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def budget_for(dev: "torch.device", max_resident: int | str | None) -> int:
    return parse_size(max_resident, "--max-resident") if max_resident else DEFAULT_MAX_RESIDENT[dev.type]


def open_source(src: str | Path, revision: str | None = None, token: str | None = None) -> Source:
    from .hub import download_source, looks_like_repo_id
    text = str(src)
    if Path(text).exists():
        if revision:
            raise FP8ConvertError(f"--revision applies to Hub repo ids, but {text} is a local directory")
        return open_local(Path(text))
    if looks_like_repo_id(text):
        return open_local(download_source(text, revision=revision, token=token), label=text)
    raise FP8ConvertError(f"{text}: no such directory, and not a Hub repo id (owner/name)")


def plan(src: str | Path, *, scheme: str = "tensor", format: str = "compressed-tensors", ignore=(),
         max_shard_size: int | str = "5GB", revision: str | None = None, token: str | None = None) -> Plan:
    """Plan a conversion from headers and config alone; reads no tensor data."""
    options = Options(scheme, format, tuple(ignore), max_shard_size)
    from .hub import looks_like_repo_id, remote_source  # a repo id plans from remote headers: no weight download
    source = remote_source(str(src), revision, token) if looks_like_repo_id(str(src)) else open_source(src, revision, token)
    return build_plan(source, options)


def quantize(src: str | Path, out: str | Path, *, scheme: str = "tensor", format: str = "compressed-tensors",
             ignore=(), device: str = "auto", max_shard_size: int | str = "5GB",
             max_resident: int | str | None = None, overwrite: bool = False, revision: str | None = None,
             token: str | None = None, progress: bool = False, read_threads: int = 8,
             prefetch: int | str = DEFAULT_PREFETCH, prefetch_threads: int = 4, stream_download: bool = False,
             on_plan: Callable[[Plan], None] | None = None) -> Report:
    """Convert a BF16/FP16/FP32 safetensors checkpoint (directory or Hub repo id) to FP8 in `out`.

    `on_plan` is called with the plan before any data is read (the CLI prints its warnings there).
    `stream_download` (Hub sources): keep only a few source shards on disk at a time."""
    started = time.monotonic()
    options = Options(scheme, format, tuple(ignore), max_shard_size)  # bad options fail before any I/O
    if stream_download:
        from .hub import looks_like_repo_id, streaming_source
        if not looks_like_repo_id(str(src)):
            raise FP8ConvertError(f"--stream-download applies to Hub repo ids; {src} is local")
        source = streaming_source(str(src), out, revision, token)
    else:
        source = open_source(src, revision, token)
    the_plan = build_plan(source, options)
    if on_plan:
        on_plan(the_plan)
    out_dir = Path(out)
    done, complete = prepare_output(the_plan, out_dir, overwrite)
    report = Report(str(out_dir), the_plan.source.label, scheme, format, device, len(the_plan.shards), len(done),
                    sum(t.quantize for t in the_plan.tensors), sum(not t.quantize for t in the_plan.tensors),
                    the_plan.source.total_bytes, the_plan.out_bytes, 0.0, None, the_plan.ignore_list,
                    list(the_plan.notes), compatibility_warnings(the_plan), complete)
    if complete:
        report.seconds = time.monotonic() - started
        return report
    check_free_space(the_plan, out_dir, done)
    units = [u for u in the_plan.units if any(the_plan.shard_of[t.name] not in done for t in u.tensors)]
    fetcher = the_plan.source.fetcher
    window = parse_size(prefetch, "--prefetch") if prefetch and not fetcher else 0
    prefetcher = Prefetcher(the_plan.source.root, [t.source for u in units for a in u.atoms() for t in a],
                            window, threads=prefetch_threads).start() if window else None
    try:
        if fetcher:
            from .hub import need_order
            fetcher.start(need_order(units))
        report.stage_seconds, report.device, report.peak_device_bytes = _run(
            the_plan, units, out_dir, done, device, max_resident, progress, read_threads, prefetcher, started)
        finalize(the_plan, out_dir)
    except BaseException:
        if fetcher:
            fetcher.close()  # downloaded shards stay for the rerun
        raise
    finally:
        if prefetcher:
            prefetcher.stop()
    if fetcher:
        fetcher.close(remove=True)
    report.seconds = time.monotonic() - started
    report.stage_seconds["total"] = round(report.seconds, 3)
    return report


def _run(the_plan: Plan, units, out_dir: Path, done: set[int], device: str, max_resident, progress: bool,
         read_threads: int, prefetcher: Prefetcher | None, started: float) -> tuple[dict, str, int | None]:
    """The heavy part, and the only one that needs torch."""
    import torch

    from .pipeline import run
    from .reader import BatchReader
    from .writer import ShardWriter

    dev = resolve_device(device)
    torch.empty(1, device=dev)  # start CUDA now, so its cost shows in "startup", not in the first batch
    startup = time.monotonic()
    batches = make_batches(units, budget_for(dev, max_resident))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    bar = Progress(sum(b.in_bytes for b in batches), f"quantize {the_plan.source.label}", enabled=progress)
    reader = BatchReader(the_plan.source.root, dev, threads=read_threads)
    writer = ShardWriter(the_plan, out_dir, out_dir / WORK_DIR, done)
    try:
        stages = run(the_plan, batches, reader, writer, dev, bar,
                     on_read=prefetcher.advance if prefetcher else None, fetcher=the_plan.source.fetcher)
    finally:
        reader.close()
        writer.close()
        bar.close()
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    return {"torch_ready_at": round(startup - started, 3), **stages.as_dict(),
            "pipeline": round(time.monotonic() - startup, 3)}, str(dev), peak


def check_free_space(the_plan: Plan, out_dir: Path, done: set[int]) -> None:
    needed = sum(s.size for s in the_plan.shards if s.index not in done)
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        raise FP8ConvertError(f"{out_dir}: needs {needed / 1e9:.2f} GB free for the output, only "
                              f"{free / 1e9:.2f} GB available")
