"""FP8 checkpoints as sources: `fp8convert dequantize` and requantizing with `fp8convert quantize`.

Sources come from two independent writers: tests/support/fp8_reference.py (DeepSeek-V3-shaped native block fp8
with its MTP layer and power-of-two scales, Qwen3-FP8's bfloat16 / float16 block scales, AutoFP8's
per-tensor scales with static activation scales, llm-compressor's compressed-tensors tensor / channel /
block) and fp8convert itself. Every expectation is computed from the source's tensors with
tests/support/reference.py, never read from the product's output: dequantized weights must equal float32(q) *
scale rounded once, bit for bit; requantized ones must be tests/support/reference.py's quantization of those
float32 values; a source already in the asked scheme must come out with its own codes and scales.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fp8_reference as F
import pytest
import reference as R
import torch
from checks import as_bytes, same_bytes
from harness import cases_in_turn, model_logits, read_json, read_safetensors_dir, run_quantize

import fp8convert
from fp8convert.verify import verify

FP8 = torch.float8_e4m3fn
MIN_COSINE = 0.99
COMBOS = [
    ("compressed-tensors", "tensor"),
    ("compressed-tensors", "channel"),
    ("compressed-tensors", "block"),
    ("fp8", "tensor"),
    ("fp8", "block"),
]
COMBO_IDS = ["ct-tensor", "ct-channel", "ct-block", "fp8-tensor", "fp8-block"]

# name -> (BF16 model it is made from, how): a reference layout, or ("fp8convert", format, scheme)
SOURCES = {
    "deepseek-native-block-ue8m0": ("deepseek_v3", F.LAYOUTS["deepseek-native-block-ue8m0"]),
    "qwen3-native-block-bf16": ("qwen3", F.LAYOUTS["qwen-native-block-bf16"]),
    "qwen3-native-block-fp16": ("qwen3", F.LAYOUTS["qwen-native-block-fp16"]),
    "llama-autofp8-tensor-static": ("llama", F.LAYOUTS["autofp8-native-tensor-static"]),
    "qwen3-ct-tensor-static-bf16": ("qwen3", F.LAYOUTS["ct-tensor-static-bf16"]),
    "qwen3_moe-ct-channel-bf16": ("qwen3_moe", F.LAYOUTS["ct-channel-bf16"]),
    "qwen3-ct-block-f32": ("qwen3", F.LAYOUTS["ct-block-f32"]),
    **{f"llama-fp8convert-{i}": ("llama", ("fp8convert", f, s)) for (f, s), i in zip(COMBOS, COMBO_IDS)},
}
REFERENCE_SOURCES = [n for n, (_, how) in SOURCES.items() if isinstance(how, F.Layout)]


def source_scheme(name: str) -> str:
    how = SOURCES[name][1]
    return how.scheme if isinstance(how, F.Layout) else how[2]


@pytest.fixture(scope="session")
def bf16_model(tmp_path_factory, source_model):
    """bf16_model(kind) -> a BF16 checkpoint: tests/support/tiny_models.py's, or (deepseek_v3) tests/support/zoo.py's
    DeepSeek-V3 with its MTP layer, hidden size 192 (1.5 blocks of 128: partial edge blocks)."""
    cache = {}

    def get(kind: str) -> Path:
        if kind != "deepseek_v3":
            return source_model(kind)
        if kind not in cache:
            import zoo

            cache[kind] = zoo.make(
                "deepseek_v3", tmp_path_factory.mktemp("ds-bf16") / "model", config_overrides={"hidden_size": 192}
            )
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def fp8_source(tmp_path_factory, bf16_model):
    """fp8_source(name) -> the FP8 checkpoint SOURCES[name], built once."""
    cache = {}

    def get(name: str) -> Path:
        if name not in cache:
            kind, how = SOURCES[name]
            out = tmp_path_factory.mktemp(f"fp8src-{name}") / "model"
            if isinstance(how, F.Layout):
                F.write_fp8(bf16_model(kind), out, how, arch=kind)
            else:
                run_quantize(bf16_model(kind), out, format=how[1], scheme=how[2])
            cache[name] = out
        return cache[name]

    return get


@pytest.fixture(scope="session")
def dequantized_out(tmp_path_factory, fp8_source):
    """dequantized_out(name, dtype=None) -> fp8convert dequantize's output of SOURCES[name]."""
    cache = {}

    def get(name: str, dtype: str | None = None) -> Path:
        if (name, dtype) not in cache:
            out = tmp_path_factory.mktemp(f"deq-{name}") / "out"
            report = fp8convert.dequantize(fp8_source(name), out, device="cpu", dtype=dtype)
            assert report.complete and report.dequantize
            cache[(name, dtype)] = out
        return cache[(name, dtype)]

    return get


