"""What the commands share: their options (OPTIONS, declared once), help conventions, Settings, JSON output."""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from ..errors import FP8ConvertError, UsageError, first_line
from ..options import FORMATS, SCALE_FORMATS, SCHEMES, SETTING_NAMES, Settings, parse_recipe, parse_scheme


class _NoHelpPlaceholder:
    """-h/--help, like every flag, shows no type placeholder."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        option.metavar = ""
        return option


class Command(_NoHelpPlaceholder, TyperCommand):
    def collect_usage_pieces(self, ctx) -> list[str]:
        """The usage line names arguments as SRC OUT (typer prints {src} {out})."""
        arguments = [p for p in self.get_params(ctx) if p.param_type_name == "argument"]
        return [self.options_metavar, *(p.metavar if p.required else f"[{p.metavar}]" for p in arguments)]


class Group(_NoHelpPlaceholder, TyperGroup):
    pass


def option(kind, usage: str, help: str, default=None, **extra) -> tuple:
    """(type, default) of an option, written as its usage reads: '--scheme tensor|channel', '--quiet -q'. A
    last word that is no flag names the value; without one the option is a flag, off by default."""
    *names, value = usage.split()
    if value.startswith("-"):
        names, value = [*names, value], ""
    default = False if kind is bool else default
    return Annotated[kind, typer.Option(*names, metavar=value, help=help, **extra)], default


def argument(kind, metavar: str, help: str, default=inspect.Parameter.empty) -> tuple:
    """(type, default) of an argument: required without a default, which the help shows otherwise."""
    shown = default is not inspect.Parameter.empty
    return Annotated[kind, typer.Argument(metavar=metavar, show_default=shown, help=help)], default


def command(names: str):
    """Give the command the parameters `names`, in the help's order, as keywords: the function's own option()
    or argument() annotation where it has one, else the one of that name in OPTIONS."""

    def decorate(function):
        own = inspect.signature(function, eval_str=True).parameters
        params = []
        for name in names.split():
            given = own[name].annotation if name in own else inspect.Parameter.empty
            kind, default = OPTIONS[name] if given is inspect.Parameter.empty else given
            params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind))
        function.__signature__ = inspect.Signature(params)
        function.__annotations__ = {}  # typer reads the signature; the function's own are (type, default) pairs
        return function

    return decorate


OPTIONS = {
    "src": argument(str, "SRC", "Local checkpoint directory or Hub repo id (owner/name)."),
    "out": argument(Path, "OUT", "Output directory (created; must be empty, or a partial run of the same plan)."),
    "scheme": option(
        list[str] | None,
        "--scheme " + "|".join(SCHEMES),
        "Scale granularity: tensor (one per weight), channel (one per output row), block (one per 128x128 block) "
        "or mxfp8 (a power-of-two scale per 32 inputs of each row); nvfp4a16 and mxfp4a16 write 4-bit float "
        "weights with BF16 activations (mxfp8 and FP4: compressed-tensors only). llm-compressor's FP8, FP8_DYNAMIC, "
        "FP8_BLOCK, MXFP8, NVFP4A16 and MXFP4A16 name them too. Repeat it as PATTERN=SCHEME (a module pattern as "
        "--ignore takes) to give the modules it matches another scheme: a mixed recipe. Default: tensor.",
    ),
    "recipe": option(
        Path | None,
        "--recipe FILE",
        "A mixed recipe (TOML, or YAML for .yaml/.yml): `scheme` (the default), `schemes` (module pattern = "
        "scheme) and `ignore`; --scheme and --ignore add to it.",
    ),
    "scale_format": option(
        str,
        "--scale-format " + "|".join(SCALE_FORMATS),
        "Block scales: float (amax/448) or ue8m0 (each rounded up to a power of two, as DeepGEMM on "
        "Blackwell wants; the config says scale_fmt ue8m0).",
        "float",
    ),
    "format": option(
        str,
        "--format " + "|".join(FORMATS),
        "Output format: compressed-tensors, or fp8 (vLLM/DeepSeek native).",
        "compressed-tensors",
    ),
    "ignore": option(
        list[str] | None,
        "--ignore PATTERN",
        "Keep matching modules in high precision, on top of the defaults: exact module name, "
        "glob ('*.mlp.down_proj') or 're:' regex. Repeatable.",
    ),
    "target_tp": option(
        list[int] | None,
        "--target-tp N",
        "Tensor-parallel size to check against vLLM's splitting rules (block scales per rank, MoE "
        "intermediate size per rank); repeatable. Default: 1, 2, 4 and 8.",
    ),
    "device": option(
        str, "--device auto|cpu|cuda|cuda:N", "Where to compute: auto (CUDA when present), cpu, cuda or cuda:N.", "auto"
    ),
    "max_shard_size": option(str, "--max-shard-size SIZE", "Largest output shard, e.g. 5GB, 500MB.", "5GB"),
    "max_resident": option(
        str | None,
        "--max-resident SIZE",
        "Memory budget for one batch of tensors on the device (default 256MiB on CUDA, "
        "1GiB on CPU); larger layers are split, never inside a fused group.",
    ),
    "prefetch": option(
        str,
        "--prefetch SIZE",
        "How far the page-cache read-ahead may run ahead of the converter (e.g. 8GiB); 0 turns it off. "
        "Default auto: half the memory available at the start (within the job's cgroup limit), shared by "
        "the run's workers, at most 32GiB. Page cache is reclaimable, but it counts in some job memory limits.",
        "auto",
    ),
    "revision": option(str | None, "--revision REV", "Hub revision (branch, tag or commit) of SRC."),
    "json_out": option(
        bool, "--json", "Print a JSON document on stdout instead of text (an error object when the command fails)."
    ),
    "worker": option(
        str | None,
        "--worker K/N|auto",
        "Convert only worker K's share of N (output shards with index % N == K, counting from 0). Without "
        "it, torchrun and multi-task srun are detected; 'auto' also detects a Slurm array or a Kubernetes "
        "indexed Job. See docs/cluster.md.",
    ),
    "devices": option(
        str | None,
        "--devices LIST|all",
        "One worker process per device on this machine, e.g. cuda:0,cuda:1 or all (every GPU); cpu "
        "entries are allowed too.",
    ),
    "dtype": option(
        str | None,
        "--dtype bf16|fp16|fp32",
        "dtype of dequantized weights (default: the model's own, from config.json; bf16 when it names none).",
    ),
    "overwrite": option(
        bool, "--overwrite", "Replace an earlier fp8convert output in OUT (a folder holding other files is refused)."
    ),
    "push_to_hub": option(str | None, "--push-to-hub REPO_ID", "Then upload OUT to this Hub repo (created if needed)."),
    "stream_download": option(
        bool,
        "--stream-download",
        "Hub source: keep only a few source shards on disk, deleting each once "
        "converted (for models larger than the free disk).",
    ),
    "quiet": option(
        bool,
        "--quiet -q",
        "No progress output and no summary line (warnings and errors are still printed, and --json's document).",
    ),
    "private": option(bool, "--private", "Create the Hub repo as private (an existing repo keeps its visibility)."),
    "token": option(
        str | None,
        "--token TOKEN",
        "Hugging Face token for the Hub. Default: $HF_TOKEN, else the token saved by `hf auth login`.",
    ),
    "cache_dir": option(
        str | None,
        "--cache-dir DIR",
        "Where Hub downloads are cached. Default: $HF_HUB_CACHE, else $HF_HOME/hub, else "
        "~/.cache/huggingface/hub (huggingface_hub's own rule).",
    ),
    "write_unloadable": option(
        bool,
        "--write-unloadable",
        "Write the output even where vLLM cannot load it at any TP size (a fused block layer whose members "
        "do not end on 128-row blocks); refused by default. FP8CONVERT_WRITE_UNLOADABLE=1 does the same.",
    ),
    "base_model": option(
        str | None,
        "--base-model REPO_ID",
        "The Hub repo the model card names as base model (default: the source's repo id; set it for a local source).",
    ),
}
# verify's and batch's --quiet: they print no summary line to silence
QUIET_REPORT = option(bool, "--quiet -q", "No progress output (the result, warnings and errors are still printed).")


def hub_token(given: str | None) -> str | None:
    """The Hub token: --token, else HF_TOKEN, else None (huggingface_hub then uses the saved login)."""
    return given or os.environ.get("HF_TOKEN") or None


def settings_from(params: dict, **values) -> Settings:
    """The Settings a command's parameters name, with `values` on top. A parameter left at None, or a flag
    left off, takes the field's default: without --write-unloadable, $FP8CONVERT_WRITE_UNLOADABLE decides."""
    given = {k: v for k, v in params.items() if k in SETTING_NAMES and v is not None and v is not False}
    if "scheme" in params:
        given |= scheme_keywords(params["scheme"], params.get("recipe"), params.get("ignore"))
    return Settings(**{**given, **values, "token": hub_token(given.get("token"))})


