"""Every architecture of tests/support/zoo.py, converted in every scheme/format pair.

Each tiny model is built once per session with transformers' own classes and saved in several shards;
each combination converts once (conftest.py's zoo_converted) and is checked:
- bit for bit against tests/support/reference.py (experts split per expert from their fused tensors, per-expert
  scales, fused members sharing a scale, kept tensors byte-identical), and by `fp8convert verify`;
- its ignore list: every entry names a real module (as the checkpoint, transformers or vLLM names it),
  and compressed-tensors, matching the way it does inside transformers, skips exactly the kept linears;
- loaded back in transformers on CPU (slow) wherever the plan says transformers can load it: logits
  cosine >= 0.99 against the source, every parameter within e4m3 rounding of the source's.
What vLLM's loaders read is test_vllm_contract.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import reference as R
import torch
import zoo
from checks import FP8, assert_codes_and_scales, assert_names_shapes_dtypes, ignore_lists, same_bytes
from harness import (
    FORMAT_SCHEMES,
    MORE_ZOO_CASES,
    ZOO_CASES,
    fp8convert_module,
    in_turn,
    read_json,
    read_safetensors_dir,
    run_quantize,
)
from tiny_ckpt import llama_tensors, write_checkpoint
from vllm_rules import CONTRACTS, vllm_name
from zoo import MORE_ARCHS, NOT_IN_VLLM_ARCHS, NOTHING_QUANTIZED, ZOO_ARCHS

MIN_COSINE = 0.99
E4M3_BOUND = 2.0**-4 * 1.02  # relative error of a correctly dequantized weight (verify's bound, normal values)


@pytest.fixture(scope="module")
def zoo_outputs(zoo_converted):
    """zoo_outputs(arch, fmt, scheme) -> (output dir, tensors, config.json, report)."""
    cache: dict = {}

    def get(arch, fmt, scheme):
        key = (arch, fmt, scheme)
        if key not in cache:
            out, report = zoo_converted(arch, fmt, scheme)
            cache[key] = (out, read_safetensors_dir(out), read_json(out / "config.json"), report)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def zoo_tensors(zoo_source):
    cache: dict = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = read_safetensors_dir(zoo_source(arch))
        return cache[arch]

    return get


def plan_warnings(src: Path, fmt: str, scheme: str):
    from fp8convert.plan.summary import compatibility_warnings

    return compatibility_warnings(fp8convert_module().make_plan(str(src), scheme=scheme, format=fmt))


# ------------------------------------------------------------------ the zoo itself

# A tensor each checkpoint must hold for the tests to mean what they say.
LAYOUT_MARKERS = {
    "llama4": "language_model.model.layers.1.feed_forward.experts.gate_up_proj",  # [E, hidden, 2*inter]
    "gpt_oss": "model.layers.0.mlp.experts.gate_up_proj",  # interleaved gate/up
    "granitemoe": "model.layers.0.block_sparse_moe.input_linear.weight",  # [E, 2*inter, hidden]
    "qwen3_vl_moe": "model.language_model.layers.0.mlp.experts.gate_up_proj",  # released [E, hidden, 2*inter]
    "gemma4": "model.language_model.layers.0.experts.gate_up_proj",  # [E, 2*inter, hidden]
    "dbrx": "transformer.blocks.0.ffn.experts.mlp.w1",  # [E*inter, hidden], no .weight
    "deepseek_v3": "model.layers.2.eh_proj.weight",  # MTP layer 2 (num_hidden_layers)
    "glm4_moe": "model.layers.2.shared_head.head.weight",
    "qwen3_next": "mtp.fc.weight",
    "nemotron_h": "backbone.layers.1.mixer.gate.weight",  # router named mixer.gate
    "phimoe": "model.layers.1.block_sparse_moe.gate.weight",  # mlp.router in transformers
    "qwen2_5_vl": "visual.merger.mlp.0.weight",
    "gemma3": "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight",
    "gpt2": "transformer.h.0.attn.c_attn.weight",  # Conv1D [in, out]
}


def test_zoo_models_have_the_layouts_the_tests_rely_on(zoo_source, zoo_tensors):
    assert len(ZOO_ARCHS) >= 20
    for arch in ZOO_ARCHS + MORE_ARCHS + NOTHING_QUANTIZED:
        assert len(list(zoo_source(arch).glob("model-*.safetensors"))) >= 3, f"{arch}: fewer than 3 shards"
        assert zoo.ARCHS[arch].model_type == read_json(zoo_source(arch) / "config.json")["model_type"]
        if arch in LAYOUT_MARKERS:
            assert LAYOUT_MARKERS[arch] in zoo_tensors(arch), arch
    e, h, i = zoo.N_EXPERTS, zoo.HIDDEN, zoo.MOE_I
    assert tuple(zoo_tensors("llama4")[LAYOUT_MARKERS["llama4"]].shape) == (e, h, 2 * i)
    assert tuple(zoo_tensors("qwen3_vl_moe")[LAYOUT_MARKERS["qwen3_vl_moe"]].shape) == (e, h, 2 * i)
    assert tuple(zoo_tensors("granitemoe")[LAYOUT_MARKERS["granitemoe"]].shape) == (e, 2 * i, h)
    assert 2 * i != h, "2 * inter == hidden would make the 3-D layouts ambiguous"


# ------------------------------------------------------------------ bytes


@pytest.mark.parametrize("arch,fmt,scheme", ZOO_CASES + MORE_ZOO_CASES)
def test_converts_exactly(arch, fmt, scheme, zoo_outputs, zoo_tensors, zoo_source):
    """Names, shapes, dtypes, FP8 codes and scales bit-exact against the reference; kept tensors
    byte-identical; and fp8convert's own verify agrees."""
    out, got, cfg, _ = zoo_outputs(arch, fmt, scheme)
    src = zoo_tensors(arch)
    exp, quant = R.expected_outputs(src, fmt, scheme, arch=arch, config=read_json(zoo_source(arch) / "config.json"))
    assert_names_shapes_dtypes(got, exp)
    if quant:
        assert_codes_and_scales(got, exp, quant)
    kept = [n for n in exp if n not in quant and not n.endswith(("_scale", "_scale_inv"))]
    assert not [n for n in kept if not same_bytes(got[n], exp[n])], "kept tensors differ from the source"
    from fp8convert.verify import verify

    report = verify(zoo_source(arch), out)
    assert report.ok, report.failures[:5]
    assert report.tensors_quantized == len(quant)


