"""One model family as the architecture registry (architectures.py) describes it: what stays in high
precision beyond the generic rules, which modules vLLM fuses, how fused MoE experts are stored, where
MTP layers live, how each consumer names a module, and what it cannot load.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from .caveats import Caveat

# vLLM fuses these sibling modules into one linear (the default `packed_modules_mapping` of most models).
FUSED_SIBLINGS = (
    ("q_proj", "k_proj", "v_proj"),  # qkv_proj
    ("gate_proj", "up_proj"),  # gate_up_proj, also per expert and for shared experts
    ("w1", "w3"),  # Mixtral-style experts' gate/up (w13)
    ("q_a_proj", "kv_a_proj_with_mqa"),  # DeepSeek MLA fused_qkv_a_proj
)

# Reasons for keeping a module that the generic rules (rules.py) and the registry both give.
ROUTER = "MoE router"
TOWER = "vision/audio tower or projector"

# How a fused expert tensor is stored: [E, in, out] (used as x @ W[e]) or [E, out, in] (nn.Linear's own).
IN_OUT = "in_out"
OUT_IN = "out_in"

# Where the MTP layers live: decoder layers model.layers.{num_hidden_layers + i}, or modules mtp.*
MTP_LAYERS = "layers"
MTP_MODULE = "mtp"


@dataclass(frozen=True)
class Keep:
    """Modules (regex searched in the checkpoint module name) kept in high precision, and why."""

    pattern: str
    reason: str
    formats: tuple[str, ...] = ()  # only for these output formats (empty: all)
    schemes: tuple[str, ...] = ()  # only for these schemes (empty: all)

    def applies(self, module: str, fmt: str, scheme: str) -> bool:
        return (
            (not self.formats or fmt in self.formats)
            and (not self.schemes or scheme in self.schemes)
            and re.search(self.pattern, module) is not None
        )


@dataclass(frozen=True)
class Rename:
    """One renaming of a module name: re.sub(pattern, to, name, count=1)."""

    pattern: str
    to: str

    def apply(self, name: str) -> str:
        return re.sub(self.pattern, self.to, name, count=1)


@dataclass(frozen=True)
class ExpertTensor:
    """One projection of all experts of a MoE layer in one source tensor.

    `stored` lists the orientations checkpoints of this family come in (IN_OUT, OUT_IN), the family's
    released one first. When both are listed, the config's hidden and expert sizes tell which one a
    checkpoint has (never the shape alone); where both fit, it is the released one.
    `members` share the output axis: gate and up of a fused gate_up tensor, concatenated
    ([gate | up]) or `interleaved` (gate, up, gate, up, ... column by column)."""

    pattern: str  # regex over the tensor name; group "block" is the MoE block module
    members: tuple[str, ...]  # per-expert module names, in order along the output axis
    stored: tuple[str, ...]  # IN_OUT and/or OUT_IN
    interleaved: bool = False
    experts: str = "{block}.experts"  # parent of the per-expert modules written: {experts}.{e}.{member}.weight

    def match(self, name: str) -> str | None:
        """The per-expert modules' parent for a source tensor of this kind, or None."""
        m = re.fullmatch(self.pattern, name)
        return self.experts.format(block=m.group("block")) if m else None


@dataclass(frozen=True)
class Experts:
    """A family's MoE experts stored as one tensor per projection for all experts of a layer. They are
    written as one 2-D weight per expert in nn.Linear orientation, the layout the engines' loaders take
    for FP8 checkpoints; or they stay as they are, with the reason."""

    tensors: tuple[ExpertTensor, ...]
    count: tuple[str, ...] = ("num_local_experts",)  # config keys (dotted paths) with the number of experts
    width: tuple[str, ...] = ("intermediate_size",)  # config keys with each expert's intermediate size
    kept: str | None = None  # why they stay as they are (no FP8 layout that loads)
    split_when_kept: tuple[str, ...] = ()  # formats in which kept experts are still written per expert
    transformers_loads_split: tuple[str, ...] = ()  # formats in which transformers loads per-expert FP8


@dataclass(frozen=True)
class Limit:
    """A combination some consumer cannot load."""

    caveat: Caveat
    text: str
    formats: tuple[str, ...] = ()
    schemes: tuple[str, ...] = ()
    experts: bool = False  # only where MoE experts are quantized

    def applies(self, fmt: str, scheme: str, has_experts: bool) -> bool:
        """`has_experts`: the output holds quantized MoE experts."""
        return (
            (not self.formats or fmt in self.formats)
            and (not self.schemes or scheme in self.schemes)
            and (has_experts or not self.experts)
        )


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
    # name a checkpoint module, so the ignore list names every kept module the way each consumer matches it.
    transformers_names: tuple[Rename, ...] = ()
    vllm_names: tuple[Rename, ...] = ()
    vllm_name_fn: Callable[[str, dict], str] | None = None  # where vLLM's module tree differs from the checkpoint's
    limits: tuple[Limit, ...] = ()  # combinations a consumer cannot load, as warnings
    quantized: str = "attention and MLP linears"  # for the README table
    notes: str = ""

    def transformers_name(self, module: str) -> str:
        for rename in self.transformers_names:
            module = rename.apply(module)
        return module

    def vllm_name(self, module: str, config: dict) -> str:
        for rename in self.vllm_names:
            module = rename.apply(module)
        return self.vllm_name_fn(module, config) if self.vllm_name_fn else module

    def names(self, module: str, config: dict) -> list[str]:
        """The module as the checkpoint, transformers and vLLM name it (each once)."""
        return list(dict.fromkeys([module, self.transformers_name(module), self.vllm_name(module, config)]))

    def keep_reason(self, module: str, fmt: str, scheme: str) -> str | None:
        return next((k.reason for k in self.keep if k.applies(module, fmt, scheme)), None)

    def expert_tensor(self, name: str) -> tuple[ExpertTensor, str] | None:
        """(layout, per-expert modules' parent) of a fused expert tensor, or None."""
        for layout in self.experts.tensors if self.experts else ():
            experts = layout.match(name)
            if experts is not None:
                return layout, experts
        return None


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
