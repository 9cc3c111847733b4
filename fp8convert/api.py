"""The Python API. The CLI is a thin layer over these functions; tests and other tools call them too.

    plan = fp8convert.make_plan("./Llama-3.1-8B", scheme="channel")        # headers only
    report = fp8convert.quantize("./Llama-3.1-8B", "./out", scheme="channel")
    report = fp8convert.quantize(src, out, Settings(device="cuda:1"), max_shard_size="2GB")
    report = fp8convert.dequantize("./DeepSeek-V3", "./DeepSeek-V3-BF16", dtype="bf16")   # FP8 in, BF16 out

Options are fields of `Settings`, given as one object, as keywords, or both (keywords win).

torch is imported only once the plan is made and the prefetcher is reading: importing it takes
seconds, which the disk spends better reading the checkpoint.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .cluster import devices as device_split
from .cluster import workers
from .errors import FP8ConvertError, PlanMismatchError, UsageError
from .options import Options, Settings, python_spelling
from .output.finalize import check_shards, finalize, finished_shards, prepare_output
from .output.lock import OutputLock
from .output.manifest import DOWNLOAD_DIR, WORK_DIR, Manifest, plan_change, source_change
from .output.ownership import replace_advice
from .output.partial import written_bytes, written_units
from .plan.build import build_plan
from .plan.plan import Action, Plan, Unit, unique_inputs
from .plan.summary import plan_warnings, refuse_unloadable
from .run.prefetch import Prefetcher, default_threads, window_for
from .run.progress import Progress
from .run.warmup import PAGES_WAIT_S, cuda_missing, start_torch
from .run.writer import ShardWriter
from .source.checkpoint import Source
from .source.local import open_local
from .source.resolve import looks_like_repo_id, open_source, plan_source
from .source.streaming import NoFetcher, need_order
from .units import format_size


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
    """Plan a conversion from headers and config alone; reads no tensor data (a Hub repo id is planned
    from remote headers)."""
    settings = Settings.of(settings, **overrides)
    return build_plan(plan_source(src, settings.revision, settings.token, settings.cache_dir), settings.options)


@python_spelling
def verify(src: str | Path, out: str | Path, **options):
    """Check the FP8 checkpoint in `out` against its source (fp8convert.verify.verify takes the options)."""
    from .verify import verify as verify_output

    return verify_output(src, out, **options)


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

    Several processes can share one conversion (docs/cluster.md). `worker`: this process's share, "K/N"
    or (K, N): it writes only the output shards whose index % N == K; None detects torchrun and
    multi-task srun (else one worker does everything); "auto" also detects a Slurm array or a
    Kubernetes indexed Job. A worker that finds every shard present finalizes (under torchrun: rank 0,
    after a barrier); otherwise `finalize_output(out)` does it later. `devices` ("cuda:0,cuda:1", a
    list, or "all"): one spawned worker process per device splits this worker's share, then this
    process finalizes. `finalize=False`: write the shards only."""
    started = time.monotonic()
    settings = Settings.of(settings, **overrides)  # bad options fail before any I/O
    spec = workers.resolve_worker(settings.worker)
    devices = _device_list(settings)
    if devices and len(devices) == 1:  # one device: no child process needed
        settings, devices = Settings.of(settings, device=devices[0], devices=None), None
    _refuse_conflicts(src, settings, spec, devices)
    if cuda_missing(settings.device):  # known without torch: refused before OUT is made or space reserved
        raise FP8ConvertError(
            f"--device {settings.device}: CUDA is not available on this machine (the installed torch is a CPU build)"
        )
    source, fetcher = _open_for_run(src, Path(out), settings, spec)
    out_dir = Path(out)
    head = _head_start(source, out_dir, settings, spec, devices)
    # The head start's reads are joined on leaving, refused or not: a thread still reading as the
    # interpreter exits fails there with a traceback of its own.
    with (
        head or contextlib.nullcontext(),
        OutputLock(out_dir, spec.index, spec.count) as lock,
    ):  # held while this run writes OUT
        try:
            the_plan = build_plan(source, settings.options)
            if not settings.write_unloadable:
                refuse_unloadable(the_plan)
            if on_plan:
                on_plan(the_plan)
            done, complete = prepare_output(
                the_plan, out_dir, settings.overwrite, streamed=settings.stream_download, lock=lock
            )
            report = _new_report(the_plan, out_dir, settings, spec, done, complete)
        finally:
            if head:
                head.stop(wait=False)  # the run's own prefetcher takes over, in the pipeline's order
        if complete:
            pass  # an earlier run of this plan finished it
        elif devices:
            lock.share()  # the workers it starts, one per device, hold it shared too
            _quantize_on_devices(the_plan, str(src), out_dir, settings, spec, done, devices, report)
        else:
            _quantize_here(the_plan, src, out_dir, settings, spec, done, fetcher, started, report)
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
    or fp32; default the model's own dtype), scales and quantization_config disappear, everything else is
    copied byte for byte. The same pipeline and guarantees as `quantize` (plan first, bounded memory,
    resumable, workers, devices, streamed Hub sources)."""
    return quantize(src, out, Settings.of(settings, **{**overrides, "dequantize": True}), on_plan=on_plan)


def _device_list(settings: Settings) -> list[str] | None:
    if not settings.devices:
        return None
    devices = device_split.parse_devices(settings.devices)
    if settings.device != "auto":
        raise UsageError(f"--device {settings.device} and --devices {','.join(devices)}: give only one of them")
    from .run.device import resolve_device

    for d in devices:  # a GPU this machine lacks fails now, named as --devices, not later as --device
        resolve_device(d, "--devices")
    return devices


def _refuse_conflicts(src, settings: Settings, spec: workers.WorkerSpec, devices: list[str] | None) -> None:
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


def _open_for_run(src, out_dir: Path, settings: Settings, spec: workers.WorkerSpec):
    """(source, fetcher): a streamed Hub source and the fetcher that brings its shards, or a source whose
    files are (or will be, for workers of a Hub repo) on disk and a fetcher that does nothing."""
    if settings.stream_download:
        from .source.streaming import streaming_source

        return streaming_source(
            str(src), out_dir / WORK_DIR / DOWNLOAD_DIR, settings.revision, settings.token, cache_dir=settings.cache_dir
        )
    if spec.count > 1 and looks_like_repo_id(str(src)):
        from .source.hub import remote_source  # headers only: each worker fetches the shards it reads

        return remote_source(str(src), settings.revision, settings.token, cache_dir=settings.cache_dir), NoFetcher()
    return open_source(src, settings.revision, settings.token, settings.cache_dir), NoFetcher()


def _head_start(
    source, out_dir: Path, settings: Settings, spec: workers.WorkerSpec, devices: list[str] | None
) -> Prefetcher | None:
    """The prefetcher that pulls the source into the page cache in file order while the plan is made
    (entering it starts it), instead of leaving the disk idle until then: a checkpoint's first file holds its
    first layers, which the pipeline reads first, and the run's own prefetcher then finds them cached (at most
    --prefetch bytes, within its window where the files hold the layers in order, as Hugging Face's shards
    do). The plan of a model of tens of thousands of tensors takes seconds. Only for a fresh OUT (one holding
    files is resumed, and may have its first shards done, or refused), one worker (each reads its share) and a
    source on disk."""
    if spec.count > 1 or devices or not _fresh(out_dir):
        return None
    return _prefetcher(source.root, source.tensors, settings)


def _fresh(out_dir: Path) -> bool:
    """Whether OUT is new or empty."""
    try:
        return not any(out_dir.iterdir())
    except FileNotFoundError:
        return True
    except OSError:  # not a directory, or unreadable: prepare_output refuses it
        return False


def _new_report(
    the_plan: Plan, out_dir: Path, settings: Settings, spec: workers.WorkerSpec, done: set[int], complete: bool
) -> Report:
    tensors = the_plan.tensors
    count = {a: sum(t.action is a for t in tensors) for a in Action}
    quant = the_plan.source.quant
    return Report(
        str(out_dir),
        the_plan.source.label,
        settings.scheme,
        settings.format,
        settings.device,
        len(the_plan.shards),
        len(done),
        sum(t.quantize for t in tensors),
        count[Action.KEEP],
        the_plan.source.total_bytes,
        the_plan.out_bytes,
        0.0,
        None,
        the_plan.ignore_list,
        list(the_plan.notes),
        plan_warnings(the_plan),
        complete,
        worker=spec.text,
        complete=complete,
        source_quantization=quant.describe() if quant else None,
        tensors_dequantized=count[Action.DEQUANTIZE],
        tensors_requantized=count[Action.REQUANTIZE],
        tensors_passed_through=count[Action.PASS],
        dequantize=settings.dequantize,
    )


def _device_worker(src: str, out: str, settings: Settings) -> Report:
    """One --devices child (spawned; must be importable by name). Its errors keep the CLI's spelling:
    the parent's `quantize` respells them for a Python caller."""
    return quantize.__wrapped__(src, out, settings)