@pytest.mark.parametrize("arch", ["llama4", "qwen3_vl_moe", "granitemoe", "gemma4"])
def test_split_experts_are_the_source_slices(arch, zoo_outputs, zoo_tensors):
    """Each expert's gate/up/down dequantizes to its own slice of the fused tensor, in nn.Linear
    orientation (checked here with plain arithmetic, not the reference's quantizer); gate and up of
    one expert share a scale; experts have their own scales."""
    _, got, _, _ = zoo_outputs(arch, "compressed-tensors", "tensor")
    src = zoo_tensors(arch)
    inter = zoo.MOE_I
    fused = next(n for n in src if re.search(r"(experts\.gate_up_proj|input_linear\.weight)$", n))
    w = src[fused].float()
    experts = fused.replace(".input_linear.weight", ".experts") if "input_linear" in fused else fused.rsplit(".", 1)[0]
    scales = set()
    for e in range(zoo.N_EXPERTS):
        rows = w[e] if w.shape[1] == 2 * inter else w[e].T  # [2*inter, hidden] either way
        for part, member in enumerate(("gate_proj", "up_proj")):
            name = f"{experts}.{e}.{member}.weight"
            deq = got[name].float() * got[name + "_scale"].float()
            want = rows[part * inter : (part + 1) * inter]
            assert deq.shape == want.shape == (inter, zoo.HIDDEN)
            assert ((deq - want).norm() / want.norm()).item() <= E4M3_BOUND, name
        assert torch.equal(got[f"{experts}.{e}.gate_proj.weight_scale"], got[f"{experts}.{e}.up_proj.weight_scale"])
        scales.add(got[f"{experts}.{e}.gate_proj.weight_scale"].item())
    assert len(scales) > zoo.N_EXPERTS // 2  # per expert, not one for the layer (bf16 amaxes can coincide)
    assert fused not in got


