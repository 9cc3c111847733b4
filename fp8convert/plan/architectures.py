"""The architecture registry: one `Architecture` (family.py) per config.json `model_type`; others get the
generic rules. Upstream files are cited by path in vLLM 0.33 and transformers 5.24."""

from __future__ import annotations

import re

from ..options import Format, Scheme
from .family import (
    FUSED_SIBLINGS,
    IN_OUT,
    MTP_LAYERS,
    MTP_MODULE,
    OUT_IN,
    ROUTER,
    TOWER,
    Architecture,
    Caveat,
    Experts,
    ExpertTensor,
    Keep,
    Limit,
    config_value,
)


def gate_up_down(
    block: str,
    stored: tuple[str, ...],
    gate_up: str = "experts.gate_up_proj",
    down: str = "experts.down_proj",
    interleaved: bool = False,
) -> tuple[ExpertTensor, ExpertTensor]:
    """The usual pair of fused expert tensors under the MoE block `block` (a regex): gate_up, then down."""
    return (
        ExpertTensor(rf"(?P<block>{block})\.{re.escape(gate_up)}", ("gate_proj", "up_proj"), stored, interleaved),
        ExpertTensor(rf"(?P<block>{block})\.{re.escape(down)}", ("down_proj",), stored),
    )


def legacy_vllm_names(*towers: str) -> tuple[tuple[str, str], ...]:
    """vLLM's mapper from transformers' multimodal names back to the legacy ones."""
    return (
        (r"^model\.language_model\.", "language_model.model."),
        *((rf"^model\.{tower}\.", f"{tower}.") for tower in towers),
        (r"^lm_head$", "language_model.lm_head"),
    )


# transformers loads the legacy multimodal layout under model.* (conversion_mapping.py, "llava"); vLLM maps
# the new names back to the legacy ones (llava.py, gemma3_mm.py, mistral3.py: hf_to_vllm_mapper).
_LLAVA_TRANSFORMERS = (
    (r"^language_model\.model\.", "model.language_model."),
    (r"^language_model\.lm_head$", "lm_head"),
    (r"^vision_tower\.vision_model\.", "model.vision_tower."),  # CLIP/SigLIP towers drop a level
    (r"^vision_tower\.", "model.vision_tower."),
    (r"^multi_modal_projector\.", "model.multi_modal_projector."),
)
_LLAVA_VLLM = legacy_vllm_names("vision_tower", "multi_modal_projector")
# Qwen-VL: vllm/model_executor/models/qwen3_vl.py and qwen2_5_vl.py, hf_to_vllm_mapper.
_QWEN_VL_VLLM = legacy_vllm_names("visual")
_MOE_ROUTED = "routed experts, one FP8 weight per expert"
_DELTANET_BA = "gated DeltaNet b/a projection (FP8 in vLLM corrupts output)"
_MTP_FC = Keep(r"^mtp\.fc$", "MTP input projection")
_TOWER_NOTE = (
    "vision tower and projector kept; vLLM builds them quantizable, so each of their linears is listed, "
    "in transformers' and vLLM's names too"
)


def _multimodal(name: str, model_types: tuple[str, ...], **fields) -> Architecture:
    """A vision-language family of which only the language model is quantized."""
    return Architecture(name, model_types, **{"quantized": "language model linears", "notes": _TOWER_NOTE} | fields)


