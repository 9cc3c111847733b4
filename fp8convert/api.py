"""The Python API. The CLI is a thin layer over these functions; tests and other tools call them too.

torch is imported only once the plan is made and the prefetcher is reading: importing it takes
seconds, which the disk spends better reading the checkpoint.
"""
from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from . import cluster
from .errors import FP8ConvertError, PlanMismatchError
from .hub import looks_like_repo_id
from .options import Options, parse_size
from .output import WORK_DIR, Manifest, check_shards, finalize, finished_shards, prepare_output
from .plan import Plan, Unit, build_plan, make_batches
from .prefetch import Prefetcher
from .progress import Progress
from .source import Source, open_local
from .summary import compatibility_warnings

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_RESIDENT = {"cuda": 4 * 2**30, "cpu": 1 * 2**30}
DEVICE_TEXT = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
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
    worker: str = "0/1"                   # this process's share: worker K of N
    shards_written: int = 0               # by this call (its workers, with --devices)
    complete: bool = False                # OUT is complete on return (False: other workers still owe shards)


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


def io_threads(device_type: str) -> tuple[int, int]:
    """(reader, writer) threads. With a GPU quantizing, parallel preads and pwrites keep the disk busy
    (8 and 4 measured best). On the CPU, quantizing is the slowest stage and needs every core; more I/O
    threads only take cores from it (on 2 cores, 8 readers and 4 writers made the run 1.5x slower)."""
    return (1, 1) if device_type == "cpu" else (8, 4)


