"""What vLLM 0.33's loader reads for each architecture of tests/support/zoo.py, written down from its model file
(vllm/model_executor/models/<file>, the function named in `source`):
- mapper: the renaming part of the model's hf_to_vllm_mapper (models/utils.py WeightsMapper: substr,
  then prefix, then suffix rules; mappings to None are dropped). vLLM applies it to checkpoint names
  and, through apply_vllm_mapper, to the ignore list (compressed-tensors: dotted entries without re:);
- names: where vLLM's module prefixes do not follow the (mapped) checkpoint names;
- packed: packed_modules_mapping (fused layers; vLLM raises when only some members are ignored);
- unquantized: modules vLLM builds without the quant config (vLLM names): FP8 weights or scales
  there fail to load;
- experts: the checkpoint names its expert loader maps per expert (gate, up, down), the experts
  module vLLM's MoE layer is registered under, whether compressed-tensors quantizes it;
- fused_bf16: fused expert tensors its loader reads only in BF16, with their shapes from config.json.
Everything else built as a linear is quantized unless the ignore list skips it, matched the way
vLLM does (quantization/utils/quant_utils.py is_layer_skipped for fp8, compressed_tensors/utils.py
should_ignore_layer and compressed_tensors_moe.py get_moe_method for compressed-tensors).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

QKV_GATE_UP = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EMBED_HEAD = r"(^|\.)(embed_tokens|embed_tokens_per_layer|wte|wpe|lm_head)$"
_LLAVA_MAPPER = (
    ("prefix", "model.language_model.", "language_model.model."),
    ("prefix", "model.vision_tower.", "vision_tower."),
    ("prefix", "model.multi_modal_projector.", "multi_modal_projector."),
    ("prefix", "lm_head.", "language_model.lm_head."),
)


@dataclasses.dataclass(frozen=True)
class Contract:
    source: str
    mapper: tuple = ()
    names: Callable[[str, dict], str] | None = None
    packed: dict = dataclasses.field(default_factory=lambda: dict(QKV_GATE_UP))
    unquantized: str = EMBED_HEAD
    expert_names: tuple[str, str | None, str] = ("gate_proj", "up_proj", "down_proj")
    experts_prefix: Callable[[str], str] = lambda experts: experts
    ct_quantizes_experts: bool = True
    fused_bf16: dict = dataclasses.field(default_factory=dict)  # name regex -> shape(config)


def text_config(config: dict) -> dict:
    return config.get("text_config") or config


def _falcon_h1_names(module: str, config: dict) -> str:
    # falcon_h1.py FalconH1ParallelHybrid: attention at the layer prefix, Mamba at model.{L + N}.mixer
    m = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.(\w+)", module)
    if m:
        return f"model.layers.{m.group(1)}.{m.group(2)}"
    m = re.fullmatch(r"model\.layers\.(\d+)\.mamba\.(\w+)", module)
    if m:
        return f"model.{int(m.group(1)) + config['num_hidden_layers']}.mixer.{m.group(2)}"
    return module


CONTRACTS = {
    "llama": Contract("llama.py LlamaForCausalLM.load_weights"),
    "qwen3": Contract("qwen3.py Qwen3ForCausalLM"),
    "gemma2": Contract("gemma2.py Gemma2ForCausalLM (logits from embed_tokens)"),
    "phi3": Contract(
        "phi3.py Phi3ForCausalLM: qkv_proj and gate_up_proj fused on disk",
        packed={"qkv_proj": ("qkv_proj",), "gate_up_proj": ("gate_up_proj",)},
    ),
    "gpt2": Contract("gpt2.py GPT2LMHeadModel: c_attn/c_proj/c_fc quantizable (weights transposed at load)", packed={}),
    "qwen3_moe": Contract(
        "qwen3_moe.py Qwen3MoeSparseMoeBlock: gate is a GateLinear with quant_config",
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
        unquantized=EMBED_HEAD + r"|\.shared_expert_gate$",
    ),
    "mixtral": Contract(
        "mixtral.py MixtralMoE: gate without quant_config; experts ckpt_names w1/w2/w3",
        mapper=(("substr", ".gate_proj.", ".w1."), ("substr", ".up_proj.", ".w3."), ("substr", ".down_proj.", ".w2.")),
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
        unquantized=EMBED_HEAD + r"|\.block_sparse_moe\.gate$",
        expert_names=("w1", "w3", "w2"),
    ),
    "phimoe": Contract(
        "phimoe.py PhiMoE: gate without quant_config, lm_head quant_config=None",
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
        unquantized=EMBED_HEAD + r"|\.block_sparse_moe\.gate$",
        expert_names=("w1", "w3", "w2"),
    ),
    "olmoe": Contract(
        "olmoe.py OlmoeMoE: gate without quant_config",
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
        unquantized=EMBED_HEAD + r"|\.mlp\.gate$",
    ),
    "minimax_m2": Contract(
        "minimax_m2.py MiniMaxM2MoE: fp32 gate without quant_config; ckpt_names w1/w2/w3",
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
        unquantized=EMBED_HEAD + r"|\.block_sparse_moe\.gate$",
        expert_names=("w1", "w3", "w2"),
    ),
    "ernie4_5_moe": Contract(
        "ernie45_moe.py Ernie4_5_MoeMoE: fp32 gate without quant_config", unquantized=EMBED_HEAD + r"|\.mlp\.gate$"
    ),
    "deepseek_v3": Contract(
        "deepseek_v2.py DeepseekV2Model.load_weights (per-expert only), deepseek_mtp.py "
        "DeepSeekMultiTokenPredictorLayer (eh_proj is a torch nn.Linear)",
        packed={"gate_up_proj": ("gate_proj", "up_proj"), "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")},
        unquantized=EMBED_HEAD + r"|\.mlp\.gate$|\.eh_proj$|\.shared_head\.head$",
    ),
    "glm4_moe": Contract(
        "glm4_moe.py Glm4MoE (fp32 gate without quant_config), glm4_moe_mtp.py (eh_proj nn.Linear)",
        unquantized=EMBED_HEAD + r"|\.mlp\.gate$|\.eh_proj$|\.shared_head\.head$",
    ),
    "llama4": Contract(
        "mllama4.py Llama4ForConditionalGeneration (vision_model and multi_modal_projector with "
        "quant_config=None), llama4.py Llama4Model.load_moe_expert_weights (per-expert mapping)",
        unquantized=EMBED_HEAD + r"|^vision_model\.|^multi_modal_projector\.|\.feed_forward\.router$",
    ),
    "gpt_oss": Contract(
        "gpt_oss.py GptOssModel._load_weights_other: BF16 experts only, [E, H, 2I] interleaved",
        mapper=(("substr", ".self_attn.", ".attn."),),
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
        unquantized=EMBED_HEAD + r"|\.mlp\.router$",
        fused_bf16={
            r"mlp\.experts\.gate_up_proj": lambda c: (
                c["num_local_experts"],
                c["hidden_size"],
                2 * c["intermediate_size"],
            ),
            r"mlp\.experts\.gate_up_proj_bias": lambda c: (c["num_local_experts"], 2 * c["intermediate_size"]),
            r"mlp\.experts\.down_proj": lambda c: (c["num_local_experts"], c["intermediate_size"], c["hidden_size"]),
            r"mlp\.experts\.down_proj_bias": lambda c: (c["num_local_experts"], c["hidden_size"]),
        },
    ),
    "granitemoe": Contract(
        "granitemoe.py GraniteMoeMoE (gate without quant_config; GraniteMoeModel mapper "
        "router.layer -> gate); experts through RoutedExperts.load_weights",
        names=lambda m, c: re.sub(r"\.router\.layer$", ".gate", m),
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
        unquantized=EMBED_HEAD + r"|\.block_sparse_moe\.gate$",
    ),
    "dbrx": Contract(
        "dbrx.py DbrxExperts.weight_loader (stacked [E*I, H]; compressed-tensors never matches "
        "DbrxExperts), DbrxRouter.layer without quant_config",
        packed={},
        unquantized=EMBED_HEAD + r"|\.ffn\.router\.layer$",
        experts_prefix=lambda experts: re.sub(r"\.experts$", "", experts),
        ct_quantizes_experts=False,
        fused_bf16={
            r"ffn\.experts\.mlp\.(w1|v1|w2)": lambda c: (
                c["ffn_config"]["moe_num_experts"] * c["ffn_config"]["ffn_hidden_size"],
                c["d_model"],
            )
        },
    ),
    "qwen3_vl_moe": Contract(
        "qwen3_vl_moe.py (Qwen3-MoE block: gate quantizable), qwen3_vl.py mapper",
        mapper=(
            ("prefix", "model.visual.", "visual."),
            ("prefix", "lm_head.", "language_model.lm_head."),
            ("prefix", "model.language_model.", "language_model.model."),
        ),
        unquantized=EMBED_HEAD + r"|^visual\.pos_embed$",
    ),
    "gemma4": Contract(
        "gemma4.py Gemma4Router.proj (GateLinear without quant), gemma4_mm.py mapper and towers with quant_config",
        mapper=(
            ("prefix", "model.vision_tower", "vision_tower"),
            ("prefix", "model.embed_vision", "embed_vision"),
            ("prefix", "model.language_model.", "language_model.model."),
            ("prefix", "lm_head.", "language_model.lm_head."),
            ("prefix", "model", "language_model.model"),
        ),
        unquantized=EMBED_HEAD + r"|\.router\.proj$",
    ),
    "qwen3_next": Contract(
        "qwen3_next.py (gate, shared_expert_gate without quant_config; in_proj_ba with it), "
        "qwen3_next_mtp.py (mtp.fc with quant_config)",
        packed={**QKV_GATE_UP, "in_proj_qkvz": ("in_proj_qkvz",), "in_proj_ba": ("in_proj_ba",)},
        unquantized=EMBED_HEAD + r"|\.mlp\.gate$|\.shared_expert_gate$",
    ),
    "nemotron_h": Contract(
        "nemotron_h.py NemotronHMoE (fp32 gate without quant_config; experts up/down only)",
        mapper=(("substr", "A_log", "A"), ("substr", "embeddings", "embed_tokens"), ("prefix", "backbone", "model")),
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
        unquantized=EMBED_HEAD + r"|\.mixer\.gate$",
        expert_names=("up_proj", None, "down_proj"),
    ),
    "falcon_h1": Contract(
        "falcon_h1.py FalconH1ParallelHybrid (attention and Mamba prefixes)",
        mapper=(("substr", "A_log", "A"), ("substr", "mamba", "mamba.mamba")),
        names=_falcon_h1_names,
    ),
    "jamba": Contract(
        "jamba.py JambaForCausalLM; layers/mamba/mamba_mixer.py MambaMixer (no quant_config)",
        mapper=(("substr", ".self_attn.", "."), ("substr", ".A_log", ".A")),
        packed={**QKV_GATE_UP, "in_proj": ("in_proj",)},
        unquantized=EMBED_HEAD + r"|\.mamba\.\w+$|\.feed_forward\.router$",
    ),
    "qwen2_5_vl": Contract(
        "qwen2_5_vl.py: the vision tower is built with quant_config",
        mapper=(
            ("prefix", "model.language_model.", "language_model.model."),
            ("prefix", "model.visual.", "visual."),
            ("prefix", "lm_head.", "language_model.lm_head."),
            ("prefix", "model.", "language_model.model."),
        ),
    ),
    "gemma3": Contract(
        "gemma3_mm.py: SiglipVisionModel with quant_config; projector has no linears", mapper=_LLAVA_MAPPER
    ),
    "mistral3": Contract(
        "mistral3.py: Pixtral tower and projector with quant_config, patch_merger.merging_layer a plain nn.Linear",
        mapper=_LLAVA_MAPPER + (("prefix", "model.", "language_model.model."),),
        unquantized=EMBED_HEAD + r"|\.patch_merger\.merging_layer$",
    ),
    "llava": Contract("llava.py: CLIP tower and projector with quant_config", mapper=_LLAVA_MAPPER),
    "falcon": Contract(
        "falcon.py FalconModel.load_weights (query_key_value rows regrouped per KV head)",
        packed={},
        unquantized=EMBED_HEAD + r"|(^|\.)word_embeddings$",
    ),
    # further model_types the registry lists (tested in two combinations)
    "mistral": Contract("mistral.py MistralForCausalLM (LlamaForCausalLM)"),
    "qwen2": Contract("qwen2.py Qwen2ForCausalLM"),
    "glm4": Contract(
        "glm4.py Glm4ForCausalLM (gate_up_proj fused on disk)",
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_up_proj",)},
    ),
    "olmo2": Contract("olmo2.py Olmo2ForCausalLM"),
    "granite": Contract("granite.py GraniteForCausalLM"),
    "starcoder2": Contract("starcoder2.py Starcoder2ForCausalLM (c_fc/c_proj are nn.Linear-shaped)"),
    "qwen2_moe": Contract(
        "qwen2_moe.py Qwen2MoeSparseMoeBlock (gate GateLinear without quant_config, "
        "shared_expert_gate quant_config=None)",
        unquantized=EMBED_HEAD + r"|\.mlp\.gate$|\.shared_expert_gate$",
    ),
    "deepseek_v2": Contract(
        "deepseek_v2.py DeepseekV2MoE (gate without quant_config)",
        packed={"gate_up_proj": ("gate_proj", "up_proj"), "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")},
        unquantized=EMBED_HEAD + r"|\.mlp\.gate$",
    ),
    "llama4_text": Contract(
        "llama4.py Llama4ForCausalLM, Llama4Model.load_moe_expert_weights",
        unquantized=EMBED_HEAD + r"|\.feed_forward\.router$",
    ),
    "granitemoeshared": Contract(
        "granitemoeshared.py (GraniteMoeModel mapper; shared_mlp.input_linear fused on disk)",
        names=lambda m, c: re.sub(r"\.router\.layer$", ".gate", m),
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "input_linear": ("input_linear",)},
        unquantized=EMBED_HEAD + r"|\.block_sparse_moe\.gate$",
    ),
    "granitemoehybrid": Contract(
        "granitemoehybrid.py GraniteMoeHybridModel.load_weights (_load_quant_expert maps "
        "block_sparse_moe.experts.{e}.gate_proj/up_proj/down_proj; router.layer -> gate); its MambaMixer2 "
        "is the attribute `mamba` built with the prefix `.mixer`",
        names=lambda m, c: re.sub(r"\.router\.layer$", ".gate", m.replace(".mamba.", ".mixer.")),
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "in_proj": ("in_proj",), "input_linear": ("input_linear",)},
        unquantized=EMBED_HEAD + r"|\.block_sparse_moe\.gate$",
    ),
    "qwen3_vl": Contract(
        "qwen3_vl.py: the vision tower is built with quant_config",
        mapper=(
            ("prefix", "model.visual.", "visual."),
            ("prefix", "lm_head.", "language_model.lm_head."),
            ("prefix", "model.language_model.", "language_model.model."),
        ),
    ),
    "qwen3_5": Contract(
        "qwen3_5.py Qwen3_5ForConditionalGeneration (Qwen3-VL mapper, in_proj_qkvz/in_proj_ba packed)",
        mapper=(
            ("prefix", "model.visual.", "visual."),
            ("prefix", "lm_head.", "language_model.lm_head."),
            ("prefix", "model.language_model.", "language_model.model."),
        ),
        packed={**QKV_GATE_UP, "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")},
    ),
    "qwen3_5_moe": Contract(
        "qwen3_5.py Qwen3_5MoeForConditionalGeneration (Qwen3NextSparseMoeBlock: gate and "
        "shared_expert_gate without quant_config)",
        mapper=(
            ("prefix", "model.visual.", "visual."),
            ("prefix", "lm_head.", "language_model.lm_head."),
            ("prefix", "model.language_model.", "language_model.model."),
        ),
        packed={**QKV_GATE_UP, "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")},
        unquantized=EMBED_HEAD + r"|\.mlp\.gate$|\.shared_expert_gate$",
    ),
}


def apply_mapper(contract: Contract, name: str) -> str:
    """vLLM's WeightsMapper renaming: substr rules, then prefix rules, then suffix rules, in order."""
    for kind in ("substr", "prefix", "suffix"):
        for k, old, new in contract.mapper:
            if k != kind:
                continue
            if kind == "substr" and old in name:
                name = name.replace(old, new, 1)
            elif kind == "prefix" and name.startswith(old):
                name = new + name[len(old) :]
            elif kind == "suffix" and name.endswith(old):
                name = name[: -len(old)] + new
    return name