def source_parts(path: Path, scheme: str):
    """(all tensors, FP8 weight names, scale and activation-scale names) of an FP8 checkpoint."""
    tensors = read_safetensors_dir(path)
    weights = set(F.fp8_weights(tensors, scheme))
    companions = {n for n in tensors if n.endswith((".weight_scale", ".weight_scale_inv", ".input_scale"))}
    return tensors, weights, companions


# ------------------------------------------------------------------ dequantize


@pytest.mark.parametrize("name", list(SOURCES))
def test_dequantize_is_bit_exact_and_drops_scales(name, fp8_source, dequantized_out):
    src = fp8_source(name)
    out = dequantized_out(name)
    tensors, weights, companions = source_parts(src, source_scheme(name))
    assert weights, "the fixture has no FP8 weight"
    got = read_safetensors_dir(out)
    assert set(got) == set(tensors) - companions, "scales must go, every other tensor must stay"
    expected = F.dequantized(tensors, source_scheme(name))
    wrong = [n for n in weights if not same_bytes(got[n], expected[n].to(torch.bfloat16))]
    assert not wrong, f"not float32(q) * scale rounded once to bf16: {wrong[:5]}"
    kept = [n for n in set(got) - weights if not same_bytes(got[n], tensors[n])]
    assert not kept, f"kept tensors changed: {kept[:5]}"
    config, src_config = read_json(out / "config.json"), read_json(src / "config.json")
    assert "quantization_config" not in config
    assert config == {k: v for k, v in src_config.items() if k != "quantization_config"}
    report = verify(src, out)
    assert report.ok and report.tensors_dequantized == len(weights), report.failures[:3]
    card = (out / "README.md").read_text()
    assert "dequantized from the FP8 checkpoint" in card and "fp8convert dequantize" in card


def test_deepseek_source_keeps_its_mtp_layer_router_and_bias(fp8_source, dequantized_out):
    """The DeepSeek-V3-shaped source: MTP layer model.layers.2 (decoder block FP8, eh_proj / shared_head /
    embed_tokens BF16), float32 router and e_score_correction_bias, partial 128x128 edge blocks."""
    tensors = read_safetensors_dir(fp8_source("deepseek-native-block-ue8m0"))
    assert tensors["model.layers.2.self_attn.q_a_proj.weight"].dtype == FP8
    assert tensors["model.layers.2.mlp.experts.3.down_proj.weight"].dtype == FP8
    assert tensors["model.layers.2.eh_proj.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (1, 2)  # [128, 192]: a partial block
    got = read_safetensors_dir(dequantized_out("deepseek-native-block-ue8m0"))
    for name in (
        "model.layers.2.eh_proj.weight",
        "model.layers.2.shared_head.head.weight",
        "model.layers.2.embed_tokens.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.gate.weight",
    ):
        assert same_bytes(got[name], tensors[name]), name


@pytest.mark.parametrize("dtype,torch_dtype", [("fp16", torch.float16), ("fp32", torch.float32)])
def test_dequantize_to_other_dtypes(dtype, torch_dtype, fp8_source, dequantized_out):
    name = "qwen3-ct-block-f32"
    tensors, weights, _ = source_parts(fp8_source(name), "block")
    got = read_safetensors_dir(dequantized_out(name, dtype))
    expected = F.dequantized(tensors, "block")
    assert all(same_bytes(got[n], expected[n].to(torch_dtype)) for n in weights)
    assert all(got[n].dtype == tensors[n].dtype for n in set(got) - weights)  # kept tensors keep their dtype
    assert verify(fp8_source(name), dequantized_out(name, dtype)).ok


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "deepseek-native-block-ue8m0",
        "qwen3-native-block-bf16",
        "qwen3_moe-ct-channel-bf16",
        "llama-autofp8-tensor-static",
        "llama-fp8convert-fp8-block",
    ],
)
def test_dequantized_model_loads_in_transformers_close_to_the_bf16_model(name, bf16_model, dequantized_out):
    kind = SOURCES[name][0]
    ref, got = model_logits(bf16_model(kind)), model_logits(dequantized_out(name))
    cos = torch.nn.functional.cosine_similarity(ref.flatten(), got.flatten(), dim=0).item()
    assert torch.isfinite(got).all() and cos >= MIN_COSINE, f"cosine {cos:.5f}"


# ------------------------------------------------------------------ requantize


