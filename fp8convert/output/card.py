"""The model card (OUT/README.md): a YAML header linking the repo to its source on the Hub, what was done,
what stayed in high precision and why, the command that reproduces it, and how to load it."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml

from .._version import __version__
from ..options import REPO_ID, Format, Options, Scheme
from ..plan.summary import describe
from ..units import format_size, plural, size_text

# Fields copied from the source card's YAML header (license_name/link go with license "other").
COPIED_FIELDS = ("license", "license_name", "license_link", "library_name", "pipeline_tag", "language")
SCHEME_TEXT = {
    Scheme.TENSOR: "per-tensor: one float32 scale per weight (members of a fused q/k/v or gate/up group share one "
    "scale, so engines that fuse them need no re-quantization)",
    Scheme.CHANNEL: "per-channel: one float32 scale per output row",
    Scheme.BLOCK: "block: one float32 scale per 128x128 weight block",
    Scheme.MXFP8: "MXFP8: one power-of-two scale per 32 consecutive inputs of each row, stored as its E8M0 exponent "
    "byte (uint8)",
    Scheme.NVFP4A16: "NVFP4: 4-bit E2M1 values packed two a byte, one FP8 (e4m3) scale per 16 consecutive inputs of "
    "each row and one float32 global scale per weight, shared by the members of a fused q/k/v or gate/up set (vLLM "
    "runs each set as one GEMM with one global scale)",
    Scheme.MXFP4A16: "MXFP4: 4-bit E2M1 values packed two a byte, one power-of-two scale per 32 consecutive inputs of "
    "each row, stored as its E8M0 exponent byte (uint8)",
}
# How a dequantize computes each weight, by the source's scheme (q: the stored FP8 or FP4 value)
DEQUANTIZED_TEXT = {
    Scheme.TENSOR: "FP8 weights: w = float32(q) * scale, one scale per weight",
    Scheme.CHANNEL: "FP8 weights: w = float32(q) * scale, one scale per output row",
    Scheme.BLOCK: "FP8 weights: w = float32(q) * scale, one scale per 128x128 tile (edge tiles included)",
    Scheme.NVFP4A16: "FP4 weights: w = float32(q) * float32(scale) / global_scale, one scale per 16 inputs",
    Scheme.MXFP4A16: "FP4 weights: w = float32(q) * 2^e, one power of two per 32 inputs",
}
WEIGHTS_NAME = {Scheme.NVFP4A16: "NVFP4", Scheme.MXFP4A16: "MXFP4"}  # what the card calls them; else FP8
UE8M0_TEXT = "block: one float32 power-of-two (UE8M0) scale per 128x128 weight block, rounded up so no code overflows"
ACTIVATIONS_TEXT = {
    (Format.COMPRESSED_TENSORS, Scheme.TENSOR): "dynamic per-tensor FP8",
    (Format.COMPRESSED_TENSORS, Scheme.CHANNEL): "dynamic per-token FP8",
    (Format.COMPRESSED_TENSORS, Scheme.BLOCK): "dynamic per-group (128) FP8",
    (Format.COMPRESSED_TENSORS, Scheme.MXFP8): "dynamic MXFP8 (groups of 32) on GPUs with MXFP8 GEMMs (Blackwell); "
    "BF16 with weight-only kernels on earlier GPUs",
    (Format.COMPRESSED_TENSORS, Scheme.NVFP4A16): "not quantized: 16-bit (weight-only quantization)",
    (Format.COMPRESSED_TENSORS, Scheme.MXFP4A16): "not quantized: 16-bit (weight-only quantization)",
    (Format.FP8, Scheme.TENSOR): "dynamic FP8",
    (Format.FP8, Scheme.BLOCK): "dynamic per-group (128) FP8",
}
DEFAULT_MAX_SHARD = Options().max_shard_size
DTYPE_TEXT = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
SNAPSHOT = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")  # a Hub cache snapshot directory
# What the card's transformers snippet needs installed, by format (checked with transformers 5.24: the fp8
# format needs accelerate even without a device_map; compressed-tensors needs only its own package).
TRANSFORMERS_NEEDS = {
    Format.COMPRESSED_TENSORS: "transformers compressed-tensors",
    Format.FP8: "transformers accelerate",
}
# Marks a generated card and records the local path its examples use, so `push` can put the repo id there.
TARGET_MARK = "<!-- fp8convert card; examples use: {} -->"
VERIFICATION = re.compile(r"^## Verification\n.*?(?=^## |^<!-- fp8convert card|\Z)", re.M | re.S)


def weights_names(info: dict) -> list[str]:
    """What the card calls the weights: 'FP8', 'NVFP4', or both for a recipe that mixes them (the schemes
    weights were written in, where the plan says; a rule whose modules all stayed high precision adds none)."""
    schemes = [info["scheme"], *(s for _, s in info.get("recipe") or ())]
    schemes = [s for s in schemes if s in by] if (by := info.get("quantized_by_scheme")) else schemes
    return list(dict.fromkeys(WEIGHTS_NAME.get(s, "FP8") for s in schemes))


def read_source_card(root: str | Path) -> str | None:
    """The source checkpoint's README.md (never copied to the output: the new card replaces it)."""
    path = Path(root) / "README.md"
    try:
        return path.read_text(encoding="utf-8") if path.is_file() else None
    except (OSError, UnicodeDecodeError):
        return None