def _quantize_on_devices(
    the_plan: Plan,
    src: str,
    out_dir: Path,
    settings: Settings,
    spec: workers.WorkerSpec,
    done: set[int],
    devices: list[str],
    report: Report,
) -> None:
    """One spawned worker process per device shares this worker's shards; then this process finalizes."""
    workers.log(
        f"{the_plan.source.label}: {len(devices)} worker processes ({', '.join(devices)})"
        + (f" sharing worker {spec.text}'s shards" if spec.count > 1 else ""),
        settings.progress,
    )
    todo = spec.owned(len(the_plan.shards)) - done
    check_free_space(the_plan, out_dir, set(range(len(the_plan.shards))) - todo)
    Manifest(out_dir).claim(the_plan, settings.base_model)
    children = device_split.child_settings(settings, spec, devices)
    reports = device_split.run_on_devices(_device_worker, src, str(out_dir), children)
    report.device = ",".join(r.device for r in reports)
    report.shards_written = sum(r.shards_written for r in reports)
    report.units, report.units_resumed = sum(r.units for r in reports), sum(r.units_resumed for r in reports)
    peaks = [r.peak_device_bytes for r in reports if r.peak_device_bytes is not None]
    report.peak_device_bytes = max(peaks) if peaks else None
    report.stage_seconds = {"workers": [r.stage_seconds for r in reports]}
    if settings.finalize:
        report.complete = _finish(the_plan, out_dir, spec, settings.progress)


