"""A zoo of tiny random Hugging Face checkpoints, one per architecture people convert to FP8.

Every model is built with transformers' own classes from a tiny config (2 decoder layers, hidden
size 64 or 128, vocabulary 256, 16 experts of width 48, small vision towers), given
non-degenerate random weights from a fixed seed, and written with `save_pretrained` in several
safetensors shards. Nothing is downloaded.

    from zoo import ARCHS, make, logits
    path = make("llama4", tmp_path / "llama4")      # -> Path of a sharded checkpoint
    ref = logits(path)                               # fixed prompt, CPU, float32

Conventions
- Linear dimensions are multiples of 16 where the architecture allows it, and some exceed 128 (the
  MLP width is 192 or 256: 1.5 or 2 blocks of 128), so block scales get several and partial blocks.
- Linear weights get std ~ factor / sqrt(fan_in) with a per-tensor factor in [0.5, 1.5] (members of a
  fused group then have clearly different amax); embeddings std 1; norms 1 + noise; other 1-D
  tensors (biases, A_log, dt_bias, e_score_correction_bias, sinks) small noise.
- MoE models route every token to every expert (top-k = number of experts): routing then varies
  smoothly with the weights, so FP8 noise cannot flip a top-k choice and a logits comparison
  measures the conversion, not routing chaos.
- Models whose real checkpoints carry MTP (next-token-prediction) layers that transformers does not
  instantiate in the main model (DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5) get those tensors
  written into an extra shard in the checkpoint layout of the real releases
  (`model.layers.{num_hidden_layers}.*` with enorm / hnorm / eh_proj / shared_head, or `mtp.*`).
- Multimodal models are saved through their `...ForConditionalGeneration` class; `logits` runs a
  text-only forward through that class.

The module has no side effects at import beyond importing torch; transformers is imported lazily.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["ARCHS", "Spec", "make", "build", "load", "logits", "PROMPT_IDS", "VOCAB"]

VOCAB = 256
HIDDEN = 64
N_EXPERTS = 16  # routers are [16, H]: kept because they are routers, not for their shape
MOE_I = 48  # expert width: 2*I = 96 and I differ from H = 64, so 3-D layouts are not ambiguous
PROMPT_IDS = (1, 17, 42, 99, 123, 7, 250, 64, 3, 200, 31, 5)
SEED = 0


@dataclass(frozen=True)
class Spec:
    """How to build one tiny architecture.

    model_type: transformers' `model_type` of the top-level config.
    config: builds the tiny config (a `PretrainedConfig`).
    model_class: the transformers class saved (and loaded back by `logits`).
    multimodal: True if the checkpoint has a vision/audio tower.
    mtp: None, "deepseek" (`model.layers.{L}.*` + enorm/hnorm/eh_proj/shared_head) or "qwen" (`mtp.*`):
        MTP tensors `make` adds to the checkpoint because transformers' main model does not save them.
    hub_fixup: where transformers 5.24's `save_pretrained` writes a layout other than the released
        checkpoints, and its loader accepts both, `make(hub_layout=True)` rewrites the saved names or
        layout into the released form (see `_HUB_FIXUPS`).
    notes: one line on what is special about the layout.
    """

    model_type: str
    config: Callable[[], Any]
    model_class: str = "AutoModelForCausalLM"
    multimodal: bool = False
    mtp: str | None = None
    notes: str = ""
    transposed_params: tuple[str, ...] = field(default=())  # param-name suffixes stored [.., in, out]
    hub_fixup: str | None = None  # see `_HUB_FIXUPS`


# ----------------------------------------------------------------------------- config helpers


def _tf():
    import transformers

    return transformers


def common_kwargs(**overrides) -> dict:
    """Keyword arguments shared by most decoder-only text configs."""
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(overrides)
    return kw


def _moe(**overrides) -> dict:
    kw = common_kwargs(intermediate_size=128)
    kw.update(overrides)
    return kw


def _cfg(class_name: str, **kwargs):
    return getattr(_tf(), class_name)(**kwargs)


def _qwen_vision(kind: str, out_hidden: int, **extra) -> dict:
    """A 2-block Qwen-VL style vision tower (patch 16, merge 2)."""
    kw = dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=out_hidden,
    )
    if kind == "qwen2_5_vl":
        kw.update(fullatt_block_indexes=[1], window_size=64)
    else:
        kw.update(num_position_embeddings=64)
    if kind in ("qwen3_vl", "qwen3_vl_moe"):
        kw.update(deepstack_visual_indexes=[0])
    kw.update(extra)
    return kw


def _text_vlm(model_type: str, **extra) -> dict:
    """Text sub-config kwargs of a multimodal model (`model_type` only names the caller)."""
    kw = common_kwargs(head_dim=16)
    kw.pop("bos_token_id"), kw.pop("eos_token_id")
    kw.update(extra)
    return kw


def _siglip(**extra) -> dict:
    kw = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, image_size=56, patch_size=14
    )
    kw.update(extra)
    return kw


def _clip(**extra) -> dict:
    kw = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=28,
        patch_size=14,
        projection_dim=64,
    )
    kw.update(extra)
    return kw


# ----------------------------------------------------------------------------- the zoo


def _specs() -> dict[str, Spec]:
    E = N_EXPERTS
    s: dict[str, Spec] = {}

    def add(name, config, **kw):
        s[name] = Spec(model_type=kw.pop("model_type", name), config=config, **kw)

    # --- dense decoders ---------------------------------------------------------------------
    add("llama", lambda: _cfg("LlamaConfig", **common_kwargs(hidden_size=128, intermediate_size=256, head_dim=32)))
    add("mistral", lambda: _cfg("MistralConfig", **common_kwargs(head_dim=16, sliding_window=64)))
    add("qwen2", lambda: _cfg("Qwen2Config", **common_kwargs()), notes="q/k/v biases")
    add("qwen3", lambda: _cfg("Qwen3Config", **common_kwargs(head_dim=32)), notes="q_norm/k_norm")
    add(
        "gemma2",
        lambda: _cfg(
            "Gemma2Config",
            **common_kwargs(head_dim=16, query_pre_attn_scalar=16, sliding_window=64, tie_word_embeddings=True),
        ),
        notes="tied embeddings, soft-capping, pre/post feedforward norms",
    )
    add(
        "phi3",
        lambda: _cfg("Phi3Config", **common_kwargs(num_key_value_heads=4)),
        notes="fused qkv_proj and gate_up_proj in the checkpoint",
    )
    add(
        "glm4",
        lambda: _cfg("Glm4Config", **common_kwargs(head_dim=16)),
        notes="fused gate_up_proj; post_self_attn/post_mlp norms",
    )
    add("olmo2", lambda: _cfg("Olmo2Config", **common_kwargs()), notes="q_norm/k_norm over all heads")
    add("olmo3", lambda: _cfg("Olmo3Config", **common_kwargs(sliding_window=64)))
    add("granite", lambda: _cfg("GraniteConfig", **common_kwargs(attention_multiplier=0.0625)))
    add(
        "cohere2",
        lambda: _cfg("Cohere2Config", **common_kwargs(sliding_window=64, tie_word_embeddings=True)),
        notes="LayerNorm without bias, parallel attention/MLP, tied embeddings",
    )
    add(
        "starcoder2",
        lambda: _cfg("Starcoder2Config", **common_kwargs(tie_word_embeddings=True)),
        notes="biases everywhere, c_fc/c_proj MLP (nn.Linear)",
    )
    add("exaone4", lambda: _cfg("Exaone4Config", **common_kwargs(sliding_window=64, sliding_window_pattern=2)))
    add("smollm3", lambda: _cfg("SmolLM3Config", **common_kwargs(no_rope_layer_interval=2)))
    add("seed_oss", lambda: _cfg("SeedOssConfig", **common_kwargs(head_dim=16)))
    add(
        "hunyuan_v1_dense",
        lambda: _cfg("HunYuanDenseV1Config", **common_kwargs(head_dim=16)),
        notes="query_layernorm/key_layernorm",
    )
    add("ernie4_5", lambda: _cfg("Ernie4_5Config", **common_kwargs(head_dim=16, tie_word_embeddings=False)))
    add(
        "apertus", lambda: _cfg("ApertusConfig", **common_kwargs()), notes="xIELU activation (1-D params), no gate_proj"
    )
    add("arcee", lambda: _cfg("ArceeConfig", **common_kwargs()), notes="relu2 MLP without gate_proj")
    add("nemotron", lambda: _cfg("NemotronConfig", **common_kwargs(head_dim=16)), notes="LayerNorm1P, relu2 MLP")
    add(
        "gpt2",
        lambda: _cfg(
            "GPT2Config",
            vocab_size=VOCAB,
            n_positions=128,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_inner=256,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=True,
        ),
        notes="Conv1D weights stored [in, out]; fused c_attn (q|k|v)",
        transposed_params=("c_attn.weight", "c_proj.weight", "c_fc.weight"),
    )
    add(
        "falcon",
        lambda: _cfg(
            "FalconConfig",
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            new_decoder_architecture=True,
            multi_query=False,
            parallel_attn=True,
            ffn_hidden_size=256,
            max_position_embeddings=128,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        notes="fused query_key_value: rows grouped per KV head (q heads of the group, then k, then v)",
    )

    # --- MoE decoders --------------------------------------------------------------------------
    add(
        "qwen2_moe",
        lambda: _cfg(
            "Qwen2MoeConfig",
            **_moe(
                moe_intermediate_size=MOE_I, shared_expert_intermediate_size=64, num_experts=E, num_experts_per_tok=E
            ),
        ),
        notes="shared_expert + shared_expert_gate",
    )
    add(
        "qwen3_moe",
        lambda: _cfg(
            "Qwen3MoeConfig",
            **_moe(head_dim=16, moe_intermediate_size=MOE_I, num_experts=E, num_experts_per_tok=E, norm_topk_prob=True),
        ),
    )
    add(
        "mixtral",
        lambda: _cfg(
            "MixtralConfig", **_moe(intermediate_size=MOE_I, head_dim=16, num_local_experts=E, num_experts_per_tok=E)
        ),
        notes="block_sparse_moe.experts.{e}.w1/w2/w3 in the checkpoint, mlp.experts.* in memory",
    )
    add(
        "phimoe",
        lambda: _cfg(
            "PhimoeConfig",
            **_moe(intermediate_size=MOE_I, num_local_experts=E, num_experts_per_tok=2, router_jitter_noise=0.0),
        ),
        notes="block_sparse_moe.gate in the checkpoint is mlp.router in memory; sparsemixer top-2",
    )
    add(
        "minimax",
        lambda: _cfg(
            "MiniMaxConfig",
            **_moe(
                intermediate_size=MOE_I,
                head_dim=16,
                num_local_experts=E,
                num_experts_per_tok=E,
                block_size=16,
                layer_types=["linear_attention", "full_attention"],
            ),
        ),
        notes="lightning (linear) attention layers: qkv_proj, output_gate, out_proj, norm",
    )
    add(
        "olmoe",
        lambda: _cfg(
            "OlmoeConfig",
            **_moe(moe_intermediate_size=MOE_I, intermediate_size=MOE_I, num_experts=E, num_experts_per_tok=E),
        ),
    )
    add(
        "granitemoe",
        lambda: _cfg("GraniteMoeConfig", **_moe(intermediate_size=MOE_I, num_local_experts=E, num_experts_per_tok=E)),
        notes="fused 3-D experts in the checkpoint: block_sparse_moe.input_linear.weight [E, 2I, H]",
    )
    add(
        "granitemoeshared",
        lambda: _cfg(
            "GraniteMoeSharedConfig",
            **_moe(intermediate_size=MOE_I, num_local_experts=E, num_experts_per_tok=E, shared_intermediate_size=64),
        ),
    )
    add(
        "dbrx",
        lambda: _cfg(
            "DbrxConfig",
            d_model=64,
            n_heads=4,
            n_layers=2,
            max_seq_len=128,
            vocab_size=VOCAB,
            attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
            ffn_config={"ffn_hidden_size": MOE_I, "moe_num_experts": E, "moe_top_k": E},
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        notes="experts as 2-D [E*I, H] tensors without .weight (ffn.experts.mlp.w1/v1/w2); fused Wqkv",
    )
    mla = dict(
        moe_intermediate_size=MOE_I,
        num_key_value_heads=4,
        n_routed_experts=E,
        num_experts_per_tok=E,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    )  # DeepSeek-V2/V3's MLA and MoE
    add("deepseek_v2", lambda: _cfg("DeepseekV2Config", **_moe(**mla)), notes="MLA; first layer dense")
    add(
        "deepseek_v3",
        lambda: _cfg("DeepseekV3Config", **_moe(**mla, num_nextn_predict_layers=1)),
        mtp="deepseek",
        notes="MLA, e_score_correction_bias, MTP layer at model.layers.2",
    )
    add(
        "glm4_moe",
        lambda: _cfg(
            "Glm4MoeConfig",
            **_moe(
                head_dim=16,
                moe_intermediate_size=MOE_I,
                n_routed_experts=E,
                num_experts_per_tok=E,
                n_shared_experts=1,
                first_k_dense_replace=1,
                use_qk_norm=True,
                partial_rotary_factor=0.5,
                num_nextn_predict_layers=1,
            ),
        ),
        mtp="deepseek",
        notes="GLM-4.5: q/k/v biases, first layer dense, MTP layer at model.layers.2",
    )
    add(
        "glm4_moe_lite",
        lambda: _cfg(
            "Glm4MoeLiteConfig",
            **_moe(
                moe_intermediate_size=MOE_I,
                num_key_value_heads=4,
                n_routed_experts=E,
                num_experts_per_tok=E,
                n_shared_experts=1,
                q_lora_rank=32,
                kv_lora_rank=32,
                qk_rope_head_dim=16,
                qk_nope_head_dim=16,
                v_head_dim=16,
                mlp_layer_types=["dense", "sparse"],
            ),
        ),
        notes="GLM-4.7-Flash: MLA + DeepSeek-style MoE",
    )
    add(
        "ernie4_5_moe",
        lambda: _cfg(
            "Ernie4_5_MoeConfig",
            **_moe(
                moe_intermediate_size=MOE_I,
                moe_num_experts=E,
                moe_k=E,
                moe_num_shared_experts=1,
                moe_layer_start_index=1,
                tie_word_embeddings=False,
            ),
        ),
        notes="moe_statics.e_score_correction_bias",
    )
    add(
        "hunyuan_v1_moe",
        lambda: _cfg("HunYuanMoEV1Config", **_moe(head_dim=16, num_experts=E, moe_topk=E)),
        notes="router is mlp.gate.wg",
    )
    add(
        "minimax_m2",
        lambda: _cfg(
            "MiniMaxM2Config", **_moe(intermediate_size=MOE_I, head_dim=16, num_local_experts=E, num_experts_per_tok=E)
        ),
        notes="block_sparse_moe.* in the checkpoint, e_score_correction_bias",
    )
    add(
        "lfm2_moe",
        lambda: _cfg(
            "Lfm2MoeConfig",
            **_moe(
                moe_intermediate_size=MOE_I,
                num_experts=E,
                num_experts_per_tok=E,
                num_dense_layers=1,
                layer_types=["conv", "full_attention"],
            ),
        ),
        notes="short-conv layers (conv.in_proj/out_proj/conv), feed_forward.experts.{e}.w1/w2/w3",
    )
    add(
        "longcat_flash",
        lambda: _cfg(
            "LongcatFlashConfig",
            vocab_size=VOCAB,
            hidden_size=64,
            num_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            ffn_hidden_size=128,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            head_dim=16,
            v_head_dim=16,
            moe_topk=E,
            n_routed_experts=E,
            zero_expert_num=2,
            expert_ffn_hidden_size=MOE_I,
            max_position_embeddings=128,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        notes="each layer holds 2 attention and 2 MLP sublayers (num_layers=1 gives 2 'layers'); zero experts",
    )
    add(
        "gpt_oss",
        lambda: _cfg(
            "GptOssConfig",
            **_moe(
                intermediate_size=MOE_I,
                head_dim=16,
                num_local_experts=E,
                num_experts_per_tok=E,
                sliding_window=64,
                layer_types=["sliding_attention", "full_attention"],
            ),
        ),
        notes="fused 3-D experts [E, H, 2I] with gate/up interleaved, biases, attention sinks",
        transposed_params=("experts.gate_up_proj", "experts.down_proj"),
    )
    add(
        "llama4_text",
        lambda: _cfg(
            "Llama4TextConfig",
            **common_kwargs(
                hidden_size=64,
                intermediate_size=MOE_I,
                intermediate_size_mlp=192,
                head_dim=16,
                num_local_experts=E,
                num_experts_per_tok=E,
                interleave_moe_layer_step=2,
                attention_chunk_size=64,
            ),
        ),
        model_class="Llama4ForCausalLM",
        notes="layer 1 MoE with fused 3-D experts [E, H, 2I] (gate|up concatenated) + shared_expert; layer 0 dense",
        transposed_params=("experts.gate_up_proj", "experts.down_proj"),
    )

    # --- hybrid / linear attention ----------------------------------------------------------
    add(
        "qwen3_next",
        lambda: _cfg(
            "Qwen3NextConfig",
            **_moe(
                head_dim=16,
                moe_intermediate_size=MOE_I,
                shared_expert_intermediate_size=64,
                num_experts=E,
                num_experts_per_tok=E,
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                linear_num_key_heads=4,
                linear_num_value_heads=8,
                layer_types=["linear_attention", "full_attention"],
            ),
        ),
        mtp="qwen",
        notes="gated DeltaNet layer 0 (linear_attn.*), gated attention layer 1, MTP at mtp.*",
    )
    add(
        "falcon_h1",
        lambda: _cfg(
            "FalconH1Config",
            **common_kwargs(
                head_dim=16,
                mamba_d_ssm=128,
                mamba_n_heads=8,
                mamba_d_head=16,
                mamba_n_groups=1,
                mamba_d_state=16,
                mamba_chunk_size=16,
            ),
        ),
        notes="every layer has attention + Mamba2 mixer in parallel",
    )
    add(
        "nemotron_h",
        lambda: _cfg(
            "NemotronHConfig",
            vocab_size=VOCAB,
            hidden_size=64,
            layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            ssm_state_size=16,
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=1,
            chunk_size=16,
            n_routed_experts=E,
            n_shared_experts=1,
            moe_intermediate_size=MOE_I,
            moe_shared_expert_intermediate_size=64,
            num_experts_per_tok=E,
            max_position_embeddings=128,
            use_mamba_kernels=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        notes="backbone.* in the checkpoint; Mamba2 / MoE / attention / MLP blocks; router mixer.gate (F32); "
        "non-gated experts (up, down)",
    )
    add(
        "jamba",
        lambda: _cfg(
            "JambaConfig",
            **common_kwargs(
                intermediate_size=MOE_I,
                num_experts=E,
                num_experts_per_tok=E,
                expert_layer_period=2,
                expert_layer_offset=1,
                attn_layer_period=2,
                attn_layer_offset=1,
                mamba_d_state=16,
                mamba_dt_rank=16,
                use_mamba_kernels=False,
            ),
        ),
        notes="Mamba1 layer 0 (in_proj, x_proj, dt_proj, conv1d, A_log, D), attention+MoE layer 1; "
        "router is feed_forward.router",
    )
    add(
        "bamba",
        lambda: _cfg(
            "BambaConfig",
            **common_kwargs(
                attn_layer_indices=[1],
                mamba_n_heads=8,
                mamba_d_head=16,
                mamba_n_groups=1,
                mamba_d_state=16,
                mamba_chunk_size=16,
            ),
        ),
        notes="Mamba2 layer 0, attention layer 1",
    )
    add(
        "granitemoehybrid",
        lambda: _cfg(
            "GraniteMoeHybridConfig",
            **_moe(
                intermediate_size=MOE_I,
                num_local_experts=E,
                num_experts_per_tok=E,
                shared_intermediate_size=64,
                layer_types=["mamba", "attention"],
                mamba_n_heads=8,
                mamba_d_head=16,
                mamba_d_state=16,
                mamba_chunk_size=16,
            ),
        ),
        notes="Granite-4.0: Mamba2 + attention, fused 3-D input_linear/output_linear experts",
    )
    add(
        "lfm2",
        lambda: _cfg(
            "Lfm2Config", **common_kwargs(layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False)
        ),
        notes="short-conv blocks: conv.in_proj [3H, H], conv.out_proj, depthwise conv.conv",
    )
    add(
        "kimi_linear",
        lambda: _cfg(
            "KimiLinearConfig",
            **_moe(
                moe_intermediate_size=MOE_I,
                num_key_value_heads=4,
                num_local_experts=E,
                num_experts_per_tok=E,
                n_shared_experts=1,
                kv_lora_rank=32,
                qk_rope_head_dim=16,
                qk_nope_head_dim=16,
                v_head_dim=16,
                linear_head_dim=16,
                linear_num_heads=4,
                layer_types=["linear_attention", "full_attention"],
                mlp_layer_types=["dense", "sparse"],
            ),
        ),
        notes="KDA linear attention (f_a_proj/f_b_proj/g_a_proj/g_b_proj, q/k/v_conv1d) + MLA + MoE",
    )
    add(
        "mamba2",
        lambda: _cfg(
            "Mamba2Config",
            vocab_size=VOCAB,
            hidden_size=64,
            num_heads=8,
            head_dim=16,
            state_size=16,
            num_hidden_layers=2,
            n_groups=1,
            chunk_size=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        notes="pure SSM: backbone.layers.N.mixer.{in_proj,out_proj,conv1d,A_log,D,dt_bias,norm}",
    )

    # --- multimodal ----------------------------------------------------------------------------
    def llama4_cfg():
        tf = _tf()
        text = dict(
            common_kwargs(
                hidden_size=64,
                intermediate_size=MOE_I,
                intermediate_size_mlp=192,
                head_dim=16,
                num_local_experts=E,
                num_experts_per_tok=E,
                interleave_moe_layer_step=2,
                attention_chunk_size=64,
            )
        )
        vision = dict(
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=128,
            vision_output_dim=64,
            image_size=56,
            patch_size=14,
            projector_input_dim=64,
            projector_output_dim=64,
            pixel_shuffle_ratio=0.5,
        )
        return tf.Llama4Config(
            text_config=text, vision_config=vision, image_token_index=200, boi_token_index=201, eoi_token_index=202
        )

    add(
        "llama4",
        llama4_cfg,
        model_class="Llama4ForConditionalGeneration",
        multimodal=True,
        notes="language_model.model.* / vision_model.* / multi_modal_projector.* in the checkpoint",
        transposed_params=("experts.gate_up_proj", "experts.down_proj"),
    )

    def qwen_vl(kind, text_cls_kw, vision_kind=None, **top):
        def f():
            tf = _tf()
            cls = {
                "qwen2_5_vl": "Qwen2_5_VLConfig",
                "qwen3_vl": "Qwen3VLConfig",
                "qwen3_vl_moe": "Qwen3VLMoeConfig",
                "qwen3_5": "Qwen3_5Config",
                "qwen3_5_moe": "Qwen3_5MoeConfig",
            }[kind]
            text = _text_vlm(kind, **text_cls_kw)
            return getattr(tf, cls)(
                text_config=text,
                vision_config=_qwen_vision(vision_kind or kind, HIDDEN),
                image_token_id=250,
                video_token_id=251,
                vision_start_token_id=252,
                vision_end_token_id=253,
                **top,
            )

        return f

    rope_mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    add(
        "qwen2_5_vl",
        qwen_vl("qwen2_5_vl", dict(rope_parameters=rope_mrope)),
        model_class="Qwen2_5_VLForConditionalGeneration",
        multimodal=True,
        notes="visual.* + model.* (text) in the checkpoint; model.visual.* / model.language_model.* in memory",
    )
    add(
        "qwen3_vl",
        qwen_vl(
            "qwen3_vl", dict(rope_parameters={**rope_mrope, "mrope_interleaved": True, "mrope_section": [2, 3, 3]})
        ),
        model_class="Qwen3VLForConditionalGeneration",
        multimodal=True,
        notes="model.visual.* / model.language_model.* (already the in-memory names)",
    )
    add(
        "qwen3_vl_moe",
        qwen_vl(
            "qwen3_vl_moe",
            dict(
                rope_parameters={**rope_mrope, "mrope_interleaved": True},
                moe_intermediate_size=MOE_I,
                num_experts=E,
                num_experts_per_tok=E,
                intermediate_size=128,
            ),
        ),
        model_class="Qwen3VLMoeForConditionalGeneration",
        multimodal=True,
        notes="fused 3-D experts; released layout gate_up_proj [E, H, 2I] / down_proj [E, I, H] (x @ W)",
        hub_fixup="qwen3_vl_moe_experts",
    )
    add(
        "qwen3_5",
        qwen_vl(
            "qwen3_5",
            dict(
                rope_parameters={**rope_mrope, "mrope_interleaved": True, "partial_rotary_factor": 0.5},
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                linear_num_key_heads=4,
                linear_num_value_heads=8,
                layer_types=["linear_attention", "full_attention"],
            ),
        ),
        model_class="Qwen3_5ForConditionalGeneration",
        multimodal=True,
        mtp="qwen",
        notes="Qwen3.5 dense: gated DeltaNet + gated attention, vision tower, MTP at mtp.*",
    )
    add(
        "qwen3_5_moe",
        qwen_vl(
            "qwen3_5_moe",
            dict(
                rope_parameters={**rope_mrope, "mrope_interleaved": True, "partial_rotary_factor": 0.5},
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                linear_num_key_heads=4,
                linear_num_value_heads=8,
                layer_types=["linear_attention", "full_attention"],
                moe_intermediate_size=MOE_I,
                shared_expert_intermediate_size=64,
                num_experts=E,
                num_experts_per_tok=E,
            ),
        ),
        model_class="Qwen3_5MoeForConditionalGeneration",
        multimodal=True,
        mtp="qwen",
        notes="Qwen3.5 MoE: DeltaNet in_proj_qkv/in_proj_z/in_proj_b/in_proj_a, per-expert 2-D experts as saved, "
        "MTP at mtp.*",
    )

    def gemma3_cfg():
        tf = _tf()
        text = _text_vlm("gemma3", head_dim=16, query_pre_attn_scalar=16, sliding_window=64, tie_word_embeddings=True)
        return tf.Gemma3Config(
            text_config=text,
            vision_config=_siglip(),
            mm_tokens_per_image=4,
            image_token_index=250,
            boi_token_index=251,
            eoi_token_index=252,
        )

    add(
        "gemma3",
        gemma3_cfg,
        model_class="Gemma3ForConditionalGeneration",
        multimodal=True,
        hub_fixup="vision_model",
        notes="SigLIP tower + multi_modal_projector (mm_input_projection_weight, no .weight suffix)",
    )

    def mistral3_cfg():
        tf = _tf()
        text = _text_vlm("mistral", head_dim=16, sliding_window=None)
        text["model_type"] = "mistral"
        vision = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            image_size=64,
            patch_size=16,
            head_dim=16,
        )
        return tf.Mistral3Config(
            text_config=text, vision_config=vision, image_token_index=250, tie_word_embeddings=False
        )

    add(
        "mistral3",
        mistral3_cfg,
        model_class="Mistral3ForConditionalGeneration",
        multimodal=True,
        notes="Pixtral tower, patch_merger, multi_modal_projector",
    )

    def llava_cfg():
        tf = _tf()
        text = _text_vlm("llama", head_dim=16)
        text["model_type"] = "llama"
        return tf.LlavaConfig(
            text_config=text,
            vision_config=_clip(),
            image_token_index=250,
            image_seq_length=4,
            tie_word_embeddings=False,
        )

    add(
        "llava",
        llava_cfg,
        model_class="LlavaForConditionalGeneration",
        multimodal=True,
        hub_fixup="vision_model",
        notes="CLIP tower + 2-layer projector with biases",
    )

    def mllama_cfg():
        tf = _tf()
        text = _text_vlm("mllama_text_model", cross_attention_layers=[1])
        text.pop("head_dim", None)
        text.pop("num_attention_heads"), text.pop("num_key_value_heads")
        text.update(num_attention_heads=4, num_key_value_heads=2)
        vision = dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_global_layers=1,
            attention_heads=4,
            intermediate_size=128,
            vision_output_dim=128,
            image_size=28,
            patch_size=14,
            max_num_tiles=2,
            intermediate_layers_indices=[0],
            supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
        )
        return tf.MllamaConfig(text_config=text, vision_config=vision, image_token_index=250)

    add(
        "mllama",
        mllama_cfg,
        model_class="MllamaForConditionalGeneration",
        multimodal=True,
        notes="layer 1 is a cross-attention layer (cross_attn.*, gates); vision_model.* with global transformer",
    )

    def gemma4_cfg():
        tf = _tf()
        text = _text_vlm(
            "gemma4_text",
            head_dim=16,
            sliding_window=64,
            tie_word_embeddings=True,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=16,
            enable_moe_block=True,
            num_experts=E,
            top_k_experts=E,
            moe_intermediate_size=MOE_I,
            global_head_dim=32,
            layer_types=["sliding_attention", "full_attention"],
        )
        vision = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            patch_size=16,
            position_embedding_size=64,
        )
        return tf.Gemma4Config(
            text_config=text,
            vision_config=vision,
            audio_config=None,
            image_token_id=250,
            boi_token_id=251,
            eoi_token_id=252,
            video_token_id=253,
            boa_token_id=254,
            eoa_token_index=255,
            audio_token_id=249,
        )

    add(
        "gemma4",
        gemma4_cfg,
        model_class="Gemma4ForConditionalGeneration",
        multimodal=True,
        notes="MoE block beside the dense MLP; experts fused 3-D without .weight; per-layer input embeddings",
    )
    return s


ARCHS: dict[str, Spec] = _specs()


# ----------------------------------------------------------------------------- building


@torch.no_grad()
def _randomize(model: torch.nn.Module, spec: Spec, seed: int) -> None:
    """Replace transformers' N(0, 0.02) init by non-degenerate values (see the module docstring).

    Embedding tables get std 1; other tensors of 2 or more dims std factor / sqrt(fan_in) (fan_in is
    the last dim, or the second-to-last for the layouts in `spec.transposed_params`). 1-D tensors
    are perturbed around their initial value, which tells their role without per-model rules:
    all-ones (multiplicative norms, scales) -> 1 + noise; all-zeros (biases, zero-centred norms)
    -> noise; anything else (A_log, dt_bias, D, ...) -> init * (1 + noise).
    """
    g = torch.Generator().manual_seed(seed + 1234)
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) in seen or not p.dtype.is_floating_point:
            continue
        seen.add(id(p))
        x0 = p.detach().float()
        if p.dim() >= 2 and isinstance(_owner(model, name), torch.nn.Embedding):
            x = torch.randn(p.shape, generator=g)
        elif p.dim() >= 2:
            transposed = any(name.endswith(t) for t in spec.transposed_params)
            fan_in = p.shape[-2] if transposed else (math.prod(p.shape[1:]) if p.dim() > 3 else p.shape[-1])
            factor = 0.5 + torch.rand((), generator=g).item()
            x = torch.randn(p.shape, generator=g) * (factor / math.sqrt(fan_in))
        else:
            noise = 0.1 * torch.randn(p.shape, generator=g)
            if x0.numel() and bool((x0 == 1).all()):
                x = 1.0 + noise
            elif not x0.numel() or bool((x0 == 0).all()):
                x = noise
            else:
                x = x0 * (1.0 + noise)
        p.copy_(x.to(p.dtype))


def _owner(model: torch.nn.Module, param_name: str) -> torch.nn.Module:
    """The module that holds parameter `param_name`."""
    return model.get_submodule(param_name.rpartition(".")[0])


def build(arch: str, dtype: torch.dtype = torch.bfloat16, seed: int = SEED, config_overrides: dict | None = None):
    """Build and randomize the tiny `arch` model in memory (eval mode). Returns the model."""
    spec = ARCHS[arch]
    return build_from_config(spec, spec.config(), dtype, seed, config_overrides)


def make(
    arch: str,
    path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: int | str | None = None,
    seed: int = SEED,
    config_overrides: dict | None = None,
    hub_layout: bool = True,
) -> Path:
    """Build, randomize and save the tiny `arch` model at `path` (created). Returns the path.

    `max_shard_size` defaults to a quarter of the model's bytes, so every checkpoint has at least 3
    shards. MTP tensors (spec.mtp) are added as one more shard, and the index is rewritten. With
    `hub_layout` (default) the names/layouts that `save_pretrained` writes differently from the
    released checkpoints are rewritten into the released form (spec.hub_fixup); both load.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    spec = ARCHS[arch]
    model = build(arch, dtype=dtype, seed=seed, config_overrides=config_overrides)
    if max_shard_size is None:
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        max_shard_size = max(total // 4, 1)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    if spec.mtp:
        _add_mtp_shard(arch, path, dtype, seed, config_overrides)
    if hub_layout and spec.hub_fixup:
        _rewrite_shards(path, _HUB_FIXUPS[spec.hub_fixup])
    return path


def _vision_model_prefix(name: str, t: torch.Tensor):
    """Released Llava / Gemma-3 checkpoints keep the CLIP/SigLIP `vision_model.` level:
    `vision_tower.vision_model.encoder...` (transformers 5.24 saves `vision_tower.encoder...`)."""
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name[len("vision_tower.") :]
    return name, t


def _qwen3_vl_moe_experts(name: str, t: torch.Tensor):
    """Released Qwen3-VL-MoE checkpoints store experts for x @ W: gate_up_proj [E, H, 2I] and
    down_proj [E, I, H]; transformers 5.24 saves its in-memory [E, 2I, H] / [E, H, I] and transposes
    on load by comparing shapes (`Transpose(1, 2, check_dims=True)`)."""
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) and t.dim() == 3:
        t = t.transpose(1, 2).contiguous()
    return name, t