def split_front_matter(text: str | None) -> tuple[dict, str]:
    """(YAML header as a dict, body) of a model card; ({}, text) when it has none or it is unreadable."""
    if not text:
        return {}, ""
    m = re.match(r"\A\ufeff?---[ \t]*\r?\n(.*?)(?:\r?\n)?^---[ \t]*(?:\r?\n|\Z)", text, re.S | re.M)
    if not m:
        return {}, text
    try:
        data = yaml.safe_load(m.group(1)) or {}
    except yaml.YAMLError:
        data = {}
    return (data if isinstance(data, dict) else {}), text[m.end() :]


def reproduce_command(info: dict, target: str, base_model: str | None) -> str:
    """The quantize (or dequantize) command line, sizes written as a user types them ('2GB', not 2000000000)."""
    source, dtype, size = str(info["source"]), info.get("dtype"), info.get("max_shard_size")
    if info.get("dequantize"):
        args = ["fp8convert", "dequantize", source, target] + (["--dtype", DTYPE_TEXT[dtype]] if dtype else [])
    else:
        args = ["fp8convert", "quantize", source, target, "--scheme", info["scheme"], "--format", info["format"]]
        for pattern, scheme in info.get("recipe") or ():
            args += ["--scheme", f"{pattern}={scheme}"]
        if info.get("scale_format", "float") != "float":
            args += ["--scale-format", info["scale_format"]]
    for pattern in info.get("ignore_patterns") or ():
        args += ["--ignore", pattern]
    if size and size != DEFAULT_MAX_SHARD:
        args += ["--max-shard-size", size_text(size)]
    if info.get("revision"):
        args += ["--revision", info["revision"]]
    if base_model:
        args += ["--base-model", base_model]
    return shlex.join(args)


def transformers_support(fmt: str, scheme: str, cannot_load: str | None) -> tuple[bool, str]:
    """Whether transformers loads this combination, and why not; `cannot_load`: the plan's own reason."""
    if cannot_load:
        return False, cannot_load
    if fmt == Format.FP8 and scheme == Scheme.TENSOR:
        return False, "transformers has no per-tensor `weight_scale` path for the fp8 format"
    return True, ""


def _fmt_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt_value(v) for v in value)
    return str(value)


def make_card(
    plan_or_info, source_card_text: str | None = None, repo_id: str | None = None, base_model: str | None = None
) -> str:
    """The README.md of a converted checkpoint, from its Plan or a describe()-like dict. The examples name
    `repo_id`, else ./NAME (`push` later puts the repo id there)."""
    if isinstance(plan_or_info, dict):
        info = plan_or_info
    else:  # a Plan: its summary plus what the reproduce command needs
        plan = plan_or_info
        info = {
            **describe(plan, 1 << 30, "cpu"),
            # a local source as an absolute path: the card's command then works from any folder
            **({"source": str(plan.source.root.resolve())} if plan.source.revision is None else {}),
            "ignore_patterns": list(plan.options.ignore),
            "max_shard_size": plan.options.max_shard_size,
            "revision": plan.source.revision,  # None for a local directory
            "root": str(plan.source.root),
            "dtype": plan.options.dtype,
            "source_scheme": plan.source_scheme,
        }
    source = str(info["source"])
    dequantized = bool(info.get("dequantize"))
    # the repo of a Hub cache snapshot given as a directory
    cached = f"{m[1]}/{m[2]}" if (m := SNAPSHOT.search((info.get("root") or source).replace("\\", "/"))) else None
    name = (repo_id or cached or source.rstrip("/")).rsplit("/", 1)[-1]
    if not repo_id:
        weights = info["scheme"].upper() if info.get("scheme") in WEIGHTS_NAME else "FP8"
        weights = "-".join(weights_names(info)) if info.get("recipe") else weights
        name = f"{name}-{info.get('dequantized_dtype') if dequantized else weights}"
    where = repo_id or f"./{name}"
    cmd = reproduce_command(info, where, base_model)  # the --base-model given, before the guesses below
    # --base-model, else a Hub source's repo id, else the cached snapshot's repo (the source card's own
    # base_model names the source's parent)
    if not base_model and info.get("revision") and REPO_ID.match(source):
        base_model = source
    base_model = base_model or cached
    body = [introduction(info, base_model), ""]
    body += dequantization_section(info) if dequantized else [*quantization_section(info), "", *kept_section(info)]
    lines = [front_matter(info, base_model, source_card_text), "", f"# {name}", "", *body]
    lines += ["", "## Reproduce", "", "```bash", cmd, "```", "", *use_section(info, where)]
    lines += ["", TARGET_MARK.format(where)]
    return "\n".join(lines).rstrip() + "\n"


