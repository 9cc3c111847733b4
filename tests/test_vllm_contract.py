"""What vLLM's loaders need from a converted checkpoint (DESIGN.md, "Numerics" and "Output formats").

These checks restate vLLM's loading rules against the files. vLLM's CPU build now loads and runs
outputs in tests/integration/engine (block scale grids, per-channel dense layers, the ignore list and
fused layers of the families it runs there), so those restatements went; what stays is what the CPU
build cannot check here: per-tensor scales (it lacks the `static_scaled_fp8_quant` op vLLM calls to
requantize fused layers), MXFP8 (no CPU kernel), per-channel MoE (no CPU FP8 MoE kernel), TP splits
(one process), and the tiny models' dims, which several of its CPU kernels reject:
- it fuses q/k/v (qkv_proj), gate/up (gate_up_proj; MoE w13 per expert) and DeepSeek's
  q_a_proj + kv_a_proj_with_mqa (fused_qkv_a_proj); with per-tensor scales it requantizes every
  member to the group's max scale, so members must already share it;
- the ignore list is matched by exact module name, and a fused module with some but not all
  members listed is an error;
- Fp8MoEMethod keeps per-expert `w13_weight_scale [E, 2]` and `w2_weight_scale [E]` in the tensor
  scheme (`w13_weight_scale.max(dim=1)` then requantizes); channel scales stack to [E, 2I, 1];
- per-tensor/channel FP8 GEMMs want both weight dims divisible by 16;
- MXFP8 (compressed-tensors, weights' scale_dtype uint8): `weight_scale` uint8 [out, in // 32], so every
  quantized input dim divides by 32 (the MoE method stacks them to w13 [E, 2I, H // 32], w2 [E, H, I // 32]).
"""

from __future__ import annotations

import re

import pytest
import torch

import reference as R
from checks import ignore_lists
from conftest import ALL_CASES, FORMAT_SCHEMES, FS_IDS, fp8convert_module, read_json, read_safetensors_dir, run_quantize
from tiny_models import KINDS, MOE_KINDS, N_EXPERTS, make_model

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def outputs(converted):
    cache: dict = {}

    def get(kind, fmt, scheme):
        key = (kind, fmt, scheme)
        if key not in cache:
            out = converted(kind, fmt, scheme)
            cache[key] = (read_safetensors_dir(out), read_json(out / "config.json"))
        return cache[key]

    return get


def weight_modules(tensors: dict) -> set[str]:
    return {R.module_of(n) for n, t in tensors.items() if n.endswith(".weight") and t.dim() == 2}


def is_quantized(tensors: dict, module: str) -> bool:
    return tensors[module + ".weight"].dtype == FP8


def scale_of(tensors: dict, module: str) -> torch.Tensor:
    for suffix in (".weight_scale", ".weight_scale_inv"):
        if module + suffix in tensors:
            return tensors[module + suffix]
    raise AssertionError(f"{module} has no scale tensor")


def moe_layers(tensors: dict) -> dict[str, tuple[str, str, str, int]]:
    """{experts prefix: (gate name, up name, down name, E)} for every MoE layer."""
    found: dict[str, set[int]] = {}
    for n in tensors:
        m = re.match(r"^(.*\.experts)\.(\d+)\.(gate_proj|w1)\.weight$", n)
        if m:
            found.setdefault(m.group(1), set()).add(int(m.group(2)))
    out = {}
    for prefix, experts in found.items():
        mixtral = f"{prefix}.0.w1.weight" in tensors
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        assert experts == set(range(len(experts))), f"{prefix}: experts not numbered 0..E-1"
        out[prefix] = (*names, len(experts))
    return out


# ------------------------------------------------------------------ fused groups


@pytest.mark.parametrize("kind,fmt,scheme", ALL_CASES)
def test_fused_groups_all_quantized_or_all_ignored(kind, fmt, scheme, outputs):
    tensors, cfg = outputs(kind, fmt, scheme)
    groups = R.fused_groups(weight_modules(tensors))
    assert groups
    names = {g.rsplit(".", 1)[-1] for g in groups}
    if kind == "deepseek_v3":
        assert "fused_qkv_a_proj" in names
    for fused, members in groups.items():
        quantized = [is_quantized(tensors, m) for m in members]
        assert all(quantized) or not any(quantized), f"{fused}: mixed quantization {dict(zip(members, quantized))}"
        for lst in ignore_lists(fmt, cfg):
            listed = [m in lst for m in members]
            assert all(listed) or not any(listed), f"{fused}: only some members in the ignore list"
            assert all(listed) == (not all(quantized)), f"{fused}: ignore list disagrees with the tensors"
        if all(quantized) and scheme == "tensor":
            scales = [scale_of(tensors, m).reshape(()) for m in members]
            assert all(torch.equal(s, scales[0]) for s in scales), f"{fused}: {scales}"


