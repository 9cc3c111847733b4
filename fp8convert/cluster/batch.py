"""Batch conversion: many models from one jobs file (TOML `[[job]]` tables with an optional `[defaults]`,
or JSON lines: docs/cluster.md), one after another or one per Slurm array task."""

from __future__ import annotations

import json
import os
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import FP8ConvertError
from ..files import json_bytes, read_json_object, write_atomic
from ..options import REPO_ID, SETTING_NAMES, Settings, env_number
from ..output.manifest import WORK_DIR
from ..run.progress import log
from ..units import plural
from .workers import parse_devices

if TYPE_CHECKING:
    from ..plan.plan import Plan

STRING_KEYS = tuple(
    "name source out scheme format scale_format device revision push_to_hub max_resident dtype base_model".split()
)
BOOL_KEYS = ("private", "stream_download", "overwrite", "dequantize", "write_unloadable")
# recipe: a table of pattern = scheme, or a list of "PATTERN=SCHEME"; target_tp: a size or a list (Settings reads both)
KNOWN_KEYS = (*STRING_KEYS, "ignore", "recipe", "target_tp", "devices", "max_shard_size", *BOOL_KEYS)
# [defaults] keys that are not a dequantize job's (it writes no FP8), and the one that is only a dequantize's
QUANTIZE_ONLY, DEQUANTIZE_ONLY = (
    ("scheme", "format", "scale_format", "ignore", "recipe", "write_unloadable"),
    ("dtype",),
)
PUSHED = "pushed.json"  # in OUT/.fp8convert: repos this output was pushed to, so a rerun does not push again


@dataclass
class Job:
    index: int
    name: str
    source: str
    out: str
    settings: Settings
    push_to_hub: str | None = None
    private: bool = False


def job_title(index: int, name: str) -> str:
    """How logs and errors name a job: `job 3 (llama)`, or `job 3` where it has no name but its index."""
    return f"job {index}" if name == str(index) else f"job {index} ({name})"


@dataclass
class JobResult:
    index: int
    job: str
    source: str
    out: str
    status: str  # done, skipped (already complete), partial (this worker's shards only), failed
    seconds: float
    gb_in: float = 0.0
    gb_out: float = 0.0
    error: str | None = None
    pushed: str | None = None  # commit URL of the push
    report: dict = field(default_factory=dict)


def result_title(result: JobResult) -> str:
    """How the summary names a job that ran: by its name, else by what it converts (`job 1 (a -> b)`)."""
    if result.job != str(result.index):
        return job_title(result.index, result.job)
    return f"job {result.index} ({result.source} -> {result.out})"


