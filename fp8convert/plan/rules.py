"""Which tensors become FP8, which stay in high precision and why, which share a scale. A "module" is a
tensor name without its trailing ".weight"."""

from __future__ import annotations

import fnmatch
import re
import shlex
from dataclasses import replace

from ..errors import FP8ConvertError, UsageError
from ..formats.sources import SourceQuantization
from ..options import GROUP_SIZE, Options, Scheme
from ..safetensors_io import FLOAT_SOURCE_DTYPES, FP8, TensorInfo
from ..units import listed
from .family import GENERIC, IN_OUT, OUT_IN, ROUTER, TOWER, Architecture, ExpertTensor, config_value
from .plan import Action, Cut, TensorPlan

EMBEDDING_LEAVES = {"wte", "wpe"}  # GPT-2's tables; any leaf with "embed" is one too
HEAD_LEAVES = {"lm_head", "embed_out", "score", "classifier", "output"}
# MoE routers: tiny, precision-critical, and some engines build them without FP8 support.
ROUTER_LEAVES = {"router", "shared_expert_gate", "e_score_correction_bias"}
ROUTER_PARENTS = {"mlp", "block_sparse_moe", "feed_forward", "moe"}  # <parent>.gate is a router
TOWER_PARTS = set(
    "vision_tower vision_model visual vision_encoder vision audio_tower audio_model audio_encoder "
    "multi_modal_projector mm_projector vision_projector image_newline audio_projector vision_embed_tokens".split()
)
KERNEL_MULTIPLE = 16  # the FP8 GEMMs want both weight dims divisible by 16
PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.\d+\.[^.]+$")  # a module of one expert
SOURCE_KEPT = "high precision in the FP8 source"


def module_of(name: str) -> str:
    if name.endswith(".weight_packed"):  # an FP4 output's weight
        return name.removesuffix(".weight_packed")
    return name.removesuffix(".weight")


def matches_pattern(module: str, pattern: str) -> bool:
    """--ignore semantics: `re:` regex (re.match), glob, or an exact module name or module prefix."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(module, pattern)
    pattern = module_of(pattern)
    return module == pattern or module.startswith(pattern + ".")


class UnsupportedLayout(FP8ConvertError):
    """A weight that looks like a linear layer but has a layout fp8convert cannot convert exactly."""


def default_keep_reason(info: TensorInfo, arch: Architecture, fmt: str, scheme: str) -> str | None:
    """Why a tensor stays in high precision by default, or None; UnsupportedLayout for a >2-D weight."""
    if info.dtype not in FLOAT_SOURCE_DTYPES and info.dtype != FP8:
        return f"{info.dtype}, not a dtype fp8convert quantizes (BF16, F16, F32)"
    if len(info.shape) < 2:
        return "1-D (norm or bias)" if info.shape else "0-D (a scalar)"
    if info.numel == 0:
        return "empty"
    module = module_of(info.name)
    parts = module.split(".")
    # Fused 3-D expert tensors (gpt-oss, Llama-4 `experts.gate_up_proj`) carry no ".weight" suffix.
    if not info.name.endswith(".weight") and not (len(info.shape) > 2 and "experts" in parts):
        return "not a weight (bias or buffer)"
    if reason := next((k.reason for k in arch.keep if k.covers(fmt, scheme) and re.search(k.pattern, module)), None):
        return reason
    leaf, parent = parts[-1], (parts[-2] if len(parts) > 1 else "")
    if TOWER_PARTS.intersection(parts):
        return TOWER
    if leaf in EMBEDDING_LEAVES or "embed" in leaf:
        return "embedding"
    if leaf in HEAD_LEAVES and "layers" not in parts:
        return "output head"
    if (
        leaf in ROUTER_LEAVES
        or (leaf == "gate" and parent in ROUTER_PARENTS)
        or (parent == "gate" and len(parts) > 2 and parts[-3] in ROUTER_PARENTS)
    ):  # Hunyuan's mlp.gate.wg
        return ROUTER
    if len(info.shape) > 2:
        if "conv" in leaf:
            return "convolution"
        raise UnsupportedLayout(f"{info.name} {list(info.shape)}")
    return shape_keep_reason(tuple(info.shape), scheme)


def shape_keep_reason(shape: tuple[int, int], scheme: str) -> str | None:
    """Why a 2-D weight of this shape cannot be FP8 in `scheme`, or None."""
    if shape[0] % KERNEL_MULTIPLE or shape[1] % KERNEL_MULTIPLE:
        return f"shape {list(shape)} not divisible by {KERNEL_MULTIPLE}"
    # whole groups only: vLLM allocates MXFP8's in // 32 scales per row, and FP4 scales are never padded
    if scheme in GROUP_SIZE and shape[1] % GROUP_SIZE[scheme]:
        kind = "MXFP8" if scheme == Scheme.MXFP8 else "FP4"
        return f"{kind}: input dim ({shape[1]}) not divisible by {GROUP_SIZE[scheme]}"
    return None


def fused_group_key(name: str, fused: tuple[tuple[str, ...], ...]) -> str | None:
    """A weight's vLLM fused layer, e.g. 'model.layers.0.self_attn.q_proj/k_proj/v_proj'."""
    parent, _, leaf = module_of(name).rpartition(".")
    group = next((g for g in fused if leaf in g), None)
    return f"{parent}.{'/'.join(group)}" if group else None