@pytest.mark.parametrize("kind,fmt,scheme", [c for c in ALL_CASES if c.values[0] in MOE_KINDS])
def test_each_moe_layer_is_quantized_whole(kind, fmt, scheme, outputs):
    """vLLM builds one FusedMoE per layer: its experts are all FP8 or all high precision."""
    tensors, _ = outputs(kind, fmt, scheme)
    layers = moe_layers(tensors)
    assert len(layers) == (1 if kind == "deepseek_v3" else 2)
    for prefix, (g, u, d, n_exp) in layers.items():
        assert n_exp == N_EXPERTS
        flags = {is_quantized(tensors, f"{prefix}.{e}.{p}") for e in range(n_exp) for p in (g, u, d)}
        assert len(flags) == 1, f"{prefix}: some experts quantized, some not"


# ------------------------------------------------------------------ MoE scales as vLLM stacks them


@pytest.mark.parametrize("kind", MOE_KINDS)
@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8"])
def test_moe_tensor_scales_map_onto_w13_and_w2(kind, fmt, outputs, source_tensors):
    tensors, _ = outputs(kind, fmt, "tensor")
    src = source_tensors(kind)
    for prefix, (g, u, d, n_exp) in moe_layers(tensors).items():
        per_expert = []
        for e in range(n_exp):
            pair = [scale_of(tensors, f"{prefix}.{e}.{p}") for p in (g, u)]
            for s in pair:
                assert s.dtype == torch.float32 and s.numel() == 1
            per_expert.append(torch.stack([s.reshape(()) for s in pair]))
        w13 = torch.stack(per_expert)  # [E, 2] as in Fp8MoEMethod
        w2 = torch.stack([scale_of(tensors, f"{prefix}.{e}.{d}").reshape(()) for e in range(n_exp)])  # [E]
        assert w13.shape == (n_exp, 2) and w2.shape == (n_exp,)
        # vLLM: max over dim 1, then requantize each shard to it -- must change nothing
        assert torch.equal(w13.max(dim=1).values, w13[:, 0]) and torch.equal(w13[:, 0], w13[:, 1])
        # per-expert scales (not one scale for the layer), each from that expert's own amax
        assert len(set(w2.tolist())) > n_exp // 2
        for e in range(n_exp):
            want13 = R.group_tensor_scale([src[f"{prefix}.{e}.{p}.weight"] for p in (g, u)])
            want2 = R.tensor_scale(src[f"{prefix}.{e}.{d}.weight"])
            assert torch.equal(w13[e, 0], want13) and torch.equal(w2[e], want2), f"{prefix}.{e}"
        assert torch.isfinite(w13).all() and (w13 > 0).all() and torch.isfinite(w2).all() and (w2 > 0).all()


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_channel_scales_stack_to_w13_and_w2(kind, outputs):
    tensors, _ = outputs(kind, "compressed-tensors", "channel")
    for prefix, (g, u, d, n_exp) in moe_layers(tensors).items():
        inter, hidden = tensors[f"{prefix}.0.{g}.weight"].shape
        w13 = torch.stack(
            [torch.cat([scale_of(tensors, f"{prefix}.{e}.{p}") for p in (g, u)]) for e in range(n_exp)]
        )
        w2 = torch.stack([scale_of(tensors, f"{prefix}.{e}.{d}") for e in range(n_exp)])
        assert w13.shape == (n_exp, 2 * inter, 1) and w13.dtype == torch.float32
        assert w2.shape == (n_exp, hidden, 1) and w2.dtype == torch.float32
        assert torch.isfinite(w13).all() and (w13 > 0).all()


# ------------------------------------------------------------------ ignore lists