def test_gpt_oss_experts_stay_bf16_fused_with_their_reason(zoo_outputs, zoo_tensors):
    out, got, cfg, report = zoo_outputs("gpt_oss", "compressed-tensors", "tensor")
    src = zoo_tensors("gpt_oss")
    for name in (
        "mlp.experts.gate_up_proj",
        "mlp.experts.gate_up_proj_bias",
        "mlp.experts.down_proj",
        "mlp.experts.down_proj_bias",
    ):
        full = f"model.layers.0.{name}"
        assert same_bytes(got[full], src[full]) and not any(k.startswith(full + "_scale") for k in got)
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == FP8  # the rest converts
    card = (out / "README.md").read_text()
    assert "no FP8 expert layout loads for gpt-oss" in card
    assert r"re:^(model\.layers\.0\.mlp\.experts)(\.|$)" in cfg["quantization_config"]["ignore"]


# ------------------------------------------------------------------ ignore lists


def transformers_names(src: Path) -> tuple[dict[str, str], dict[str, type]]:
    """({checkpoint module: module name in memory}, {in-memory module name: its class}) by transformers'
    own checkpoint conversion (conversion_mapping + rename_source_key), on a meta-device model."""
    import transformers
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    config = transformers.AutoConfig.from_pretrained(str(src))
    cls = getattr(transformers, config.architectures[0])
    with torch.device("meta"):
        model = cls._from_config(config)
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    state = model.state_dict()
    names = {}
    for key in read_safetensors_dir_names(src):
        new, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if key.endswith(".weight") and new.endswith(".weight"):
            names[key[: -len(".weight")]] = new[: -len(".weight")]
    return names, {n: type(m) for n, m in model.named_modules()}


def read_safetensors_dir_names(path: Path) -> list[str]:
    from safetensors import safe_open

    names = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            names += list(h.keys())
    return names


@pytest.fixture(scope="module")
def in_memory(zoo_source):
    cache: dict = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = transformers_names(zoo_source(arch))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch,fmt,scheme", ZOO_CASES + MORE_ZOO_CASES)
def test_ignore_list_names_real_modules(arch, fmt, scheme, zoo_outputs, in_memory, zoo_source):
    """Every entry is a module of the model as the checkpoint, transformers or vLLM names it (or
    lm_head); a `re:` entry (compressed-tensors only) matches at least one. Every kept linear of the
    checkpoint is listed by its checkpoint name."""
    _, got, cfg, _ = zoo_outputs(arch, fmt, scheme)
    checkpoint = {n[: -len(".weight")] for n, t in got.items() if n.endswith(".weight")} | {
        n for n in got if not n.endswith((".weight", "_scale", "_scale_inv", ".bias"))
    }
    names, modules = in_memory(arch)
    config = read_json(zoo_source(arch) / "config.json")
    contract = CONTRACTS[arch]
    vllm = {vllm_name(contract, m, config) for m in checkpoint} | {
        vllm_name(contract, m.rsplit(".", 2)[0] if ".experts." in m else m, config) for m in checkpoint
    }
    real = checkpoint | set(modules) | vllm | {"lm_head"}
    kept_linears = {
        n[: -len(".weight")]
        for n, t in got.items()
        if n.endswith(".weight") and t.dim() == 2 and t.dtype != FP8 and not R.is_embedding(n[:-7])
    }
    for lst in ignore_lists(fmt, cfg):
        assert len(lst) == len(set(lst))
        for entry in lst:
            if entry.startswith("re:"):
                assert fmt == "compressed-tensors", f"{entry}: the fp8 format's readers take no re: entries"
                assert any(re.match(entry[3:], m) for m in real), f"{entry} matches no module"
            else:
                assert entry in real, f"{entry} is not a module of {arch} in any consumer's naming"
        missing = sorted(
            m for m in kept_linears if m not in lst and not any(e.startswith("re:") and re.match(e[3:], m) for e in lst)
        )
        assert not missing, f"kept linears not in the ignore list: {missing[:5]}"


