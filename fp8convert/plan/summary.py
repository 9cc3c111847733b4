"""What `inspect` prints: the plan in numbers, estimated memory, and where the result will not load."""

from __future__ import annotations

import math
import re
from collections import Counter

from ..errors import FP8ConvertError
from ..options import BLOCK, Format, ScaleFormat, Scheme
from ..units import format_size, plural
from .batches import make_batches
from .family import GENERIC, MTP_LAYERS, MTP_MODULE, Caveat, Limit, PlanWarning, mtp_layers
from .parallel import tp_warnings
from .plan import COMPUTED, Action, Plan
from .rules import experts_of, is_linear_weight

CUDA_CONTEXT_HOST_BYTES = 1 << 30  # torch + CUDA runtime resident memory, roughly
PYTHON_HOST_BYTES = 400 << 20  # interpreter + torch on CPU, roughly
PINNED_HOST_BYTES = 9 * (32 << 20)  # pinned read chunks of 32 MiB: 8 reader threads and one more
FUSED_BLOCK_RULE = f"needs every member but the last to have an output size divisible by {BLOCK}"

# Where transformers cannot load an output of any family (the registry adds each family's own).
LIMITS = (
    Limit(
        Caveat.TRANSFORMERS_CANNOT_LOAD,
        "transformers cannot use fp8-format per-tensor checkpoints (vLLM and SGLang can): dense models load but "
        "ignore the scales and give wrong outputs, MoE models fail; use --format compressed-tensors to load it in "
        "transformers",
        formats=(Format.FP8,),
        schemes=(Scheme.TENSOR,),
    ),
    Limit(
        Caveat.TRANSFORMERS_CANNOT_LOAD,
        "transformers cannot load compressed-tensors block scales for MoE experts (vLLM can); use --format fp8 "
        "--scheme block, or --scheme channel, to load it in transformers",
        formats=(Format.COMPRESSED_TENSORS,),
        schemes=(Scheme.BLOCK,),
        experts=True,
    ),
    # transformers 5.24 integrations/compressed_tensors.py: CompressedTensorsDequantize decodes E8M0 only for
    # dense layers; its expert merge multiplies codes by the raw [out, in/32] bytes and fails on the shapes.
    Limit(
        Caveat.TRANSFORMERS_CANNOT_LOAD,
        "transformers cannot load MXFP8 MoE experts (its compressed-tensors expert path does not decode per-group "
        "E8M0 scales; dense MXFP8 layers load); vLLM can; use --scheme channel, or keep the experts with --ignore, "
        "to load it in transformers",
        schemes=(Scheme.MXFP8,),
        experts=True,
    ),
    # transformers 5.25 integrations/compressed_tensors.py merges NVFP4 experts without weight_global_scale.
    Limit(
        Caveat.TRANSFORMERS_MISREADS,
        "transformers dequantizes NVFP4 MoE experts without their global scale (transformers issue #48371): the "
        "model loads, but its experts' weights come out wrong (dense layers are right); vLLM reads them right",
        schemes=(Scheme.NVFP4A16,),
        experts=True,
    ),
)


def memory_estimate(plan: Plan, budget: int, device_type: str) -> dict:
    """Peak bytes: the device holds a batch plus float32 temporaries of the largest tensor; the host pinned
    chunks (CUDA) or the same as the device (CPU)."""
    batches = make_batches(plan.units, budget)
    largest_batch = max((b.in_bytes + b.out_bytes for b in batches), default=0)
    largest_tensor = max((math.prod(t.shape) for t in plan.tensors if t.action in COMPUTED), default=0)
    device = largest_batch + 9 * largest_tensor  # float32 copy, expanded scales, codes
    host = CUDA_CONTEXT_HOST_BYTES + PINNED_HOST_BYTES if device_type == "cuda" else PYTHON_HOST_BYTES + device
    return {"batches": len(batches), "largest_batch_bytes": largest_batch, "device_bytes": device, "host_bytes": host}


