"""What a registry entry holds, and the warnings' Caveats (code reads a warning's Caveat, never its text)."""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass

# vLLM fuses these sibling modules into one linear (the default `packed_modules_mapping` of most models).
FUSED_SIBLINGS = (
    ("q_proj", "k_proj", "v_proj"),  # qkv_proj
    ("gate_proj", "up_proj"),  # gate_up_proj, also per expert and for shared experts
    ("w1", "w3"),  # Mixtral-style experts' gate/up (w13)
    ("q_a_proj", "kv_a_proj_with_mqa"),  # DeepSeek MLA fused_qkv_a_proj
)

# Keep reasons that both the generic rules and the registry give.
ROUTER = "MoE router"
TOWER = "vision/audio tower or projector"

# How a fused expert tensor is stored: [E, in, out] (used as x @ W[e]) or [E, out, in] (nn.Linear's own).
IN_OUT = "in_out"
OUT_IN = "out_in"

# Where the MTP layers live: decoder layers model.layers.{num_hidden_layers + i}, or modules mtp.*
MTP_LAYERS = "layers"
MTP_MODULE = "mtp"


class Caveat(enum.Enum):
    TRANSFORMERS_CANNOT_LOAD = "transformers-cannot-load"
    TRANSFORMERS_MISREADS = "transformers-misreads"  # loads, but some weights dequantize wrongly
    VLLM_CANNOT_LOAD = "vllm-cannot-load"
    VLLM_TP_LIMITS = "vllm-tp-limits"  # loads at some tensor-parallel sizes only


@dataclass(frozen=True)
class PlanWarning:
    caveat: Caveat
    text: str


@dataclass(frozen=True, kw_only=True)
class Scoped:
    """Applies only in these output formats and schemes (empty: all)."""

    formats: tuple[str, ...] = ()
    schemes: tuple[str, ...] = ()

    def covers(self, fmt: str, scheme: str) -> bool:
        return (not self.formats or fmt in self.formats) and (not self.schemes or scheme in self.schemes)


@dataclass(frozen=True)
class Keep(Scoped):
    """Modules (regex searched in the checkpoint module name) kept in high precision, and why."""

    pattern: str
    reason: str


@dataclass(frozen=True)
class Limit(Scoped):
    """A combination some consumer cannot load."""

    caveat: Caveat
    text: str
    experts: bool = False  # only where the output holds quantized MoE experts


@dataclass(frozen=True)
class ExpertTensor:
    """One projection of all experts of a MoE layer in one source tensor; where the config's sizes fit both
    `stored` orientations, the first (the released one) is taken."""

    pattern: str  # regex over the tensor name; group "block" is the MoE block module
    members: tuple[str, ...]  # per-expert module names ({block}.experts.{e}.{member}), in order along the output axis
    stored: tuple[str, ...]  # IN_OUT and/or OUT_IN
    interleaved: bool = False  # members alternate along the output axis instead of being concatenated


@dataclass(frozen=True)
class Experts:
    """Fused MoE experts, written as one nn.Linear weight per expert (what engines load for FP8) or kept."""

    tensors: tuple[ExpertTensor, ...]
    count: tuple[str, ...] = ("num_local_experts",)  # config keys (dotted paths) with the number of experts
    width: tuple[str, ...] = ("intermediate_size",)  # config keys with each expert's intermediate size
    kept: str | None = None  # why they stay as they are (no FP8 layout that loads)
    # formats in which transformers reads experts one weight per expert (kept experts are split there too)
    transformers_loads_split: tuple[str, ...] = ()


@dataclass(frozen=True)
class Architecture:
    name: str  # family, as inspect and the README show it
    model_types: tuple[str, ...]  # config.json's model_type values it covers
    # Sibling modules vLLM packs into one linear layer: in the tensor scheme they share one scale, and
    # they are kept or quantized together (vLLM refuses a half-quantized fused layer).
    fused: tuple[tuple[str, ...], ...] = FUSED_SIBLINGS
    keep: tuple[Keep, ...] = ()  # kept in high precision beyond the generic rules of rules.py
    experts: Experts | None = None
    mtp: str | None = None  # MTP_LAYERS or MTP_MODULE
    # How transformers (in memory, after its checkpoint conversion) and vLLM (after its hf_to_vllm_mapper)
    # name a checkpoint module, so the ignore list names every kept module the way each consumer matches it:
    # (pattern, replacement) pairs, each applied once with re.sub in turn.
    transformers_names: tuple[tuple[str, str], ...] = ()
    vllm_names: tuple[tuple[str, str], ...] = ()
    vllm_name_fn: Callable[[str, dict], str] | None = None  # where vLLM's module tree differs from the checkpoint's
    limits: tuple[Limit, ...] = ()  # combinations a consumer cannot load, as warnings
    quantized: str = "attention and MLP linears"  # for the README table
    notes: str = ""

    def vllm_name(self, module: str, config: dict) -> str:
        module = _renamed(module, self.vllm_names)
        return self.vllm_name_fn(module, config) if self.vllm_name_fn else module

    def names(self, module: str, config: dict) -> list[str]:
        return list(dict.fromkeys([module, _renamed(module, self.transformers_names), self.vllm_name(module, config)]))

    def expert_tensor(self, name: str) -> tuple[ExpertTensor, str] | None:
        """(layout, per-expert modules' parent) of a fused expert tensor, or None."""
        for layout in self.experts.tensors if self.experts else ():
            if m := re.fullmatch(layout.pattern, name):
                return layout, f"{m['block']}.experts"
        return None


def _renamed(module: str, renames: tuple[tuple[str, str], ...]) -> str:
    for pattern, to in renames:
        module = re.sub(pattern, to, module, count=1)
    return module


def config_value(config: dict, *keys: str):
    """The first of `keys` (dotted paths) found in config.json or its text_config, else None."""
    for scope in (config, config.get("text_config") or {}):
        for key in keys:
            value = scope
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None:
                return value
    return None


def mtp_layers(arch: Architecture, config: dict) -> list[str]:
    """The module prefixes of the MTP layers the config declares (DeepSeek-style layer numbering)."""
    if arch.mtp != MTP_LAYERS:
        return []
    count = config_value(config, "num_nextn_predict_layers") or 0
    first = config_value(config, "num_hidden_layers") or 0
    return [f"model.layers.{first + i}" for i in range(count)]


GENERIC = Architecture("generic", ())
