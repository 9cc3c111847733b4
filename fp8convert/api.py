"""The Python API; the CLI is a thin layer over it.

    plan = fp8convert.make_plan("./Llama-3.1-8B", scheme="channel")        # headers only
    report = fp8convert.quantize("./Llama-3.1-8B", "./out", scheme="channel")
    report = fp8convert.quantize(src, out, Settings(device="cuda:1"), max_shard_size="2GB")
    report = fp8convert.dequantize("./DeepSeek-V3", "./DeepSeek-V3-BF16", dtype="bf16")   # FP8 in, BF16 out

Options are fields of `Settings`, given as one object, as keywords, or both (keywords win). torch is
imported only once the plan is made and the prefetcher is reading: importing it takes seconds, which the
disk spends better reading the checkpoint.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .cluster import workers
from .errors import FP8ConvertError
from .options import HubAccess, Settings, python_spelling
from .output.finalize import check_shards, finalize, prepare_output, recorded_plan
from .output.lock import LOCK, OutputLock
from .output.manifest import DOWNLOAD_DIR, WORK_DIR, Manifest
from .output.partial import written_bytes, written_units
from .plan.build import build_plan
from .plan.plan import Action, Plan, unique_inputs
from .plan.summary import refuse_empty, refuse_unloadable
from .run.prefetch import Prefetcher, default_threads, window_for
from .run.progress import Progress, log
from .run.warmup import PAGES_WAIT_S, TorchStart, torch_has_cuda
from .run.writer import ShardWriter
from .source import looks_like_repo_id, open_source, run_source
from .source.streaming import need_order
from .units import format_size


@dataclass
class Report:
    """What a conversion did."""

    out_dir: str
    source: str
    scheme: str | None  # None for a dequantize
    format: str  # "dequantized" for a dequantize
    device: str
    shards: int
    shards_resumed: int
    tensors_quantized: int
    tensors_kept: int
    bytes_in: int
    bytes_out: int
    seconds: float = 0.0
    peak_device_bytes: int | None = None
    ignore: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    already_complete: bool = False
    stage_seconds: dict = field(default_factory=dict)
    worker: str = "0/1"  # this process's share: worker K of N
    shards_written: int = 0  # by this call (its workers, with --devices)
    units: int = 0  # units with outputs in the shards this call wrote
    units_resumed: int = 0  # of those, units an earlier run had written already (skipped)
    complete: bool = False  # OUT is complete on return (False: other workers still owe shards)
    source_quantization: str | None = None  # an FP8 source: how it is quantized
    tensors_dequantized: int = 0  # FP8 source weights written in high precision
    tensors_requantized: int = 0  # FP8 source weights quantized again in the output's scheme
    tensors_passed_through: int = 0  # FP8 source weights whose codes and scales are the output's
    dequantize: bool = False  # the run was a dequantize (no FP8 in the output)


@dataclass
class FinalizeReport:
    """What `finalize_output` did."""

    out_dir: str
    source: str
    shards: int
    bytes_out: int
    seconds: float


@python_spelling
def make_plan(src: str | Path, settings: Settings | None = None, **overrides) -> Plan:
    """Plan a conversion from headers and config alone (a Hub repo id's remote headers); reads no tensor data."""
    settings = Settings.of(settings, **overrides)
    return build_plan(open_source(src, settings.hub, download=False), settings.options)


@python_spelling
def quantize(
    src: str | Path,
    out: str | Path,
    settings: Settings | None = None,
    *,
    on_plan: Callable[[Plan], None] | None = None,
    **overrides,
) -> Report:
    """Convert a BF16/FP16/FP32 safetensors checkpoint (directory or Hub repo id) to FP8 in `out`.
    `on_plan` is called with the plan before any data is read (the CLI prints its warnings there).

    Several processes can share one conversion (docs/cluster.md). `worker` "K/N" or (K, N): write only
    the shards whose index % N == K; None detects torchrun and multi-task srun, "auto" also a Slurm array
    or a Kubernetes indexed Job. The worker that finds every shard present finalizes (torchrun: rank 0,
    after a barrier); else `finalize_output(out)` does. `devices` ("cuda:0,cuda:1", a list, or "all"):
    one spawned process per device splits this worker's share, then this one finalizes.
    `finalize=False`: write the shards only."""
    started = time.monotonic()
    settings = Settings.of(settings, **overrides)  # bad options fail before any I/O
    spec = workers.resolve_worker(settings.worker)
    settings, devices = workers.split_settings(settings)
    _refuse_conflicts(src, settings, spec, devices)
    out_dir = Path(out)
    stream_to = out_dir / WORK_DIR / DOWNLOAD_DIR if settings.stream_download else None
    source, fetcher = run_source(src, settings.hub, stream_to, shared=spec.count > 1)
    # While the plan is made (seconds, for tens of thousands of tensors), the disk pulls the checkpoint into
    # the page cache in the pipeline's order: only for one worker (each of several reads its share) on a
    # fresh OUT (a resumed one may have its first shards done, or be refused).
    existed, fresh = out_dir.exists(), spec.count == 1 and _fresh(out_dir)
    head = _prefetcher(source.root, source.tensors, settings) if fresh and not devices else None
    # The head start's reads are joined on leaving, refused or not (a thread still reading as the
    # interpreter exits fails with a traceback); the lock is held while this run writes OUT.
    with head or contextlib.nullcontext(), OutputLock(out_dir, spec.index, spec.count) as lock:
        try:
            the_plan = build_plan(source, settings.options)
            if not settings.write_unloadable:
                refuse_unloadable(the_plan)
            refuse_empty(the_plan)
            if on_plan:
                on_plan(the_plan)
            done, complete = prepare_output(
                the_plan, out_dir, settings.overwrite, streamed=settings.stream_download, lock=lock
            )
        finally:
            if head:
                head.stop(wait=False)  # the run's own prefetcher takes over, in the pipeline's order
        report = _new_report(the_plan, out_dir, settings, spec, done, complete)
        if not complete:  # else an earlier run of this plan finished it
            todo = spec.owned(len(the_plan.shards)) - done
            written = {}  # units an earlier run wrote in this share's partial shards
            if devices:
                lock.share()  # the workers it starts, one per device, hold it shared too and check their own
            else:
                for i in todo:
                    if units := written_units(the_plan, out_dir / WORK_DIR, the_plan.shards[i]):
                        written[i] = units
            try:
                check_free_space(the_plan, out_dir, todo, fetcher.disk_bytes_needed(), written_bytes(the_plan, written))
            except FP8ConvertError:
                if fresh:  # refused before claiming it: OUT is left as it was
                    _unmake(out_dir, existed)
                raise
            Manifest(out_dir).claim(the_plan, settings.base_model)
            if devices:
                _quantize_on_devices(the_plan, str(src), out_dir, settings, spec, devices, report)
            else:
                _quantize_here(the_plan, out_dir, settings, spec, todo, written, fetcher, started, report)
    report.seconds = time.monotonic() - started
    report.stage_seconds["total"] = round(report.seconds, 3)
    return report


@python_spelling
def dequantize(
    src: str | Path,
    out: str | Path,
    settings: Settings | None = None,
    *,
    on_plan: Callable[[Plan], None] | None = None,
    **overrides,
) -> Report:
    """Convert an FP8 checkpoint (native fp8 or compressed-tensors, directory or Hub repo id) to high
    precision in `out`: every FP8 weight becomes float32(q) * scale rounded once to `dtype` (bf16, fp16
    or fp32; default the model's own), scales and quantization_config go, the rest is copied byte for
    byte; with `quantize`'s pipeline and guarantees."""
    return quantize(src, out, Settings.of(settings, **{**overrides, "dequantize": True}), on_plan=on_plan)


def _refuse_conflicts(src, settings: Settings, spec: workers.WorkerSpec, devices: list[str] | None) -> None:
    """Refusals known before OUT is made or space reserved (whether CUDA is there: without torch)."""
    if settings.overwrite and spec.count > 1:
        raise FP8ConvertError(
            f"--overwrite with several workers (worker {spec.text}): each would clear the "
            "others' work; clear OUT once beforehand instead"
        )
    if settings.stream_download and (spec.count > 1 or devices):
        raise FP8ConvertError(
            "--stream-download works with one worker only: workers would delete source shards another one still reads"
        )
    if settings.stream_download and not looks_like_repo_id(str(src)):
        raise FP8ConvertError(f"--stream-download applies to Hub repo ids; {src} is local")
    if settings.device.startswith("cuda") and not torch_has_cuda():
        raise FP8ConvertError(
            f"--device {settings.device}: CUDA is not available on this machine (the installed torch is a CPU build)"
        )


def _fresh(out_dir: Path) -> bool:
    try:
        return not any(out_dir.iterdir())
    except FileNotFoundError:
        return True
    except OSError:  # not a directory, or unreadable: prepare_output refuses it
        return False


def _unmake(out_dir: Path, existed: bool) -> None:
    """Remove what this run made in a fresh OUT, its lock first (still held, so no other run took it), then
    the folders, each only if empty: never what another process put there meanwhile."""
    work = out_dir / WORK_DIR
    with contextlib.suppress(OSError):
        (work / LOCK).unlink()
        with contextlib.suppress(OSError):
            (work / DOWNLOAD_DIR).rmdir()
        work.rmdir()
        if not existed:
            out_dir.rmdir()


def _new_report(
    the_plan: Plan, out_dir: Path, settings: Settings, spec: workers.WorkerSpec, done: set[int], complete: bool
) -> Report:
    count = {a: sum(t.action is a for t in the_plan.tensors) for a in Action}
    quant = the_plan.source.quant
    return Report(
        out_dir=str(out_dir),
        source=the_plan.source.label,
        scheme=None if settings.dequantize else settings.scheme,
        format="dequantized" if settings.dequantize else settings.format,
        device=settings.device,
        shards=len(the_plan.shards),
        shards_resumed=len(done),
        tensors_quantized=sum(t.quantize for t in the_plan.tensors),
        tensors_kept=count[Action.KEEP],
        bytes_in=the_plan.source.total_bytes,
        bytes_out=the_plan.out_bytes,
        ignore=the_plan.ignore_list,
        notes=list(the_plan.notes),
        warnings=list(the_plan.warnings),
        already_complete=complete,
        worker=spec.text,
        complete=complete,
        source_quantization=quant.describe() if quant else None,
        tensors_dequantized=count[Action.DEQUANTIZE],
        tensors_requantized=count[Action.REQUANTIZE],
        tensors_passed_through=count[Action.PASS],
        dequantize=settings.dequantize,
    )


def _device_worker(src: str, out: str, settings: Settings) -> Report:
    """One --devices child (spawned: importable by name). Its errors keep the CLI's spelling: the parent's
    `quantize` respells them for a Python caller."""
    return quantize.__wrapped__(src, out, settings)


def _quantize_on_devices(
    the_plan: Plan, src: str, out_dir: Path, settings: Settings, spec: workers.WorkerSpec, devices: list, report: Report
) -> None:
    """One spawned worker process per device shares this worker's shards; then this process finalizes."""
    log(
        f"{the_plan.source.label}: {len(devices)} worker processes ({', '.join(devices)})"
        + (f" sharing worker {spec.text}'s shards" if spec.count > 1 else ""),
        settings.progress,
    )
    reports = workers.run_on_devices(_device_worker, src, str(out_dir), settings, spec, devices)
    report.device = ",".join(r.device for r in reports)
    report.shards_written = sum(r.shards_written for r in reports)
    report.units, report.units_resumed = sum(r.units for r in reports), sum(r.units_resumed for r in reports)
    peaks = [r.peak_device_bytes for r in reports if r.peak_device_bytes is not None]
    report.peak_device_bytes = max(peaks, default=None)
    report.stage_seconds = {"workers": [r.stage_seconds for r in reports]}
    if settings.finalize:
        report.complete = workers.finalize_share(the_plan, out_dir, spec, settings.progress)


def _quantize_here(
    the_plan: Plan,
    out_dir: Path,
    settings: Settings,
    spec: workers.WorkerSpec,
    todo: set[int],
    written: dict[int, set[int]],
    fetcher,
    started: float,
    report: Report,
) -> None:
    units = the_plan.units_in(todo, written)
    report.units = len(the_plan.units_in(todo))
    report.units_resumed = report.units - len(units)
    label = the_plan.source.label + (f" [worker {spec.text}]" if spec.count > 1 else "")
    if report.units_resumed:
        log(f"{label}: resumed: {report.units_resumed} of {report.units} units already written", settings.progress)
    if spec.count > 1:
        hint = " (more workers than shards: a smaller --max-shard-size gives more shards)"
        log(
            f"{the_plan.source.label}: worker {spec.text} ({spec.launcher}): {len(todo)} of "
            f"{len(the_plan.shards)} shards to write, {report.shards_resumed} already done"
            + (hint if spec.count > len(the_plan.shards) else ""),
            settings.progress,
        )
        # a Hub source planned from its headers: this worker downloads the shards it reads
        fetcher.fetch(sorted({i.file for u in units for t in u.tensors for i in t.inputs}))
    device = workers.device_for(spec, settings.device)
    warmup = TorchStart(device)
    command = "dequantize" if settings.dequantize else "quantize"
    bar = Progress(
        sum(u.in_bytes for u in units), f"{command} {label}", enabled=settings.progress, plain=spec.count > 1
    )
    # torch's start-up pages queued on the disk before the checkpoint's reads (run/warmup.py)
    warmup.pages_queued.wait(PAGES_WAIT_S)
    reads = unique_inputs([t for u in units for a in u.atoms() for t in a])
    prefetcher = _prefetcher(the_plan.source.root, reads, settings, spec.sharing)
    with (
        fetcher,
        prefetcher or contextlib.nullcontext(),
        contextlib.closing(bar),
        ShardWriter(
            the_plan, out_dir, out_dir / WORK_DIR, set(range(len(the_plan.shards))) - todo, written=written
        ) as writer,
    ):
        fetcher.start(need_order(units))
        # Join torch's thread before importing the pipeline (which imports torch): on a small model the
        # main thread gets here first and would do torch's import itself.
        warmup.join()
        from .run.pipeline import convert

        report.stage_seconds, report.device, report.peak_device_bytes = convert(
            the_plan,
            units,
            writer,
            device,
            settings.max_resident,
            fetcher,
            bar,
            on_read=prefetcher.advance if prefetcher else lambda nbytes: None,
            started=started,
        )
        warmup.record_pages()
        report.shards_written = len(todo)
        if settings.finalize:  # before the fetcher leaves: a streamed source's side files are in its folder
            report.complete = workers.finalize_share(the_plan, out_dir, spec, settings.progress)


def _prefetcher(root: Path, tensors: list, settings: Settings, sharing: int = 1) -> Prefetcher | None:
    """The page-cache read-ahead of `tensors`; None with --prefetch 0 or a streamed source (its shards arrive
    as needed). --prefetch auto is divided among the `sharing` workers on this machine (WorkerSpec.sharing)."""
    if not settings.prefetch or settings.stream_download:
        return None
    return Prefetcher(
        root, tensors, window_for(settings.prefetch, sharing), threads=settings.prefetch_threads or default_threads()
    )


def check_free_space(the_plan: Plan, out_dir: Path, todo: set[int], streamed_bytes: int, written: int) -> None:
    """Refuse when the shards left to write (less `written` bytes) plus the streamed shards held at once won't fit."""
    needed = sum(the_plan.shards[i].size for i in todo) - written + streamed_bytes
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        what = " and the streamed source shards" if streamed_bytes else ""
        raise FP8ConvertError(
            f"{out_dir}: needs {format_size(needed)} free for the output{what}, only {format_size(free)} available"
        )


@python_spelling
def finalize_output(out: str | Path, *, token: str | None = None, cache_dir: str | None = None) -> FinalizeReport:
    """Finish an output whose shards several workers wrote: rebuild the plan from the manifest (headers only;
    refused if it is not the workers' plan or the source changed), check every shard's size and header, then
    write side files, card, index and config.json (the same bytes again on a complete output)."""
    started = time.monotonic()
    out_dir = Path(out)
    the_plan = recorded_plan(out_dir, HubAccess(token=token, cache_dir=cache_dir))
    with OutputLock(out_dir) as lock:
        lock.acquire()  # refused while a worker still writes here
        check_shards(the_plan, out_dir)
        finalize(the_plan, out_dir)
        workers.release_finalize(out_dir)  # a claim left by a worker that died while finalizing
    return FinalizeReport(
        str(out_dir), the_plan.source.label, len(the_plan.shards), the_plan.out_bytes, time.monotonic() - started
    )