def vllm_name(contract: Contract, module: str, config: dict) -> str:
    """vLLM's name (the prefix its quant config sees) of a checkpoint module: where its module tree
    follows the checkpoint, the mapper's renaming of the weight's name (`<module>.weight`)."""
    if contract.names:
        return contract.names(module, text_config(config))
    return apply_mapper(contract, module + ".weight")[: -len(".weight")]


def vllm_ignore(contract: Contract, ignore: list[str], fmt: str) -> list[str]:
    """The ignore list as vLLM holds it after apply_vllm_mapper."""
    if fmt == "fp8":
        return [apply_mapper(contract, e) for e in ignore]
    return [apply_mapper(contract, e) if "." in e and not e.startswith("re:") else e for e in ignore]


def ct_matches(name: str, entries: list[str]) -> bool:
    return any(re.match(e[3:], name) if e.startswith("re:") else e == name for e in entries)


def vllm_skips_module(name: str, entries: list[str], fmt: str) -> bool:
    """One (non-expert) module: fp8 is_layer_skipped(match_mode="exact"), or compressed-tensors."""
    if fmt == "fp8":
        if "experts" in name:  # quant_utils.py: any ignored entry containing "experts" that contains the prefix
            return any(name in e for e in entries if "experts" in e)
        return name in entries
    return ct_matches(name, entries)


def vllm_skips_experts(contract: Contract, experts: str, entries: list[str], fmt: str) -> bool:
    """A MoE layer (vLLM prefix `experts`): fp8 by is_layer_skipped, compressed-tensors by the synthetic
    per-expert names get_moe_method builds (all three must agree, else vLLM raises)."""
    if fmt == "fp8":
        return vllm_skips_module(experts, entries, fmt)
    if not contract.ct_quantizes_experts:
        return True
    names = [f"{experts}.0.{n}" for n in contract.expert_names if n] + (
        [f"{experts}.0.None"] if None in contract.expert_names else []
    )
    skipped = {ct_matches(n, entries) for n in names}
    assert len(skipped) == 1, f"{experts}: vLLM raises: some of {names} ignored, some not"
    return skipped.pop()


EXPERT_OUTPUT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<member>[^.]+)$")
