"""verify: check an FP8 checkpoint against its source, structure and numbers."""

from __future__ import annotations

import sys
from pathlib import Path

from ..units import plural
from ._options import (
    CacheDir,
    Device,
    Json,
    MaxResident,
    Prefetch,
    QuietReport,
    Revision,
    Token,
    argument,
    option,
    print_json,
    token,
)


def verify(
    src: argument(str, "SRC", "The source checkpoint: directory or Hub repo id."),
    out: argument(Path, "OUT", "The FP8 checkpoint to check."),
    revision: Revision = None,
    json_out: Json = False,
    worst: option(int, "--worst N", "How many of the worst tensors to list.", min=0) = 10,
    every_problem: option(bool, "--all", "List every problem found, not one line per cause.") = False,
    device: Device = "auto",
    max_resident: MaxResident = None,
    prefetch: Prefetch = "auto",
    quiet: QuietReport = False,
    hub_token: Token = None,
    cache_dir: CacheDir = None,
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
    from .. import verify as verify_mod

    report = verify_mod.verify(
        src,
        out,
        revision=revision,
        token=token(hub_token),
        cache_dir=cache_dir,
        device=device,
        max_resident=max_resident,
        prefetch=prefetch,
        progress=not quiet,
    )
    if json_out:
        print_json(report.to_dict(worst))
    else:
        print(verify_mod.render(report, worst, every_problem))
    if report.ok:
        if problem := verify_mod.record_in_card(report, out):
            print(f"warning: {problem}", file=sys.stderr)
    else:
        causes = report.causes()
        raise verify_mod.VerifyFailed(
            f"{out}: verification failed, {plural(len(causes), 'problem')}; first: {causes[0]}"
        )
