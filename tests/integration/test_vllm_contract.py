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
import reference as R
import torch
from checks import ignore_lists
from harness import (
    ALL_CASES,
    FORMAT_SCHEMES,
    FS_IDS,
    MORE_ZOO_CASES,
    ZOO_CASES,
    fp8convert_module,
    read_json,
    read_safetensors_dir,
    run_quantize,
)
from tiny_models import KINDS, MOE_KINDS, N_EXPERTS, make_model
from vllm_rules import (
    CONTRACTS,
    EXPERT_OUTPUT,
    text_config,
    vllm_ignore,
    vllm_name,
    vllm_skips_experts,
    vllm_skips_module,
)

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
        w13 = torch.stack([torch.cat([scale_of(tensors, f"{prefix}.{e}.{p}") for p in (g, u)]) for e in range(n_exp)])
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
            assert entry == "lm_head" or entry in modules or entry in in_memory, (
                f"{entry} is not a module of the checkpoint, nor as transformers names it"
            )
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
    routers = sorted(m for m in weight_modules(tensors) if re.search(r"\.(mlp\.gate|block_sparse_moe\.gate)$", m))
    assert routers
    for lst in ignore_lists(fmt, cfg):
        assert set(routers) <= set(lst)
    for r in routers:
        assert not is_quantized(tensors, r)


# ------------------------------------------------------------------ shapes and scale layouts


@pytest.mark.parametrize(
    "fmt,scheme", [("compressed-tensors", "tensor"), ("compressed-tensors", "channel"), ("fp8", "tensor")]
)
def test_quantized_weights_have_dims_divisible_by_16(fmt, scheme, odd_llama, tmp_path):
    """A model with linear weights whose dims are not multiples of 16 (the fixture is checked to have
    them): none of those becomes FP8, every FP8 weight has both dims divisible by 16."""
    src = read_safetensors_dir(odd_llama)
    odd = {
        n for n, t in src.items() if t.dim() == 2 and n.endswith("proj.weight") and (t.shape[0] % 16 or t.shape[1] % 16)
    }
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


@pytest.mark.parametrize(
    "fmt,scheme", [("compressed-tensors", "tensor"), ("compressed-tensors", "channel"), ("fp8", "tensor")]
)
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
# (vllm_rules.py writes down what vLLM's loader reads for each architecture)


@pytest.mark.parametrize("arch,fmt,scheme", ZOO_CASES + MORE_ZOO_CASES)
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
            assert tensors.get(module + ".weight") is not None and tensors[module + ".weight"].dtype == FP8, (
                f"{name}: a scale without an FP8 weight (vLLM has no parameter for it)"
            )
            continue
        for pattern, shape in contract.fused_bf16.items():
            if re.search(rf"\.{pattern}$", name):
                assert t.dtype == torch.bfloat16 and tuple(t.shape) == shape(text_config(config)), (
                    name,
                    t.dtype,
                    t.shape,
                )
                assert not any(k.startswith(name + "_scale") or k.startswith(name + ".weight_scale") for k in tensors)
                experts = re.sub(r"\.(gate_up_proj|down_proj|mlp\.\w+)(_bias)?$", "", name)
                experts = experts if experts.endswith(".experts") else experts + ".experts"
                assert vllm_skips_experts(
                    contract, contract.experts_prefix(vllm_name(contract, experts, config)), entries, fmt
                ), f"{name}: vLLM would build these experts as FP8"
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
                assert t.shape[1] % 32 == 0 and tuple(scale.shape) == (t.shape[0], t.shape[1] // 32), (
                    name,
                    tuple(t.shape),
                    tuple(scale.shape),
                )
        if re.search(contract.unquantized, vname) or R.is_embedding(module) or "norm" in module.rsplit(".", 1)[-1]:
            assert not fp8, f"{name}: FP8, but vLLM builds {vname} without the quant config"
            continue
        m = EXPERT_OUTPUT.match(vname)
        if m:
            assert m.group("member") in [n for n in contract.expert_names if n], (
                f"{name}: vLLM's expert loader maps only {contract.expert_names}"
            )
            experts_fp8.setdefault(m.group("experts"), set()).add(fp8)
            continue
        skipped = vllm_skips_module(vname, entries, fmt)
        assert fp8 != skipped, (
            f"{name}: {'FP8' if fp8 else 'BF16'}, but vLLM's ignore matching "
            f"{'skips' if skipped else 'does not skip'} {vname}"
        )
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
    assert checked, "no quantizable module was checked"
