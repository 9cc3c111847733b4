"""quantize, inspect and demo."""
from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import api, publish
from ..errors import FP8ConvertError
from ..options import REPO_ID, Settings
from ..plan.summary import compatibility_warnings, describe, render
from ..units import format_size, plural
from ._options import (CacheDir, Command, Device, Devices, Format, Ignore, Json, MaxResident, MaxShardSize, Prefetch,
                       Private, Quiet, Revision, Scheme, Token, Worker, flag, token)
from ._output import print_json

Src = Annotated[str, typer.Argument(metavar="SRC", show_default=False,
                                    help="Local checkpoint directory or Hub repo id (owner/name).")]
Out = Annotated[Path, typer.Argument(metavar="OUT", show_default=False,
                                     help="Output directory (created; must be empty, or a partial run of the same "
                                          "plan).")]


def quantize(
    src: Src, out: Out, scheme: Scheme = "tensor", format: Format = "compressed-tensors", ignore: Ignore = None,
    device: Device = "auto", max_shard_size: MaxShardSize = "5GB", max_resident: MaxResident = None,
    overwrite: Annotated[bool, flag("--overwrite", help="Replace an earlier fp8convert output in OUT (a folder "
                                                        "holding other files is refused).")] = False,
    revision: Revision = None, json_out: Json = False,
    quiet: Quiet = False,
    push_to_hub: Annotated[Optional[str], typer.Option(
        "--push-to-hub", metavar="REPO_ID", help="Then upload OUT to this Hub repo (created if needed).")] = None,
    private: Private = False,
    stream_download: Annotated[bool, flag(
        "--stream-download", help="Hub source: keep only a few source shards on disk, deleting each once "
                                  "converted (for models larger than the free disk).")] = False,
    worker: Worker = None, devices: Devices = None, prefetch: Prefetch = "8GiB",
    hub_token: Token = None, cache_dir: CacheDir = None,
    base_model: Annotated[Optional[str], typer.Option(
        "--base-model", metavar="REPO_ID",
        help="The Hub repo the model card names as base model (default: the source's repo id; set it for a "
             "local source).")] = None,
):
    """Convert SRC to FP8 in OUT. Rerunning the same command resumes an interrupted run.

    Examples:

      fp8convert quantize Qwen/Qwen3-8B ./Qwen3-8B-FP8

      fp8convert quantize ./llama --scheme channel --ignore 're:.*down_proj' ./llama-fp8

      fp8convert quantize ./dsv3 ./dsv3-fp8 --format fp8 --scheme block --device cuda:1

      fp8convert quantize Qwen/Qwen3-8B ./Qwen3-8B-FP8 --push-to-hub me/Qwen3-8B-FP8 --stream-download

      fp8convert quantize ./dsv3 ./dsv3-fp8 --devices all                # one process per GPU

      srun -n 8 fp8convert quantize ./dsv3 ./dsv3-fp8                    # 8 workers; the last one finalizes

      fp8convert quantize ./dsv3 ./dsv3-fp8 --worker 3/8                 # then: fp8convert finalize ./dsv3-fp8
    """
    if private and not push_to_hub:
        raise FP8ConvertError("--private applies only with --push-to-hub REPO_ID")
    if push_to_hub and not REPO_ID.match(push_to_hub):
        raise FP8ConvertError(f"--push-to-hub {push_to_hub}: not a Hub repo id (owner/name)")

    def show_warnings(the_plan):
        if not quiet:
            for line in [w.text for w in compatibility_warnings(the_plan)] + the_plan.notes:
                print(f"warning: {line}", file=sys.stderr)

    settings = Settings(scheme=scheme, format=format, ignore=tuple(ignore or ()), device=device,
                        max_shard_size=max_shard_size, max_resident=max_resident, overwrite=overwrite,
                        revision=revision, token=token(hub_token), cache_dir=cache_dir, progress=not quiet,
                        stream_download=stream_download, worker=worker, devices=devices, prefetch=prefetch,
                        base_model=base_model)
    report = api.quantize(src, out, settings, on_plan=show_warnings)
    if json_out:
        print_json(asdict(report))
    elif report.already_complete:
        print(f"{out}: already complete (same plan); nothing to do")
    elif not report.complete:
        print(f"worker {report.worker}: wrote {report.shards_written} of {plural(report.shards, 'shard')} of {out} "
              f"in {report.seconds:.1f}s on {report.device}; the worker that finds every shard written finalizes "
              f"the output (rank 0 under torchrun), or run `fp8convert finalize {out}` once every worker is done")
    else:
        print(summary_line(report))
    if push_to_hub and report.complete:
        url = publish.push(out, push_to_hub, private=private, token=token(hub_token))
        print(f"pushed {out} to {push_to_hub}: {url}", file=sys.stderr if json_out else sys.stdout)
    elif push_to_hub:
        print(f"--push-to-hub: not from worker {report.worker}; the worker that finalizes {out} pushes it "
              f"(or run `fp8convert push {out} {push_to_hub}` after finalize)", file=sys.stderr)


