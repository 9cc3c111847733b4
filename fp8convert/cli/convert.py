"""quantize, dequantize, inspect and demo."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

from .. import api, publish
from ..errors import UsageError
from ..options import REPO_ID, SCHEMES, Settings
from ..plan.summary import describe, plan_warnings, render
from ..units import format_size, plural
from ._options import (
    BaseModel,
    CacheDir,
    Device,
    Devices,
    Dtype,
    Format,
    Ignore,
    Json,
    MaxResident,
    MaxShardSize,
    Out,
    Overwrite,
    Prefetch,
    Private,
    PushToHub,
    Quiet,
    Recipe,
    Revision,
    ScaleFormat,
    Scheme,
    Src,
    StreamDownload,
    TargetTp,
    Token,
    Worker,
    WriteUnloadable,
    argument,
    option,
    print_json,
    scheme_choice,
    settings_from,
)


def quantize(
    src: Src,
    out: Out,
    scheme: Scheme = None,
    recipe: Recipe = None,
    format: Format = "compressed-tensors",
    ignore: Ignore = None,
    device: Device = "auto",
    max_shard_size: MaxShardSize = "5GB",
    max_resident: MaxResident = None,
    overwrite: Overwrite = False,
    revision: Revision = None,
    json_out: Json = False,
    quiet: Quiet = False,
    push_to_hub: PushToHub = None,
    private: Private = False,
    stream_download: StreamDownload = False,
    worker: Worker = None,
    devices: Devices = None,
    prefetch: Prefetch = "auto",
    target_tp: TargetTp = None,
    scale_format: ScaleFormat = "float",
    token: Token = None,
    cache_dir: CacheDir = None,
    base_model: BaseModel = None,
    write_unloadable: WriteUnloadable = False,
):
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

      fp8convert quantize ./Qwen3-30B-A3B ./out --scheme block --scheme 're:.*mlp.experts.*=nvfp4a16'

      fp8convert quantize ./dsv3 ./dsv3-fp8 --format fp8 --scheme block --scale-format ue8m0

      fp8convert quantize ./Qwen3-30B-A3B ./out --scheme block --target-tp 4     # say what fails at TP 4

      fp8convert quantize Qwen/Qwen3-8B ./Qwen3-8B-FP8 --push-to-hub me/Qwen3-8B-FP8 --stream-download

      fp8convert quantize ./dsv3 ./dsv3-fp8 --devices all                # one process per GPU

      srun -n 8 fp8convert quantize ./dsv3 ./dsv3-fp8                    # 8 workers; the last one finalizes

      fp8convert quantize ./dsv3 ./dsv3-fp8 --worker 3/8                 # then: fp8convert finalize ./dsv3-fp8
    """
    settings = settings_from(locals(), **scheme_choice(scheme, recipe, ignore), progress=not quiet)
    _convert(src, out, settings, json_out, push_to_hub, private)


def dequantize(
    src: Src,
    out: Out,
    dtype: Dtype = None,
    device: Device = "auto",
    max_shard_size: MaxShardSize = "5GB",
    max_resident: MaxResident = None,
    overwrite: Overwrite = False,
    revision: Revision = None,
    json_out: Json = False,
    quiet: Quiet = False,
    push_to_hub: PushToHub = None,
    private: Private = False,
    stream_download: StreamDownload = False,
    worker: Worker = None,
    devices: Devices = None,
    prefetch: Prefetch = "auto",
    token: Token = None,
    cache_dir: CacheDir = None,
    base_model: BaseModel = None,
):
    """Convert the FP8 checkpoint SRC (native fp8 or compressed-tensors) to high precision in OUT:
    every FP8 weight becomes float32(codes) x scale rounded once to --dtype, scales and
    quantization_config are dropped, every other tensor is copied byte for byte. Rerunning the same
    command resumes an interrupted run.

    Examples:

      fp8convert dequantize deepseek-ai/DeepSeek-V3 ./DeepSeek-V3-BF16 --stream-download

      fp8convert dequantize ./Qwen3-8B-FP8 ./Qwen3-8B-BF16 --dtype bf16 --device cuda

      fp8convert inspect ./Qwen3-8B-FP8 --dequantize          # the plan, without reading weights
    """
    settings = settings_from(locals(), dequantize=True, progress=not quiet)
    _convert(src, out, settings, json_out, push_to_hub, private)


def _convert(src: str, out: Path, settings: Settings, json_out: bool, push_to_hub: str | None, private: bool) -> None:
    """Run a quantize or dequantize, print what it did, push it if asked."""
    if private and not push_to_hub:
        raise UsageError("--private applies only with --push-to-hub REPO_ID")
    if push_to_hub and not REPO_ID.match(push_to_hub):
        raise UsageError(f"--push-to-hub {push_to_hub}: not a Hub repo id (owner/name)")
    report = api.quantize(src, out, settings, on_plan=print_warnings)
    if json_out:
        print_json(asdict(report))
    elif settings.progress:  # not -q
        print(summary_line(report))
    if push_to_hub and report.complete:
        url = publish.push(out, push_to_hub, private=private, token=settings.token)
        print(f"pushed {out} to {push_to_hub}: {url}", file=sys.stderr if json_out else sys.stdout)
    elif push_to_hub:
        print(
            f"--push-to-hub: not from worker {report.worker}; the worker that finalizes {out} pushes it "
            f"(or run `fp8convert push {out} {push_to_hub}` after finalize)",
            file=sys.stderr,
        )


