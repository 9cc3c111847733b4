"""Option aliases shared by the commands, defined once so every command spells them the same way, and
the help conventions of every command (-h, usage `SRC OUT`, no type placeholders after flags)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from ..options import FORMATS, SCALE_FORMATS, SCHEMES, SETTING_NAMES, Settings


class _NoHelpPlaceholder:
    """-h/--help, like every flag, shows no type placeholder."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


class Command(_NoHelpPlaceholder, TyperCommand):
    def collect_usage_pieces(self, ctx) -> list[str]:
        """The usage line names arguments as SRC OUT (typer prints {src} {out})."""
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = (param.metavar or param.name).upper()
                pieces.append(name if param.required else f"[{name}]")
        return pieces


class Group(_NoHelpPlaceholder, TyperGroup):
    pass


def flag(*names: str, help: str) -> typer.models.OptionInfo:
    """An on/off option, shown without a <bool> placeholder."""
    return typer.Option(*names, help=help, metavar="")


Scheme = Annotated[
    str,
    typer.Option(
        "--scheme",
        metavar="|".join(SCHEMES),
        help="Scale granularity: tensor (one per weight), channel (one per output row), block (one per 128x128 "
        "block) or mxfp8 (a power-of-two scale per 32 inputs of each row; compressed-tensors only). "
        "llm-compressor's FP8, FP8_DYNAMIC and FP8_BLOCK name tensor, channel and block.",
    ),
]
ScaleFormat = Annotated[
    str,
    typer.Option(
        "--scale-format",
        metavar="|".join(SCALE_FORMATS),
        help="Block scales: float (amax/448) or ue8m0 (each rounded up to a power of two, as DeepGEMM on "
        "Blackwell wants; the config says scale_fmt ue8m0).",
    ),
]
Format = Annotated[
    str,
    typer.Option(
        "--format", metavar="|".join(FORMATS), help="Output format: compressed-tensors, or fp8 (vLLM/DeepSeek native)."
    ),
]
Ignore = Annotated[
    list[str] | None,
    typer.Option(
        "--ignore",
        metavar="PATTERN",
        help="Keep matching modules in high precision, on top of the defaults: exact module name, "
        "glob ('*.mlp.down_proj') or 're:' regex. Repeatable.",
    ),
]
TargetTp = Annotated[
    list[int] | None,
    typer.Option(
        "--target-tp",
        metavar="N",
        help="Tensor-parallel size to check against vLLM's splitting rules (block scales per rank, MoE "
        "intermediate size per rank); repeatable. Default: 1, 2, 4 and 8.",
    ),
]
Device = Annotated[
    str,
    typer.Option(
        "--device",
        metavar="auto|cpu|cuda|cuda:N",
        help="Where to compute: auto (CUDA when present), cpu, cuda or cuda:N.",
    ),
]
MaxShardSize = Annotated[
    str, typer.Option("--max-shard-size", metavar="SIZE", help="Largest output shard, e.g. 5GB, 500MB.")
]
MaxResident = Annotated[
    str | None,
    typer.Option(
        "--max-resident",
        metavar="SIZE",
        help="Memory budget for one batch of tensors on the device (default 256MiB on CUDA, "
        "1GiB on CPU); larger layers are split, never inside a fused group.",
    ),
]
Prefetch = Annotated[
    str,
    typer.Option(
        "--prefetch",
        metavar="SIZE",
        help="How far the page-cache read-ahead may run ahead of the converter (e.g. 8GiB); 0 turns it off. "
        "Default auto: half the memory available at the start (within the job's cgroup limit), shared by "
        "the run's workers, at most 32GiB. Page cache is reclaimable, but it counts in some job memory limits.",
    ),
]
Revision = Annotated[
    str | None, typer.Option("--revision", metavar="REV", help="Hub revision (branch, tag or commit) of SRC.")
]
Json = Annotated[
    bool,
    flag("--json", help="Print a JSON document on stdout instead of text (an error object when the command fails)."),
]
Worker = Annotated[
    str | None,
    typer.Option(
        "--worker",
        metavar="K/N|auto",
        help="Convert only worker K's share of N (output shards with index % N == K, counting from 0). Without "
        "it, torchrun and multi-task srun are detected; 'auto' also detects a Slurm array or a Kubernetes "
        "indexed Job. See docs/cluster.md.",
    ),
]
Devices = Annotated[
    str | None,
    typer.Option(
        "--devices",
        metavar="LIST|all",
        help="One worker process per device on this machine, e.g. cuda:0,cuda:1 or all (every GPU); cpu "
        "entries are allowed too.",
    ),
]
Dtype = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        metavar="bf16|fp16|fp32",
        help="dtype of dequantized weights (default: the model's own, from config.json; bf16 when it names none).",
    ),
]
Overwrite = Annotated[
    bool,
    flag("--overwrite", help="Replace an earlier fp8convert output in OUT (a folder holding other files is refused)."),
]
PushToHub = Annotated[
    str | None,
    typer.Option("--push-to-hub", metavar="REPO_ID", help="Then upload OUT to this Hub repo (created if needed)."),
]
StreamDownload = Annotated[
    bool,
    flag(
        "--stream-download",
        help="Hub source: keep only a few source shards on disk, deleting each once "
        "converted (for models larger than the free disk).",
    ),
]
Quiet = Annotated[
    bool,
    flag(
        "--quiet",
        "-q",
        help="No progress output and no summary line (warnings and errors are still printed, and --json's document).",
    ),
]
QuietReport = Annotated[
    bool, flag("--quiet", "-q", help="No progress output (the result, warnings and errors are still printed).")
]
Private = Annotated[
    bool, flag("--private", help="Create the Hub repo as private (an existing repo keeps its visibility).")
]
Token = Annotated[
    str | None,
    typer.Option(
        "--token",
        metavar="TOKEN",
        help="Hugging Face token for the Hub. Default: $HF_TOKEN, else the token saved by `hf auth login`.",
    ),
]
CacheDir = Annotated[
    str | None,
    typer.Option(
        "--cache-dir",
        metavar="DIR",
        help="Where Hub downloads are cached. Default: $HF_HUB_CACHE, else $HF_HOME/hub, else "
        "~/.cache/huggingface/hub (huggingface_hub's own rule).",
    ),
]