def compatibility_warnings(plan: Plan) -> list[PlanWarning]:
    """Combinations some consumer will refuse or read wrongly, each recipe scheme over its own tensors."""
    if plan.options.dequantize:  # no FP8 left
        return []
    fmt, arch = plan.options.format, plan.architecture or GENERIC
    by_scheme = {s: [t for t in plan.tensors if t.quantize and t.scheme == s] for s in plan.options.schemes}

    def limits(table: tuple[Limit, ...]) -> list[PlanWarning]:
        return [
            PlanWarning(x.caveat, x.text)
            for scheme, quantized in by_scheme.items()
            for x in table
            if x.covers(fmt, scheme) and (x.experts is False or any(experts_of(t.name) for t in quantized))
        ]

    warnings = limits(LIMITS)
    block = by_scheme.get(Scheme.BLOCK, [])  # readers assume whole 128x128 tiles, and vLLM one grid per fused layer
    if odd := [t.name for t in block if t.shape[0] % BLOCK or t.shape[1] % BLOCK]:
        odd = f"{len(odd)} quantized weights have a dim not divisible by {BLOCK} (e.g. {odd[0]})"
        if fmt == Format.FP8:
            what = "transformers infers the block size from the scale grid and dequantizes these wrongly"
            warnings.append(PlanWarning(Caveat.TRANSFORMERS_MISREADS, f"{odd}: {what}"))
        else:
            what = "transformers cannot load these (needs both dims divisible by 128)"
            warnings.append(PlanWarning(Caveat.TRANSFORMERS_CANNOT_LOAD, f"{odd}: {what}"))
    if why := unloadable(plan):
        warnings.append(PlanWarning(Caveat.VLLM_CANNOT_LOAD, why))
    warnings += limits(arch.limits)
    if arch.experts and any(t.cut for t in plan.tensors) and fmt not in arch.experts.transformers_loads_split:
        # transformers' conversion mapping merges no per-expert weights of this family, and its fused path
        # reads FP8 expert codes without their scales: no FP8 layout loads in both.
        elsewhere = arch.experts.transformers_loads_split
        where = f" in the {fmt} format (it can in {', '.join(elsewhere)})" if elsewhere else ""
        why = f"transformers cannot load {arch.name}'s experts written one weight per expert{where}: it loads the "
        why += "model without an error but with the experts randomly initialised; vLLM serves this layout"
        warnings.append(PlanWarning(Caveat.TRANSFORMERS_CANNOT_LOAD, why))
    for scheme, quantized in by_scheme.items():
        warnings += tp_warnings(quantized, plan.source.config, fmt, scheme, plan.options.target_tp)
    return list(dict.fromkeys(warnings))


def unloadable(plan: Plan) -> str | None:
    """Why vLLM cannot load the plan's block-FP8 fused layers at any TP size, or None: it loads each member
    at its row offset in one weight with one 128x128 scale grid, so every member but the last must end on
    a block boundary. MoE experts follow vLLM's MoE rules instead (parallel.py)."""
    quantized = [t for t in plan.tensors if t.quantize and t.scheme == Scheme.BLOCK]
    fused: dict[str, list] = {}
    for t in quantized:
        if t.group and not experts_of(t.name):
            fused.setdefault(t.group, []).append(t)
    broken = []  # (module, what it is, why, how to keep it)
    for group, members in fused.items():
        leaves = group.rsplit(".", 1)[-1]
        members.sort(key=lambda t: leaves.split("/").index(t.name.rsplit(".", 2)[-2]))
        if offending := [t for t in members[:-1] if t.shape[0] % BLOCK]:
            e = offending[0]
            why = f"its fused block GEMM {FUSED_BLOCK_RULE}, and these do not (e.g. {e.name} {list(e.shape)})"
            keep = f"the group in high precision with --ignore 're:.*\\.({leaves.replace('/', '|')})$'"
            broken.append((group, "group", why, keep))
    broken = broken or _unloadable_mamba2_in_proj(plan.tensors, quantized)
    if not broken:
        return None
    module, kind, why, keep = broken[0]
    others = f" and {plural(len(broken) - 1, f'more {kind}')} like it" if len(broken) > 1 else ""
    return (
        f"vLLM cannot load {module}{others} in the {plan.options.format} format's block scheme: {why}; use "
        f"--scheme channel or tensor, or keep {keep}"
    )