@pytest.mark.parametrize(
    "arch,scheme",
    [  # the fast loop takes the conversions ZOO_CASES has there
        pytest.param(
            a, s, marks=() if ("compressed-tensors", s) in in_turn(ZOO_ARCHS, FORMAT_SCHEMES)[a] else pytest.mark.slow
        )
        for a in ZOO_ARCHS
        for s in ("tensor", "block")
    ],
)
def test_compressed_tensors_in_transformers_skips_exactly_the_kept_linears(arch, scheme, zoo_outputs, in_memory):
    """compressed-tensors inside transformers targets every nn.Linear by its in-memory name and skips
    what the ignore list names (compressed_tensors.utils.match.match_name: exact or re:). Every kept
    checkpoint linear that is an nn.Linear in memory must be skipped, every quantized one not."""
    from compressed_tensors.utils.match import match_name

    _, got, cfg, _ = zoo_outputs(arch, "compressed-tensors", scheme)
    ignore = cfg["quantization_config"]["ignore"]
    names, modules = in_memory(arch)
    checked = 0
    for n, t in got.items():
        if not n.endswith(".weight") or t.dim() != 2:
            continue
        module = names.get(n[: -len(".weight")])
        if module is None or not issubclass(modules.get(module, type(None)), torch.nn.Linear):
            continue  # fused in memory (experts) or not a Linear: compressed-tensors does not target it
        skipped = any(match_name(module, entry) for entry in ignore)
        assert skipped == (t.dtype != FP8), f"{n} (in memory {module}): {t.dtype}, skipped={skipped}"
        checked += 1
    assert checked


# ------------------------------------------------------------------ refusals and caveats