def read_jobs(path: str | Path) -> list[Job]:
    """Parse and validate a jobs file; every problem is one line naming the file and the job."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise FP8ConvertError(f"{path}: cannot read ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise FP8ConvertError(f"{path}: not UTF-8 text ({e})") from e
    entries = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip() and line.strip()[0] != "#"]
    first = entries[0][1].strip() if entries else ""
    if path.suffix in (".jsonl", ".json", ".ndjson") or (path.suffix != ".toml" and first.startswith("{")):
        raw = []
        for number, line in entries:
            try:
                raw.append(json.loads(line))
            except ValueError as e:
                raise FP8ConvertError(f"{path}:{number}: not a JSON object ({e})") from e
        defaults: dict = {}
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise FP8ConvertError(f"{path}: not valid TOML ({e})") from e
        if extra := sorted(set(data) - {"job", "defaults"}):
            raise FP8ConvertError(
                f"{path}: unknown top-level key {extra[0]!r} (expected [[job]] tables and an optional [defaults] table)"
            )
        raw, defaults = data.get("job", []), data.get("defaults", {})
        if not isinstance(raw, list) or not isinstance(defaults, dict):
            raise FP8ConvertError(f"{path}: 'job' must be an array of tables ([[job]]) and 'defaults' a table")
        _check_keys(defaults, f"{path}: [defaults]", not_here=("source", "out", "name"))
    if not raw:
        raise FP8ConvertError(f"{path}: no jobs")
    jobs, problems = [], []  # each job's first problem, so that one run of the command names them all
    for i, entry in enumerate(raw):
        try:
            jobs.append(_job(path, i, entry, defaults))
        except FP8ConvertError as e:
            problems.append(str(e).removeprefix(f"{path}: "))
    seen: dict[str, Job] = {}
    for job in jobs:
        if (first := seen.setdefault(os.path.abspath(job.out), job)) is not job:
            title = job_title(first.index, first.name)
            problems.append(f"{job_title(job.index, job.name)} writes to {job.out}, as {title} does")
    if problems:
        raise FP8ConvertError(
            f"{path}: " + (f"{len(problems)} problems: " if len(problems) > 1 else "") + "; ".join(problems)
        )
    return jobs


def _check_keys(entry: dict, where: str, not_here=()) -> None:
    for key in entry:
        if key not in KNOWN_KEYS:
            raise FP8ConvertError(f"{where}: unknown key {key!r} (known: {', '.join(KNOWN_KEYS)})")
        if key in not_here:
            raise FP8ConvertError(f"{where}: {key!r} belongs in each [[job]], not in [defaults]")


def strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _job(path: Path, index: int, entry, defaults: dict) -> Job:
    label = f"{path}: job {index}"
    if not isinstance(entry, dict):
        raise FP8ConvertError(f"{label}: not a table/object")
    if isinstance(entry.get("name"), str):
        label += f" ({entry['name']})"
    _check_keys(entry, label)
    other = QUANTIZE_ONLY if entry.get("dequantize", defaults.get("dequantize")) is True else DEQUANTIZE_ONLY
    merged = {**{k: v for k, v in defaults.items() if k not in other}, **entry}
    for key in ("source", "out"):
        if not merged.get(key):
            raise FP8ConvertError(f"{label}: missing {key!r}")
    for keys, kind, what in ((STRING_KEYS, str, "a string"), (BOOL_KEYS, bool, "true or false")):
        for key in keys:
            if key in merged and not isinstance(merged[key], kind):
                raise FP8ConvertError(f"{label}: {key!r} must be {what}, got {merged[key]!r}")
    if isinstance(merged.get("ignore"), str):  # one pattern
        merged["ignore"] = [merged["ignore"]]
    if not strings(merged.get("ignore", [])):
        raise FP8ConvertError(f"{label}: 'ignore' must be a list of patterns")
    devices = merged.get("devices")
    if not (devices is None or isinstance(devices, str) or strings(devices)):
        raise FP8ConvertError(f"{label}: 'devices' must be a string (cuda:0,cuda:1 or all) or a list")
    size = merged.get("max_shard_size", "5GB")
    if isinstance(size, bool) or not isinstance(size, (str, int)):
        raise FP8ConvertError(f"{label}: 'max_shard_size' must be a size such as \"5GB\"")
    try:
        settings = Settings(**{k: v for k, v in merged.items() if k in SETTING_NAMES})
        if devices is not None and devices not in ("all", ["all"]):  # 'all' is resolved where the job runs
            parse_devices(devices)
    except FP8ConvertError as e:
        raise FP8ConvertError(f"{label}: {e}") from None
    push = merged.get("push_to_hub")
    if push and not REPO_ID.match(push):
        raise FP8ConvertError(f"{label}: push_to_hub {push!r} is not a Hub repo id (owner/name)")
    if not push and merged.get("private"):
        raise FP8ConvertError(f"{label}: 'private' applies only with 'push_to_hub'")
    name = merged.get("name") or str(index)
    return Job(index, name, merged["source"], merged["out"], settings, push, bool(merged.get("private")))


def task_index_from_env(env=None) -> int | None:
    """The job of this Slurm array task: job N for task id N, whatever the array's first id and step, so
    `--array=3,7` reruns jobs 3 and 7 (None outside an array)."""
    return env_number(os.environ if env is None else env, "SLURM_ARRAY_TASK_ID")


def run_job(
    job: Job, progress: bool, token: str | None, cache_dir: str | None, on_plan: Callable[[Job, Plan], None] | None
) -> JobResult:
    """One job; a failure is recorded in the result, not raised (Ctrl-C still stops everything).
    `on_plan(job, plan)` is called before the job reads any data."""
    from .. import api, publish

    started = time.monotonic()
    result = JobResult(job.index, job.name, job.source, job.out, "failed", 0.0)
    title = job_title(job.index, job.name)
    log(f"{title}: {job.source} -> {job.out}", progress)
    try:
        report = api.quantize(
            job.source,
            job.out,
            job.settings,
            progress=progress,
            token=token,
            cache_dir=cache_dir,
            on_plan=(lambda plan: on_plan(job, plan)) if on_plan else None,
        )
        result.report = asdict(report)
        result.gb_in, result.gb_out = report.bytes_in / 1e9, report.bytes_out / 1e9
        result.status = "skipped" if report.already_complete else "done"
        if job.push_to_hub and report.complete:
            pushed_file = Path(job.out) / WORK_DIR / PUSHED
            pushed = read_json_object(pushed_file)
            if not (report.already_complete and job.push_to_hub in pushed):
                pushed[job.push_to_hub] = publish.push(job.out, job.push_to_hub, private=job.private, token=token).url
                write_atomic(pushed_file, json_bytes(pushed))
            result.pushed = pushed[job.push_to_hub]
        elif not report.complete:
            result.status = "partial"  # this worker's shards are written; others still owe theirs
    except FP8ConvertError as e:
        result.error = str(e)
    except Exception as e:  # an unexpected failure in one job must not stop the others
        result.error = " ".join(f"{type(e).__name__}: {e}".split())
    result.seconds = time.monotonic() - started
    log(f"{title}: {result.status} in {result.seconds:.1f}s" + (f": {result.error}" if result.error else ""), progress)
    return result


def run_batch(
    path: str | Path,
    task_index: int | None = None,
    progress: bool = True,
    token: str | None = None,
    cache_dir: str | None = None,
    on_plan: Callable[[Job, Plan], None] | None = None,
) -> list[JobResult]:
    """Validate the jobs file, then run its jobs in order (or only job `task_index`, default the array task's)."""
    jobs = read_jobs(path)
    task_index = task_index_from_env() if task_index is None else task_index
    if task_index is not None:
        if not 0 <= task_index < len(jobs):
            raise FP8ConvertError(
                f"task index {task_index}: {path} has {plural(len(jobs), 'job')}, numbered 0 to {len(jobs) - 1}"
            )
        jobs = [jobs[task_index]]
    return [run_job(job, progress, token, cache_dir, on_plan) for job in jobs]


def render(results: list[JobResult]) -> str:
    rows = [("job", "source", "out", "status", "seconds", "GB")]
    for r in results:
        job = f"{r.index} {r.job}" if r.job != str(r.index) else r.job
        rows.append((job, r.source, r.out, r.status, f"{r.seconds:.1f}", f"{r.gb_out:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) if i < 4 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [f"{result_title(r)} failed: {r.error}" for r in results if r.status == "failed"]
    return "\n".join(line.rstrip() for line in lines)


def summary(results: list[JobResult]) -> dict:
    counts = {s: sum(r.status == s for r in results) for s in ("done", "skipped", "partial", "failed")}
    return {"ok": not counts["failed"], "jobs": [asdict(r) for r in results], **counts}
