"""The commands, each a thin layer over the Python API; `command` (_options.py) names their parameters."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

from .. import api, publish
from .. import verify as verify_mod
from ..cluster import batch as batch_mod
from ..errors import FP8ConvertError, UsageError
from ..options import REPO_ID, SCHEMES, Settings
from ..plan.summary import describe, refuse_unloadable, render
from ..units import format_size, plural
from ._options import QUIET_REPORT, argument, command, hub_token, option, print_json, print_out, settings_from


@command(
    "src out scheme recipe format ignore device max_shard_size max_resident overwrite revision json_out quiet "
    "push_to_hub private stream_download worker devices prefetch target_tp scale_format token cache_dir "
    "base_model write_unloadable"
)
def quantize(src, out, json_out, quiet, push_to_hub, private, **settings):
    """Convert SRC to FP8 in OUT. Rerunning the same command resumes an interrupted run.

    SRC may itself be FP8 (native fp8 such as DeepSeek-V3, or compressed-tensors): each FP8 weight is then
    passed through as it is when SRC has the scheme you ask for, requantized from its dequantized values
    when it has another, and dequantized where you --ignore it; no BF16 copy is written in between.

    Examples:

      fp8convert quantize Qwen/Qwen3-8B ./Qwen3-8B-FP8

      fp8convert quantize ./llama --scheme channel --ignore 're:.*down_proj' ./llama-fp8

      fp8convert quantize ./dsv3 ./dsv3-fp8 --format fp8 --scheme block --device cuda:1

      fp8convert quantize ./DeepSeek-V3 ./dsv3-channel --scheme channel      # FP8 blocks to per-channel scales

      fp8convert quantize ./Qwen3-8B ./Qwen3-8B-MXFP8 --scheme mxfp8                # Blackwell MXFP8

      fp8convert quantize ./Qwen3-30B-A3B ./out --scheme block --scheme 're:.*mlp.experts.\\*=nvfp4a16'

      fp8convert quantize ./dsv3 ./dsv3-fp8 --format fp8 --scheme block --scale-format ue8m0

      fp8convert quantize ./Qwen3-30B-A3B ./out --scheme block --target-tp 4     # say what fails at TP 4

      fp8convert quantize Qwen/Qwen3-8B ./Qwen3-8B-FP8 --push-to-hub me/Qwen3-8B-FP8 --stream-download

      fp8convert quantize ./dsv3 ./dsv3-fp8 --devices all                # one process per GPU

      srun -n 8 fp8convert quantize ./dsv3 ./dsv3-fp8                    # 8 workers; the last one finalizes

      fp8convert quantize ./dsv3 ./dsv3-fp8 --worker 3/8                 # then: fp8convert finalize ./dsv3-fp8
    """
    _convert(src, out, settings_from(settings, progress=not quiet), json_out, push_to_hub, private)


@command(
    "src out dtype device max_shard_size max_resident overwrite revision json_out quiet push_to_hub private "
    "stream_download worker devices prefetch token cache_dir base_model"
)
def dequantize(src, out, json_out, quiet, push_to_hub, private, **settings):
    """Convert the FP8 checkpoint SRC (native fp8 or compressed-tensors) to high precision in OUT:
    every FP8 weight becomes float32(codes) x scale rounded once to --dtype, scales and
    quantization_config are dropped, every other tensor is copied byte for byte. Rerunning the same
    command resumes an interrupted run.

    Examples:

      fp8convert dequantize deepseek-ai/DeepSeek-V3 ./DeepSeek-V3-BF16 --stream-download

      fp8convert dequantize ./Qwen3-8B-FP8 ./Qwen3-8B-BF16 --dtype bf16 --device cuda

      fp8convert inspect ./Qwen3-8B-FP8 --dequantize          # the plan, without reading weights
    """
    _convert(src, out, settings_from(settings, dequantize=True, progress=not quiet), json_out, push_to_hub, private)


def _convert(src: str, out: Path, settings: Settings, json_out: bool, push_to: str | None, private: bool) -> None:
    if private and not push_to:
        raise UsageError("--private applies only with --push-to-hub REPO_ID")
    if push_to and not REPO_ID.match(push_to):
        raise UsageError(f"--push-to-hub {push_to}: not a Hub repo id (owner/name)")
    report = api.quantize(src, out, settings, on_plan=print_warnings)
    if json_out:
        print_json(asdict(report))
    elif settings.progress:  # not -q
        print_out(summary_line(report))
    if push_to and report.complete:
        pushed = publish.push(out, push_to, private=private, token=settings.token)
        print_out(f"pushed {out} to {push_to}: {pushed.url}", stderr=json_out)
    elif push_to:
        print(
            f"--push-to-hub: not from worker {report.worker}; the worker that finalizes {out} pushes it "
            f"(or run `fp8convert push {out} {push_to}` after finalize)",
            file=sys.stderr,
        )


def print_warnings(the_plan, prefix: str = "") -> None:
    """The plan's warnings and notes on stderr, before anything is read; -q does not silence them."""
    for line in the_plan.warnings:
        print(f"warning: {prefix}{line}", file=sys.stderr)
    for line in the_plan.notes:
        print(f"note: {prefix}{line}", file=sys.stderr)