def _rewrite(src: Path, dst: Path, tensors: dict, config_changes: dict) -> Path:
    """A copy of `src` with some tensors replaced and text_config (or config) keys changed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    index = read_json(dst / "model.safetensors.index.json")
    for name, value in tensors.items():
        shard = dst / index["weight_map"][name]
        data = load_file(str(shard))
        data[name] = value
        save_file(data, str(shard), metadata={"format": "pt"})
    config = read_json(dst / "config.json")
    scope = config.get("text_config", config)
    scope.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_fused_experts_that_fit_both_orientations_are_read_as_released(zoo_source, zoo_tensors, tmp_path):
    """Qwen3-VL-MoE checkpoints come as [E, hidden, 2*inter] (released) or [E, 2*inter, hidden]
    (transformers' save): when hidden == 2*inter the shapes fit both, and the family's released
    orientation, the one vLLM reads whatever the shapes, is the one read."""
    src = zoo_tensors("qwen3_vl_moe")
    h, e = zoo.HIDDEN, zoo.N_EXPERTS
    g = torch.Generator().manual_seed(5)
    changed = {}
    for name in src:
        if name.endswith("experts.gate_up_proj"):
            changed[name] = (torch.randn(e, h, h, generator=g) / h**0.5).to(torch.bfloat16)
        elif name.endswith("experts.down_proj"):
            changed[name] = (torch.randn(e, h // 2, h, generator=g) / h**0.5).to(torch.bfloat16)
    model = _rewrite(zoo_source("qwen3_vl_moe"), tmp_path / "square", changed, {"moe_intermediate_size": h // 2})
    run_quantize(model, tmp_path / "out", scheme="channel")
    got = read_safetensors_dir(tmp_path / "out")
    gate_up = next(n for n in changed if n.endswith("gate_up_proj"))
    experts = gate_up.rsplit(".", 1)[0]
    for member, want in (
        ("gate_proj", changed[gate_up][3].T[: h // 2]),
        ("up_proj", changed[gate_up][3].T[h // 2 :]),
        ("down_proj", changed[experts + ".down_proj"][3].T),
    ):
        name = f"{experts}.3.{member}.weight"
        deq = got[name].float() * got[name + "_scale"].float()
        assert ((deq - want.float()).norm() / want.float().norm()).item() <= E4M3_BOUND, name


@pytest.mark.parametrize("fmt,scheme", [("compressed-tensors", "channel"), ("fp8", "block")])
def test_gpt2_quantizes_nothing_and_is_refused(zoo_source, tmp_path, fmt, scheme):
    """GPT-2's Conv1D weights are kept (transformers has no FP8 Conv1D): no FP8 weight would be written."""
    out = tmp_path / "out"
    with pytest.raises(fp8convert_module().FP8ConvertError) as ei:
        run_quantize(zoo_source("gpt2"), out, format=fmt, scheme=scheme)
    assert "no weight is quantized (e.g. transformer.h.0.attn.c_attn.weight: Conv1D weight" in str(ei.value)
    assert not out.exists()


def test_fused_experts_that_do_not_match_the_config_are_refused(zoo_source, tmp_path):
    model = _rewrite(zoo_source("llama4"), tmp_path / "mismatch", {}, {"intermediate_size": zoo.MOE_I * 2})
    with pytest.raises(fp8convert_module().FP8ConvertError) as ei:
        fp8convert_module().make_plan(str(model))
    message = str(ei.value)
    assert "\n" not in message and "feed_forward.experts" in message and "expected [16, 64, 192]" in message


@pytest.mark.parametrize(
    "arch,fmt,scheme,caveat",
    [
        ("llama4", "fp8", "block", "transformers-cannot-load"),  # Llama-4 per-expert only under CT
        ("granitemoe", "compressed-tensors", "tensor", "transformers-cannot-load"),
        ("qwen3_vl_moe", "compressed-tensors", "channel", "transformers-cannot-load"),
        ("mistral3", "fp8", "block", "vllm-cannot-load"),  # vLLM renames weight_scale_inv away
    ],
)
def test_combinations_a_consumer_cannot_load_carry_their_caveat(arch, fmt, scheme, caveat, zoo_source):
    assert caveat in {w.caveat.value for w in plan_warnings(zoo_source(arch), fmt, scheme)}


@pytest.mark.parametrize(
    "arch,fmt,scheme",
    [
        ("llama4", "compressed-tensors", "tensor"),
        ("gpt_oss", "compressed-tensors", "channel"),
        ("mistral3", "compressed-tensors", "tensor"),
    ],
)
def test_loadable_combinations_carry_no_caveat(arch, fmt, scheme, zoo_source):
    caveats = {w.caveat.value for w in plan_warnings(zoo_source(arch), fmt, scheme)}
    assert not caveats & {"transformers-cannot-load", "vllm-cannot-load"}, caveats


def test_llama4_experts_kept_by_the_user_stay_per_expert_under_compressed_tensors(zoo_source, zoo_tensors, tmp_path):
    """compressed-tensors in transformers replaces Llama-4's fused experts by per-expert Linears, so
    experts kept in BF16 are still written one per expert (transposed), and listed; in the fp8 format
    they stay fused as released."""
    src = zoo_tensors("llama4")
    ct = tmp_path / "ct"
    run_quantize(zoo_source("llama4"), ct, ignore=(r"re:.*feed_forward\.experts",))
    got = read_safetensors_dir(ct)
    fused = LAYOUT_MARKERS["llama4"]
    experts = fused.rsplit(".", 1)[0]
    assert fused not in got
    assert torch.equal(got[f"{experts}.3.up_proj.weight"], src[fused][3][:, zoo.MOE_I :].T.contiguous())
    ignore = read_json(ct / "config.json")["quantization_config"]["ignore"]
    assert f"{experts}.3.up_proj" in ignore
    fp8 = tmp_path / "fp8"
    run_quantize(zoo_source("llama4"), fp8, format="fp8", scheme="block", ignore=(r"re:.*feed_forward\.experts",))
    got = read_safetensors_dir(fp8)
    assert same_bytes(got[fused], src[fused])
    assert experts in read_json(fp8 / "config.json")["quantization_config"]["ignored_layers"]


# ------------------------------------------------------------------ loading back in transformers


@pytest.fixture(scope="module")
def source_state(zoo_source):
    cache: dict = {}

    def get(arch):
        if arch not in cache:
            model = zoo.load(zoo_source(arch))
            cache[arch] = ({n: p.detach().clone() for n, p in model.named_parameters()}, zoo.logits(model))
        return cache[arch]

    return get


def as_source_param(loaded: dict, name: str) -> torch.Tensor:
    """A loaded parameter by the source model's name. Under compressed-tensors transformers replaces
    Llama-4's fused experts ([E, hidden, 2*inter], x @ W) by per-expert Linears: stack them back."""
    if name in loaded:
        return loaded[name].detach()
    experts, _, kind = name.rpartition(".")
    count = 1 + max(int(m.group(1)) for k in loaded if (m := re.match(re.escape(experts) + r"\.(\d+)\.", k)))
    if kind == "gate_up_proj":
        return torch.stack(
            [
                torch.cat([loaded[f"{experts}.{e}.gate_proj.weight"], loaded[f"{experts}.{e}.up_proj.weight"]]).T
                for e in range(count)
            ]
        ).detach()
    return torch.stack([loaded[f"{experts}.{e}.down_proj.weight"].T for e in range(count)]).detach()


@pytest.mark.slow
@pytest.mark.parametrize("arch,fmt,scheme", ZOO_CASES)
def test_loads_in_transformers(arch, fmt, scheme, zoo_outputs, zoo_source, source_state):
    """Loads with the class the model was saved with: logits cosine >= 0.99 against the source, and
    every parameter within e4m3 rounding of the source's (a kept tower or router loaded into an FP8
    module comes out as garbage, which text logits alone may not show)."""
    from fp8convert.plan.family import Caveat

    warnings = plan_warnings(zoo_source(arch), fmt, scheme)
    caveats = {w.caveat for w in warnings}
    if Caveat.TRANSFORMERS_CANNOT_LOAD in caveats:
        pytest.skip(
            "the plan says transformers cannot load this: "
            + next(w.text for w in warnings if w.caveat is Caveat.TRANSFORMERS_CANNOT_LOAD)[:120]
        )
    out, _, _, _ = zoo_outputs(arch, fmt, scheme)
    params, ref = source_state(arch)
    # compressed-tensors' MXFP8 decompressor yields bfloat16 weights whatever dtype is asked for (float32
    # fails at the first matmul: the README's table says "in bfloat16"), so MXFP8 loads in the source's bf16
    model = zoo.load(out, dtype=torch.bfloat16 if scheme == "mxfp8" else torch.float32)
    logits = zoo.logits(model)
    assert torch.isfinite(logits).all()
    cos = torch.nn.functional.cosine_similarity(ref.flatten(), logits.flatten(), dim=0).item()
    assert cos >= MIN_COSINE, f"logits cosine {cos:.5f}"
    if Caveat.TRANSFORMERS_MISREADS in caveats:
        return  # transformers' inferred block size misreads some scales: only the logits are checked
    loaded = dict(model.named_parameters())
    bad = []
    for name, want in params.items():
        have = as_source_param(loaded, name).float()
        err = ((have - want.float()).norm() / max(want.float().norm().item(), 1e-30)).item()
        if not err <= E4M3_BOUND:
            bad.append(f"{name}: relative error {err:.3g}")
    assert not bad, bad[:5]


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,ignore", [("qwen3_vl_moe", r"re:.*mlp\.experts"), ("llama4", r"re:.*feed_forward\.experts")]
)
def test_experts_kept_by_the_user_load_in_transformers(arch, ignore, zoo_source, source_state, tmp_path):
    """The way to a transformers-loadable checkpoint when the per-expert FP8 layout is not one:
    --ignore the experts (fused as released; Llama-4 under compressed-tensors per expert)."""
    assert not any(
        w.caveat.value == "transformers-cannot-load" for w in plan_warnings_with(zoo_source(arch), ignore=(ignore,))
    )
    out = tmp_path / "out"
    run_quantize(zoo_source(arch), out, ignore=(ignore,))
    _, ref = source_state(arch)
    logits = zoo.logits(zoo.load(out))
    cos = torch.nn.functional.cosine_similarity(ref.flatten(), logits.flatten(), dim=0).item()
    assert cos >= MIN_COSINE, f"logits cosine {cos:.5f}"