def default_prefetch_threads() -> int:
    """Prefetch reads cost CPU time too: a quarter of the cores, from 1 to 4 (4 is plenty for a disk)."""
    return min(4, max(1, (os.cpu_count() or 1) // 4))


def budget_for(dev: "torch.device", max_resident: int | str | None) -> int:
    """--max-resident, or the default for the device type."""
    return parse_size(max_resident, "--max-resident") if max_resident else DEFAULT_MAX_RESIDENT[dev.type]


def open_source(src: str | Path, revision: str | None = None, token: str | None = None) -> Source:
    from .hub import download_source
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
    from .hub import remote_source  # a repo id plans from remote headers: no weight download
    source = remote_source(str(src), revision, token) if looks_like_repo_id(str(src)) else open_source(src, revision, token)
    return build_plan(source, options)


def quantize(src: str | Path, out: str | Path, *, scheme: str = "tensor", format: str = "compressed-tensors",
             ignore=(), device: str = "auto", max_shard_size: int | str = "5GB",
             max_resident: int | str | None = None, overwrite: bool = False, revision: str | None = None,
             token: str | None = None, progress: bool = False, read_threads: int | None = None,
             prefetch: int | str = DEFAULT_PREFETCH, prefetch_threads: int | None = None, stream_download: bool = False,
             on_plan: Callable[[Plan], None] | None = None, worker=None, devices=None,
             finalize_when_done: bool = True) -> Report:
    """Convert a BF16/FP16/FP32 safetensors checkpoint (directory or Hub repo id) to FP8 in `out`.

    `on_plan` is called with the plan before any data is read (the CLI prints its warnings there).
    `stream_download` (Hub sources): keep only a few source shards on disk at a time.

    Several processes can share one conversion (docs/cluster.md). `worker`: this process's share, "K/N"
    or (K, N): it writes only the output shards whose index % N == K; None detects torchrun and
    multi-task srun (else one worker does everything); "auto" also detects a Slurm array or a
    Kubernetes indexed Job. A worker that finds every shard present finalizes (under torchrun: rank 0,
    after a barrier); otherwise `finalize_output(out)` does it later. `devices` ("cuda:0,cuda:1", a
    list, or "all"): one spawned worker process per device splits this worker's share, then this
    process finalizes. `finalize_when_done=False`: write the shards only."""
    started = time.monotonic()
    options = Options(scheme, format, tuple(ignore), max_shard_size)  # bad options fail before any I/O
    if not DEVICE_TEXT.match(device):  # spelling only: whether CUDA is there needs torch, checked later
        raise FP8ConvertError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N")
    max_resident = parse_size(max_resident, "--max-resident") if max_resident else None
    prefetch = parse_size(prefetch, "--prefetch") if prefetch else 0
    spec = cluster.resolve_worker(worker)
    device_list = cluster.parse_devices(devices) if devices else None
    if device_list and device != "auto":
        raise FP8ConvertError(f"--device {device} and --devices {','.join(device_list)}: give only one of them")
    if device_list and len(device_list) == 1:  # one device: no child process needed
        device, device_list = device_list[0], None
    for d in device_list or ():
        resolve_device(d)  # a GPU this machine lacks fails now, not in a child after OUT was made
    if overwrite and spec.count > 1:
        raise FP8ConvertError(f"--overwrite with several workers (worker {spec.text}): each would clear the "
                              "others' work; clear OUT once beforehand instead")
    if stream_download and (spec.count > 1 or device_list):
        raise FP8ConvertError("--stream-download works with one worker only: workers would delete source "
                              "shards another one still reads")
    if stream_download:
        from .hub import streaming_source
        if not looks_like_repo_id(str(src)):
            raise FP8ConvertError(f"--stream-download applies to Hub repo ids; {src} is local")
        source = streaming_source(str(src), out, revision, token)
    elif spec.count > 1 and looks_like_repo_id(str(src)):
        from .hub import remote_source
        source = remote_source(str(src), revision, token)  # headers only: each worker fetches the shards it reads
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
                    list(the_plan.notes), compatibility_warnings(the_plan), complete,
                    worker=spec.text, complete=complete)
    if complete:
        pass  # an earlier run of this plan finished it
    elif device_list:
        kwargs = dict(scheme=scheme, format=format, ignore=tuple(ignore), max_shard_size=max_shard_size,
                      max_resident=max_resident, revision=revision, token=token, progress=progress,
                      read_threads=read_threads, prefetch=prefetch, prefetch_threads=prefetch_threads)
        _quantize_on_devices(the_plan, str(src), out_dir, spec, done, device_list, kwargs, report, progress,
                             finalize_when_done)
    else:
        _quantize_here(the_plan, src, out_dir, spec, done, device, max_resident, token, progress, read_threads,
                       prefetch, prefetch_threads, started, report, finalize_when_done)
    report.seconds = time.monotonic() - started
    report.stage_seconds["total"] = round(report.seconds, 3)
    return report


def _quantize_on_devices(the_plan: Plan, src: str, out_dir: Path, spec: cluster.WorkerSpec, done: set[int],
                         device_list: list[str], kwargs: dict, report: Report, progress: bool,
                         finalize_when_done: bool) -> None:
    """One spawned worker process per device shares this worker's shards; then this process finalizes."""
    cluster.log(f"{the_plan.source.label}: {len(device_list)} worker processes ({', '.join(device_list)})"
                + (f" sharing worker {spec.text}'s shards" if spec.count > 1 else ""), progress)
    todo = spec.owned(len(the_plan.shards)) - done
    check_free_space(the_plan, out_dir, set(range(len(the_plan.shards))) - todo)
    reports = cluster.run_on_devices(src, str(out_dir), spec, device_list, kwargs)
    report.device = ",".join(r.device for r in reports)
    report.shards_written = sum(r.shards_written for r in reports)
    peaks = [r.peak_device_bytes for r in reports if r.peak_device_bytes is not None]
    report.peak_device_bytes = max(peaks) if peaks else None
    report.stage_seconds = {"workers": [r.stage_seconds for r in reports]}
    if finalize_when_done:
        report.complete = _finish(the_plan, out_dir, spec, progress)


def _quantize_here(the_plan: Plan, src, out_dir: Path, spec: cluster.WorkerSpec, done: set[int], device: str,
                   max_resident, token: str | None, progress: bool, read_threads: int | None, prefetch,
                   prefetch_threads: int | None, started: float, report: Report, finalize_when_done: bool) -> None:
    """This process writes its share of the shards (all of them when it is the only worker)."""
    todo = spec.owned(len(the_plan.shards)) - done
    skip = set(range(len(the_plan.shards))) - todo
    check_free_space(the_plan, out_dir, skip,
                     the_plan.source.fetcher.disk_bytes_needed() if the_plan.source.fetcher else 0)
    units = units_for(the_plan, todo)
    if spec.count > 1:
        cluster.log(f"{the_plan.source.label}: worker {spec.text} ({spec.launcher}): {len(todo)} of "
                    f"{len(the_plan.shards)} shards to write, {len(done)} already done"
                    + ("" if spec.count <= len(the_plan.shards) else
                       " (more workers than shards: a smaller --max-shard-size gives more shards)"), progress)
        if looks_like_repo_id(str(src)) and not the_plan.source.fetcher:
            from .hub import fetch_from_hub
            fetch_from_hub(the_plan.source, sorted({t.source.file for u in units for t in u.tensors}), token)
    fetcher = the_plan.source.fetcher
    window = 0 if fetcher else prefetch
    prefetcher = Prefetcher(the_plan.source.root, [t.source for u in units for a in u.atoms() for t in a],
                            window, threads=prefetch_threads or default_prefetch_threads()).start() if window else None
    try:
        if fetcher:
            from .hub import need_order
            fetcher.start(need_order(units))
        report.stage_seconds, report.device, report.peak_device_bytes = _run(
            the_plan, units, out_dir, skip, cluster.device_for(spec, device), max_resident, progress,
            read_threads, prefetcher, started, tag=f" [worker {spec.text}]" if spec.count > 1 else "")
        report.shards_written = len(todo)
        if finalize_when_done:
            report.complete = _finish(the_plan, out_dir, spec, progress)
    except BaseException:
        if fetcher:
            fetcher.close()  # downloaded shards stay for the rerun
        raise
    finally:
        if prefetcher:
            prefetcher.stop()
    if fetcher:
        fetcher.close(remove=True)


def units_for(the_plan: Plan, shards: set[int]) -> list[Unit]:
    """The plan's units cut down to the tensors whose outputs land in `shards`. All outputs of an atom
    (fused group or single tensor) share one shard, so atoms are never split and, across workers that
    own disjoint shards, no tensor is read twice."""
    units = []
    for unit in the_plan.units:
        kept = [t for t in unit.tensors if the_plan.shard_of[t.name] in shards]
        if kept:
            units.append(unit if len(kept) == len(unit.tensors) else Unit(unit.label, kept))
    return units


def _finish(the_plan: Plan, out_dir: Path, spec: cluster.WorkerSpec, progress: bool) -> bool:
    """Finalize when this process may: alone, as torchrun's rank 0 after every rank's shards are
    written, or as the worker that finds every shard present. Returns whether OUT is complete."""
    if spec.count == 1:
        finalize(the_plan, out_dir)
        return True
    if spec.launcher == "torchrun":
        cluster.log(f"worker {spec.text}: shards written; waiting for the other ranks", progress)
        cluster.barrier()
        if spec.index != 0:
            return False
        finalize(the_plan, out_dir)
        return True
    present = finished_shards(the_plan, out_dir)
    if len(present) < len(the_plan.shards):
        cluster.log(f"worker {spec.text}: shards written; {len(present)} of {len(the_plan.shards)} shards present. "
                    f"The last worker to finish finalizes, or run: fp8convert finalize {out_dir}", progress)
        return False
    claim = cluster.claim_finalize(out_dir)
    if claim is None:
        cluster.log(f"worker {spec.text}: every shard present; another worker is finalizing {out_dir}", progress)
        return False
    try:
        finalize(the_plan, out_dir)
    finally:
        cluster.release_finalize(out_dir, claim)
    return True


def _run(the_plan: Plan, units, out_dir: Path, done: set[int], device: str, max_resident, progress: bool,
         read_threads: int | None, prefetcher: Prefetcher | None, started: float,
         tag: str = "") -> tuple[dict, str, int | None]:
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
    bar = Progress(sum(b.in_bytes for b in batches), f"quantize {the_plan.source.label}{tag}", enabled=progress,
                   plain=bool(tag))
    default_readers, writers = io_threads(dev.type)
    reader = BatchReader(the_plan.source.root, dev, threads=read_threads or default_readers)
    writer = ShardWriter(the_plan, out_dir, out_dir / WORK_DIR, done, threads=writers)
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


def check_free_space(the_plan: Plan, out_dir: Path, skip: set[int], streamed_bytes: int = 0) -> None:
    """The output shards still to write, plus the source shards a streamed download keeps at once."""
    needed = sum(s.size for s in the_plan.shards if s.index not in skip) + streamed_bytes
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        what = " and the streamed source shards" if streamed_bytes else ""
        raise FP8ConvertError(f"{out_dir}: needs {needed / 1e9:.2f} GB free for the output{what}, only "
                              f"{free / 1e9:.2f} GB available")


@dataclass
class FinalizeReport:
    """What `finalize_output` did."""

    out_dir: str
    source: str
    shards: int
    bytes_out: int
    seconds: float


def finalize_output(out: str | Path, *, token: str | None = None) -> FinalizeReport:
    """Finish an output whose shards several workers wrote: rebuild the plan from what the manifest
    records (source, revision, scheme, format, ignore patterns, shard size; headers only, a Hub repo
    id is planned from remote headers), refuse if it is not the plan the workers used, check that every
    shard is present and complete (size and header bytes), then write side files, card, index and
    config.json. Idempotent: finalizing a complete output rewrites the same bytes."""
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
        raise FP8ConvertError(f"{manifest.path}: does not record {lacking[0]} (written by an older fp8convert); "
                              "rerun the quantize command to finish the output")
    the_plan = _plan_from_manifest(state, token)
    if the_plan.fingerprint != state["fingerprint"]:
        from .output import plan_change
        raise PlanMismatchError(f"{out_dir}: the source no longer gives the plan the workers used "
                                f"({plan_change(state, the_plan)}); rerun the conversion with --overwrite")
    check_shards(the_plan, out_dir)
    finalize(the_plan, out_dir)
    cluster.release_finalize(out_dir, None)  # a claim left by a worker that died while finalizing
    return FinalizeReport(str(out_dir), the_plan.source.label, len(the_plan.shards), the_plan.out_bytes,
                          time.monotonic() - started)


def _plan_from_manifest(state: dict, token: str | None) -> Plan:
    """The workers' plan again, from the manifest: same source label (the card names it), same options."""
    options = Options(state["scheme"], state["format"], tuple(state["ignore"]), state["max_shard_size"])
    if state.get("source_path"):
        return build_plan(open_local(Path(state["source_path"]), label=state["source"]), options)
    from .hub import fetch_from_hub, remote_source
    repo_id, revision = state["source"], state.get("revision")
    if not looks_like_repo_id(repo_id):
        raise FP8ConvertError(f"{repo_id}: the manifest's source is neither a directory nor a Hub repo id")
    source = remote_source(repo_id, revision, token)
    fetch_from_hub(source, [], token)  # side files and card: this machine's cache may lack them
    return build_plan(source, options)