def front_matter(info: dict, base_model: str | None, source_card_text: str | None) -> str:
    source_meta, _ = split_front_matter(source_card_text)
    meta: dict = {}
    dequantized = bool(info.get("dequantize"))
    if base_model:
        meta["base_model"] = base_model
        if not dequantized:  # the Hub has no relation for "dequantized from"
            meta["base_model_relation"] = "quantized"
    for key in COPIED_FIELDS:
        if source_meta.get(key) not in (None, "", []):
            meta[key] = source_meta[key]
    tags = (
        [DTYPE_TEXT.get(info.get("dequantized_dtype"), "bf16"), "dequantized"]
        if dequantized
        else [*(w.lower() for w in weights_names(info)), info["format"]]
    )
    meta["tags"] = list(dict.fromkeys(tags + ["fp8convert"]))
    header = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, default_flow_style=False)
    return f"---\n{header}---"


def introduction(info: dict, base_model: str | None) -> str:
    from_text = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else f"`{info['source']}`"
    at = f" at commit `{info['revision'][:12]}`" if info.get("revision") else ""
    if info.get("dequantize"):
        return (
            f"{info.get('dequantized_dtype')} weights dequantized from the "
            f"{'FP4' if ' FP4 weights' in str(info.get('source_quantization')) else 'FP8'} checkpoint {from_text}{at} "
            f"({info.get('source_quantization')}), converted offline with fp8convert {__version__}."
        )
    names = weights_names(info)
    weights = " and ".join("FP8 (e4m3)" if w == "FP8" else f"{w} (4-bit E2M1)" for w in names) + " weights"
    weights += ", chosen by module (a mixed recipe)," if len(names) > 1 else ""
    if "FP8" not in names:
        activations = "Activations stay in 16 bits, so no calibration data was used."
    elif len(names) > 1:
        activations = (
            "The FP8 layers' activations are quantized dynamically at run time and the FP4 layers' stay in "
            "16 bits, so no calibration data was used."
        )
    elif info.get("static_activations"):
        activations = "Activations use the static per-tensor scales the source was calibrated with."
    else:
        activations = "Activations are quantized dynamically at run time, so no calibration data was used."
    return f"{weights} of {from_text}{at}, converted offline with fp8convert {__version__}. {activations}"


def quantization_section(info: dict) -> list[str]:
    scheme, fmt = info["scheme"], info["format"]
    weights = UE8M0_TEXT if info.get("scale_format") == "ue8m0" else SCHEME_TEXT.get(scheme, scheme)
    activations = (
        "static per-tensor FP8 (the source's calibrated input_scale)"
        if info.get("static_activations")
        else ACTIVATIONS_TEXT.get((fmt, scheme), "dynamic FP8")
    )
    by_scheme = info.get("quantized_by_scheme")
    rules = [(p, s) for p, s in info.get("recipe") or () if not by_scheme or s in by_scheme]  # those that wrote weights
    lines = [
        "## Quantization",
        "",
        f"- Format: `{fmt}` (`quantization_config` in config.json)",
        f"- Weights{' (the modules no recipe rule matches)' if rules else ''}: {weights}",
        f"- Activations: {activations}",
        *(f"- Recipe: modules matching `{p}`: {SCHEME_TEXT.get(s, s)}" for p, s in rules),
    ]
    if by_scheme:
        lines.append("- Per scheme: " + ", ".join(f"{n} weights {s}" for s, n in by_scheme.items()))
    if q := info.get("quantized"):
        lines.append(
            f"- Quantized: {q['tensors']} linear weights, {format_size(q['bytes_in'])} -> "
            f"{format_size(q['bytes_out'])} with scales"
        )
    if info.get("source_quantization"):
        actions = info["actions"]
        lines.append(
            f"- Source: FP8 ({info['source_quantization']}): {actions['pass']} weights passed through with "
            f"their codes and scales unchanged, {actions['requantize']} requantized from their dequantized "
            f"values (float32(q) * scale), {actions['dequantize']} dequantized"
        )
    if info.get("bytes_in") and info.get("bytes_out"):
        lines.append(
            f"- Checkpoint: {format_size(info['bytes_in'])} -> {format_size(info['bytes_out'])} "
            f"({info['bytes_out'] / info['bytes_in']:.0%})"
        )
    return lines