def summary_line(report: api.Report) -> str:
    """'wrote OUT: 1 shard, 28 tensors quantized, 11 kept, 6.32 MB -> 3.86 MB in 0.9s on cpu', or what this
    worker did, or that OUT was complete already."""
    out = report.out_dir
    if report.already_complete:
        return f"{out}: already complete (same plan); nothing to do"
    if not report.complete:
        return (
            f"worker {report.worker}: wrote {report.shards_written} of {plural(report.shards, 'shard')} of {out} in "
            f"{report.seconds:.1f}s on {report.device}; the worker that finds every shard written finalizes the "
            f"output (rank 0 under torchrun), or run `fp8convert finalize {out}` once every worker is done"
        )
    # written before this run began: by an earlier run of it, or (in a split) by the other workers
    before = f", {report.shards_resumed} already written" if report.shards_resumed else ""
    if report.units_resumed:  # in partial shards an earlier run left: the units it had written are kept
        before += f", resumed: {report.units_resumed} of {plural(report.units, 'unit')} already written"
    return (
        f"wrote {out}: {plural(report.shards, 'shard')}{before}, {done_text(report)}, {format_size(report.bytes_in)} "
        f"-> {format_size(report.bytes_out)} in {report.seconds:.1f}s on {report.device}"
    )


def done_text(report: api.Report) -> str:
    """What happened to the tensors, e.g. '120 FP8 weights dequantized, 35 kept'."""
    kept = f"{report.tensors_kept} kept"
    if report.dequantize:
        kind = "FP4" if " FP4 weights" in (report.source_quantization or "") else "FP8"
        return f"{plural(report.tensors_dequantized, kind + ' weight')} dequantized, {kept}"
    if not report.source_quantization:
        return f"{plural(report.tensors_quantized, 'tensor')} quantized, {kept}"
    quantized_here = report.tensors_quantized - report.tensors_requantized - report.tensors_passed_through
    parts = [
        f"{plural(report.tensors_passed_through, 'FP8 weight')} passed through",
        f"{report.tensors_requantized} requantized",
        *([f"{quantized_here} quantized"] if quantized_here else []),
        f"{report.tensors_dequantized} dequantized",
        kept,
    ]
    return ", ".join(parts)


# What `inspect --tensors` says becomes of a tensor, by action; {} is the plan's reason.
ACTION_TEXT = {
    "quantize": "fp8",
    "pass": "fp8 (passed through)",
    "requantize": "fp8 (requantized)",
    "dequantize": "dequantize ({})",
}