def plan_warnings_with(src: Path, **options):
    from fp8convert.plan.summary import compatibility_warnings

    return compatibility_warnings(fp8convert_module().make_plan(str(src), **options))


def test_the_fused_block_warning_names_the_member_that_breaks_the_rule(tmp_path):
    """q_proj [128, 128] meets vLLM's rule; k_proj [32, 128] does not: the example is k_proj."""
    from fp8convert.plan.summary import Caveat

    src = write_checkpoint(tmp_path / "src", llama_tensors(hidden=128, inter=256))
    (warning,) = [w for w in plan_warnings_with(src, scheme="block") if w.caveat is Caveat.VLLM_CANNOT_LOAD]
    assert "(e.g. model.layers.0.self_attn.k_proj.weight [32, 128])" in warning.text, warning.text


# ------------------------------------------------------------------ tensor parallelism


def _tp(name: str, shape: tuple[int, int]):
    from types import SimpleNamespace

    return SimpleNamespace(name=name, shape=shape)


QWEN3_30B = [
    _tp(f"model.layers.0.mlp.experts.{e}.{p}.weight", (768, 2048)) for e in range(2) for p in ("gate_proj", "up_proj")
] + [
    _tp("model.layers.0.mlp.experts.0.down_proj.weight", (2048, 768)),
    _tp("model.layers.0.self_attn.q_proj.weight", (4096, 2048)),
    _tp("model.layers.0.self_attn.k_proj.weight", (512, 2048)),
    _tp("model.layers.0.self_attn.o_proj.weight", (2048, 4096)),
]
QWEN3_30B_CONFIG = {"hidden_size": 2048, "num_key_value_heads": 4}