def scheme_keywords(schemes: list[str] | None, recipe: Path | None, ignore: list[str] | None) -> dict:
    """The Settings keywords --scheme (a default and PATTERN=SCHEME rules), --recipe and --ignore give: the
    file's rules and patterns, then the command line's; a plain --scheme overrides the file's default."""
    schemes = schemes or []
    plain = [s for s in schemes if "=" not in s]
    if len(plain) > 1:
        raise UsageError(f"--scheme given twice ({', '.join(plain)}); rules are PATTERN=SCHEME")
    rules = parse_recipe([s for s in schemes if "=" in s])
    from_file = read_recipe(recipe) if recipe else {}
    return {
        "scheme": plain[0] if plain else from_file.get("scheme", "tensor"),
        "recipe": (*from_file.get("recipe", ()), *rules),
        "ignore": (*from_file.get("ignore", ()), *(ignore or ())),
    }


def read_recipe(path: Path) -> dict:
    """A recipe file (TOML, or YAML for .yaml/.yml) as Settings keywords: `recipe` from its `schemes` table, the
    default `scheme` and `ignore` patterns, each optional."""
    import tomllib  # here: only --recipe needs them

    import yaml

    language = "YAML" if str(path).endswith((".yaml", ".yml")) else "TOML"
    try:
        with open(path, "rb") as f:
            doc = yaml.safe_load(f) if language == "YAML" else tomllib.load(f)
    except OSError as e:
        raise UsageError(f"--recipe {path}: cannot read it ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise UsageError(f"--recipe {path}: not valid {language} ({first_line(e)})") from None
    if not isinstance(doc, dict) or not doc:
        raise UsageError(f"--recipe {path}: expected `scheme`, a `schemes` table or `ignore`")
    if unknown := sorted(set(doc) - {"scheme", "schemes", "ignore"}):
        raise UsageError(f"--recipe {path}: unknown key {unknown[0]!r} (known: scheme, schemes, ignore)")
    if not isinstance(doc.get("schemes", {}), dict):
        raise UsageError(f"--recipe {path}: expected a `schemes` table of module pattern = scheme")
    ignore = doc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise UsageError(f"--recipe {path}: `ignore` is a list of module patterns")
    keywords = {"recipe": parse_recipe(doc.get("schemes", {}), f"--recipe {path}"), "ignore": tuple(ignore)}
    if doc.get("scheme"):
        keywords["scheme"] = parse_scheme(doc["scheme"], f"--recipe {path}: scheme")
    return keywords


printed = SimpleNamespace(json=False)  # whether the command printed its JSON document: main() then prints no error


def print_out(text: str, what: str = "output", stderr: bool = False) -> None:
    """A command's result on stdout (`stderr`: there instead, beside a JSON document); a full disk under
    `> out.txt` or a closed pipe is one error line naming the stream, not a file the conversion wrote."""
    try:
        print(text, file=sys.stderr if stderr else sys.stdout)
    except OSError as e:
        raise FP8ConvertError(f"{'stderr' if stderr else 'stdout'}: cannot write the {what} ({e.strerror})") from e


def print_json(doc: dict) -> None:
    """A command's JSON document; "ok" leads it, true unless the document says otherwise (verify, batch)."""
    print_out(json.dumps({"ok": True, **doc}, indent=2), "JSON report")
    printed.json = True