@pytest.mark.parametrize("kind,fmt,scheme", ALL_CASES)
def test_ignore_entries_are_exact_module_names(kind, fmt, scheme, outputs):
    tensors, cfg = outputs(kind, fmt, scheme)
    modules = weight_modules(tensors)
    in_memory = {R.transformers_name(kind, m): m for m in modules}  # transformers' names of the same modules
    for lst in ignore_lists(fmt, cfg):
        assert "lm_head" in lst, "transformers adds its default skips only when no list is given"
        for entry in lst:
            assert isinstance(entry, str)
            assert not entry.startswith("re:") and not set(entry) & set("*?[]"), f"not an exact name: {entry}"
            assert not entry.endswith(".weight"), entry
            assert entry == "lm_head" or entry in modules or entry in in_memory, \
                f"{entry} is not a module of the checkpoint, nor as transformers names it"
            module = entry if entry in modules else in_memory.get(entry)
            if module:
                assert not is_quantized(tensors, module), f"{entry} is listed but quantized"
                assert module + ".weight_scale" not in tensors and module + ".weight_scale_inv" not in tensors
        assert len(lst) == len(set(lst))
    if fmt == "fp8":
        qc = cfg["quantization_config"]
        assert sorted(qc["ignored_layers"]) == sorted(qc["modules_to_not_convert"])


@pytest.mark.parametrize("kind", MOE_KINDS)
@pytest.mark.parametrize("fmt,scheme", FORMAT_SCHEMES, ids=FS_IDS)
def test_routers_are_listed(kind, fmt, scheme, outputs):
    """vLLM's Qwen3-MoE builds the router `gate` with the quant config: it must be in the list."""
    tensors, cfg = outputs(kind, fmt, scheme)
    routers = sorted(
        m for m in weight_modules(tensors) if re.search(r"\.(mlp\.gate|block_sparse_moe\.gate)$", m)
    )
    assert routers
    for lst in ignore_lists(fmt, cfg):
        assert set(routers) <= set(lst)
    for r in routers:
        assert not is_quantized(tensors, r)


# ------------------------------------------------------------------ shapes and scale layouts


@pytest.mark.parametrize("fmt,scheme", [("compressed-tensors", "tensor"), ("compressed-tensors", "channel"),
                                        ("fp8", "tensor")])
def test_quantized_weights_have_dims_divisible_by_16(fmt, scheme, odd_llama, tmp_path):
    """A model with linear weights whose dims are not multiples of 16 (the fixture is checked to have
    them): none of those becomes FP8, every FP8 weight has both dims divisible by 16."""
    src = read_safetensors_dir(odd_llama)
    odd = {n for n, t in src.items() if t.dim() == 2 and n.endswith("proj.weight") and
           (t.shape[0] % 16 or t.shape[1] % 16)}
    assert odd, "the fixture must have linear weights with dims not divisible by 16"
    out = tmp_path / "out"
    run_quantize(odd_llama, out, scheme=scheme, format=fmt)
    tensors = read_safetensors_dir(out)
    assert any(t.dtype == FP8 for t in tensors.values())
    for n, t in tensors.items():
        if t.dtype == FP8:
            assert t.dim() == 2 and t.shape[0] % 16 == 0 and t.shape[1] % 16 == 0, (n, tuple(t.shape))
    assert all(tensors[n].dtype != FP8 for n in odd)


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_tensor_scales_are_scalars(kind, outputs):
    tensors, cfg = outputs(kind, "fp8", "tensor")
    assert "weight_block_size" not in cfg["quantization_config"]
    assert cfg["quantization_config"]["activation_scheme"] == "dynamic"
    for n, t in tensors.items():
        if t.dtype == FP8:
            s = tensors[R.module_of(n) + ".weight_scale"]
            assert s.dtype == torch.float32 and s.numel() == 1 and s.dim() <= 1
            assert R.module_of(n) + ".weight_scale_inv" not in tensors


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_compressed_tensors_strategies_are_a_pair_vllm_moe_accepts(scheme, outputs):
    _, cfg = outputs("qwen3_moe", "compressed-tensors", scheme)
    g = cfg["quantization_config"]["config_groups"]["group_0"]
    pair = (g["weights"]["strategy"], g["input_activations"]["strategy"])
    assert pair in {("tensor", "tensor"), ("channel", "token"), ("block", "group")}, pair
    assert g["input_activations"]["dynamic"] is True and g["weights"]["dynamic"] is False


# ------------------------------------------------------------------ refusals and odd shapes


def test_fp8_format_has_no_channel_scheme(source_model, tmp_path):
    fp8convert = fp8convert_module()
    out = tmp_path / "out"
    with pytest.raises(fp8convert.FP8ConvertError) as ei:
        run_quantize(source_model("llama"), out, scheme="channel", format="fp8")
    assert "\n" not in str(ei.value).strip()
    if out.exists():  # nothing heavy starts before the plan validates
        assert not (out / "config.json").exists() and not list(out.glob("*.safetensors"))
    with pytest.raises(fp8convert.FP8ConvertError):
        fp8convert.make_plan(str(source_model("llama")), scheme="channel", format="fp8")