def print_warnings(the_plan, prefix: str = "") -> None:
    """The plan's warnings and notes on stderr, before anything is read; -q does not silence them."""
    for line in plan_warnings(the_plan):
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
            f"worker {report.worker}: wrote {report.shards_written} of {plural(report.shards, 'shard')} of "
            f"{out} in {report.seconds:.1f}s on {report.device}; the worker that finds every shard written "
            f"finalizes the output (rank 0 under torchrun), or run `fp8convert finalize {out}` once every "
            "worker is done"
        )
    # written before this run began: by an earlier run of it, or (in a split) by the other workers
    before = f", {report.shards_resumed} already written" if report.shards_resumed else ""
    if report.units_resumed:  # in partial shards an earlier run left: the units it had written are kept
        before += f", resumed: {report.units_resumed} of {plural(report.units, 'unit')} already written"
    return (
        f"wrote {report.out_dir}: {plural(report.shards, 'shard')}{before}, {done_text(report)}, "
        f"{format_size(report.bytes_in)} -> {format_size(report.bytes_out)} in {report.seconds:.1f}s on "
        f"{report.device}"
    )


def done_text(report: api.Report) -> str:
    """What happened to the tensors, e.g. '120 FP8 weights dequantized, 35 kept'."""
    if report.dequantize:
        kind = "FP4" if " FP4 weights" in (report.source_quantization or "") else "FP8"
        return f"{plural(report.tensors_dequantized, kind + ' weight')} dequantized, {report.tensors_kept} kept"
    parts = [f"{plural(report.tensors_quantized, 'tensor')} quantized"]
    if report.source_quantization:
        quantized_here = report.tensors_quantized - report.tensors_requantized - report.tensors_passed_through
        parts = [
            f"{plural(report.tensors_passed_through, 'FP8 weight')} passed through",
            f"{report.tensors_requantized} requantized",
        ]
        parts += [f"{quantized_here} quantized"] if quantized_here else []
        parts.append(f"{report.tensors_dequantized} dequantized")
    return ", ".join(parts + [f"{report.tensors_kept} kept"])


# What `inspect --tensors` says becomes of a tensor, by action; {} is the plan's reason.
ACTION_TEXT = {
    "quantize": "fp8",
    "pass": "fp8 (passed through)",
    "requantize": "fp8 (requantized)",
    "dequantize": "dequantize ({})",
}


def inspect(
    src: Src,
    scheme: Scheme = None,
    recipe: Recipe = None,
    format: Format = "compressed-tensors",
    ignore: Ignore = None,
    device: Device = "auto",
    max_shard_size: MaxShardSize = "5GB",
    max_resident: MaxResident = None,
    revision: Revision = None,
    json_out: Json = False,
    target_tp: TargetTp = None,
    scale_format: ScaleFormat = "float",
    tensors: option(bool, "--tensors", "Also list every tensor and what becomes of it.") = False,
    dequantize: option(
        bool, "--dequantize", "Plan `fp8convert dequantize` of an FP8 SRC instead of a quantize."
    ) = False,
    dtype: Dtype = None,
    token: Token = None,
    cache_dir: CacheDir = None,
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
    settings = settings_from(locals(), **scheme_choice(scheme, recipe, ignore))
    the_plan = api.make_plan(src, settings)
    from ..run.device import budget_for, resolve_device

    dev = resolve_device(device)
    budget = budget_for(dev, settings.max_resident)
    info = describe(the_plan, budget, dev.type)
    given = next((s for s in scheme or () if "=" not in s), None)
    if given and given != settings.scheme and not dequantize:  # an alias or another case: say which it means
        info["scheme_given"] = given
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
    print(render(info))
    for t in info.get("tensor_plan", []):
        what = ACTION_TEXT.get(t["action"], "keep ({})").format(t["reason"])
        origin = f"  <- {t['from']}" if t["from"] else ""
        print(f"  {t['name']:<70} {str(t['shape']):<16} {what}{origin}")


def demo(
    directory: argument(Path, "DIR", "Where to put the demo model and its FP8 conversion.", show_default=True) = Path(
        "fp8convert-demo"
    ),
    scheme: option(str, "--scheme " + "|".join(SCHEMES), "The scheme of the conversion (see quantize).") = "tensor",
    format: Format = "compressed-tensors",
    device: Device = "auto",
    json_out: Json = False,
):
    """Build a small random Llama-shaped BF16 model (embedded, no download) in DIR/source and convert it
    to DIR/fp8.

    Example:

      fp8convert demo /tmp/fp8demo
    """
    from ..demo import demo_source, next_steps
    from ..run import startup_pages, warmup

    src = demo_source(directory / "source")
    text_to = sys.stderr if json_out else sys.stdout
    print(f"built demo model {src}", file=text_to)
    quantize(
        str(src), directory / "fp8", scheme=scheme, format=format, device=device, overwrite=True, json_out=json_out
    )
    # Building the model imported torch before the conversion, which then records no start-up pages (a
    # caller's process maps much else); this process is the program's own, so it leaves the record, and
    # the first real conversion on this device starts torch as every later one does.
    startup_pages.record(warmup.record_path(device))
    print(next_steps(src, directory / "fp8", scheme, format), file=text_to)