def _quantize_here(
    the_plan: Plan,
    src,
    out_dir: Path,
    settings: Settings,
    spec: workers.WorkerSpec,
    done: set[int],
    fetcher,
    started: float,
    report: Report,
) -> None:
    """This process writes its share of the shards (all of them when it is the only worker)."""
    todo = spec.owned(len(the_plan.shards)) - done
    skip = set(range(len(the_plan.shards))) - todo
    # the units an earlier run wrote in this share's partial shards, checked against their bytes
    written = {
        i: units for i in sorted(todo) if (units := written_units(the_plan, out_dir / WORK_DIR, the_plan.shards[i]))
    }
    check_free_space(the_plan, out_dir, skip, fetcher.disk_bytes_needed(), written_bytes(the_plan, written))
    Manifest(out_dir).claim(the_plan, settings.base_model)
    units = units_for(the_plan, todo, written)
    report.units = len(units_for(the_plan, todo))
    report.units_resumed = report.units - len(units)
    if report.units_resumed:
        workers.log(
            f"{the_plan.source.label}{_tag(spec)}: resumed: {report.units_resumed} of {report.units} units "
            "already written",
            settings.progress,
        )
    if spec.count > 1:
        _log_share(the_plan, spec, todo, done, settings.progress)
        if looks_like_repo_id(str(src)):
            from .source.hub import fetch_from_hub

            fetch_from_hub(
                the_plan.source,
                sorted({i.file for u in units for t in u.tensors for i in t.inputs}),
                settings.token,
                settings.cache_dir,
            )
    device = workers.device_for(spec, settings.device)
    warmup = start_torch(device)
    command = "dequantize" if settings.dequantize else "quantize"
    bar = Progress(
        sum(u.in_bytes for u in units),
        f"{command} {the_plan.source.label}{_tag(spec)}",
        enabled=settings.progress,
        plain=spec.count > 1,
    )
    # torch's start-up pages queued on the disk before the checkpoint's reads (run/startup_pages.py)
    warmup.pages_queued.wait(PAGES_WAIT_S)
    reads = unique_inputs([t for u in units for a in u.atoms() for t in a])
    prefetcher = _prefetcher(the_plan.source.root, reads, settings, spec.sharing)
    with (
        fetcher,
        prefetcher or contextlib.nullcontext(),
        contextlib.closing(bar),
        ShardWriter(the_plan, out_dir, out_dir / WORK_DIR, skip, written=written) as writer,
    ):
        fetcher.start(need_order(units))
        # Join torch's thread before importing the pipeline (which imports torch): on a small model the
        # main thread gets here first and would do torch's import itself.
        warmup.join()
        from .run.pipeline import convert

        result = convert(
            the_plan,
            units,
            writer,
            device,
            settings.max_resident,
            fetcher,
            bar,
            read_threads=settings.read_threads,
            on_read=prefetcher.advance if prefetcher else _ignore,
            started=started,
        )
        warmup.record_pages()
        report.stage_seconds, report.device, report.peak_device_bytes = (
            result.stage_seconds,
            result.device,
            result.peak_device_bytes,
        )
        report.shards_written = len(todo)
        if settings.finalize:
            report.complete = _finish(the_plan, out_dir, spec, settings.progress)