def expected_requantized(
    tensors: dict,
    scheme_in: str,
    fmt: str,
    scheme: str,
    kind: str,
    config: dict,
    passes: bool | None = None,
    scale_format: str = "float",
):
    """(expected outputs, FP8 output names) of requantizing an FP8 checkpoint: a source that `passes`
    (by default: one already in `scheme`) keeps its codes and scale values (its scale named and shaped as
    `fmt` writes them, dtype as stored); otherwise tests/support/reference.py quantizes the dequantized float32
    values in `scheme` and `scale_format`."""
    weights = F.fp8_weights(tensors, scheme_in)
    plain = {n: t for n, t in tensors.items() if not n.endswith((".weight_scale", ".weight_scale_inv", ".input_scale"))}
    if not (scheme_in == scheme if passes is None else passes):
        values = {**plain, **F.dequantized(tensors, scheme_in)}
        out, quantized = R.expected_outputs(values, fmt, scheme, arch=kind, config=config, scale_format=scale_format)
        # FP8 weights the output cannot hold as FP8 (an MXFP8 input dim not divisible by 32) are dequantized
        out.update({n: out[n].to(torch.bfloat16) for n in weights if n not in quantized})
        return out, quantized
    out = dict(plain)
    for n, (q, s) in weights.items():
        suffix, shape = R.scale_name_and_shape(fmt, scheme, q.shape)
        out[R.module_of(n) + suffix] = s.reshape(shape)
    return out, set(weights)


@pytest.mark.parametrize("name,fmt,scheme", cases_in_turn(REFERENCE_SOURCES, COMBOS, COMBO_IDS))
def test_requantize_to_every_scheme_and_format(name, fmt, scheme, fp8_source, tmp_path):
    src = fp8_source(name)
    kind = SOURCES[name][0]
    tensors = read_safetensors_dir(src)
    out = tmp_path / "out"
    report = run_quantize(src, out, format=fmt, scheme=scheme)
    got = read_safetensors_dir(out)
    expected, fp8_names = expected_requantized(
        tensors, source_scheme(name), fmt, scheme, kind, read_json(src / "config.json")
    )
    static = {n for n in tensors if n.endswith(".input_scale")}
    carried = static if scheme == "tensor" else set()
    assert set(got) == set(expected) | carried, (sorted(set(got) ^ (set(expected) | carried)))[:6]
    wrong = [n for n in expected if not same_bytes(got[n], expected[n])]
    assert not wrong, f"differ from the reference: {wrong[:6]}"
    for n in carried:  # static activation scales as they were, shaped as the format's per-tensor scales
        assert got[n].dtype == tensors[n].dtype and torch.equal(as_bytes(got[n]), as_bytes(tensors[n])), n
        assert tuple(got[n].shape) == R.scale_name_and_shape(fmt, "tensor", (1, 1))[1]
    passed = source_scheme(name) == scheme
    assert report.tensors_passed_through == (len(fp8_names) if passed else 0)
    assert report.tensors_requantized == (0 if passed else len(fp8_names))
    assert report.tensors_dequantized == 0 and report.tensors_quantized == len(fp8_names)
    qc = read_json(out / "config.json")["quantization_config"]
    static_out = bool(carried)
    if fmt == "fp8":
        assert qc["activation_scheme"] == ("static" if static_out else "dynamic") and "scale_fmt" not in qc
    else:
        assert qc["config_groups"]["group_0"]["input_activations"]["dynamic"] is not static_out
    if static and not carried:
        assert any("static activation scales" in n for n in report.notes)
    check = verify(src, out)
    assert check.ok, check.failures[:3]


@pytest.mark.parametrize("fmt,scheme", COMBOS, ids=COMBO_IDS)
def test_requantizing_fp8convert_output_to_its_own_scheme_gives_its_bytes(fmt, scheme, fp8_source, tmp_path):
    """An fp8convert output converted again with the options that made it: every shard and the index
    come back byte for byte (codes and scales passed through, the same layout)."""
    src = fp8_source(f"llama-fp8convert-{COMBO_IDS[COMBOS.index((fmt, scheme))]}")
    out = tmp_path / "again"
    report = run_quantize(src, out, format=fmt, scheme=scheme)
    assert report.tensors_passed_through == report.tensors_quantized > 0
    files = sorted(p.name for p in src.glob("model*"))
    assert files == sorted(p.name for p in out.glob("model*"))
    assert all((src / f).read_bytes() == (out / f).read_bytes() for f in files)
    assert read_json(out / "config.json") == read_json(src / "config.json")


BLACKWELL = [
    ("compressed-tensors", "mxfp8", "float"),
    ("compressed-tensors", "block", "ue8m0"),
    ("fp8", "block", "ue8m0"),
]