def experts_of(name: str) -> str | None:
    """A per-expert weight's experts module (e.g. `model.layers.1.mlp.experts`), or None."""
    m = PER_EXPERT.match(module_of(name))
    return m.group("experts") if m else None


def decision(
    name: str, source: TensorInfo, reason: str | None, group: str | None = None, cut: Cut | None = None, scheme=None
):
    action = Action.KEEP if reason else Action.QUANTIZE
    return TensorPlan(name, (source,), action, reason, group, cut=cut, scheme=scheme)


def scheme_of(module: str, options: Options, used: set[str]) -> str:
    """The scheme a recipe gives `module`: its matching rules' (which must agree), else --scheme."""
    hits = {pattern: scheme for pattern, scheme in options.recipe if matches_pattern(module, pattern)}
    if len(set(hits.values())) > 1:
        rules = ", ".join(f"{p}={s}" for p, s in hits.items())
        raise UsageError(f"module {module}: recipe rules {rules} give it different schemes; make them exclusive")
    used.update(hits)
    return next(iter(hits.values()), options.scheme)


def expert_cuts(
    info: TensorInfo, layout: ExpertTensor, experts: str, arch: Architecture, config: dict
) -> list[tuple[str, Cut]]:
    """(output name, cut) of every expert's every member in a fused expert tensor. The orientation comes
    from the registry and the config's sizes, never the shape alone."""
    count = config_value(config, *arch.experts.count)
    width = config_value(config, *arch.experts.width)
    hidden = config_value(config, "hidden_size", "d_model")
    if not all(isinstance(v, int) and v > 0 for v in (count, width, hidden)):
        raise UnsupportedLayout(
            f"tensor {info.name} {list(info.shape)}: fused experts, but config.json does not "
            "give their number, width and the hidden size, which fix the layout"
        )
    out, inp = (hidden, width) if "down_proj" in layout.members else (width * len(layout.members), hidden)
    expected = {OUT_IN: (count, out, inp), IN_OUT: (count, inp, out)}
    fits = [o for o in layout.stored if expected[o] == tuple(info.shape)]
    if not fits:
        want = " or ".join(f"{list(expected[o])} ({o.replace('_', ', ')})" for o in layout.stored)
        raise UnsupportedLayout(
            f"tensor {info.name} {list(info.shape)}: fused experts whose layout cannot be told "
            f"from config.json: expected {want}; keep them with --ignore {module_of(info.name)}"
        )
    cut = Cut(transpose=fits[0] == IN_OUT, parts=len(layout.members), interleaved=layout.interleaved)
    members = list(enumerate(layout.members))
    return [(f"{experts}.{e}.{m}.weight", replace(cut, expert=e, part=j)) for e in range(count) for j, m in members]