def _tag(spec: workers.WorkerSpec) -> str:
    return f" [worker {spec.text}]" if spec.count > 1 else ""


def _ignore(nbytes: int) -> None:
    pass


def _prefetcher(root: Path, tensors: list, settings: Settings, workers: int = 1) -> Prefetcher | None:
    """The page-cache read-ahead of `tensors`, in their order; None with --prefetch 0 or a streamed source
    (nothing to read ahead: its shards arrive as needed). `workers`: how many processes converting shares
    of this model share this machine's memory (WorkerSpec.sharing), which --prefetch auto divides."""
    if not settings.prefetch or settings.stream_download:
        return None
    return Prefetcher(
        root, tensors, window_for(settings.prefetch, workers), threads=settings.prefetch_threads or default_threads()
    )


def _log_share(the_plan: Plan, spec: workers.WorkerSpec, todo: set[int], done: set[int], progress: bool) -> None:
    workers.log(
        f"{the_plan.source.label}: worker {spec.text} ({spec.launcher}): {len(todo)} of "
        f"{len(the_plan.shards)} shards to write, {len(done)} already done"
        + (
            ""
            if spec.count <= len(the_plan.shards)
            else " (more workers than shards: a smaller --max-shard-size gives more shards)"
        ),
        progress,
    )


def units_for(the_plan: Plan, shards: set[int], written: dict[int, set[int]] | None = None) -> list[Unit]:
    """The plan's units cut down to the tensors whose outputs land in `shards`, but in a shard where
    `written` says the unit is written already. All outputs of an atom (fused group or single tensor)
    share one shard, so atoms are never split and, across workers that own disjoint shards, no tensor is
    read twice."""
    written = written or {}
    units = []
    for ui, unit in enumerate(the_plan.units):
        kept = [
            t
            for t in unit.tensors
            if (shard := the_plan.shard_of[t.name]) in shards and ui not in written.get(shard, ())
        ]
        if kept:
            units.append(unit if len(kept) == len(unit.tensors) else Unit(unit.label, kept))
    return units


def _finish(the_plan: Plan, out_dir: Path, spec: workers.WorkerSpec, progress: bool) -> bool:
    """Finalize when this process may: alone, as torchrun's rank 0 after every rank's shards are
    written, or as the worker that finds every shard present. Returns whether OUT is complete."""
    if spec.count == 1:
        finalize(the_plan, out_dir)
        return True
    if spec.launcher == "torchrun":
        workers.log(f"worker {spec.text}: shards written; waiting for the other ranks", progress)
        workers.barrier()
        if spec.index != 0:
            return False
        finalize(the_plan, out_dir)
        return True
    present = finished_shards(the_plan, out_dir)
    if len(present) < len(the_plan.shards):
        workers.log(
            f"worker {spec.text}: shards written; {len(present)} of {len(the_plan.shards)} shards present. "
            f"The last worker to finish finalizes, or run: fp8convert finalize {out_dir}",
            progress,
        )
        return False
    claim = workers.claim_finalize(out_dir)
    if claim is None:
        workers.log(f"worker {spec.text}: every shard present; another worker is finalizing {out_dir}", progress)
        return False
    try:
        finalize(the_plan, out_dir)
    finally:
        workers.release_finalize(out_dir, claim)
    return True