def test_tp_block_moe_compressed_tensors_needs_128_per_rank():
    """Qwen3-30B-A3B's experts (768 wide): 384 per rank at TP 2, 192 at TP 4 (not a multiple of 128:
    compressed-tensors' block MoE refuses it), 96 at TP 8. Attention (4 KV heads, replicated one head of
    128 per rank at TP 8) loads everywhere."""
    from fp8convert.plan.family import Caveat
    from fp8convert.plan.parallel import tp_warnings

    warnings = tp_warnings(QWEN3_30B, QWEN3_30B_CONFIG, "compressed-tensors", "block", (1, 2, 4, 8))
    assert len(warnings) == 1 and warnings[0].caveat is Caveat.VLLM_TP_LIMITS
    text = warnings[0].text
    assert "expert intermediate size 768 of model.layers.*.mlp.experts" in text
    assert "at TP 4, 8 (192, 96 per rank)" in text and "it loads at TP 1, 2" in text and "--scheme channel" in text
    assert not tp_warnings(QWEN3_30B, QWEN3_30B_CONFIG, "compressed-tensors", "channel", (1, 2, 4, 8))


def test_tp_block_moe_fp8_format_falls_back_to_smaller_blocks():
    """The fp8 format's MoE refines the block to gcd(128, per-rank size, hidden) >= 32 on Triton: it loads
    at every size, and says where it runs on the smaller blocks."""
    from fp8convert.plan.family import Caveat
    from fp8convert.plan.parallel import tp_warnings

    (warning,) = tp_warnings(QWEN3_30B, QWEN3_30B_CONFIG, "fp8", "block", (1, 2, 4, 8))
    assert warning.caveat is Caveat.VLLM_TP_LIMITS
    assert "it loads at TP 1, 2, 4, 8 (at TP 4, 8 only with smaller blocks" in warning.text
    narrow = [_tp(f"model.layers.0.mlp.experts.0.{p}.weight", (48, 64)) for p in ("gate_proj", "up_proj")]
    (warning,) = tp_warnings(narrow, {"hidden_size": 64}, "fp8", "block", (1,))
    assert warning.caveat is Caveat.VLLM_CANNOT_LOAD  # gcd(128, 48, 64) = 16: no block vLLM accepts


def test_tp_sizes_that_do_not_divide():
    from fp8convert.plan.parallel import tp_warnings

    warnings = tp_warnings(QWEN3_30B, QWEN3_30B_CONFIG, "compressed-tensors", "tensor", (3,))
    texts = " | ".join(w.text for w in warnings)
    assert "expert intermediate size 768" not in texts  # 768 = 3 x 256 divides
    assert "output size 4096 of model.layers.*.self_attn.q_proj" in texts and "does not divide evenly at TP 3" in texts
    assert "input size 4096 of model.layers.*.self_attn.o_proj" in texts