def _unloadable_mamba2_in_proj(tensors: list, quantized: list) -> list[tuple[str, str, str, str]]:
    """The same rule for a Mamba2 mixer's one in_proj tensor, which vLLM's MambaMixer2
    (layers/mamba/mamba_mixer2.py; granitemoehybrid, nemotron_h, falcon_h1, bamba, zamba2) loads as a
    merged layer of five members: gate and x (the mixer's width, out_proj's input, each), B and C
    (n_groups * d_state each), dt (one row per head, dt_bias's length)."""
    shapes = {t.name: t.shape for t in tensors}
    broken = []
    for t in quantized:
        mixer = t.name.removesuffix(".in_proj.weight")
        heads, out = shapes.get(f"{mixer}.dt_bias"), shapes.get(f"{mixer}.out_proj.weight")
        if not (heads and out):  # not a Mamba2 mixer's in_proj
            continue
        width, groups = out[1], (t.shape[0] - 2 * out[1] - heads[0]) // 2
        if width % BLOCK or groups % BLOCK:
            members = [width, width, groups, groups, heads[0]]
            why = f"it loads this Mamba2 in_proj as one fused block GEMM of gate, x, B, C and dt members {members}"
            keep = f"it in high precision with --ignore 're:.*\\.{mixer.rsplit('.', 1)[-1]}\\.in_proj$'"
            broken.append((mixer + ".in_proj", "layer", f"{why}, which {FUSED_BLOCK_RULE}", keep))
    return broken


def refuse_unloadable(plan: Plan) -> None:
    """Refuse an output vLLM cannot load even at TP 1 (fused block groups that break its rule)."""
    if not plan.options.dequantize and Scheme.BLOCK in plan.options.schemes and (why := unloadable(plan)):
        raise FP8ConvertError(f"{plan.source.label}: {why}; --write-unloadable writes it anyway")


def refuse_empty(plan: Plan) -> None:
    """Refuse an FP8 output without one FP8 weight: it converts nothing, and fp8convert refuses it as a source."""
    if plan.options.dequantize or any(t.quantize for t in plan.tensors):
        return
    kept = [t for t in plan.tensors if is_linear_weight(t.name, t.shape, t.source.dtype, t.reason)]
    why = "it has no linear weight"
    if kept:  # the reason most of them share, with one of them
        reason = Counter(t.reason for t in kept).most_common(1)[0][0]
        why = f"e.g. {next(t.name for t in kept if t.reason == reason)}: {reason}"
    raise FP8ConvertError(f"{plan.source.label}: no weight is quantized ({why}); nothing to write")


# Which GPUs vLLM 0.33's kernel selection runs each layout on (CompressedTensorsW8A8Fp8, FlashInfer MXFP8,
# Marlin, DeepGEMM), by --scale-format, or the MXFP8 and FP4 schemes.
VLLM_GPUS = {
    ScaleFormat.FLOAT: "FP8 GEMMs on SM89 and later (Ada, Hopper, Blackwell), weight-only Marlin kernels from SM75",
    Scheme.MXFP8: "MXFP8 GEMMs on Blackwell (SM100 and later), weight-only Marlin kernels (BF16 activations) on SM75 "
    "to SM90, Hopper included",
    ScaleFormat.UE8M0: "FP8 GEMMs on SM89 and later, weight-only Marlin kernels from SM75; DeepGEMM (SM90, SM100, "
    "SM120) takes the power-of-two block scales as written (its load-time rounding to powers of two changes no value)",
    Scheme.NVFP4A16: "weight-only FP4 GEMMs (BF16 activations): native kernels on Blackwell (SM100, SM103), Marlin "
    "kernels on SM75 to SM90 and SM120; not on vLLM's CPU build",
    Scheme.MXFP4A16: "weight-only Marlin kernels (BF16 activations) from SM75; on Blackwell (SM100 and later) vLLM's "
    "FlashInfer kernel quantizes activations to MXFP4 as well unless served with --linear-backend marlin; not on "
    "vLLM's CPU build",
}