@pytest.fixture(scope="module")
def odd_llama(tmp_path_factory):
    """llama whose MLP width (72) is not a multiple of 16: gate/up/down cannot take FP8 GEMMs."""
    return make_model("llama", tmp_path_factory.mktemp("odd") / "model", config_overrides={"intermediate_size": 72})


@pytest.mark.parametrize("fmt,scheme", [("compressed-tensors", "tensor"), ("compressed-tensors", "channel"), ("fp8", "tensor")])
def test_linears_not_divisible_by_16_stay_high_precision_and_listed(fmt, scheme, odd_llama, tmp_path):
    out = tmp_path / "out"
    run_quantize(odd_llama, out, scheme=scheme, format=fmt)
    src = read_safetensors_dir(odd_llama)
    got = read_safetensors_dir(out)
    cfg = read_json(out / "config.json")
    mlp = {f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")}
    for m in mlp:
        assert got[m + ".weight"].dtype == src[m + ".weight"].dtype
        assert torch.equal(got[m + ".weight"].view(torch.uint8), src[m + ".weight"].view(torch.uint8))
    for lst in ignore_lists(fmt, cfg):
        assert mlp <= set(lst)
    for i in range(2):  # attention is unaffected
        assert got[f"model.layers.{i}.self_attn.q_proj.weight"].dtype == FP8
    # and everything else is exactly what the reference says
    exp, quant = R.expected_outputs(src, fmt, scheme)
    assert set(got) == set(exp)
    for n in quant:
        assert torch.equal(got[n].view(torch.uint8), exp[n].view(torch.uint8)), n


# ================================================================== the zoo: one contract per architecture
#
# What vLLM 0.33's loader reads for each architecture of tests/zoo.py, written down from its model file
# (vllm/model_executor/models/<file>, the function named in `source`):
# - mapper: the renaming part of the model's hf_to_vllm_mapper (models/utils.py WeightsMapper: substr,
#   then prefix, then suffix rules; mappings to None are dropped). vLLM applies it to checkpoint names
#   and, through apply_vllm_mapper, to the ignore list (compressed-tensors: dotted entries without re:);
# - names: where vLLM's module prefixes do not follow the (mapped) checkpoint names;
# - packed: packed_modules_mapping (fused layers; vLLM raises when only some members are ignored);
# - unquantized: modules vLLM builds without the quant config (vLLM names): FP8 weights or scales
#   there fail to load;
# - experts: the checkpoint names its expert loader maps per expert (gate, up, down), the experts
#   module vLLM's MoE layer is registered under, whether compressed-tensors quantizes it;
# - fused_bf16: fused expert tensors its loader reads only in BF16, with their shapes from config.json.
# Everything else built as a linear is quantized unless the ignore list skips it, matched the way
# vLLM does (quantization/utils/quant_utils.py is_layer_skipped for fp8, compressed_tensors/utils.py
# should_ignore_layer and compressed_tensors_moe.py get_moe_method for compressed-tensors).

import dataclasses  # noqa: E402
from typing import Callable  # noqa: E402


QKV_GATE_UP = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EMBED_HEAD = r"(^|\.)(embed_tokens|embed_tokens_per_layer|wte|wpe|lm_head)$"
_LLAVA_MAPPER = (("prefix", "model.language_model.", "language_model.model."),
                 ("prefix", "model.vision_tower.", "vision_tower."),
                 ("prefix", "model.multi_modal_projector.", "multi_modal_projector."),
                 ("prefix", "lm_head.", "language_model.lm_head."))


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
    fused_bf16: dict = dataclasses.field(default_factory=dict)   # name regex -> shape(config)


def _text(config: dict) -> dict:
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
    "phi3": Contract("phi3.py Phi3ForCausalLM: qkv_proj and gate_up_proj fused on disk",
                     packed={"qkv_proj": ("qkv_proj",), "gate_up_proj": ("gate_up_proj",)}),
    "gpt2": Contract("gpt2.py GPT2LMHeadModel: c_attn/c_proj/c_fc quantizable (weights transposed at load)",
                     packed={}),
    "qwen3_moe": Contract("qwen3_moe.py Qwen3MoeSparseMoeBlock: gate is a GateLinear with quant_config",
                          packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
                          unquantized=EMBED_HEAD + r"|\.shared_expert_gate$"),
    "mixtral": Contract("mixtral.py MixtralMoE: gate without quant_config; experts ckpt_names w1/w2/w3",
                        mapper=(("substr", ".gate_proj.", ".w1."), ("substr", ".up_proj.", ".w3."),
                                ("substr", ".down_proj.", ".w2.")),
                        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
                        unquantized=EMBED_HEAD + r"|\.block_sparse_moe\.gate$", expert_names=("w1", "w3", "w2")),
    "phimoe": Contract("phimoe.py PhiMoE: gate without quant_config, lm_head quant_config=None",
                       packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
                       unquantized=EMBED_HEAD + r"|\.block_sparse_moe\.gate$", expert_names=("w1", "w3", "w2")),
    "olmoe": Contract("olmoe.py OlmoeMoE: gate without quant_config",
                      packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")}, unquantized=EMBED_HEAD + r"|\.mlp\.gate$"),
    "minimax_m2": Contract("minimax_m2.py MiniMaxM2MoE: fp32 gate without quant_config; ckpt_names w1/w2/w3",
                           packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
                           unquantized=EMBED_HEAD + r"|\.block_sparse_moe\.gate$", expert_names=("w1", "w3", "w2")),
    "ernie4_5_moe": Contract("ernie45_moe.py Ernie4_5_MoeMoE: fp32 gate without quant_config",
                             unquantized=EMBED_HEAD + r"|\.mlp\.gate$"),
    "deepseek_v3": Contract("deepseek_v2.py DeepseekV2Model.load_weights (per-expert only), deepseek_mtp.py "
                            "DeepSeekMultiTokenPredictorLayer (eh_proj is a torch nn.Linear)",
                            packed={"gate_up_proj": ("gate_proj", "up_proj"),
                                    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")},
                            unquantized=EMBED_HEAD + r"|\.mlp\.gate$|\.eh_proj$|\.shared_head\.head$"),
    "glm4_moe": Contract("glm4_moe.py Glm4MoE (fp32 gate without quant_config), glm4_moe_mtp.py (eh_proj nn.Linear)",
                         unquantized=EMBED_HEAD + r"|\.mlp\.gate$|\.eh_proj$|\.shared_head\.head$"),
    "llama4": Contract("mllama4.py Llama4ForConditionalGeneration (vision_model and multi_modal_projector with "
                       "quant_config=None), llama4.py Llama4Model.load_moe_expert_weights (per-expert mapping)",
                       unquantized=EMBED_HEAD + r"|^vision_model\.|^multi_modal_projector\.|\.feed_forward\.router$"),
    "gpt_oss": Contract("gpt_oss.py GptOssModel._load_weights_other: BF16 experts only, [E, H, 2I] interleaved",
                        mapper=(("substr", ".self_attn.", ".attn."),),
                        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
                        unquantized=EMBED_HEAD + r"|\.mlp\.router$",
                        fused_bf16={
                            r"mlp\.experts\.gate_up_proj": lambda c: (c["num_local_experts"], c["hidden_size"],
                                                                       2 * c["intermediate_size"]),
                            r"mlp\.experts\.gate_up_proj_bias": lambda c: (c["num_local_experts"],
                                                                            2 * c["intermediate_size"]),
                            r"mlp\.experts\.down_proj": lambda c: (c["num_local_experts"], c["intermediate_size"],
                                                                   c["hidden_size"]),
                            r"mlp\.experts\.down_proj_bias": lambda c: (c["num_local_experts"], c["hidden_size"])}),
    "granitemoe": Contract("granitemoe.py GraniteMoeMoE (gate without quant_config; GraniteMoeModel mapper "
                           "router.layer -> gate); experts through RoutedExperts.load_weights",
                           names=lambda m, c: re.sub(r"\.router\.layer$", ".gate", m),
                           packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
                           unquantized=EMBED_HEAD + r"|\.block_sparse_moe\.gate$"),
    "dbrx": Contract("dbrx.py DbrxExperts.weight_loader (stacked [E*I, H]; compressed-tensors never matches "
                     "DbrxExperts), DbrxRouter.layer without quant_config",
                     packed={}, unquantized=EMBED_HEAD + r"|\.ffn\.router\.layer$",
                     experts_prefix=lambda experts: re.sub(r"\.experts$", "", experts), ct_quantizes_experts=False,
                     fused_bf16={r"ffn\.experts\.mlp\.(w1|v1|w2)": lambda c: (
                         c["ffn_config"]["moe_num_experts"] * c["ffn_config"]["ffn_hidden_size"], c["d_model"])}),
    "qwen3_vl_moe": Contract("qwen3_vl_moe.py (Qwen3-MoE block: gate quantizable), qwen3_vl.py mapper",
                             mapper=(("prefix", "model.visual.", "visual."),
                                     ("prefix", "lm_head.", "language_model.lm_head."),
                                     ("prefix", "model.language_model.", "language_model.model.")),
                             unquantized=EMBED_HEAD + r"|^visual\.pos_embed$"),
    "gemma4": Contract("gemma4.py Gemma4Router.proj (GateLinear without quant), gemma4_mm.py mapper and towers "
                       "with quant_config", mapper=(("prefix", "model.vision_tower", "vision_tower"),
                                                    ("prefix", "model.embed_vision", "embed_vision"),
                                                    ("prefix", "model.language_model.", "language_model.model."),
                                                    ("prefix", "lm_head.", "language_model.lm_head."),
                                                    ("prefix", "model", "language_model.model")),
                       unquantized=EMBED_HEAD + r"|\.router\.proj$"),
    "qwen3_next": Contract("qwen3_next.py (gate, shared_expert_gate without quant_config; in_proj_ba with it), "
                           "qwen3_next_mtp.py (mtp.fc with quant_config)",
                           packed={**QKV_GATE_UP, "in_proj_qkvz": ("in_proj_qkvz",), "in_proj_ba": ("in_proj_ba",)},
                           unquantized=EMBED_HEAD + r"|\.mlp\.gate$|\.shared_expert_gate$"),
    "nemotron_h": Contract("nemotron_h.py NemotronHMoE (fp32 gate without quant_config; experts up/down only)",
                           mapper=(("substr", "A_log", "A"), ("substr", "embeddings", "embed_tokens"),
                                   ("prefix", "backbone", "model")),
                           packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},
                           unquantized=EMBED_HEAD + r"|\.mixer\.gate$", expert_names=("up_proj", None, "down_proj")),
    "falcon_h1": Contract("falcon_h1.py FalconH1ParallelHybrid (attention and Mamba prefixes)",
                          mapper=(("substr", "A_log", "A"), ("substr", "mamba", "mamba.mamba")),
                          names=_falcon_h1_names),
    "jamba": Contract("jamba.py JambaForCausalLM; layers/mamba/mamba_mixer.py MambaMixer (no quant_config)",
                      mapper=(("substr", ".self_attn.", "."), ("substr", ".A_log", ".A")),
                      packed={**QKV_GATE_UP, "in_proj": ("in_proj",)},
                      unquantized=EMBED_HEAD + r"|\.mamba\.\w+$|\.feed_forward\.router$"),
    "qwen2_5_vl": Contract("qwen2_5_vl.py: the vision tower is built with quant_config",
                           mapper=(("prefix", "model.language_model.", "language_model.model."),
                                   ("prefix", "model.visual.", "visual."),
                                   ("prefix", "lm_head.", "language_model.lm_head."),
                                   ("prefix", "model.", "language_model.model."))),
    "gemma3": Contract("gemma3_mm.py: SiglipVisionModel with quant_config; projector has no linears",
                       mapper=_LLAVA_MAPPER),
    "mistral3": Contract("mistral3.py: Pixtral tower and projector with quant_config, patch_merger.merging_layer "
                         "a plain nn.Linear", mapper=_LLAVA_MAPPER + (("prefix", "model.", "language_model.model."),),
                         unquantized=EMBED_HEAD + r"|\.patch_merger\.merging_layer$"),
    "llava": Contract("llava.py: CLIP tower and projector with quant_config", mapper=_LLAVA_MAPPER),
    "falcon": Contract("falcon.py FalconModel.load_weights (query_key_value rows regrouped per KV head)",
                       packed={}, unquantized=EMBED_HEAD + r"|(^|\.)word_embeddings$"),
    # further model_types the registry lists (tested in two combinations)
    "mistral": Contract("mistral.py MistralForCausalLM (LlamaForCausalLM)"),
    "qwen2": Contract("qwen2.py Qwen2ForCausalLM"),
    "glm4": Contract("glm4.py Glm4ForCausalLM (gate_up_proj fused on disk)",
                     packed={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_up_proj",)}),
    "olmo2": Contract("olmo2.py Olmo2ForCausalLM"),
    "granite": Contract("granite.py GraniteForCausalLM"),
    "starcoder2": Contract("starcoder2.py Starcoder2ForCausalLM (c_fc/c_proj are nn.Linear-shaped)"),
    "qwen2_moe": Contract("qwen2_moe.py Qwen2MoeSparseMoeBlock (gate GateLinear without quant_config, "
                          "shared_expert_gate quant_config=None)",
                          unquantized=EMBED_HEAD + r"|\.mlp\.gate$|\.shared_expert_gate$"),
    "deepseek_v2": Contract("deepseek_v2.py DeepseekV2MoE (gate without quant_config)",
                            packed={"gate_up_proj": ("gate_proj", "up_proj"), "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")},
                            unquantized=EMBED_HEAD + r"|\.mlp\.gate$"),
    "llama4_text": Contract("llama4.py Llama4ForCausalLM, Llama4Model.load_moe_expert_weights",
                            unquantized=EMBED_HEAD + r"|\.feed_forward\.router$"),
    "granitemoeshared": Contract("granitemoeshared.py (GraniteMoeModel mapper; shared_mlp.input_linear fused on disk)",
                                 names=lambda m, c: re.sub(r"\.router\.layer$", ".gate", m),
                                 packed={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "input_linear": ("input_linear",)},
                                 unquantized=EMBED_HEAD + r"|\.block_sparse_moe\.gate$"),
    "granitemoehybrid": Contract("granitemoehybrid.py GraniteMoeHybridModel.load_weights (_load_quant_expert maps "
                                 "block_sparse_moe.experts.{e}.gate_proj/up_proj/down_proj; router.layer -> gate)",
                                 names=lambda m, c: re.sub(r"\.router\.layer$", ".gate", m),
                                 packed={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "in_proj": ("in_proj",),
                                         "input_linear": ("input_linear",)},
                                 unquantized=EMBED_HEAD + r"|\.block_sparse_moe\.gate$"),
    "qwen3_vl": Contract("qwen3_vl.py: the vision tower is built with quant_config",
                         mapper=(("prefix", "model.visual.", "visual."), ("prefix", "lm_head.", "language_model.lm_head."),
                                 ("prefix", "model.language_model.", "language_model.model."))),
    "qwen3_5": Contract("qwen3_5.py Qwen3_5ForConditionalGeneration (Qwen3-VL mapper, in_proj_qkvz/in_proj_ba packed)",
                        mapper=(("prefix", "model.visual.", "visual."), ("prefix", "lm_head.", "language_model.lm_head."),
                                ("prefix", "model.language_model.", "language_model.model.")),
                        packed={**QKV_GATE_UP, "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
                                "in_proj_ba": ("in_proj_b", "in_proj_a")}),
    "qwen3_5_moe": Contract("qwen3_5.py Qwen3_5MoeForConditionalGeneration (Qwen3NextSparseMoeBlock: gate and "
                            "shared_expert_gate without quant_config)",
                            mapper=(("prefix", "model.visual.", "visual."),
                                    ("prefix", "lm_head.", "language_model.lm_head."),
                                    ("prefix", "model.language_model.", "language_model.model.")),
                            packed={**QKV_GATE_UP, "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
                                    "in_proj_ba": ("in_proj_b", "in_proj_a")},
                            unquantized=EMBED_HEAD + r"|\.mlp\.gate$|\.shared_expert_gate$"),
}
ZOO_TWO_COMBOS = ("mistral", "qwen2", "glm4", "olmo2", "granite", "starcoder2", "qwen2_moe", "deepseek_v2", "llama4_text",
                  "granitemoeshared", "granitemoehybrid", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "falcon")


def apply_mapper(contract: Contract, name: str) -> str:
    """vLLM's WeightsMapper renaming: substr rules, then prefix rules, then suffix rules, in order."""
    for kind in ("substr", "prefix", "suffix"):
        for k, old, new in contract.mapper:
            if k != kind:
                continue
            if kind == "substr" and old in name:
                name = name.replace(old, new, 1)
            elif kind == "prefix" and name.startswith(old):
                name = new + name[len(old):]
            elif kind == "suffix" and name.endswith(old):
                name = name[: -len(old)] + new
    return name


def vllm_name(contract: Contract, module: str, config: dict) -> str:
    """vLLM's name (the prefix its quant config sees) of a checkpoint module: where its module tree
    follows the checkpoint, the mapper's renaming of the weight's name (`<module>.weight`)."""
    if contract.names:
        return contract.names(module, _text(config))
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
    names = [f"{experts}.0.{n}" for n in contract.expert_names if n] + \
        ([f"{experts}.0.None"] if None in contract.expert_names else [])
    skipped = {ct_matches(n, entries) for n in names}
    assert len(skipped) == 1, f"{experts}: vLLM raises: some of {names} ignored, some not"
    return skipped.pop()


EXPERT_OUTPUT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<member>[^.]+)$")


@pytest.mark.parametrize("arch,fmt,scheme", [
    pytest.param(a, f, s, id=f"{a}-{i}") for a in CONTRACTS for (f, s), i in zip(FORMAT_SCHEMES, FS_IDS)
    if a not in ZOO_TWO_COMBOS or (f, s) in (("compressed-tensors", "tensor"), ("fp8", "block"))])
def test_zoo_meets_vllm_loader_contract(arch, fmt, scheme, zoo_converted, zoo_source):
    contract = CONTRACTS[arch]
    out, _ = zoo_converted(arch, fmt, scheme)
    tensors = read_safetensors_dir(out)
    config = read_json(zoo_source(arch) / "config.json")
    entries = vllm_ignore(contract, ignore_lists(fmt, read_json(out / "config.json"))[0], fmt)
    scale_suffix = ".weight_scale_inv" if fmt == "fp8" and scheme == "block" else ".weight_scale"
    experts_fp8: dict[str, set[bool]] = {}
    checked = 0
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_inv")):
            module = name.rsplit(".", 1)[0]
            assert tensors.get(module + ".weight") is not None and tensors[module + ".weight"].dtype == FP8, \
                f"{name}: a scale without an FP8 weight (vLLM has no parameter for it)"
            continue
        for pattern, shape in contract.fused_bf16.items():
            if re.search(rf"\.{pattern}$", name):
                assert t.dtype == torch.bfloat16 and tuple(t.shape) == shape(_text(config)), (name, t.dtype, t.shape)
                assert not any(k.startswith(name + "_scale") or k.startswith(name + ".weight_scale") for k in tensors)
                experts = re.sub(r"\.(gate_up_proj|down_proj|mlp\.\w+)(_bias)?$", "", name)
                experts = experts if experts.endswith(".experts") else experts + ".experts"
                assert vllm_skips_experts(contract, contract.experts_prefix(vllm_name(contract, experts, config)),
                                          entries, fmt), f"{name}: vLLM would build these experts as FP8"
        if not name.endswith(".weight") or t.dim() != 2:
            continue
        module = name[: -len(".weight")]
        vname = vllm_name(contract, module, config)
        fp8 = t.dtype == FP8
        if fp8:
            scale = tensors.get(module + scale_suffix)
            want = torch.uint8 if scheme == "mxfp8" else torch.float32
            assert scale is not None and scale.dtype == want, f"{name}: no {want} {scale_suffix} for vLLM"
            if scheme == "mxfp8":  # CompressedTensorsW8A8Mxfp8.create_weights: uint8 [out, in // 32]
                assert t.shape[1] % 32 == 0 and tuple(scale.shape) == (t.shape[0], t.shape[1] // 32), \
                    (name, tuple(t.shape), tuple(scale.shape))
        if re.search(contract.unquantized, vname) or R.is_embedding(module) or "norm" in module.rsplit(".", 1)[-1]:
            assert not fp8, f"{name}: FP8, but vLLM builds {vname} without the quant config"
            continue
        m = EXPERT_OUTPUT.match(vname)
        if m:
            assert m.group("member") in [n for n in contract.expert_names if n], \
                f"{name}: vLLM's expert loader maps only {contract.expert_names}"
            experts_fp8.setdefault(m.group("experts"), set()).add(fp8)
            continue
        skipped = vllm_skips_module(vname, entries, fmt)
        assert fp8 != skipped, (f"{name}: {'FP8' if fp8 else 'BF16'}, but vLLM's ignore matching "
                                f"{'skips' if skipped else 'does not skip'} {vname}")
        checked += 1
    for experts, kinds in experts_fp8.items():
        assert len(kinds) == 1, f"{experts}: some experts FP8, some not (one FusedMoE per layer)"
        skipped = vllm_skips_experts(contract, contract.experts_prefix(experts), entries, fmt)
        assert kinds.pop() != skipped, f"{experts}: dtype disagrees with vLLM's ignore matching"
    for fused, members in contract.packed.items():  # vLLM raises when a fused layer is partly ignored
        for name in tensors:
            parts = name[: -len(".weight")].rsplit(".", 1) if name.endswith(".weight") else None
            if parts and len(parts) == 2 and parts[1] == members[0] and len(members) > 1:
                vnames = [vllm_name(contract, f"{parts[0]}.{m}", config) for m in members]
                present = [f"{parts[0]}.{m}.weight" in tensors for m in members]
                if all(present):
                    assert len({vllm_skips_module(v, entries, fmt) for v in vnames}) == 1, f"{parts[0]}.{fused}"
    assert checked or arch == "gpt2", "no quantizable module was checked"