Src = Annotated[
    str,
    typer.Argument(metavar="SRC", show_default=False, help="Local checkpoint directory or Hub repo id (owner/name)."),
]
Out = Annotated[
    Path,
    typer.Argument(
        metavar="OUT",
        show_default=False,
        help="Output directory (created; must be empty, or a partial run of the same plan).",
    ),
]
WriteUnloadable = Annotated[
    bool,
    flag(
        "--write-unloadable",
        help="Write the output even where vLLM cannot load it at any TP size (a fused block layer whose members "
        "do not end on 128-row blocks); refused by default. FP8CONVERT_WRITE_UNLOADABLE=1 does the same.",
    ),
]
BaseModel = Annotated[
    str | None,
    typer.Option(
        "--base-model",
        metavar="REPO_ID",
        help="The Hub repo the model card names as base model (default: the source's repo id; set it for a "
        "local source).",
    ),
]


def token(given: str | None = None) -> str | None:
    """The Hub token: --token, else HF_TOKEN, else None (huggingface_hub then uses the saved login)."""
    return given or os.environ.get("HF_TOKEN") or None


def settings_from(params: dict, **values) -> Settings:
    """The Settings a command's parameters (its `locals()`) name by field name, with `values` on top. A
    parameter left at None, or a flag left off, takes the field's default, so without --write-unloadable
    $FP8CONVERT_WRITE_UNLOADABLE still decides; the token is --token, else $HF_TOKEN."""
    given = {k: v for k, v in params.items() if k in SETTING_NAMES and v is not None and v is not False}
    return Settings(**{**given, **values, "token": token(given.get("token"))})
