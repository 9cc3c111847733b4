"""build_plan: every tensor decided (rules.py), how each output is made, shards, ignore list, fingerprint."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import replace

from .._version import __version__
from ..errors import FP8ConvertError
from ..formats import CONFIGS
from ..formats.sources import SourceQuantization
from ..options import FP4_SCHEMES, Format, Options, ScaleFormat, Scheme
from ..source.checkpoint import Source
from ..units import plural
from .architectures import architecture_of
from .family import GENERIC, Architecture, config_value, mtp_layers
from .plan import LAYER_PATTERN, Action, Plan, TensorPlan, group_into_units, lay_out_shards, natural_key
from .rules import decide, experts_of, is_linear_weight, module_of
from .summary import compatibility_warnings

MODEL_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def build_plan(source: Source, options: Options) -> Plan:
    check_layers(source)
    quant = source.quant
    if options.dequantize and quant is None:
        raise FP8ConvertError(
            f"{source.label}: holds no FP8 weights (config.json has no FP8 quantization_config); nothing to dequantize"
        )
    if quant and quant.scheme in FP4_SCHEMES and not options.dequantize:
        raise FP8ConvertError(
            f"{source.label}: holds FP4 ({quant.scheme}) weights; fp8convert dequantizes them (fp8convert "
            "dequantize), but quantizes only BF16/FP16/FP32 and FP8 sources"
        )
    arch = architecture_of(source.config)
    rules = arch or GENERIC
    decisions, notes, warnings = decide(source.tensors, source.config, options, rules, quant)
    model_dtype = source.config.get("torch_dtype", source.config.get("dtype"))
    high_precision = options.dtype or MODEL_DTYPES.get(str(model_dtype), "BF16")
    plans = [tensor_plan(d, quant, options, high_precision) for d in decisions]
    notes += source_notes(quant, plans, options)
    if not any(t.quantize for t in plans) and not options.dequantize:
        notes.append("no tensor is quantized: every weight is kept in high precision; quantize refuses to write this")
    units = group_into_units(plans)
    shards, shard_of = lay_out_shards(units, options.max_shard_size)
    notes += architecture_notes(arch, source)
    if model_dtype == "float32" and not options.dequantize:
        notes.append(
            "the model's dtype is float32: serving engines run FP8 kernels with bfloat16/float16 "
            "activations; consider serving with --dtype bfloat16"
        )
    # a dequantized output has no FP8 left for engines to skip
    ignore = [] if options.dequantize else ignore_list(plans, rules, source.config, options.format)
    groups = scheme_groups(plans, rules, source.config, options)
    key = fingerprint(source, options)
    plan = Plan(source, options, units, shards, shard_of, ignore, notes, key, arch, warnings, groups)
    plan.warnings += [w.text for w in compatibility_warnings(plan)]
    return plan


def check_layers(source: Source) -> None:
    """Refuse a gap in a stack of layers, or fewer than num_hidden_layers (a shard left out of a download):
    the output would load with layers randomly initialised. More are fine (DeepSeek's MTP layer)."""
    stacks: dict[str, set[int]] = {}
    for t in source.tensors:
        if m := LAYER_PATTERN.match(t.name):
            prefix, _, index = m.group(1).rpartition(".")
            stacks.setdefault(prefix, set()).add(int(index))
    for prefix, indices in sorted(stacks.items()):
        if missing := sorted(set(range(max(indices) + 1)) - indices):
            raise FP8ConvertError(
                f"{source.label}: the weights hold {prefix} {describe_numbers(sorted(indices))} but "
                f"not {describe_numbers(missing)}; a shard or its tensors are missing"
            )
    declared = config_value(source.config, "num_hidden_layers")
    if stacks and type(declared) is int:  # not a bool: JSON's true is no layer count
        prefix, indices = max(stacks.items(), key=lambda item: len(item[1]))
        if len(indices) < declared:
            raise FP8ConvertError(
                f"{source.label}: config.json says num_hidden_layers {declared}, but the weights hold "
                f"{plural(len(indices), 'layer')} of {prefix}; a shard or its tensors are missing"
            )


def describe_numbers(numbers: list[int]) -> str:
    """'1', '0-4', '0-4 and 7', '1, 3 and 5' (sorted, distinct)."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def fingerprint(source: Source, options: Options) -> str:
    """Same fingerprint, same output bytes; the card's TP notes aside: --target-tp only says what is reported,
    so workers and reruns that differ in it write one conversion."""
    listed = [options.scheme, options.format, options.ignore, options.max_shard_size]
    # Each addition only when set, so the defaults keep earlier fingerprints.
    if options.scale_format != ScaleFormat.FLOAT:
        listed.append(options.scale_format)
    if options.dequantize or options.dtype:
        listed += [options.dequantize, options.dtype]
    if options.recipe:
        listed.append(options.recipe)  # JSON writes tuples as lists
    tensors = [[t.name, t.dtype, list(t.shape), t.file, t.offset] for t in source.tensors]
    blob = {"tool": __version__, "options": listed, "tensors": tensors, "config": source.config}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def tensor_plan(d: TensorPlan, quant: SourceQuantization | None, options: Options, high_precision: str) -> TensorPlan:
    """How decision `d` is made; an FP8 source's weight is dequantized, passed through or requantized."""
    fp8_weight = quant.weights.get(d.source.name) if quant else None
    if fp8_weight is None and not d.quantize:
        return d
    if not d.quantize:
        inputs = (fp8_weight.weight, fp8_weight.scale) + ((fp8_weight.global_scale,) if fp8_weight.global_scale else ())
        return replace(d, name=fp8_weight.name, inputs=inputs, action=Action.DEQUANTIZE, out_dtype=high_precision)
    fmt, scheme = CONFIGS[options.format](d.scheme), d.scheme
    d = replace(d, scale_name=fmt.scale_name(d.name), scale_shape=fmt.scale_shapes(d.shape)[0])
    if scheme in FP4_SCHEMES:  # compressed-tensors' names: X.weight_packed, X.weight_scale, X.weight_global_scale
        global_scale = d.name + "_global_scale" if scheme == Scheme.NVFP4A16 else None
        d = replace(d, name=d.name + "_packed", packed=True, global_scale_name=global_scale)
    if fp8_weight is None:
        return replace(d, scale_dtype=fmt.scale_dtype())
    d = replace(d, inputs=(fp8_weight.weight, fp8_weight.scale))
    if fp8_weight.input_scale is not None and scheme == Scheme.TENSOR:
        d = replace(d, inputs=(*d.inputs, fp8_weight.input_scale), input_scale_name=module_of(d.name) + ".input_scale")
    # The source's codes and scales are already the output's: same scheme and, for ue8m0, scales the source
    # declares powers of two (re-deriving them would change codes where they are not amax / 448).
    ue8m0_ok = options.scale_format == ScaleFormat.FLOAT or quant.config.scale_fmt == ScaleFormat.UE8M0
    if quant.scheme == scheme and ue8m0_ok:
        return replace(d, action=Action.PASS, scale_dtype=fp8_weight.scale.dtype)  # the scale keeps its dtype
    return replace(d, action=Action.REQUANTIZE, scale_dtype=fmt.scale_dtype())


def source_notes(quant: SourceQuantization | None, plans: list[TensorPlan], options: Options) -> list[str]:
    """An FP8 source's extras the output cannot say the same way."""
    if quant is None:
        return []
    notes = []
    without_scale = {t.source.name for t in plans if t.quantize and not t.input_scale_name}
    if dropped := sum(w.input_scale is not None for name, w in quant.weights.items() if name in without_scale):
        notes.append(
            f"the source's static activation scales (input_scale) of {dropped} FP8 weights are not "
            f"carried: the {options.scheme} scheme's activations are dynamic (only the tensor scheme "
            "takes static per-tensor activation scales)"
        )
    ue8m0_dropped = quant.config.scale_fmt == ScaleFormat.UE8M0 and options.scale_format == ScaleFormat.FLOAT
    if ue8m0_dropped and not options.dequantize:
        notes.append(
            "the source's scale_fmt 'ue8m0' is not written to the output: its stored scales are used as "
            "they are (transformers would round scales that are not powers of two under it; "
            "--scheme block --scale-format ue8m0 keeps it)"
        )
    return notes


def ignore_list(plans: list[TensorPlan], arch: Architecture, config: dict, fmt: str) -> list[str]:
    """Every linear module left unquantized, as the checkpoint, transformers and vLLM each name it (they
    match exact names). A MoE layer with every expert kept is named whole too: vLLM's fp8 path matches a
    substring of the experts prefix, compressed-tensors per-expert names (only a regex covers both)."""
    entries: set[str] = set()
    for t in plans:
        if not t.quantize and is_linear_weight(t.name, t.shape, t.dtype, t.reason):
            entries.update(module_names(t.name, arch, config))
    for experts in kept_expert_blocks(plans, arch):
        names = arch.names(experts, config)
        if fmt == Format.COMPRESSED_TENSORS:
            entries.add("re:^(" + "|".join(re.escape(n) for n in names) + r")(\.|$)")
        else:
            entries.update(names)
    ignore = sorted(entries, key=natural_key)
    if "lm_head" not in ignore:  # tied heads have no tensor; transformers only skips what the list names
        ignore.insert(0, "lm_head")
    return ignore


def module_names(name: str, arch: Architecture, config: dict) -> list[str]:
    """The module of output `name` as the checkpoint, transformers and vLLM name it (transformers holds
    per-expert weights fused, or under the checkpoint's own names)."""
    module = module_of(name)
    return [module, arch.vllm_name(module, config)] if experts_of(name) else arch.names(module, config)


def scheme_groups(
    plans: list[TensorPlan], arch: Architecture, config: dict, options: Options
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """A recipe's schemes besides the default (whose config group targets "Linear"), with their modules."""
    if not options.recipe:
        return ()
    every, by_scheme = set(), {}
    for t in plans:
        names = module_names(t.name, arch, config)
        every.update(names)
        if t.quantize and t.scheme != options.scheme:
            by_scheme.setdefault(t.scheme, set()).update(names)
    return tuple((s, tuple(compact_targets(by_scheme[s], every))) for s in options.schemes if s in by_scheme)


def compact_targets(names: set[str], every: set[str]) -> list[str]:
    """`names` as config targets (a MoE has thousands of experts): names alike but for their numbers and
    last part as one `re:` pattern where it matches exactly them among `every`, else by last part, else each."""
    targets = []
    for members in _alike(names, last_too=True):
        if pattern := _exact_pattern(members, every):
            targets.append(pattern)
            continue
        for same_leaf in _alike(members, last_too=False):
            targets += [p] if (p := _exact_pattern(same_leaf, every)) else same_leaf
    return targets


def _alike(names, last_too: bool) -> list[list[str]]:
    """`names` in families that differ only in their numbered parts (and, `last_too`, their last part)."""
    families: dict[str, list[str]] = {}
    for name in names:
        key = re.sub(r"(?<=\.)\d+(?=\.|$)", "#", name)
        families.setdefault(key.rpartition(".")[0] + ".*" if last_too else key, []).append(name)
    return [sorted(m, key=natural_key) for _, m in sorted(families.items(), key=lambda item: natural_key(item[0]))]


def _exact_pattern(members: list[str], every: set[str]) -> str | None:
    """An `re:` target matching just `members` among `every` (the product of their varying parts), or None."""
    split = [m.split(".") for m in members]
    if len(members) < 2 or len({len(parts) for parts in split}) > 1:
        return None
    pieces = []
    for column in zip(*split):
        values = sorted(set(column), key=natural_key)
        pieces.append(re.escape(values[0]) if len(values) == 1 else "(?:" + "|".join(map(re.escape, values)) + ")")
    pattern = r"\.".join(pieces)
    return f"re:^{pattern}$" if {m for m in every if re.fullmatch(pattern, m)} == set(members) else None


def kept_expert_blocks(plans: list[TensorPlan], arch: Architecture) -> list[str]:
    """Experts modules (e.g. `model.layers.1.mlp.experts`) none of whose outputs is quantized."""
    quantized: dict[str, bool] = {}
    for t in plans:
        fused = arch.expert_tensor(t.name)
        experts = fused[1] if fused else experts_of(t.name)
        if experts:
            quantized[experts] = quantized.get(experts, False) or t.quantize
    return sorted((e for e, q in quantized.items() if not q), key=natural_key)


def architecture_notes(arch: Architecture | None, source: Source) -> list[str]:
    config = source.config
    if arch is None:
        return [
            f"model_type {config.get('model_type')!r} is not in fp8convert's architecture registry: the "
            "generic rules apply (see the README's supported architectures); check the ignore list against "
            "your engine and run fp8convert verify"
        ]
    names = {t.name for t in source.tensors}
    if missing := [layer for layer in mtp_layers(arch, config) if not any(n.startswith(layer + ".") for n in names)]:
        return [
            f"config.json declares MTP layer(s) {', '.join(missing)} (num_nextn_predict_layers), but the "
            "checkpoint has none: the output cannot serve MTP speculative decoding either"
        ]
    return []