def load_table(plan: Plan, warnings: list[PlanWarning], cannot: str | None) -> dict[str, str]:
    """Which engines (and, for vLLM, which GPUs) load this output; `cannot`: why transformers cannot."""
    options = plan.options
    if options.dequantize:  # a plain high-precision checkpoint: every consumer loads it
        return {}
    caveats = {w.caveat for w in warnings}
    layouts: dict[str, str] = {}  # vLLM's kernel family -> the first scheme using it
    for scheme in options.schemes:
        layouts.setdefault(scheme if scheme in VLLM_GPUS else options.scale_format, scheme)
    vllm = "no (see the warnings)"
    if Caveat.VLLM_CANNOT_LOAD not in caveats:
        tp = "; at some tensor-parallel sizes only (see the warnings)" if Caveat.VLLM_TP_LIMITS in caveats else ""
        gpus = [f"{s}: {VLLM_GPUS[layout]}" if len(layouts) > 1 else VLLM_GPUS[layout] for layout, s in layouts.items()]
        vllm = f"yes: {'; '.join(gpus)}{tp}"
    if cannot:
        transformers = "no: " + cannot
    elif Caveat.TRANSFORMERS_MISREADS in caveats:
        transformers = "loads, but dequantizes some weights wrongly (see the warnings)"
    else:
        package = "; needs the compressed-tensors package" if options.format == Format.COMPRESSED_TENSORS else ""
        transformers = "yes (dequantizes on load)" + package
    return {"vLLM": vllm, "transformers": transformers}


def describe(plan: Plan, budget: int, device_type: str) -> dict:
    tensors = plan.tensors
    warnings = compatibility_warnings(plan)
    cannot = next((w.text for w in warnings if w.caveat is Caveat.TRANSFORMERS_CANNOT_LOAD), None)
    kept_reasons, kept_bytes = Counter(), Counter()
    for t in tensors:
        if not t.quantize:  # by kind: a shape or input-dim reason without the tensor's own sizes
            reason = re.sub(r" \[[^\]]*\]| \(\d+\)", "", t.reason)
            kept_reasons[reason] += 1
            kept_bytes[reason] += t.out_bytes
    fused = dict.fromkeys(t.group for t in tensors if t.group and t.quantize)  # in plan order, unlike a set
    arch, model_type = plan.architecture, f"model_type {plan.source.config.get('model_type')!r}"
    quant = plan.source.quant
    return {
        "source": plan.source.label,
        "source_quantization": quant.describe() if quant else None,
        "dequantize": plan.options.dequantize,
        "actions": {a.value: sum(t.action is a for t in tensors) for a in Action},
        "dequantized_dtype": next((t.out_dtype for t in tensors if t.action is Action.DEQUANTIZE), None),
        "static_activations": plan.static_activations,
        "architecture": f"{arch.name} ({model_type})" if arch else f"not in the registry ({model_type}): generic rules",
        "scheme": plan.options.scheme,
        "recipe": plan.options.recipe,
        "quantized_by_scheme": dict(Counter(t.scheme for t in tensors if t.quantize)) if plan.options.recipe else {},
        "format": plan.options.format,
        "scale_format": plan.options.scale_format,
        "fingerprint": plan.fingerprint,
        "tensors": len(tensors),
        "units": len(plan.units),
        "quantized": {
            "tensors": sum(t.quantize for t in tensors),
            "bytes_in": sum(t.in_bytes for t in tensors if t.quantize),
            "bytes_out": sum(t.out_bytes for t in tensors if t.quantize),
        },
        "kept": {reason: {"tensors": n, "bytes": kept_bytes[reason]} for reason, n in kept_reasons.most_common()},
        "fused_groups": dict(Counter(key.rsplit(".", 1)[-1] for key in fused)),
        "scale_sharing": bool({Scheme.TENSOR, Scheme.NVFP4A16} & set(plan.options.schemes)),
        "bytes_in": plan.source.total_bytes,
        "bytes_out": plan.out_bytes,
        "shards": len(plan.shards),
        "split_experts": split_experts(plan),
        "mtp": mtp_summary(plan),
        "target_tp": list(plan.options.target_tp),
        "ignore": plan.ignore_list,
        "memory": memory_estimate(plan, budget, device_type),
        "warnings": plan.warnings,
        "transformers_cannot_load": cannot,
        "loads": load_table(plan, warnings, cannot),
        "notes": plan.notes,
    }


def split_experts(plan: Plan) -> list[str]:
    """Where the outputs of each fused expert tensor written one weight per expert come from."""
    cuts: dict[str, list] = {}
    for t in plan.tensors:
        if t.cut:
            cuts.setdefault(t.source.name, []).append(t)
    return [
        f"{name} {list(ts[0].source.shape)} -> {len(ts)} weights {list(ts[0].shape)} "
        f"(e.g. {ts[0].name} = {ts[0].cut.describe(name.rsplit('.', 1)[-1])})"
        for name, ts in cuts.items()
    ]


