"""Option aliases shared by the commands, defined once so every command spells them the same way."""
from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

Scheme = Annotated[str, typer.Option(
    "--scheme", help="Scale granularity: tensor, channel (per output row), block (128x128) or mxfp8 (a power-of-two "
                     "scale per 32 inputs of each row; compressed-tensors only).")]
ScaleFormat = Annotated[str, typer.Option(
    "--scale-format", help="Block scales: float (amax/448) or ue8m0 (each rounded up to a power of two, as "
                           "DeepGEMM on Blackwell wants; the config says scale_fmt ue8m0).")]
Format = Annotated[str, typer.Option("--format", help="Output format: compressed-tensors or fp8 (vLLM/DeepSeek native).")]
Ignore = Annotated[Optional[list[str]], typer.Option(
    "--ignore", help="Keep matching modules in high precision, on top of the defaults: exact module name, "
                     "glob ('*.mlp.down_proj') or 're:' regex. Repeatable.")]
TargetTp = Annotated[Optional[list[int]], typer.Option(
    "--target-tp", metavar="N",
    help="Tensor-parallel size to check against vLLM's splitting rules (block scales per rank, MoE "
         "intermediate size per rank); repeatable. Default: 1, 2, 4 and 8.")]
Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
MaxShardSize = Annotated[str, typer.Option("--max-shard-size", help="Largest output shard, e.g. 5GB, 500MB.")]
MaxResident = Annotated[Optional[str], typer.Option(
    "--max-resident", help="Memory budget for one batch of tensors on the device (default 4GiB on CUDA, "
                           "1GiB on CPU); larger layers are split, never inside a fused group.")]
Prefetch = Annotated[str, typer.Option(
    "--prefetch", help="How far the page-cache read-ahead may run ahead of the converter (e.g. 8GiB); "
                       "0 turns it off. Page cache is reclaimable, but it counts in some job memory limits.")]
Revision = Annotated[Optional[str], typer.Option("--revision", help="Hub revision (branch, tag or commit) of SRC.")]
Json = Annotated[bool, typer.Option("--json", help="Print a JSON document instead of text.")]
Worker = Annotated[Optional[str], typer.Option(
    "--worker", metavar="K/N|auto",
    help="Convert only worker K's share of N (output shards with index % N == K, counting from 0). Without "
         "it, torchrun and multi-task srun are detected; 'auto' also detects a Slurm array or a Kubernetes "
         "indexed Job. See docs/cluster.md.")]
Devices = Annotated[Optional[str], typer.Option(
    "--devices", metavar="LIST|all",
    help="One worker process per device on this machine, e.g. cuda:0,cuda:1 or all (every GPU); cpu "
         "entries are allowed too.")]
Dtype = Annotated[Optional[str], typer.Option(
    "--dtype", metavar="bf16|fp16|fp32",
    help="dtype of dequantized weights (default: the model's own, from config.json; bf16 when it names none).")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace whatever OUT holds.")]
PushToHub = Annotated[Optional[str], typer.Option(
    "--push-to-hub", metavar="REPO_ID", help="Then upload OUT to this Hub repo (created if needed).")]
StreamDownload = Annotated[bool, typer.Option(
    "--stream-download", help="Hub source: keep only a few source shards on disk, deleting each once "
                              "converted (for models larger than the free disk).")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")]
Private = Annotated[bool, typer.Option("--private", help="Create the Hub repo as private (an existing repo keeps "
                                                         "its visibility).")]


def token() -> str | None:
    """The Hub token: HF_TOKEN, else None (huggingface_hub then uses the saved login)."""
    return os.environ.get("HF_TOKEN") or None