@pytest.mark.parametrize(
    "name,fmt,scheme,scale_format",
    cases_in_turn(REFERENCE_SOURCES, BLACKWELL, ["ct-mxfp8", "ct-block-ue8m0", "fp8-block-ue8m0"]),
)
def test_requantize_to_mxfp8_and_ue8m0_blocks(name, fmt, scheme, scale_format, fp8_source, tmp_path):
    """FP8 sources to the Blackwell layouts: requantized from their dequantized float32 values with the
    power-of-two rules, as tests/support/reference.py computes them, except a block source that declares
    scale_fmt ue8m0 asked for ue8m0 blocks: its codes and scales pass through. verify then checks every
    exponent and code exactly."""
    src = fp8_source(name)
    tensors, config = read_safetensors_dir(src), read_json(src / "config.json")
    passes = source_scheme(name) == scheme and config["quantization_config"].get("scale_fmt") == "ue8m0"
    out = tmp_path / "out"
    report = run_quantize(src, out, format=fmt, scheme=scheme, scale_format=scale_format)
    got = read_safetensors_dir(out)
    expected, fp8_names = expected_requantized(
        tensors, source_scheme(name), fmt, scheme, SOURCES[name][0], config, passes, scale_format
    )
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))[:6]  # static activation scales dropped
    wrong = [n for n in expected if not same_bytes(got[n], expected[n])]
    assert not wrong, f"differ from the reference: {wrong[:6]}"
    assert report.tensors_passed_through == (len(fp8_names) if passes else 0)
    assert report.tensors_requantized == (0 if passes else len(fp8_names))
    assert report.tensors_dequantized == len(F.fp8_weights(tensors, source_scheme(name))) - len(fp8_names)
    qc = read_json(out / "config.json")["quantization_config"]
    assert qc.get("scale_fmt") == ("ue8m0" if scale_format == "ue8m0" else None)
    if scheme == "mxfp8":
        assert qc["format"] == "mxfp8-quantized"
        assert all(got[R.module_of(n) + ".weight_scale"].dtype == torch.uint8 for n in fp8_names)
    dropped_fmt = config["quantization_config"].get("scale_fmt") == "ue8m0" and scale_format != "ue8m0"
    assert any("scale_fmt 'ue8m0' is not written" in n for n in report.notes) == dropped_fmt
    assert any("static activation scales" in n for n in report.notes) == any(
        n.endswith(".input_scale") for n in tensors
    )
    check = verify(src, out)
    assert check.ok, check.failures[:3]


def test_ignored_fp8_weights_are_dequantized_and_listed(fp8_source, tmp_path):
    name = "deepseek-native-block-ue8m0"
    src = fp8_source(name)
    tensors = read_safetensors_dir(src)
    out = tmp_path / "out"
    report = run_quantize(src, out, format="compressed-tensors", scheme="channel", ignore=["re:.*self_attn\\.o_proj$"])
    got = read_safetensors_dir(out)
    deq = F.dequantized(tensors, "block")
    o_projs = [n for n in tensors if n.endswith("self_attn.o_proj.weight")]
    assert report.tensors_dequantized == len(o_projs) == 3
    for n in o_projs:
        assert same_bytes(got[n], deq[n].to(torch.bfloat16)) and R.module_of(n) + ".weight_scale" not in got
        assert R.module_of(n) in read_json(out / "config.json")["quantization_config"]["ignore"]
    assert verify(src, out).ok


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,fmt,scheme",
    [
        ("deepseek-native-block-ue8m0", "compressed-tensors", "channel"),
        ("qwen3-ct-tensor-static-bf16", "compressed-tensors", "tensor"),
        ("qwen3-native-block-fp16", "compressed-tensors", "channel"),
        ("qwen3_moe-ct-channel-bf16", "fp8", "block"),
        ("llama-autofp8-tensor-static", "compressed-tensors", "tensor"),
    ],
)
def test_requantized_model_loads_in_transformers_close_to_the_bf16_model(
    name, fmt, scheme, bf16_model, fp8_source, tmp_path
):
    out = tmp_path / "out"
    run_quantize(fp8_source(name), out, format=fmt, scheme=scheme)
    ref, got = model_logits(bf16_model(SOURCES[name][0])), model_logits(out)
    cos = torch.nn.functional.cosine_similarity(ref.flatten(), got.flatten(), dim=0).item()
    assert torch.isfinite(got).all() and cos >= MIN_COSINE, f"cosine {cos:.5f}"


# ------------------------------------------------------------------ the plan, inspect, verify


