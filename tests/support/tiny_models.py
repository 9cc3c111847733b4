"""Tiny random Hugging Face checkpoints for the end-to-end tests (no network, no Hub).

`make_model(kind, path)` builds a 2-layer model of one of KINDS with transformers from a config,
gives it non-degenerate random weights (fixed seed), saves it sharded with `save_pretrained`, and
adds small fake tokenizer files and a chat template so the converter's file copying can be checked.

Every linear dimension is a multiple of 16; hidden size 64, except llama's 128 (every llama
in_features is a multiple of 128, which compressed-tensors' block scheme needs to run in
transformers). Some dims exceed 128 so the 128x128 block grid has several blocks, and qwen3's
192-wide MLP gives partial edge blocks in a multi-block grid. A few weights carry all-zero rows /
blocks / whole experts to exercise the amax == 0 rule. With the default max_shard_size every
model is saved in at least 3 shards.

`make_gpt_oss_like(path)` hand-writes a checkpoint with gpt-oss's fused 3D expert tensors
(`mlp.experts.gate_up_proj [E, H, 2I]`); under another model_type the converter has no layout for
them and must refuse them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from zoo import VOCAB, common_kwargs

KINDS = ("llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3")
MOE_KINDS = ("qwen3_moe", "mixtral", "deepseek_v3")
DENSE_KINDS = ("llama", "qwen3")

N_EXPERTS = 16  # a multiple of 16, so routers are kept because they are routers, not for their shape
# Every token is routed to every expert (top-k = E): routing then varies smoothly with the weights, so
# FP8 noise cannot flip a top-k choice and the logits comparison measures the converter, not routing
# chaos (with top-2 of 16, cosine against the source fell to ~0.97 for correct conversions); and
# every expert's weights and scales reach the logits.

# Extra (non-weight) files the converter must copy byte for byte.
EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}\n"
)


def _config(kind: str):
    import transformers as tf

    if kind == "llama":
        # every in_features a multiple of 128: compressed-tensors' block scheme quantizes input
        # activations in groups of 128 and cannot run a layer whose in_features is not a multiple
        return tf.LlamaConfig(**common_kwargs(hidden_size=128, intermediate_size=256, head_dim=32))
    if kind == "qwen3":
        # 192 = 1.5 blocks: partial edge blocks inside a multi-block grid
        return tf.Qwen3Config(**common_kwargs(intermediate_size=192, head_dim=32))
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common_kwargs(
                intermediate_size=128,
                moe_intermediate_size=32,
                num_experts=N_EXPERTS,
                num_experts_per_tok=N_EXPERTS,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                head_dim=16,
                norm_topk_prob=True,
            )
        )
    if kind == "mixtral":
        return tf.MixtralConfig(
            **common_kwargs(
                intermediate_size=32,
                num_local_experts=N_EXPERTS,
                num_experts_per_tok=N_EXPERTS,
                head_dim=16,
            )
        )
    if kind == "deepseek_v3":
        return tf.DeepseekV3Config(
            **common_kwargs(
                intermediate_size=128,
                moe_intermediate_size=32,
                num_key_value_heads=4,
                n_shared_experts=1,
                n_routed_experts=N_EXPERTS,
                num_experts_per_tok=N_EXPERTS,
                n_group=1,
                topk_group=1,
                first_k_dense_replace=1,
                q_lora_rank=32,
                kv_lora_rank=32,
                qk_rope_head_dim=16,
                qk_nope_head_dim=16,
                v_head_dim=16,
            )
        )
    raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")


@torch.no_grad()
def _make_weights_interesting(model: torch.nn.Module, kind: str, seed: int) -> None:
    """Rescale transformers' N(0, 0.02) init into something non-degenerate and test-worthy.

    - linear weights get std ~ 1/sqrt(fan_in) times a per-tensor factor in [0.5, 1.5], so members of
      a fused group have clearly different amax (sharing the max scale is then observable);
    - embeddings get std ~ 1, norms 1 + noise, biases / e_score_correction_bias noise (so that
      "kept byte-identical" is not satisfied by writing ones or zeros);
    - sparse outliers in one tensor; zero rows, a zero 128x128 block and a whole zero expert
      exercise amax == 0.
    Values are computed in float32 and copied into each tensor's own dtype.
    """
    g = torch.Generator().manual_seed(seed + 1234)
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if "e_score_correction_bias" in n})
    for name, p in tensors.items():
        x = p.detach().float()
        if "embed_tokens" in name:
            x = torch.randn(p.shape, generator=g)
        elif p.dim() >= 2:
            fan_in = p.shape[-1]
            factor = 0.5 + 1.0 * torch.rand((), generator=g).item()
            std = x.std().item() or 0.02
            x = x * (factor / (fan_in**0.5) / std)
        elif "norm" in name:
            x = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:  # biases, e_score_correction_bias, other 1D
            x = 0.1 * torch.randn(p.shape, generator=g)
        if name.endswith("layers.1.self_attn.o_proj.weight"):
            x.view(-1)[::97] *= 8.0  # sparse outliers
        if name.endswith("layers.0.self_attn.o_proj.weight"):
            x[:16] = 0.0  # zero rows: per-channel amax == 0
        if kind == "llama" and name == "model.layers.1.mlp.down_proj.weight":
            x[:, 128:] = 0.0  # [128, 256]: block (0, 1) all zero
        if kind in MOE_KINDS and ".layers.1." in name and ".experts." in name and p.dim() == 3:
            x[3] = 0.0  # in memory transformers 5 fuses experts [E, ...]; expert 3 all zero
        p.copy_(x.to(p.dtype))


def make_model(
    kind: str,
    path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size="150KB",
    seed: int = 0,
    config_overrides: dict | None = None,
) -> Path:
    """Build, randomize and save a tiny `kind` model at `path` (created). Returns the path.

    `dtype` is the checkpoint dtype (bfloat16, float16 or float32); modules transformers keeps in
    float32 (DeepSeek's router) stay float32, as in real checkpoints. `config_overrides` changes
    config attributes (e.g. an intermediate_size that is not a multiple of 16).
    """
    import transformers as tf

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = _config(kind)
    for key, value in (config_overrides or {}).items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    _make_weights_interesting(model, kind, seed)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    _write_fake_tokenizer(path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    assert (path / "generation_config.json").exists()
    return path


def _write_fake_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, VOCAB):
        vocab[f"t{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "model_max_length": 128,
            },
            indent=2,
        )
        + "\n"
    )


# ------------------------------------------------------------------ gpt-oss-like

GPT_OSS_FUSED_TENSOR = "model.layers.0.mlp.experts.gate_up_proj"


def make_gpt_oss_like(path, n_experts: int = 4, hidden: int = 64, inter: int = 64, model_type: str = "gpt_oss") -> Path:
    """A gpt-oss-shaped checkpoint: fused 3D experts, gate/up interleaved on the last dim.

    Not loadable by transformers (and need not be): it only has to reach the converter's planner.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    E, H, I, V = n_experts, hidden, inter, VOCAB
    nh, nkv, hd = 4, 2, 16

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    t = {
        "model.embed_tokens.weight": r(V, H),
        "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "lm_head.weight": r(V, H),
        "model.layers.0.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": r(nh * hd, H),
        "model.layers.0.self_attn.k_proj.weight": r(nkv * hd, H),
        "model.layers.0.self_attn.v_proj.weight": r(nkv * hd, H),
        "model.layers.0.self_attn.o_proj.weight": r(H, nh * hd),
        "model.layers.0.self_attn.sinks": r(nh),
        "model.layers.0.mlp.router.weight": r(E, H),
        "model.layers.0.mlp.router.bias": r(E),
        GPT_OSS_FUSED_TENSOR: r(E, H, 2 * I),
        "model.layers.0.mlp.experts.gate_up_proj_bias": r(E, 2 * I),
        "model.layers.0.mlp.experts.down_proj": r(E, I, H),
        "model.layers.0.mlp.experts.down_proj_bias": r(E, H),
    }
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": model_type,
        "hidden_size": H,
        "intermediate_size": I,
        "num_hidden_layers": 1,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "num_local_experts": E,
        "experts_per_token": 2,
        "num_experts_per_tok": 2,
        "vocab_size": V,
        "layer_types": ["full_attention"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path