def _falcon_h1_vllm_name(module: str, config: dict) -> str:
    """vllm/model_executor/models/falcon_h1.py builds attention at model.layers.N.{q,k,v,o}_proj, Mamba at
    model.{L + N}.mixer.*: checkpoint names do not reach them through its mapper."""
    if m := re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.(\w+)", module):
        return f"model.layers.{m[1]}.{m[2]}"
    if m := re.fullmatch(r"model\.layers\.(\d+)\.mamba\.(\w+)", module):
        return f"model.{int(m[1]) + int(config_value(config, 'num_hidden_layers') or 0)}.mixer.{m[2]}"
    return module


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        "Llama-style dense",
        ("llama", "mistral", "qwen2", "qwen3", "gemma2", "glm4", "olmo2", "granite", "starcoder2"),
        notes="q/k/v and gate/up share one scale per layer in the tensor scheme",
    ),
    Architecture(
        # vllm/model_executor/models/falcon.py FalconModel.load_weights (128-row blocks span 64-row heads).
        "Falcon",
        ("falcon",),
        keep=(
            Keep(
                r"\.self_attention\.query_key_value$",
                "vLLM's Falcon loader regroups query_key_value rows per KV head, scales included, which 128-row "
                "block scales cannot follow; --scheme channel or tensor quantizes it",
                schemes=(Scheme.BLOCK,),
            ),
        ),
        quantized="attention and MLP linears (query_key_value kept under --scheme block)",
    ),
    Architecture(
        "Phi-3",
        ("phi3",),
        quantized="attention and MLP linears (q/k/v and gate/up already fused in the checkpoint: one scale each)",
    ),
    Architecture(
        # transformers/models/gpt2/modeling_gpt2.py: Conv1D computes x @ W + b with W stored [in, out].
        "GPT-2",
        ("gpt2",),
        keep=(Keep(r"\.(c_attn|c_proj|c_fc)$", "Conv1D weight stored [in, out] (transformers has no FP8 Conv1D)"),),
        quantized="nothing: every linear is a Conv1D",
        notes="quantize refuses it: there is nothing to quantize",
    ),
    Architecture(
        # vllm/model_executor/models/qwen3_moe.py: router `mlp.gate` is a GateLinear built with the quant
        # config; experts load per expert (RoutedExperts.load_weights).
        "Qwen-MoE",
        ("qwen2_moe", "qwen3_moe", "olmoe"),
        quantized=f"attention, shared experts, {_MOE_ROUTED}",
        notes="routers `mlp.gate` and `shared_expert_gate` kept and listed (vLLM builds Qwen3-MoE's router "
        "with the quant config)",
    ),
    Architecture(
        # transformers conversion_mapping.py "mixtral": block_sparse_moe -> mlp; PhiMoE also gate -> router,
        # an nn.Linear subclass that compressed-tensors would quantize unless its in-memory name is listed.
        "Mixtral-style MoE",
        ("mixtral", "minimax_m2"),
        transformers_names=((r"\.block_sparse_moe\.", ".mlp."),),
        quantized=f"attention, {_MOE_ROUTED} (w1/w3 share a scale)",
    ),
    Architecture(
        "PhiMoE",
        ("phimoe",),
        transformers_names=((r"\.block_sparse_moe\.gate$", ".mlp.router"), (r"\.block_sparse_moe\.", ".mlp.")),
        quantized=f"attention, {_MOE_ROUTED}",
        notes="router listed also as transformers names it (`mlp.router`, an nn.Linear there)",
    ),
    Architecture(
        # vllm/model_executor/models/deepseek_mtp.py: a decoder layer plus eh_proj and shared_head.head.
        "DeepSeek-V3 / GLM-4.5",
        ("deepseek_v2", "deepseek_v3", "glm4_moe"),
        keep=(
            Keep(r"\.eh_proj$", "MTP input projection (vLLM builds it as a plain nn.Linear)"),
            Keep(r"\.shared_head\.head$", "output head"),
        ),
        mtp=MTP_LAYERS,
        quantized=f"attention (q_a_proj + kv_a_proj_with_mqa share a scale), shared experts, {_MOE_ROUTED}, "
        "MTP decoder layers",
        notes="MTP layers `model.layers.{num_hidden_layers + i}` converted like decoder layers (vLLM's MTP "
        "loads them); their eh_proj and shared_head stay BF16",
    ),
    Architecture(
        # vllm/model_executor/models/ernie45_moe.py: gate built without quant config; moe_statics 2-D bias.
        "ERNIE-4.5-MoE",
        ("ernie4_5_moe",),
        quantized=f"attention, shared experts, {_MOE_ROUTED}",
    ),
    Architecture(
        # vllm/model_executor/models/llama4.py: per-expert 2-D experts load for every scheme (fused ones
        # load no per-tensor scales); transformers' compressed-tensors path: SequentialLlama4TextExperts.
        "Llama-4",
        ("llama4", "llama4_text"),
        keep=(
            Keep(
                r"^(language_model\.)?model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj)$",
                "vLLM's Llama-4 loader permutes q/k rows per head and cannot permute 128x128 block scales",
                formats=(Format.COMPRESSED_TENSORS,),
                schemes=(Scheme.BLOCK,),
            ),
        ),
        experts=Experts(
            gate_up_down(r".+\.feed_forward", (IN_OUT,)),
            transformers_loads_split=(Format.COMPRESSED_TENSORS,),
        ),
        quantized=f"attention, shared expert, dense MLPs, {_MOE_ROUTED}",
        notes="fused experts [E, hidden, 2*inter] (gate, up concatenated) split per expert and transposed to "
        "[out, in]; transformers loads them under compressed-tensors only (in the fp8 format it leaves the "
        "experts randomly initialised)",
    ),
    Architecture(
        # vllm/model_executor/models/gpt_oss.py: GptOssModel.load_weights sends fp8 and compressed-tensors
        # checkpoints to _load_weights_other, the BF16 path (no expert scales).
        "gpt-oss",
        ("gpt_oss",),
        experts=Experts(
            gate_up_down(r".+\.mlp", (IN_OUT,), interleaved=True),
            kept="no FP8 expert layout loads for gpt-oss (vLLM 0.33 reads fp8 and compressed-tensors gpt-oss "
            "experts as BF16; transformers 5.24 has no converter for them)",
        ),
        vllm_names=((r"\.self_attn\.", ".attn."),),
        quantized="attention",
        notes="experts (gate/up interleaved, with biases) stay BF16, fused as released",
    ),
    Architecture(
        # vllm/model_executor/models/qwen3_next.py: in_proj_ba is quantizable, but FP8 corrupts it (vLLM
        # #47445: "ba_proj doesn't support blockwise fp8"); qwen3_next_mtp.py: mtp.fc, kept like eh_proj.
        "Qwen3-Next",
        ("qwen3_next",),
        keep=(Keep(r"\.linear_attn\.in_proj_ba$", _DELTANET_BA), _MTP_FC),
        mtp=MTP_MODULE,
        quantized=f"attention, DeltaNet in_proj_qkvz/out_proj, shared expert, {_MOE_ROUTED}, MTP layers",
        notes="`mtp.*` layers converted like decoder layers",
    ),
    Architecture(
        # vllm/model_executor/models/qwen3_5.py packs in_proj_qkv with in_proj_z, in_proj_b with in_proj_a.
        "Qwen3.5",
        ("qwen3_5", "qwen3_5_moe"),
        fused=FUSED_SIBLINGS + (("in_proj_qkv", "in_proj_z"), ("in_proj_b", "in_proj_a")),
        keep=(Keep(r"\.linear_attn\.in_proj_[ab]$", _DELTANET_BA), _MTP_FC),
        mtp=MTP_MODULE,
        vllm_names=_QWEN_VL_VLLM,
        quantized=f"language model attention, DeltaNet, MLPs / {_MOE_ROUTED}, MTP layers",
    ),
    Architecture(
        # vllm/model_executor/models/nemotron_h.py: the router mixer.gate is an fp32 GateLinear; experts
        # are non-gated (up, down). Renames: its mapper, and transformers' conversion_mapping.py.
        "Nemotron-H",
        ("nemotron_h",),
        keep=(Keep(r"\.mixer\.gate$", ROUTER),),
        mtp=MTP_MODULE,
        transformers_names=((r"^backbone\.", "model."),),
        vllm_names=((r"^backbone\.", "model."), (r"\.embeddings$", ".embed_tokens")),
        quantized=f"Mamba2 in_proj/out_proj, attention, MLPs, {_MOE_ROUTED} (up, down)",
    ),
    Architecture(
        "Falcon-H1",
        ("falcon_h1",),
        vllm_name_fn=_falcon_h1_vllm_name,
        quantized="attention, Mamba2 in_proj/out_proj, MLP",
        notes="ignore list also in vLLM's own module names (its module tree differs from the checkpoint's)",
    ),
    Architecture(
        # vllm/layers/mamba/mamba_mixer.py: MambaMixer builds its projections without the quant config.
        "Jamba",
        ("jamba",),
        keep=(Keep(r"\.mamba\.(in_proj|x_proj|dt_proj|out_proj)$", "Mamba mixer (vLLM builds it unquantized)"),),
        vllm_names=((r"\.self_attn\.", "."),),
        quantized=f"attention, MLPs, {_MOE_ROUTED}",
        notes="Mamba mixers stay BF16",
    ),
    Architecture(
        # transformers conversion_mapping.py "granitemoe" merges no per-expert weights and reads fused FP8
        # experts as their codes; vLLM's granitemoe.py loads per-expert 2-D: no FP8 layout loads in both.
        "GraniteMoE",
        ("granitemoe", "granitemoeshared", "granitemoehybrid"),
        keep=(Keep(r"\.router\.layer$", ROUTER),),
        experts=Experts(
            gate_up_down(r".+\.block_sparse_moe", (OUT_IN,), gate_up="input_linear.weight", down="output_linear.weight")
        ),
        transformers_names=((r"\.router\.layer$", ".router"),),
        # granitemoehybrid.py builds its Mamba2 mixer `self.mamba` under the prefix `.mixer`
        vllm_names=((r"\.router\.layer$", ".gate"), (r"\.mamba\.", ".mixer.")),
        quantized=f"attention, shared MLP, {_MOE_ROUTED}",
        notes="fused experts [E, 2*inter, hidden] split per expert, as vLLM loads them; transformers loads "
        "that with the experts randomly initialised",
    ),
    Architecture(
        # vllm/model_executor/models/dbrx.py: DbrxExperts take only stacked [E*I, H] tensors, which
        # compressed-tensors never quantizes; its RoutedExperts prefix is `...ffn` (no "experts").
        "DBRX",
        ("dbrx",),
        keep=(Keep(r"\.ffn\.router\.layer$", ROUTER),),
        experts=Experts(
            (
                ExpertTensor(r"(?P<block>.+\.ffn)\.experts\.mlp\.(w1|v1)", ("gate_proj",), (OUT_IN,)),
                ExpertTensor(r"(?P<block>.+\.ffn)\.experts\.mlp\.w2", ("down_proj",), (IN_OUT,)),
            ),
            count=("ffn_config.moe_num_experts",),
            width=("ffn_config.ffn_hidden_size",),
            kept="no FP8 expert layout loads for DBRX (vLLM's DbrxExperts take no compressed-tensors "
            "scales and no per-expert weights)",
        ),
        vllm_names=((r"\.ffn\.experts$", ".ffn"),),
        quantized="attention (Wqkv, out_proj)",
        notes="experts [E*inter, hidden] stay BF16",
    ),
    Architecture(
        # vllm/model_executor/models/qwen3_vl_moe.py reads [E, H, 2I] as released; transformers saves [E, 2I, H].
        "Qwen3-VL-MoE",
        ("qwen3_vl_moe",),
        experts=Experts(
            gate_up_down(r".+\.mlp", (IN_OUT, OUT_IN)),
            count=("num_experts", "num_local_experts"),
            width=("moe_intermediate_size",),
        ),
        vllm_names=_QWEN_VL_VLLM,
        quantized=f"language model attention, {_MOE_ROUTED}",
        notes="fused experts ([E, hidden, 2*inter] as released, or [E, 2*inter, hidden] as transformers "
        "saves them: told apart by the config's sizes, as released where both fit) split per expert",
    ),
    Architecture(
        # vllm/model_executor/models/gemma4.py: router.proj built without quant config; experts fused
        # [E, 2I, H] (F.linear orientation); embed_vision.embedding_projection is quantizable there.
        "Gemma-4",
        ("gemma4",),
        keep=(Keep(r"\.router\.proj$", ROUTER), Keep(r"(^|\.)embed_(vision|audio)\.", TOWER)),
        experts=Experts(
            gate_up_down(r".+\.layers\.\d+", (OUT_IN,)), count=("num_experts",), width=("moe_intermediate_size",)
        ),
        vllm_names=legacy_vllm_names("vision_tower", "embed_vision"),
        quantized=f"language model attention, dense MLP, per-layer projections, {_MOE_ROUTED}",
    ),
    _multimodal(
        # vllm/model_executor/models/qwen2_5_vl.py builds the vision tower with the quant config, so every
        # tower linear must be listed.
        "Qwen2.5-VL",
        ("qwen2_5_vl",),
        transformers_names=(
            (r"^visual\.", "model.visual."),
            (r"^model\.(?!visual\.|language_model\.)", "model.language_model."),
        ),
        vllm_names=_QWEN_VL_VLLM + ((r"^model\.", "language_model.model."),),
    ),
    _multimodal("Qwen3-VL", ("qwen3_vl",), vllm_names=_QWEN_VL_VLLM),
    Architecture(
        # transformers conversion_mapping.py "mllama": the legacy names load under model.*, and
        # compressed-tensors matches the ignore list there. vLLM: model_executor/models/registry.py.
        "Mllama",
        ("mllama",),
        transformers_names=_LLAVA_TRANSFORMERS[:2] + ((r"^(vision_model|multi_modal_projector)\b", r"model.\1"),),
        limits=(
            Limit(Caveat.VLLM_CANNOT_LOAD, "vLLM does not serve Mllama (removed in vLLM 0.10.2); transformers can"),
        ),
        quantized="language model linears, cross-attention included",
        notes="vision tower and projector kept, listed also as transformers names them (`model.vision_model.*`)",
    ),
    _multimodal("Gemma-3", ("gemma3",), transformers_names=_LLAVA_TRANSFORMERS, vllm_names=_LLAVA_VLLM),
    _multimodal("Llava", ("llava",), transformers_names=_LLAVA_TRANSFORMERS, vllm_names=_LLAVA_VLLM),
    _multimodal(
        # vllm/model_executor/models/mistral3.py: hf_to_vllm_mapper renames `.weight_scale_inv`.
        "Mistral-3",
        ("mistral3",),
        transformers_names=_LLAVA_TRANSFORMERS,
        vllm_names=_LLAVA_VLLM + ((r"^model\.", "language_model.model."),),
        limits=(
            Limit(
                Caveat.VLLM_CANNOT_LOAD,
                "vLLM's Mistral-3 loader renames weight_scale_inv to weight_scale, which fp8-format block layers "
                "do not have; use --format compressed-tensors",
                formats=(Format.FP8,),
                schemes=(Scheme.BLOCK,),
            ),
        ),
        notes=_TOWER_NOTE + "; fp8-format block scales do not load in vLLM (its loader renames weight_scale_inv)",
    ),
)

_BY_MODEL_TYPE = {t: arch for arch in ARCHITECTURES for t in arch.model_types}


def architecture_of(config: dict) -> Architecture | None:
    """The registered family of a config.json, or None (then the generic rules apply)."""
    return _BY_MODEL_TYPE.get(config.get("model_type"))


def architectures_table() -> str:
    """The README's "Supported architectures" table, rendered from the registry."""
    rows = [
        "| architecture | model_type | quantized | kept beyond the generic rules | notes |",
        "|---|---|---|---|---|",
    ]
    for arch in ARCHITECTURES:
        kept = [
            k.reason + (f" ({', '.join(k.formats + k.schemes)})" if k.formats or k.schemes else "") for k in arch.keep
        ]
        kept += ["fused experts: " + arch.experts.kept] if arch.experts and arch.experts.kept else []
        types, kept_text = ", ".join(f"`{t}`" for t in arch.model_types), "; ".join(dict.fromkeys(kept))
        rows.append(f"| {arch.name} | {types} | {arch.quantized} | {kept_text or 'generic only'} | {arch.notes} |")
    return "\n".join(rows)