def check_free_space(the_plan: Plan, out_dir: Path, skip: set[int], streamed_bytes: int = 0, written: int = 0) -> None:
    """The output shards still to write, but the bytes of their partial files that are `written`, plus
    the source shards a streamed download keeps at once."""
    needed = sum(s.size for s in the_plan.shards if s.index not in skip) - written + streamed_bytes
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        what = " and the streamed source shards" if streamed_bytes else ""
        raise FP8ConvertError(
            f"{out_dir}: needs {format_size(needed)} free for the output{what}, only {format_size(free)} available"
        )


@python_spelling
def finalize_output(out: str | Path, *, token: str | None = None, cache_dir: str | None = None) -> FinalizeReport:
    """Finish an output whose shards several workers wrote: rebuild the plan from what the manifest
    records (source, revision, scheme, format, ignore patterns, shard size, target TP sizes, scale format;
    headers only, a Hub repo id is planned from remote headers), refuse if it is not the plan the workers
    used or the source changed, check that every shard is present and complete (size and header bytes), then write side
    files, card, index and config.json. Idempotent: finalizing a complete output rewrites the same bytes."""
    started = time.monotonic()
    out_dir = Path(out)
    if not out_dir.is_dir():
        raise FP8ConvertError(f"{out_dir}: no such output directory")
    manifest = Manifest(out_dir)
    state = manifest.read()
    if state is None:
        raise FP8ConvertError(f"{out_dir}: no {WORK_DIR}/manifest.json, so no fp8convert worker started here")
    lacking = [k for k in ("fingerprint", "source", "scheme", "format", "ignore", "max_shard_size") if k not in state]
    if lacking:
        raise FP8ConvertError(
            f"{manifest.path}: does not record {lacking[0]} (written by an older fp8convert); "
            "rerun the quantize command to finish the output"
        )
    the_plan = _plan_from_manifest(state, token, cache_dir)
    if the_plan.fingerprint != state["fingerprint"]:
        raise PlanMismatchError(
            f"{out_dir}: the source no longer gives the plan the workers used "
            f"({plan_change(state, the_plan)}); " + replace_advice(out_dir, "rerun the conversion with --overwrite")
        )
    changed = source_change(state, the_plan.source)
    if changed:
        raise PlanMismatchError(
            f"{out_dir}: the source changed since the workers read it ({changed}); "
            + replace_advice(out_dir, "rerun the conversion with --overwrite")
        )
    with OutputLock(out_dir) as lock:
        lock.acquire()  # refused while a worker still writes here
        check_shards(the_plan, out_dir)
        finalize(the_plan, out_dir)
        workers.release_finalize(out_dir, None)  # a claim left by a worker that died while finalizing
    return FinalizeReport(
        str(out_dir), the_plan.source.label, len(the_plan.shards), the_plan.out_bytes, time.monotonic() - started
    )


def _plan_from_manifest(state: dict, token: str | None, cache_dir: str | None) -> Plan:
    """The workers' plan again, from the manifest: same source label (the card names it), same options."""
    options = Options(
        state["scheme"],
        state["format"],
        tuple(state["ignore"]),
        state["max_shard_size"],
        tuple(state.get("target_tp") or Options().target_tp),
        scale_format=state.get("scale_format") or "float",
        dequantize=bool(state.get("dequantize")),
        dtype=state.get("dtype"),
    )
    if state.get("source_path"):
        return build_plan(open_local(Path(state["source_path"]), label=state["source"]), options)
    from .source.hub import fetch_from_hub, remote_source

    repo_id, revision = state["source"], state.get("revision")
    if not looks_like_repo_id(repo_id):
        raise FP8ConvertError(f"{repo_id}: the manifest's source is neither a directory nor a Hub repo id")
    source: Source = remote_source(repo_id, revision, token, cache_dir=cache_dir)
    fetch_from_hub(source, [], token, cache_dir)  # side files and card: this machine's cache may lack them
    return build_plan(source, options)