def test_target_tp_option_in_inspect_and_quantize(source_model, capsys, tmp_path):
    from fp8convert.cli import main

    src = source_model("qwen3_moe")
    assert main(["inspect", str(src), "--scheme", "block", "--json", "--target-tp", "4"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["target_tp"] == [4]
    tp_lines = [w for w in info["warnings"] if "tensor-parallel" in w]
    assert tp_lines and all("TP 4" in w and "TP 2" not in w for w in tp_lines)
    assert main(["inspect", str(src), "--scheme", "block", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target_tp"] == [1, 2, 4, 8]
    assert main(["inspect", str(src), "--target-tp", "0"]) != 0
    err = capsys.readouterr().err
    assert "--target-tp" in err and len([line for line in err.splitlines() if line.startswith("error:")]) == 1
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out), "--scheme", "block", "--target-tp", "4", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    tp_lines = [line for line in err.splitlines() if "tensor-parallel" in line]
    assert tp_lines and all(line.startswith("warning:") and "TP 4" in line and "TP 2" not in line for line in tp_lines)
    assert "at TP 4" in (out / "README.md").read_text()  # the card reports the sizes asked for
    # --target-tp changes what is reported, not the shards: a worker or rerun without it goes on with the same
    # conversion (it was refused as another plan, which only --overwrite, redoing it all, got past)
    split, common = tmp_path / "split", ["--scheme", "block", "--device", "cpu", "--max-shard-size", "100KB", "-q"]
    assert main(["quantize", str(src), str(split), *common, "--target-tp", "4", "--worker", "0/2"]) == 0
    assert main(["quantize", str(src), str(split), *common, "--worker", "1/2"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["quantize", str(src), str(split), *common[:-1], "--target-tp", "2"]) == 0
    assert "already complete" in capsys.readouterr().out and main(["verify", str(src), str(split), "-q"]) == 0


# ------------------------------------------------------------------ docs/architectures.md


def test_docs_architecture_table_is_the_registry():
    from harness import REPO_ROOT

    from fp8convert.plan.architectures import ARCHITECTURES, architectures_table

    page = (REPO_ROOT / "docs" / "architectures.md").read_text()
    start = "<!-- architectures table: fp8convert.plan.architectures.architectures_table() -->\n"
    end = "\n<!-- end of architectures table -->"
    assert start in page and end in page
    assert page[page.index(start) + len(start) : page.index(end)] == architectures_table(), (
        "docs/architectures.md's supported-architectures table differs from the registry: paste architectures_table()"
    )
    listed = {t for arch in ARCHITECTURES for t in arch.model_types}
    converted = set(ZOO_ARCHS + MORE_ARCHS + NOT_IN_VLLM_ARCHS + NOTHING_QUANTIZED)
    assert listed <= converted, f"registered but never converted in the tests: {listed - converted}"


# ------------------------------------------------------------------ memory


def test_fused_experts_over_the_budget_are_read_a_few_experts_at_a_time(zoo_source, zoo_converted, tmp_path):
    """A fused expert tensor larger than --max-resident is read in ranges of whole experts (each a batch
    within the budget); the output is the same to the byte."""
    from fp8convert.plan.batches import make_batches

    src = zoo_source("llama4")
    the_plan = fp8convert_module().make_plan(str(src))
    fused = the_plan.source.tensors[[t.name for t in the_plan.source.tensors].index(LAYOUT_MARKERS["llama4"])]
    budget = fused.nbytes // 5 + 1
    batches = make_batches(the_plan.units, budget)
    cut = [b for b in batches if any(t.cut and t.source.name == fused.name for t in b.tensors)]
    assert len(cut) >= 5 and all(b.in_bytes <= budget for b in cut)
    spans = sorted({(t.source.offset, t.source.nbytes) for b in cut for t in b.tensors if t.source.name == fused.name})
    assert [s[0] for s in spans] == [fused.offset + sum(n for _, n in spans[:i]) for i in range(len(spans))]
    assert sum(n for _, n in spans) == fused.nbytes  # every byte of the fused tensor read once
    assert len({t.name for b in cut for t in b.tensors}) == 2 * zoo.N_EXPERTS  # every expert's gate and up once
    out = tmp_path / "out"
    run_quantize(src, out, max_resident=budget)
    whole, _ = zoo_converted("llama4", "compressed-tensors", "tensor")
    assert {p.name: p.read_bytes() for p in out.glob("*.safetensors")} == {
        p.name: p.read_bytes() for p in whole.glob("*.safetensors")
    }


def test_mtp_layers_are_converted_like_decoder_layers_or_kept_on_request(zoo_source):
    from fp8convert.plan.summary import describe

    src = zoo_source("deepseek_v3")  # config: num_hidden_layers 2, num_nextn_predict_layers 1
    the_plan = fp8convert_module().make_plan(str(src))
    assert describe(the_plan, 1 << 30, "cpu")["mtp"].startswith("model.layers.2:")
    by_name = {t.name: t for t in the_plan.tensors}
    assert by_name["model.layers.2.self_attn.q_a_proj.weight"].quantize
    assert by_name["model.layers.2.mlp.experts.0.gate_proj.weight"].quantize
    assert not by_name["model.layers.2.eh_proj.weight"].quantize
    assert not by_name["model.layers.2.shared_head.head.weight"].quantize
    kept = fp8convert_module().make_plan(str(src), ignore=("model.layers.2",))
    assert not any(t.quantize for t in kept.tensors if t.name.startswith("model.layers.2."))
    assert "model.layers.2.mlp.experts.15.down_proj" in kept.ignore_list