_HUB_FIXUPS: dict[str, Callable] = {
    "vision_model": _vision_model_prefix,
    "qwen3_vl_moe_experts": _qwen3_vl_moe_experts,
}


def _rewrite_shards(path: Path, fn: Callable) -> None:
    """Apply fn(name, tensor) -> (name, tensor) to every tensor, shard by shard; rewrite the index."""
    from safetensors.torch import load_file, save_file

    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = dict(fn(k, v) for k, v in load_file(str(path / shard)).items())
        save_file(tensors, str(path / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in tensors})
    index["weight_map"] = dict(sorted(weight_map.items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")


# ----------------------------------------------------------------------------- MTP tensors


def _mtp_tensors(arch: str, dtype, seed: int, config_overrides: dict | None) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors, in the checkpoint naming of the real releases.

    The decoder block of the MTP layer is taken from a model built with one more layer (so it is a
    genuine decoder layer of this architecture in checkpoint naming, e.g. per-expert 2-D tensors).
    """
    from safetensors.torch import load_file

    spec = ARCHS[arch]
    cfg = spec.config()
    text = cfg.get_text_config()
    n = text.num_hidden_layers
    overrides = dict(config_overrides or {})
    extra_layer: dict[str, Any] = {"num_hidden_layers": n + 1}
    if getattr(text, "layer_types", None) is not None:
        extra_layer["layer_types"] = list(text.layer_types) + ["full_attention"]
    g = torch.Generator().manual_seed(seed + 99)

    def rnd(*shape, std=None):
        std = 1.0 / math.sqrt(shape[-1]) if std is None else std
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def norm(h):
        return (1.0 + 0.1 * torch.randn(h, generator=g)).to(dtype)

    with tempfile.TemporaryDirectory() as tmp:
        if text is cfg:
            overrides.update(extra_layer)
        else:
            for k, v in extra_layer.items():
                setattr(text, k, v)
        bigger = build_from_config(spec, cfg, dtype, seed + 7, overrides)
        bigger.save_pretrained(tmp)
        state = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            state.update(load_file(str(f)))
    text = bigger.config.get_text_config()  # sizes after config_overrides
    H, V = text.hidden_size, text.vocab_size
    out: dict[str, torch.Tensor] = {}
    if spec.mtp == "deepseek":
        prefix = f"model.layers.{n}."
        for k, v in state.items():
            if k.startswith(prefix):
                out[k] = v
        out[prefix + "enorm.weight"] = norm(H)
        out[prefix + "hnorm.weight"] = norm(H)
        out[prefix + "eh_proj.weight"] = rnd(H, 2 * H)
        out[prefix + "shared_head.norm.weight"] = norm(H)
        out[prefix + "shared_head.head.weight"] = rnd(V, H)
        out[prefix + "embed_tokens.weight"] = rnd(V, H, std=1.0)
    else:  # qwen: mtp.fc, mtp.pre_fc_norm_embedding/hidden, mtp.norm, mtp.layers.0.*
        lm_prefix = next(
            p for p in ("model.language_model.layers.", "model.layers.") if any(k.startswith(p) for k in state)
        )
        src = f"{lm_prefix}{n}."
        for k, v in state.items():
            if k.startswith(src):
                out["mtp.layers.0." + k[len(src) :]] = v
        out["mtp.fc.weight"] = rnd(H, 2 * H)
        out["mtp.pre_fc_norm_embedding.weight"] = norm(H)
        out["mtp.pre_fc_norm_hidden.weight"] = norm(H)
        out["mtp.norm.weight"] = norm(H)
    return {k: v.contiguous() for k, v in sorted(out.items())}


def build_from_config(spec: Spec, cfg, dtype, seed: int, overrides: dict | None = None):
    """Like `build`, from an explicit config object. An override key may be dotted
    ("text_config.moe_intermediate_size") to reach a nested config."""
    tf = _tf()
    for key, value in (overrides or {}).items():
        *path, leaf = key.split(".")
        target = cfg
        for part in path:
            target = getattr(target, part)
        setattr(target, leaf, value)
    torch.manual_seed(seed)
    cls = getattr(tf, spec.model_class)
    model = (
        cls.from_config(cfg, dtype=dtype) if spec.model_class.startswith("Auto") else cls._from_config(cfg, dtype=dtype)
    )
    model.eval()
    _randomize(model, spec, seed)
    return model


def _add_mtp_shard(arch: str, path: Path, dtype, seed: int, config_overrides: dict | None) -> None:
    """Append the MTP tensors as the last shard and renumber all shards `model-0000i-of-0000N`."""
    from safetensors.torch import save_file

    tensors = _mtp_tensors(arch, dtype, seed, config_overrides)
    index_path = path / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        files = sorted(set(index["weight_map"].values()))
    else:  # a single unsharded file
        index = {"metadata": {"total_size": 0}, "weight_map": {}}
        files = ["model.safetensors"]
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), "pt") as f:
            index["weight_map"] = {k: "model.safetensors" for k in f.keys()}
    n = len(files) + 1
    renames = {old: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, old in enumerate(files)}
    for old, new in renames.items():
        os.replace(path / old, path / (new + ".tmp"))
    for new in renames.values():
        os.replace(path / (new + ".tmp"), path / new)
    last = f"model-{n:05d}-of-{n:05d}.safetensors"
    save_file(tensors, str(path / last), metadata={"format": "pt"})
    weight_map = {k: renames[v] for k, v in index["weight_map"].items()}
    weight_map.update({k: last for k in tensors})
    total = index["metadata"].get("total_size", 0) + sum(t.numel() * t.element_size() for t in tensors.values())
    index = {
        "metadata": {**index.get("metadata", {}), "total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    index_path.write_text(json.dumps(index, indent=2) + "\n")


# ----------------------------------------------------------------------------- running


def load(path, dtype: torch.dtype = torch.float32, **kwargs):
    """Load a checkpoint made by `make` (or converted from one) with the class it was saved with.

    Keyword arguments go to `from_pretrained` (with `output_loading_info=True` it returns its tuple).
    """
    tf = _tf()
    cfg = json.loads((Path(path) / "config.json").read_text())
    arch_cls = (cfg.get("architectures") or ["AutoModelForCausalLM"])[0]
    cls = getattr(tf, arch_cls, None) or tf.AutoModelForCausalLM
    loaded = cls.from_pretrained(str(path), dtype=dtype, **kwargs)
    (loaded[0] if isinstance(loaded, tuple) else loaded).eval()  # a tuple with output_loading_info=True
    return loaded


@torch.no_grad()
def logits(path_or_model, prompt_ids=PROMPT_IDS, dtype: torch.dtype = torch.float32, **load_kwargs) -> torch.Tensor:
    """Logits [len(prompt), vocab] (float32) of a fixed text-only prompt, on CPU."""
    model = load(path_or_model, dtype=dtype, **load_kwargs) if isinstance(path_or_model, (str, Path)) else path_or_model
    ids = torch.tensor([list(prompt_ids)])
    if type(model).__name__ == "Llama4ForConditionalGeneration":
        # Its text-only forward fails in transformers 5.24 while building the output dataclass (it
        # reads `image_outputs` from the language model's output); the text path is its
        # `language_model` (a Llama4ForCausalLM), which it calls with the same embeddings. The
        # root's forward pre-hooks still have to run: compressed-tensors decompresses the model in
        # one registered there on the first forward.
        for hook in list(model._forward_pre_hooks.values()):
            hook(model, ())
        model = model.language_model
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return out.logits.float()[0]


# The architectures test_architectures.py converts in every scheme/format pair.
ZOO_ARCHS = (
    # dense
    "llama",
    "qwen3",
    "gemma2",
    "phi3",
    # MoE, per-expert 2-D in the checkpoint
    "qwen3_moe",
    "mixtral",
    "phimoe",
    "olmoe",
    "minimax_m2",
    "ernie4_5_moe",
    "deepseek_v3",
    "glm4_moe",
    # MoE, fused experts
    "llama4",
    "gpt_oss",
    "granitemoe",
    "dbrx",
    "qwen3_vl_moe",
    "gemma4",
    # hybrid / linear attention / SSM
    "qwen3_next",
    "nemotron_h",
    "falcon_h1",
    "jamba",
    # multimodal
    "qwen2_5_vl",
    "gemma3",
    "mistral3",
    "llava",
)
# GPT-2's linears are all Conv1D, which no output quantizes: quantize refuses it (test_architectures.py).
NOTHING_QUANTIZED = ("gpt2",)
# Further model_types the registry lists, checked in two combinations only (bytes, verify, ignore list,
# vLLM contract).
MORE_ARCHS = (
    "mistral",
    "qwen2",
    "glm4",
    "olmo2",
    "granite",
    "starcoder2",
    "qwen2_moe",
    "deepseek_v2",
    "llama4_text",
    "granitemoeshared",
    "granitemoehybrid",
    "qwen3_vl",
    "qwen3_5",
    "qwen3_5_moe",
    "falcon",
)
# Registered families vLLM does not serve, converted in tests of their own (test_transformers_loads.py).
NOT_IN_VLLM_ARCHS = ("mllama",)