def dequantization_section(info: dict) -> list[str]:
    dtype = info.get("dequantized_dtype")
    kept = info.get("kept") or {}
    dequantized = kept.get("dequantized", {"tensors": 0, "bytes": 0})
    lines = [
        "## Dequantization",
        "",
        f"- {dequantized['tensors']} {DEQUANTIZED_TEXT.get(info.get('source_scheme'), 'weights: w = q * scale')}, "
        f"rounded once to {dtype}: {format_size(dequantized['bytes'])}",
        "- Scale tensors, static activation scales and `quantization_config` removed",
        "- Every other tensor copied byte for byte:",
    ]
    lines += [
        f"  {k['tensors']} {reason} ({format_size(k['bytes'])})"
        for reason, k in kept.items()
        if reason != "dequantized"
    ]
    if info.get("bytes_in") and info.get("bytes_out"):
        lines.append(f"- Checkpoint: {format_size(info['bytes_in'])} -> {format_size(info['bytes_out'])}")
    return lines


def kept_section(info: dict) -> list[str]:
    kept = info.get("kept") or {}
    lines = ["### Kept in high precision", ""]
    if kept:
        lines += ["| reason | tensors | size |", "|---|---:|---:|"]
        lines += [f"| {reason} | {k['tensors']} | {format_size(k['bytes'])} |" for reason, k in kept.items()]
        lines.append("")
    ignore = info.get("ignore") or []
    lines.append(
        f"Engines skip the {plural(len(ignore), 'linear module')} listed in the config's ignore list"
        + (f" ({', '.join(f'`{m}`' for m in ignore[:8])}{', ...' if len(ignore) > 8 else ''})." if ignore else ".")
    )
    return lines


def use_section(info: dict, where: str) -> list[str]:
    """How to serve or load it: vLLM, SGLang (FP8), and transformers where it can."""
    vllm = ["```bash", f"vllm serve {shlex.quote(where)}", "```"]
    load = ["```python", "from transformers import AutoModelForCausalLM", ""]
    load += [f"model = AutoModelForCausalLM.from_pretrained({json.dumps(where)})", "```"]
    if info.get("dequantize"):
        intro = ["## Use", "", "A plain high-precision checkpoint:", "", *vllm, "", "transformers:", ""]
        return intro + ["```bash", "pip install transformers", "```", "", *load]
    names = weights_names(info)
    weights = " and ".join(names)
    lines = ["## Use", "", f"vLLM (reads the {weights} weights directly; no `--quantization` flag needed):", "", *vllm]
    if names == ["FP8"]:  # SGLang's compressed-tensors path has no weight-only FP4 scheme
        lines += ["", "SGLang:", "", "```bash", f"python -m sglang.launch_server --model-path {shlex.quote(where)}"]
        lines += ["```"]
    ok, why = transformers_support(info["format"], info["scheme"], info.get("transformers_cannot_load"))
    lines += ["", "transformers:", ""]
    if ok:
        lines += ["Loads with transformers, which dequantizes the weights on the CPU:", "", "```bash"]
        lines += [f"pip install {TRANSFORMERS_NEEDS[info['format']]}", "```", "", *load]
    else:
        lines += [f"Not loadable in transformers: {why.rstrip('.')}. Serve it with vLLM or SGLang."]
    if caveats := [w for w in info.get("warnings") or [] if w != why]:
        lines += ["", "Notes:", ""] + [f"- {w}" for w in caveats]
    return lines


def with_verification(text: str, figures: dict) -> str:
    """The card with its "## Verification" section set to `figures` (replaced, else put before "## Reproduce",
    else at the end)."""
    lines = ["## Verification", "", "Dequantized weights compared with the source (`fp8convert verify`):", ""]
    lines += ["| measure | value |", "|---|---|"]
    lines += [f"| {str(k).replace('_', ' ')} | {_fmt_value(v)} |" for k, v in figures.items()]
    return _with_section(text, "\n".join(lines) + "\n\n")


def keep_verification(old: str, new: str) -> str:
    """The card `new` with the Verification section of `old`, the card it replaces on the same shards."""
    return _with_section(new, m.group(0)) if (m := VERIFICATION.search(old)) else new


def _with_section(text: str, section: str) -> str:
    text = VERIFICATION.sub("", text)
    if m := re.search(r"^## Reproduce$", text, re.M):
        return text[: m.start()] + section + text[m.start() :]
    return text.rstrip() + "\n\n" + section
