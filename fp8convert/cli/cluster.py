"""finalize and batch: the commands for cluster jobs (docs/cluster.md)."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

from ..errors import FP8ConvertError
from ..units import format_size, plural
from ._options import CacheDir, Json, QuietReport, Token, argument, option, print_json, token
from .convert import print_warnings


def finalize(
    out: argument(Path, "OUT", "An output directory whose shards workers wrote."),
    json_out: Json = False,
    hub_token: Token = None,
    cache_dir: CacheDir = None,
):
    """Check that every shard of OUT is present and complete (size and header), then write the index,
    config.json and model card. The plan is rebuilt from the source recorded in OUT/.fp8convert
    (headers only) and must be the one the workers used. Safe to run more than once.

    Examples:

      fp8convert finalize ./dsv3-fp8

      sbatch --dependency=afterok:$JOB scripts/slurm_finalize.sbatch ./dsv3-fp8
    """
    from .. import api

    report = api.finalize_output(out, token=token(hub_token), cache_dir=cache_dir)
    if json_out:
        print_json(asdict(report))
    else:
        print(
            f"finalized {out}: {plural(report.shards, 'shard')}, {format_size(report.bytes_out)}, from {report.source}"
        )


def batch(
    # \\[ keeps rich from reading [[job]] as markup
    jobs: argument(Path, "JOBS", "Jobs file: TOML with \\[\\[job]] tables, or JSON lines (docs/cluster.md)."),
    task_index: option(
        int | None,
        "--task-index N",
        "Run only job N (counting from 0). Default in a Slurm array: "
        "$SLURM_ARRAY_TASK_ID - $SLURM_ARRAY_TASK_MIN; elsewhere every job.",
    ) = None,
    json_out: Json = False,
    quiet: QuietReport = False,
    hub_token: Token = None,
    cache_dir: CacheDir = None,
):
    """Convert every model listed in JOBS, in order: finished outputs are skipped, a failed job does not
    stop the others, and a summary table (job, source, out, status, seconds, GB) ends the run. Exits 1
    if any job failed. The file is validated before any job starts.

    Examples:

      fp8convert batch jobs.toml

      fp8convert batch jobs.jsonl --task-index 2 --json

      sbatch --array=0-9 scripts/slurm_array.sbatch jobs.toml     # one job per array task
    """
    from ..cluster import batch as batch_mod

    results = batch_mod.run_batch(
        jobs,
        task_index=task_index,
        progress=not quiet,
        token=token(hub_token),
        cache_dir=cache_dir,
        on_plan=lambda job, plan: print_warnings(plan, f"{batch_mod.job_title(job.index, job.name)}: "),
    )
    if json_out:
        print_json(batch_mod.summary(results))
    else:
        print(batch_mod.render(results))
    failed = [r for r in results if r.status == "failed"]
    if failed:
        raise FP8ConvertError(
            f"{jobs}: {len(failed)} of {plural(len(results), 'job')} failed (first: "
            f"{batch_mod.result_title(failed[0])}: {failed[0].error})"
        )
    sys.stdout.flush()
