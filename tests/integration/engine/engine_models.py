"""The tests/zoo.py models resized for vLLM's CPU build, and which families and formats to run.

vLLM's CPU kernels reject several of the zoo's tiny dims (head dims below 64 in some attention and
linear-attention kernels, MLA head dims other than 576, Llama-4 attention chunks below 128), so the
engine models use head_dim 128 and widths that are multiples of 128: the layouts, names and config
structure stay the zoo's, only sizes change.
"""

from __future__ import annotations

import json
from pathlib import Path

import zoo

# Sizes set wherever the (text) config has the key.
TEXT_SIZES = {
    "hidden_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "intermediate_size": 256,
    "intermediate_size_mlp": 256,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "moe_shared_expert_intermediate_size": 128,
    "shared_intermediate_size": 128,
    # DeepSeek MLA: vLLM's CPU MLA wants kv_lora_rank + qk_rope_head_dim = 576
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "q_lora_rank": 256,
    # gated DeltaNet
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    # Mamba2 mixers: 2 heads of 128
    "mamba_n_heads": 2,
    "mamba_d_head": 128,
    "mamba_num_heads": 2,
    "mamba_head_dim": 128,
    "mamba_d_ssm": 256,
    "attention_chunk_size": 128,
}
# What the DeepSeek configs derive from the MLA sizes at construction (head_dim is the rope part)
_MLA_DERIVED = {"head_dim": 64, "qk_head_dim": 192}
# MLA has no grouped K/V: every query head gets its own K/V from kv_b_proj, and transformers' attention
# repeats K/V num_attention_heads / num_key_value_heads times, so the two must be equal (as released)
_MLA = {**_MLA_DERIVED, "num_key_value_heads": TEXT_SIZES["num_attention_heads"]}
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [16, 24, 24]}
# Qwen3.5 rotates half of each head: 64 dims, sections adding up to 32
_MROPE_HALF_ROTARY = {**_MROPE, "mrope_section": [11, 11, 10], "mrope_interleaved": True, "partial_rotary_factor": 0.5}
# Families whose sizes live under other keys.
EXTRA = {
    "gpt2": {"n_embd": 256, "n_head": 2, "n_inner": 256},
    "dbrx": {
        "d_model": 256,
        "n_heads": 2,
        "attn_config.kv_n_heads": 1,
        "ffn_config.ffn_hidden_size": 128,
        "ffn_config.hidden_size": 256,
    },
    "gemma2": {"query_pre_attn_scalar": 128},
    "gemma3": {"text_config.query_pre_attn_scalar": 128},
    # its full-attention layer's wider heads (the zoo's 32 would end the fused q/k/v mid-block)
    "gemma4": {"text_config.per_layer_config": {"1": {"head_dim": 256}}},
    # M-RoPE sections must add up to half the head dim (vLLM asserts it): the released models' for 128
    "qwen2_5_vl": {"vision_config.out_hidden_size": 256, "text_config.rope_parameters": _MROPE},
    "qwen3_vl": {
        "vision_config.out_hidden_size": 256,
        "text_config.rope_parameters": {**_MROPE, "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    },
    "qwen3_vl_moe": {  # vLLM reads norm_topk_prob, which transformers' config lacks (its MoE always normalizes)
        "text_config.norm_topk_prob": True,
        "vision_config.out_hidden_size": 256,
        "text_config.rope_parameters": {**_MROPE, "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    },
    "qwen3_5": {"vision_config.out_hidden_size": 256, "text_config.rope_parameters": _MROPE_HALF_ROTARY},
    "qwen3_5_moe": {"vision_config.out_hidden_size": 256, "text_config.rope_parameters": _MROPE_HALF_ROTARY},
    # Falcon: head dim 64 as released; vLLM sizes its MLP 4 x hidden whatever ffn_hidden_size says
    "falcon": {"hidden_size": 256, "num_attention_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 1024},
    # Llama-4 routes each token to one expert, and vLLM implements its router-weighted input for top-1 only
    "llama4_text": {"num_experts_per_tok": 1},
    "llama4": {"vision_config.projector_output_dim": 256, "text_config.num_experts_per_tok": 1},
    # config fields the released checkpoints have and transformers 5 no longer writes; vLLM reads them
    # (use_routing_bias: without it vLLM builds no parameter for the checkpoint's e_score_correction_bias)
    "minimax_m2": {"rotary_dim": 64, "scoring_func": "sigmoid", "use_routing_bias": True},
    "deepseek_v3": {"topk_method": "noaux_tc", **_MLA},
    "deepseek_v2": _MLA,
    "granitemoehybrid": {"mamba_n_heads": 4},  # its config checks n_heads * d_head == 2 * hidden_size
}


def engine_overrides(arch: str) -> dict:
    """config_overrides for zoo.make that give `arch` the sizes above."""
    cfg = zoo.ARCHS[arch].config()
    text = cfg.get_text_config()
    prefix = "" if text is cfg else next(f"{k}." for k in ("text_config",) if getattr(cfg, k, None) is text)
    present = text.to_dict()
    out = {prefix + k: v for k, v in TEXT_SIZES.items() if k in present}
    out.update(EXTRA.get(arch, {}))
    return out


# Keys every transformers sub-config writes, which released DBRX configs do not have in attn_config and
# ffn_config, and vLLM's DbrxConfig refuses ("Found unknown kwargs").
_SUBCONFIG_BOILERPLATE = (
    "_name_or_path",
    "architectures",
    "chunk_size_feed_forward",
    "dtype",
    "id2label",
    "label2id",
    "is_encoder_decoder",
    "model_type",
    "output_attentions",
    "output_hidden_states",
    "problem_type",
    "return_dict",
)


# Engine models that are a zoo family with other config values: name -> (zoo family, config overrides).
VARIANTS = {
    # Qwen3-MoE with 4 experts, all active: each carries a quarter of the MoE output (a sixteenth in the
    # zoo's), so what a wrongly decoded expert does shows in the log-probs (test_engine_fp4.py)
    "qwen3_moe_4e": ("qwen3_moe", {"num_local_experts": 4, "num_experts_per_tok": 4}),
}


def make_engine_model(arch: str, path, **overrides) -> Path:
    """The engine-sized `arch` (a zoo family or a VARIANTS name) at `path`; `overrides` (config keys) go
    on top of the engine sizes."""
    arch, variant = VARIANTS.get(arch, (arch, {}))
    path = zoo.make(arch, Path(path), config_overrides={**engine_overrides(arch), **variant, **overrides})
    if arch == "dbrx":
        config = json.loads((path / "config.json").read_text())
        for sub in ("attn_config", "ffn_config"):
            config[sub] = {k: v for k, v in config[sub].items() if k not in _SUBCONFIG_BOILERPLATE}
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


# The formats vLLM's CPU build can run at all (llama, measured): compressed-tensors channel (dense
# layers only: its per-channel FP8 MoE has no CPU kernel), and both block formats (AMX kernels, or
# the emulated GEMM without AMX). Per-tensor scales need `static_scaled_fp8_quant`, which the CPU
# build lacks (vLLM calls it to requantize fused layers to one scale); MXFP8 has no CPU kernel.
FORMATS = (("compressed-tensors", "channel"), ("compressed-tensors", "block"), ("fp8", "block"))
# The docs' mixed recipes give the MoE experts (the modules this pattern matches) an FP4 scheme.
EXPERTS = r"re:.*mlp\.experts\..*"
FORMAT_IDS = {
    ("compressed-tensors", "channel"): "ct-channel",
    ("compressed-tensors", "block"): "ct-block",
    ("fp8", "block"): "fp8-block",
}
