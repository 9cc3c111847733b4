"""verify: check an FP8 checkpoint against its source, structure and numbers."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ._options import Json, Revision, token


def verify(
    src: Annotated[str, typer.Argument(help="The source checkpoint: directory or Hub repo id.", show_default=False)],
    out: Annotated[Path, typer.Argument(help="The FP8 checkpoint to check.", show_default=False)],
    revision: Revision = None, json_out: Json = False,
    worst: Annotated[int, typer.Option("--worst", help="How many of the worst tensors to list.")] = 10,
):
    """Check OUT against SRC, one tensor at a time: every source tensor accounted for, dtypes, shapes,
    finite positive scales, config, ignore list and index consistent, kept tensors byte-identical, and
    each quantized tensor within the e4m3 rounding bound (relative error and SNR listed, worst first).
    Exits 1 on any failure.

    Examples:

      fp8convert verify ./Qwen3-8B ./Qwen3-8B-FP8

      fp8convert verify meta-llama/Llama-3.1-8B-Instruct ./llama-fp8 --json
    """
    from .. import verify as verify_mod

    report = verify_mod.verify(src, out, revision=revision, token=token())
    if json_out:
        print(json.dumps(report.to_dict(worst), indent=2))
    else:
        print(verify_mod.render(report, worst))
    if report.ok:
        verify_mod.record_in_card(report, out)
    else:
        raise verify_mod.VerifyFailed(f"{out}: verification failed, {len(report.failures)} problem(s); "
                                      f"first: {report.failures[0]}")


def register(app: typer.Typer) -> None:
    app.command()(verify)
