"""Which tensors become FP8, which stay in high precision (and why), and which share a scale.

Pure functions of tensor names, shapes and the options: no I/O. Names are Hugging Face checkpoint
names; a "module" is a tensor name without its trailing ".weight".
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from ..errors import FP8ConvertError
from ..safetensors_io import FLOAT_SOURCE_DTYPES, TensorInfo

# vLLM fuses these sibling modules into one linear and, with per-tensor scales, re-quantizes every
# member to the largest scale; giving members one shared scale makes that a no-op. vLLM also refuses
# a fused layer whose members are partly ignored, so members are kept or quantized together.
FUSED_SIBLINGS = (
    ("q_proj", "k_proj", "v_proj"),          # qkv_proj
    ("gate_proj", "up_proj"),                # gate_up_proj, also per expert and for shared experts
    ("w1", "w3"),                            # Mixtral experts' gate/up
    ("q_a_proj", "kv_a_proj_with_mqa"),      # DeepSeek MLA fused_qkv_a_proj
)
_SIBLING_GROUP = {leaf: group for group in FUSED_SIBLINGS for leaf in group}

EMBEDDING_LEAVES = {"embed_tokens", "wte", "wpe", "word_embeddings", "position_embeddings",
                    "token_type_embeddings", "embeddings", "embed_positions", "tok_embeddings"}
HEAD_LEAVES = {"lm_head", "embed_out", "score", "classifier", "output"}
# MoE routers: tiny, precision-critical, and some engines build them without FP8 support.
ROUTER_LEAVES = {"router", "shared_expert_gate", "e_score_correction_bias"}
ROUTER_PARENTS = {"mlp", "block_sparse_moe", "feed_forward", "moe"}  # <parent>.gate is a router
TOWER_PARTS = {"vision_tower", "vision_model", "visual", "vision_encoder", "vision", "audio_tower",
               "audio_model", "audio_encoder", "multi_modal_projector", "mm_projector", "vision_projector",
               "image_newline", "audio_projector", "vision_embed_tokens"}
KERNEL_MULTIPLE = 16  # the FP8 GEMMs want both weight dims divisible by 16


def module_of(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def matches_pattern(module: str, pattern: str) -> bool:
    """--ignore semantics: `re:` regex (re.match), glob, or an exact module name or module prefix."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(module, pattern)
    pattern = module_of(pattern)
    return module == pattern or module.startswith(pattern + ".")


class UnsupportedLayout(FP8ConvertError):
    """A weight that looks like a linear layer but is not 2-D (e.g. fused 3-D experts)."""


def default_keep_reason(info: TensorInfo) -> str | None:
    """Why a tensor stays in high precision by default, or None if it is a candidate for FP8.
    Raises UnsupportedLayout for a linear-looking weight of more than 2 dims."""
    if info.dtype not in FLOAT_SOURCE_DTYPES:
        return f"not floating point ({info.dtype})"
    if len(info.shape) < 2:
        return "1-D (norm or bias)"
    if info.numel == 0:
        return "empty"
    parts = module_of(info.name).split(".")
    # Fused 3-D expert tensors (gpt-oss, Llama-4 `experts.gate_up_proj`) carry no ".weight" suffix.
    if not info.name.endswith(".weight") and not (len(info.shape) > 2 and "experts" in parts):
        return "not a weight (bias or buffer)"
    leaf, parent = parts[-1], (parts[-2] if len(parts) > 1 else "")
    if TOWER_PARTS.intersection(parts):
        return "vision/audio tower or projector"
    if leaf in EMBEDDING_LEAVES or "embed" in leaf:
        return "embedding"
    if leaf in HEAD_LEAVES and "layers" not in parts:
        return "output head"
    if leaf in ROUTER_LEAVES or (leaf == "gate" and parent in ROUTER_PARENTS):
        return "MoE router"
    if len(info.shape) > 2:
        if "conv" in leaf:
            return "convolution"
        raise UnsupportedLayout(f"{info.name} {list(info.shape)}")
    if info.shape[0] % KERNEL_MULTIPLE or info.shape[1] % KERNEL_MULTIPLE:
        return f"shape {list(info.shape)} not divisible by {KERNEL_MULTIPLE}"
    return None


def fused_group_key(name: str) -> str | None:
    """The vLLM fused layer a weight belongs to, e.g. 'model.layers.0.self_attn.q_proj/k_proj/v_proj'."""
    module = module_of(name)
    parent, _, leaf = module.rpartition(".")
    group = _SIBLING_GROUP.get(leaf)
    return f"{parent}.{'/'.join(group)}" if group else None


@dataclass(frozen=True)
class Decision:
    quantize: bool
    reason: str | None  # why kept; None when quantized
    group: str | None   # fused group key (scale shared in the tensor scheme)


def decide(tensors: list[TensorInfo], ignore: tuple[str, ...]) -> tuple[dict[str, Decision], list[str]]:
    """Decide every tensor. Returns (decisions by name, notes for the user)."""
    notes: list[str] = []
    reasons: dict[str, str | None] = {}
    used_patterns: set[str] = set()
    unsupported: list[str] = []
    for info in tensors:
        hit = next((p for p in ignore if matches_pattern(module_of(info.name), p)), None)
        try:
            reason = default_keep_reason(info)
        except UnsupportedLayout as e:
            if hit is None:
                unsupported.append(str(e))
            reason = None  # the user chose to keep it
        if reason is None and hit is not None:
            used_patterns.add(hit)
            reason = f"--ignore {hit}"
        reasons[info.name] = reason
    if unsupported:
        more = f" and {len(unsupported) - 3} more" if len(unsupported) > 3 else ""
        raise UnsupportedLayout(
            f"tensor {', '.join(unsupported[:3])}{more}: more than 2-D; fp8convert quantizes 2-D linear weights "
            f"only (fused 3-D expert layouts are not supported); keep them in high precision with --ignore")
    for pattern in ignore:
        if pattern not in used_patterns:
            notes.append(f"--ignore {pattern!r} matched no weight that would otherwise be quantized")

    # A fused group is quantized only if every member is: vLLM cannot mix within one fused layer.
    members: dict[str, list[str]] = {}
    for info in tensors:
        key = fused_group_key(info.name) if info.name.endswith(".weight") else None
        if key:
            members.setdefault(key, []).append(info.name)
    for key, names in members.items():
        kept = [n for n in names if reasons[n] is not None]
        if kept and len(kept) < len(names):
            for n in names:
                if reasons[n] is None:
                    reasons[n] = f"fused with {module_of(kept[0])}, which is kept"
            notes.append(f"kept all of {key} because {module_of(kept[0])} is kept ({reasons[kept[0]]})")

    decisions = {}
    for info in tensors:
        key = fused_group_key(info.name) if info.name.endswith(".weight") else None
        decisions[info.name] = Decision(reasons[info.name] is None, reasons[info.name], key)
    return decisions, notes


def is_linear_weight(info: TensorInfo, reason: str | None) -> bool:
    """Kept 2-D weights that engines build as linear layers, so the ignore list must name them."""
    return (info.name.endswith(".weight") and len(info.shape) == 2
            and reason not in ("embedding",) and info.dtype in FLOAT_SOURCE_DTYPES)