@command(
    "src scheme recipe format ignore device max_shard_size max_resident revision json_out target_tp "
    "scale_format tensors dequantize dtype token cache_dir"
)
def inspect(
    src,
    json_out,
    tensors: option(bool, "--tensors", "Also list every tensor and what becomes of it."),
    dequantize: option(bool, "--dequantize", "Plan `fp8convert dequantize` of an FP8 SRC instead of a quantize."),
    **settings,
):
    """Print the plan without reading tensor data: what is quantized, what is kept and why, fused
    groups, output size, shard count, estimated peak memory, and which engines (and GPUs) load it. For
    an FP8 SRC: its format, and which weights pass through, are requantized or dequantized.

    Examples:

      fp8convert inspect meta-llama/Llama-3.1-8B-Instruct

      fp8convert inspect ./Qwen3-30B-A3B --scheme block --json

      fp8convert inspect ./Qwen3-30B-A3B --scheme mxfp8         # what stays BF16, who loads it where

      fp8convert inspect ./Llama-4-Scout --tensors --target-tp 8

      fp8convert inspect ./DeepSeek-V3 --dequantize --dtype bf16
    """
    given = next((s for s in settings["scheme"] or () if "=" not in s), None)
    settings = settings_from(settings, dequantize=dequantize)
    the_plan = api.make_plan(src, settings)
    from ..run.device import budget_for, resolve_device  # imports torch

    dev = resolve_device(settings.device)
    info = describe(the_plan, budget_for(dev, settings.max_resident), dev.type)
    if given and given != settings.scheme and not dequantize:  # an alias or another case: say which it means
        info["scheme_given"] = given
    try:
        if not settings.write_unloadable:
            refuse_unloadable(the_plan)
    except FP8ConvertError:  # its reason is among the warnings already
        info["warnings"].append("quantize refuses to write this (vLLM cannot load it); --write-unloadable writes it")
    if tensors:
        info["tensor_plan"] = [
            {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": t.source.dtype,
                "quantize": t.quantize,
                "action": t.action.value,
                "reason": t.reason,
                "group": t.group,
                "scheme": t.scheme if t.quantize else None,
                "from": t.cut.describe(t.source.name) if t.cut else None,
            }
            for t in the_plan.tensors
        ]
    if json_out:
        print_json(info)
        return
    print_out(render(info))
    for t in info.get("tensor_plan", []):
        what = ACTION_TEXT.get(t["action"], "keep ({})").format(t["reason"])
        origin = f"  <- {t['from']}" if t["from"] else ""
        print_out(f"  {t['name']:<70} {str(t['shape']):<16} {what}{origin}")


@command("directory scheme format device json_out quiet")
def demo(
    directory: argument(Path, "DIR", "Where to put the demo model and its FP8 conversion.", Path("fp8convert-demo")),
    scheme: option(str, "--scheme " + "|".join(SCHEMES), "The scheme of the conversion (see quantize).", "tensor"),
    format,
    device,
    json_out,
    quiet: QUIET_REPORT,
):
    """Build a small random Llama-shaped BF16 model (embedded, no download) in DIR/source and convert it
    to DIR/fp8.

    Example:

      fp8convert demo /tmp/fp8demo
    """
    from ..demo import demo_source, next_steps  # imports torch
    from ..run import warmup

    settings = Settings(scheme=scheme, format=format, device=device, overwrite=True, progress=not quiet)
    src = demo_source(directory / "source")
    print_out(f"built demo model {src}", stderr=json_out)
    _convert(str(src), directory / "fp8", settings, json_out, None, False)
    # Building the model imported torch first, so the conversion recorded no start-up pages (a caller's
    # process maps much else); this process is the program's own, so it records them for later runs.
    warmup.record(warmup.record_path(device))
    print_out(next_steps(src, directory / "fp8", scheme, format), stderr=json_out)


@command("src out revision json_out worst every_problem device max_resident prefetch quiet token cache_dir")
def verify(
    src: argument(str, "SRC", "The source checkpoint: directory or Hub repo id."),
    out: argument(Path, "OUT", "The FP8 checkpoint to check."),
    json_out,
    worst: option(int, "--worst N", "How many of the worst tensors to list.", 10, min=0),
    every_problem: option(bool, "--all", "List every problem found, not one line per cause."),
    quiet: QUIET_REPORT,
    token,
    **settings,
):
    """Check OUT against SRC: every source tensor accounted for, dtypes, shapes, finite positive scales,
    config, ignore list and index consistent, kept tensors byte-identical, and each quantized tensor
    within the e4m3 rounding bound, element by element (relative error and SNR listed, worst first).
    Reads both checkpoints as quantize does (batched, on CUDA when present). Problems are listed one
    line per cause. Exits 1 on any failure.

    Examples:

      fp8convert verify ./Qwen3-8B ./Qwen3-8B-FP8

      fp8convert verify meta-llama/Llama-3.1-8B-Instruct ./llama-fp8 --json

      fp8convert verify ./Qwen3-8B ./Qwen3-8B-FP8 --all --device cpu
    """
    report = verify_mod.verify(src, out, token=hub_token(token), progress=not quiet, **settings)
    if json_out:
        print_json(report.to_dict(worst))
    else:
        print_out(verify_mod.render(report, worst, every_problem))
    if not report.ok:
        causes = report.causes()
        raise verify_mod.VerifyFailed(
            f"{out}: verification failed, {plural(len(causes), 'problem')}; first: {causes[0]}"
        )
    if problem := verify_mod.record_in_card(report, out):
        print(f"warning: {problem}", file=sys.stderr)