def decide(
    tensors: list[TensorInfo], config: dict, options: Options, arch: Architecture, quant: SourceQuantization | None
) -> tuple[list[TensorPlan], list[str], list[str]]:
    """(decisions in source order, notes, warnings). An FP8 source's scales are inputs of their weights, and
    what it kept in high precision stays so."""
    companions = quant.companions() if quant else set()
    tensors = [t for t in tensors if t.name not in companions]
    if options.dequantize:  # every FP8 weight becomes high precision, every other tensor is kept
        return [decision(t.name, t, "dequantized" if t.name in quant.weights else SOURCE_KEPT) for t in tensors], [], []
    decisions: list[TensorPlan] = []
    used_patterns, used_rules, unsupported = set(), set(), []
    for info in tensors:
        module = module_of(info.name)
        group = fused_group_key(info.name, arch.fused) if info.name.endswith(".weight") else None
        scheme = scheme_of(module, options, used_rules)
        try:
            reason, no_layout = default_keep_reason(info, arch, options.format, scheme), None
        except UnsupportedLayout as e:
            reason, no_layout = None, e
        if quant and info.name not in quant.weights:
            decisions.append(decision(info.name, info, reason or SOURCE_KEPT, group, scheme=scheme))
            continue
        fused_experts = arch.expert_tensor(info.name)
        modules = (module, fused_experts[1]) if fused_experts else (module,)
        hit = next((p for p in options.ignore if any(matches_pattern(m, p) for m in modules)), None)
        if fused_experts:
            layout, experts = fused_experts
            used_patterns.add(hit)
            reason = arch.experts.kept or (f"--ignore {hit}" if hit else None)
            if reason and options.format not in arch.experts.transformers_loads_split:
                decisions.append(decision(info.name, info, reason, scheme=scheme))
                continue
            decisions += [
                decision(name, info, reason or shape_keep_reason(cut.shape(info.shape), scheme), group, cut, scheme)
                for name, cut in expert_cuts(info, layout, experts, arch, config)
                for group in [fused_group_key(name, arch.fused)]
                for scheme in [scheme_of(module_of(name), options, used_rules)]
            ]
            continue
        if no_layout and hit is None:
            unsupported.append(str(no_layout))
        if reason is None and hit is not None:
            used_patterns.add(hit)
            reason = f"--ignore {hit}"
        decisions.append(decision(info.name, info, reason, group, scheme=scheme))
    if unsupported:
        family = f"model_type {config.get('model_type')!r}" + ("" if arch is not GENERIC else ", not in the registry")
        raise UnsupportedLayout(
            f"tensor {listed(unsupported)}: more than 2-D, and fp8convert has no layout for it "
            f"({family}: it converts fused 3-D experts only of the architectures it lists); keep them in high "
            "precision with --ignore"
        )
    unused = [pattern for pattern in options.ignore if pattern not in used_patterns]
    # quoted for a shell, as typed (repr would double a regex's backslashes)
    warnings = [f"--ignore {shlex.quote(p)} matched no weight that would otherwise be quantized" for p in unused]
    warnings += [f"--scheme {p}={s} matched no module" for p, s in options.recipe if p not in used_rules]
    notes = _one_layer_sets(decisions)
    quantized = {module_of(d.name) for d in decisions if d.quantize}
    idle = [
        f"--scheme {p}={s}"
        for p, s in options.recipe
        if p in used_rules and not any(matches_pattern(m, p) for m in quantized)
    ]
    warnings += [
        f"{r} quantizes no weight: every weight it matches stays in high precision (inspect --tensors says why)"
        for r in idle
    ]
    return _unsplit_kept(decisions, arch, options), notes, warnings


def _unsplit_kept(decisions: list[TensorPlan], arch: Architecture, options: Options) -> list[TensorPlan]:
    """A fused expert tensor none of whose cuts is quantized stays whole, as released: split BF16 experts
    would only cost transformers the layout it reads."""
    if arch.experts is None or options.format in arch.experts.transformers_loads_split:
        return decisions
    whole = {d.source.name for d in decisions if d.cut} - {d.source.name for d in decisions if d.cut and d.quantize}
    # the reason the layer is kept, not "fused with ..." (those name cuts that are no longer written)
    root = {}
    for d in decisions:
        if d.cut and d.source.name in whole and not d.reason.startswith("fused with"):
            root.setdefault(experts_of(d.name), d.reason)
    out, done = [], set()
    for d in decisions:
        if not (d.cut and d.source.name in whole):
            out.append(d)
        elif d.source.name not in done:
            done.add(d.source.name)
            out.append(decision(d.source.name, d.source, root.get(experts_of(d.name), d.reason), scheme=d.scheme))
    return out


def _one_layer_sets(decisions: list[TensorPlan]) -> list[str]:
    """vLLM runs a fused set (q/k/v, gate/up) or a MoE layer's experts as one layer in one scheme, all FP8 or
    all high precision: a recipe that splits a set is refused; where some members are kept, all are."""
    notes = []
    sets = ((lambda d: d.group, "fused set", "all of"), (lambda d: experts_of(d.name), "experts of", "every expert of"))
    for key_of, what, every in sets:
        members: dict[str, list[int]] = {}
        first: dict[str, TensorPlan] = {}
        for i, d in enumerate(decisions):
            if not (key := key_of(d)):
                continue
            members.setdefault(key, []).append(i)
            if d.name.endswith(".weight") and first.setdefault(key, d).scheme != d.scheme:  # biases follow weights
                raise UsageError(
                    f"the recipe splits the {what} {key}: {module_of(first[key].name)} is {first[key].scheme}, "
                    f"{module_of(d.name)} is {d.scheme}; vLLM loads them as one layer, in one scheme"
                )
        for key, indices in members.items():
            kept = [decisions[i] for i in indices if not decisions[i].quantize]
            if kept and len(kept) < len(indices):
                why = f"fused with {module_of(kept[0].name)}, which is kept"
                for i in indices:
                    if decisions[i].quantize:
                        decisions[i] = replace(decisions[i], action=Action.KEEP, reason=why)
                notes.append(f"kept {every} {key} because {module_of(kept[0].name)} is kept ({kept[0].reason})")
    return notes


def is_linear_weight(name: str, shape: tuple[int, ...], dtype: str, reason: str | None) -> bool:
    """Kept 2-D weights that engines build as linear layers, so the ignore list must name them; F64 too
    (unlisted, engines would build that layer for FP8 and cast the float64 values into it)."""
    floating = dtype in FLOAT_SOURCE_DTYPES or dtype == "F64"
    return name.endswith(".weight") and len(shape) == 2 and reason != "embedding" and floating