def summary_line(report: api.Report) -> str:
    """'wrote OUT: 1 shard, 28 tensors quantized, 11 kept, 6.32 MB -> 3.86 MB in 0.9s on cpu'."""
    resumed = f", {report.shards_resumed} resumed" if report.shards_resumed else ""
    return (f"wrote {report.out_dir}: {plural(report.shards, 'shard')}{resumed}, "
            f"{plural(report.tensors_quantized, 'tensor')} quantized, {report.tensors_kept} kept, "
            f"{format_size(report.bytes_in)} -> {format_size(report.bytes_out)} in {report.seconds:.1f}s on "
            f"{report.device}")


def inspect(
    src: Src, scheme: Scheme = "tensor", format: Format = "compressed-tensors", ignore: Ignore = None,
    device: Device = "auto", max_shard_size: MaxShardSize = "5GB", max_resident: MaxResident = None,
    revision: Revision = None, json_out: Json = False,
    tensors: Annotated[bool, flag("--tensors", help="Also list every tensor and what becomes of it.")] = False,
    hub_token: Token = None, cache_dir: CacheDir = None,
):
    """Print the plan without reading tensor data: what is quantized, what is kept and why, fused
    groups, output size, shard count, and estimated peak memory.

    Examples:

      fp8convert inspect meta-llama/Llama-3.1-8B-Instruct

      fp8convert inspect ./Qwen3-30B-A3B --scheme block --json
    """
    settings = Settings(scheme=scheme, format=format, ignore=tuple(ignore or ()), max_shard_size=max_shard_size,
                        device=device, max_resident=max_resident, revision=revision, token=token(hub_token),
                        cache_dir=cache_dir)
    the_plan = api.make_plan(src, settings)
    from ..run.device import budget_for, resolve_device
    dev = resolve_device(device)
    budget = budget_for(dev, settings.max_resident)
    info = describe(the_plan, budget, dev.type)
    if tensors:
        info["tensor_plan"] = [{"name": t.name, "shape": list(t.source.shape), "dtype": t.source.dtype,
                                "quantize": t.quantize, "reason": t.reason, "group": t.group}
                               for t in the_plan.tensors]
    if json_out:
        print_json(info)
        return
    print(render(info))
    if tensors:
        for t in info["tensor_plan"]:
            what = "fp8" if t["quantize"] else f"keep ({t['reason']})"
            print(f"  {t['name']:<70} {str(t['shape']):<16} {what}")


def demo(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="Where to put the demo model and its FP8 "
                                                                  "conversion.")] = Path("fp8convert-demo"),
    scheme: Scheme = "tensor", format: Format = "compressed-tensors", device: Device = "auto",
):
    """Build a small random Llama-shaped BF16 model (embedded, no download) in DIR/source and convert it
    to DIR/fp8.

    Example:

      fp8convert demo /tmp/fp8demo
    """
    from ..demo import make_demo_model
    src = make_demo_model(directory / "source")
    print(f"built demo model {src}")
    quantize(str(src), directory / "fp8", scheme=scheme, format=format, device=device, overwrite=True)


def register(app: typer.Typer) -> None:
    app.command(cls=Command)(quantize)
    app.command(cls=Command)(inspect)
    app.command(cls=Command)(demo)