def test_inspect_shows_the_source_and_what_becomes_of_each_weight(fp8_source, capsys):
    from fp8convert.cli import main

    src = fp8_source("deepseek-native-block-ue8m0")
    assert main(["inspect", str(src), "--scheme", "channel", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["source_quantization"].startswith("fp8 block (weight_scale_inv F32)")
    assert "scale_fmt ue8m0" in info["source_quantization"]
    assert info["actions"]["requantize"] > 0 and info["actions"]["pass"] == info["actions"]["dequantize"] == 0
    assert any("scale_fmt 'ue8m0' is not written" in n for n in info["notes"])
    assert main(["inspect", str(src), "--dequantize", "--dtype", "fp16"]) == 0
    text = capsys.readouterr().out
    assert "dequantize  to F16" in text and "ignore list" not in text


def test_dequantize_batches_fit_the_budget_on_their_outputs(fp8_source):
    """Dequantized weights are larger than their codes: batches are cut on whichever is larger."""
    from fp8convert.plan.batches import make_batches, resident_bytes

    plan = fp8convert.make_plan(fp8_source("qwen3_moe-ct-channel-bf16"), dequantize=True, dtype="fp32")
    budget = 64 << 10
    batches = make_batches(plan.units, budget)
    assert len(batches) > len(plan.units)
    for b in batches:
        assert len(b.atoms()) == 1 or resident_bytes(b.tensors) <= budget
    assert sorted(t.name for b in batches for t in b.tensors) == sorted(t.name for t in plan.tensors)


@pytest.mark.parametrize(
    "scheme,shape", [("tensor", (200, 96)), ("channel", (130, 48)), ("block", (300, 260)), ("block", (64, 16))]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_both_dequantize_paths_match_reference(scheme, shape, dtype):
    from fp8convert.run import numerics

    g = torch.Generator().manual_seed(1)
    w = torch.randn(*shape, generator=g) * torch.rand(shape[0], 1, generator=g)
    codes, scale = R.quantize(w, scheme)
    expected = R.dequant(codes, scale, scheme).to(dtype)
    stored = numerics.scale_as_stored(scale.reshape((1,) if scheme == "tensor" else scale.shape), scheme)
    for cpu_path in (True, False):
        got = numerics.dequantize_to(codes, stored, scheme, dtype, cpu_path)
        assert same_bytes(got, expected), (scheme, shape, dtype, cpu_path)


def test_verify_catches_a_wrong_dequantized_element_and_a_left_scale(fp8_source, dequantized_out, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(dequantized_out("qwen3-native-block-bf16"), out)
    name = "model.layers.1.mlp.down_proj.weight"
    shard = out / read_json(out / "model.safetensors.index.json")["weight_map"][name]
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(shard))
    w = tensors[name].clone()
    w.view(torch.int16)[3, 5] += 1  # one bf16 ulp: a second rounding would do this
    tensors[name] = w
    save_file(tensors, str(shard), metadata={"format": "pt"})
    report = verify(fp8_source("qwen3-native-block-bf16"), out)
    assert not report.ok and any(name in f and "1 element differs" in f for f in report.failures)


def test_verify_catches_a_requantized_code_off_the_grid(fp8_source, tmp_path):
    src = fp8_source("qwen3-native-block-bf16")
    out = tmp_path / "out"
    run_quantize(src, out, format="compressed-tensors", scheme="channel")
    name = "model.layers.0.self_attn.q_proj.weight"
    shard = out / read_json(out / "model.safetensors.index.json")["weight_map"][name]
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(shard))
    q = tensors[name].clone()
    q.view(torch.uint8)[2, 2] ^= 0x02  # another code, two steps away
    tensors[name] = q
    save_file(tensors, str(shard), metadata={"format": "pt"})
    report = verify(src, out)
    assert not report.ok and any(name in f and "not the nearest e4m3" in f for f in report.failures)


def test_verify_of_an_fp4_output_names_the_source_scale_that_is_not_finite(fp8_source, tmp_path):
    """Where the FP8 source's own scale is bad, the failure names that scale, not the output's."""
    src = tmp_path / "src"
    shutil.copytree(fp8_source("qwen3-native-block-bf16"), src)
    out = tmp_path / "out"
    run_quantize(src, out, scheme="nvfp4a16")
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    shard = src / read_json(src / "model.safetensors.index.json")["weight_map"][name]
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(shard))
    tensors[name] = tensors[name].clone().fill_(float("inf"))
    save_file(tensors, str(shard), metadata={"format": "pt"})
    report = verify(src, out)
    assert not report.ok
    assert any(name in f and "source's scale is not finite" in f for f in report.failures), report.failures