def mtp_summary(plan: Plan) -> str | None:
    """Where the MTP layers are and what became of them (None: the family has none)."""
    arch, names = plan.architecture, [t.name for t in plan.source.tensors]
    if arch is None or not arch.mtp:
        return None
    prefixes = mtp_layers(arch, plan.source.config) if arch.mtp == MTP_LAYERS else [MTP_MODULE]
    found = [prefix for prefix in prefixes if any(n.startswith(prefix + ".") for n in names)]
    if not found:
        return None
    return (
        f"{', '.join(found)}: converted like the decoder layers, as vLLM's MTP loads them (their input "
        f"projection and head stay BF16); transformers' own MTP decoding reads them without dequantizing, "
        f"--ignore {found[0]} keeps one in BF16 for it"
    )


def render(info: dict) -> str:
    q, actions = info["quantized"], info["actions"]
    lines = [f"source      {info['source']}"]
    if info["source_quantization"]:
        lines.append(f"source is   {info['source_quantization']}")
    lines.append(f"family      {info['architecture']}")
    tensors = f"tensors     {info['tensors']} in {plural(info['units'], 'unit')} (at most one decoder layer each)"
    if info["dequantize"]:
        lines += [
            f"dequantize  to {info['dequantized_dtype']}: w = float32(q) * scale, rounded once; scales and "
            f"quantization_config dropped   plan {info['fingerprint']}",
            tensors,
        ]
    else:
        given = f" (from {info['scheme_given']})" if info.get("scheme_given") else ""
        scales = f"   scales {info['scale_format']}" if info["scale_format"] != ScaleFormat.FLOAT else ""
        lines += [
            f"scheme      {info['scheme']}{given}   format {info['format']}{scales}   plan {info['fingerprint']}",
            *[f"recipe      {pattern} = {scheme}" for pattern, scheme in info["recipe"]],
            tensors,
            f"quantized   {plural(q['tensors'], 'tensor')}, {format_size(q['bytes_in'])} -> "
            f"{format_size(q['bytes_out'])} with scales"
            + (f" ({', '.join(f'{n} {s}' for s, n in by.items())})" if (by := info["quantized_by_scheme"]) else ""),
        ]
        if info["source_quantization"]:
            lines.append(
                f"from FP8    {actions['pass']} passed through (codes and scales as they are), "
                f"{actions['requantize']} requantized from their dequantized values, "
                f"{actions['dequantize']} dequantized to {info['dequantized_dtype'] or 'high precision'}"
            )
    for reason, k in info["kept"].items():
        lines.append(
            f"kept        {k['tensors']:>5} {'tensor ' if k['tensors'] == 1 else 'tensors'} "
            f"{format_size(k['bytes']):>10}  {reason}"
        )
    if info["fused_groups"]:
        share = "share one scale" if info["scale_sharing"] else "scales per row, block or group, no sharing needed"
        if info["scheme"] == Scheme.NVFP4A16:
            share = "share one global scale, each member its own group scales"
        groups = ", ".join(f"{n} x {kind}" for kind, n in sorted(info["fused_groups"].items()))
        lines.append(f"fused       {groups} ({share})")
    if info["split_experts"]:
        lines.append(
            f"experts     {plural(len(info['split_experts']), 'fused expert tensor')} split per expert, e.g. "
            f"{info['split_experts'][0]}"
        )
    if info["mtp"]:
        lines.append(f"mtp         {info['mtp']}")
    mem = info["memory"]
    lines += [
        f"output      {format_size(info['bytes_out'])} in {plural(info['shards'], 'shard')} "
        f"(input {format_size(info['bytes_in'])}, {info['bytes_out'] / max(info['bytes_in'], 1):.0%})",
        f"memory      peak device ~{format_size(mem['device_bytes'])}, peak host ~{format_size(mem['host_bytes'])} "
        f"({plural(mem['batches'], 'batch', 'batches')}, largest {format_size(mem['largest_batch_bytes'])})",
    ]
    if not info["dequantize"]:
        lines.append(
            f"ignore list {plural(len(info['ignore']), 'module')}: {', '.join(info['ignore'][:6])}"
            + (" ..." if len(info["ignore"]) > 6 else "")
        )
    lines += [f"loads       {engine}: {verdict}" for engine, verdict in info["loads"].items()]
    lines += [f"warning     {w}" for w in info["warnings"]]
    lines += [f"note        {n}" for n in info["notes"]]
    return "\n".join(lines)