@command("out repo_id private revision commit_message create_pr token json_out")
def push(
    out: argument(Path, "OUT", "A complete fp8convert output directory."),
    repo_id: argument(str, "REPO_ID", "Hub repo to upload to (owner/name); created if needed."),
    private,
    revision: option(str | None, "--revision BRANCH", "Branch to push to (created from main if needed)."),
    commit_message: option(str | None, "--commit-message TEXT", "Commit title."),
    create_pr: option(
        bool,
        "--create-pr",
        "Open a pull request (against --revision, default main) instead of committing to the branch.",
    ),
    token,
    json_out,
):
    """Upload OUT to the Hub repo REPO_ID with its model card. Refuses an incomplete output; never
    uploads OUT/.fp8convert/. Rerunning an interrupted push resumes it. Uses --token, HF_TOKEN or the
    saved login.

    Examples:

      fp8convert push ./Qwen3-8B-FP8 me/Qwen3-8B-FP8

      fp8convert push ./llama-fp8 my-org/llama-fp8 --private --revision channel-scheme

      fp8convert push ./llama-fp8 their-org/llama-fp8 --create-pr       # a repo you may not write to directly
    """
    pushed = publish.push(out, repo_id, private, revision, commit_message, hub_token(token), create_pr)
    if pushed.left_out:
        print(f"note: not uploaded, as fp8convert did not write them: {', '.join(pushed.left_out)}", file=sys.stderr)
    if json_out:
        print_json({"out": str(out), "repo_id": repo_id, "revision": revision, **asdict(pushed)})
    elif create_pr and not pushed.pull_request:
        print_out(f"no pull request opened on {repo_id}: {out} holds nothing its branch does not ({pushed.url})")
    else:
        done = "opened a pull request on" if pushed.pull_request else f"pushed {out} to"
        print_out(f"{done} {repo_id}: {pushed.url}")


@command("out json_out token cache_dir")
def finalize(out: argument(Path, "OUT", "An output directory whose shards workers wrote."), json_out, token, cache_dir):
    """Check that every shard of OUT is present and complete (size and header), then write the index,
    config.json and model card. The plan is rebuilt from the source recorded in OUT/.fp8convert
    (headers only) and must be the one the workers used. Safe to run more than once.

    Examples:

      fp8convert finalize ./dsv3-fp8

      sbatch --dependency=afterok:$JOB scripts/slurm_finalize.sbatch ./dsv3-fp8
    """
    report = api.finalize_output(out, token=hub_token(token), cache_dir=cache_dir)
    if json_out:
        print_json(asdict(report))
    else:
        print_out(
            f"finalized {out}: {plural(report.shards, 'shard')}, {format_size(report.bytes_out)}, from {report.source}"
        )


@command("jobs task_index json_out quiet token cache_dir")
def batch(
    # \\[ keeps rich from reading [[job]] as markup
    jobs: argument(Path, "JOBS", "Jobs file: TOML with \\[\\[job]] tables, or JSON lines (docs/cluster.md)."),
    task_index: option(
        int | None,
        "--task-index N",
        "Run only job N (counting from 0). Default in a Slurm array: "
        "$SLURM_ARRAY_TASK_ID - $SLURM_ARRAY_TASK_MIN; elsewhere every job.",
    ),
    json_out,
    quiet: QUIET_REPORT,
    token,
    cache_dir,
):
    """Convert every model listed in JOBS, in order: finished outputs are skipped, a failed job does not
    stop the others, and a summary table (job, source, out, status, seconds, GB) ends the run. Exits 1
    if any job failed. The file is validated before any job starts.

    Examples:

      fp8convert batch jobs.toml

      fp8convert batch jobs.jsonl --task-index 2 --json

      sbatch --array=0-9 scripts/slurm_array.sbatch jobs.toml     # one job per array task
    """
    results = batch_mod.run_batch(
        jobs,
        task_index=task_index,
        progress=not quiet,
        token=hub_token(token),
        cache_dir=cache_dir,
        on_plan=lambda job, plan: print_warnings(plan, f"{batch_mod.job_title(job.index, job.name)}: "),
    )
    if json_out:
        print_json(batch_mod.summary(results))
    else:
        print_out(batch_mod.render(results))
    if failed := [r for r in results if r.status == "failed"]:
        raise FP8ConvertError(
            f"{jobs}: {len(failed)} of {plural(len(results), 'job')} failed (first: "
            f"{batch_mod.result_title(failed[0])}: {failed[0].error})"
        )
    sys.stdout.flush()
