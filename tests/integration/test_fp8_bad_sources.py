"""Bad FP8 sources, and sources quantized some other way. Each must end in one `error:` line naming the
tensor (or the method found), a non-zero exit, and no output that looks complete; what the headers
already condemn fails before OUT is created, what only the values show (a scale of 0 or Inf, a NaN
code, a value float16 cannot hold) fails while reading, naming the tensor, leaving a resumable output."""

from __future__ import annotations

import json

import fp8_reference as F
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_ckpt import assert_refused, llama_tensors, rewrite_index, run_cli, write_checkpoint

try:
    from fakehub import fake_hub  # noqa: F401  (a fixture)
except ImportError:  # tests/ imported as a package
    from tests.fakehub import fake_hub  # noqa: F401

SHARD2 = "model-00002-of-00003.safetensors"  # layer 1
W = "model.layers.1.mlp.up_proj"  # an FP8 weight in SHARD2: [128, 64]


def fp8_checkpoint(root, layout: F.Layout = F.LAYOUTS["qwen-native-block-bf16"]):
    """A small native fp8 block checkpoint (bfloat16 scales, Qwen3-FP8 style) in three shards."""
    bf16 = write_checkpoint(root.parent / (root.name + "-bf16"), llama_tensors())
    return F.write_fp8(bf16, root, layout)


def edit_shard(src, edit, file=SHARD2):
    tensors = load_file(str(src / file))
    edit(tensors)
    save_file(tensors, str(src / file), metadata={"format": "pt"})
    rewrite_index(
        src,
        lambda ix: ix.update(
            weight_map={**{k: v for k, v in ix["weight_map"].items() if v != file}, **{k: file for k in tensors}}
        ),
    )


def edit_config(src, edit):
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))


# ---------------------------------------------------------------- refused from the headers


def scale_missing(src):
    edit_shard(src, lambda t: t.pop(W + ".weight_scale_inv"))
    return (f"{src / SHARD2}: FP8 weight {W}.weight has no scale",)  # the shard's path: a batch has many checkpoints


def scale_named_otherwise(src):
    # one reported tool read no scale at all for a `.scale` and wrote weights thousands of times off
    edit_shard(src, lambda t: t.update({W + ".scale": t.pop(W + ".weight_scale_inv")}))
    return W + ".weight", W + ".scale", "will not guess"


def two_scales(src):
    # per tensor, native fp8 reads both names (vLLM's weight_scale, transformers' weight_scale_inv)
    edit_shard(src, lambda t: t.update({W + ".weight_scale_inv": torch.ones(())}))
    return W + ".weight", "2 scales"


two_scales.layout = F.Layout("fp8", "tensor")


def scale_of_another_format(src):
    edit_shard(src, lambda t: t.update({W + ".weight_scale": t[W + ".weight_scale_inv"].clone()}))
    return W + ".weight_scale", "not a scale name", W + ".weight_scale_inv"


def scale_wrong_shape(src):
    edit_shard(src, lambda t: t.update({W + ".weight_scale_inv": torch.ones(2, 2, dtype=torch.bfloat16)}))
    return W + ".weight_scale_inv", "[2, 2]", "[1, 1]"


def scale_per_channel_in_a_block_model(src):
    edit_shard(src, lambda t: t.update({W + ".weight_scale_inv": torch.ones(128, 1, dtype=torch.bfloat16)}))
    return W + ".weight_scale_inv", "[128, 1]"


def scale_e8m0(src):
    edit_shard(src, lambda t: t.update({W + ".weight_scale_inv": torch.ones(1, 1).to(torch.float8_e8m0fnu)}))
    return W + ".weight_scale_inv", "F8_E8M0"


def scale_integer(src):
    edit_shard(src, lambda t: t.update({W + ".weight_scale_inv": torch.full((1, 1), 127, dtype=torch.uint8)}))
    return W + ".weight_scale_inv", "U8"


def scale_without_fp8_weight(src):
    edit_shard(src, lambda t: t.update({W + ".weight": t[W + ".weight"].to(torch.bfloat16)}))
    return W + ".weight_scale_inv", "is BF16"


def orphan_scale(src):
    edit_shard(src, lambda t: t.update({"model.layers.1.mlp.ghost.weight_scale_inv": torch.ones(1, 1)}))
    return "model.layers.1.mlp.ghost.weight_scale_inv", "does not exist"


def three_d_fp8(src):
    edit_shard(
        src,
        lambda t: t.update({"model.layers.1.mlp.experts.gate_up_proj": torch.zeros(2, 32, 64).to(torch.float8_e4m3fn)}),
    )
    return "model.layers.1.mlp.experts.gate_up_proj", "2-D"


def e5m2_weight(src):
    edit_shard(src, lambda t: t.update({W + ".weight": t[W + ".weight"].float().to(torch.float8_e5m2)}))
    return W + ".weight", "F8_E5M2"


def static_without_input_scale(src):
    edit_config(src, lambda c: c["quantization_config"].update(activation_scheme="static"))
    return "model.layers.0.mlp.down_proj.weight", "input_scale", "static"  # the first FP8 weight in file order


def input_scale_but_dynamic(src):
    edit_shard(src, lambda t: t.update({W + ".input_scale": torch.ones(())}))
    return W + ".input_scale", "dynamic"


def block_size_64(src):
    edit_config(src, lambda c: c["quantization_config"].update(weight_block_size=[64, 64]))
    return "config.json", "[64, 64]"


def fmt_e5m2(src):
    edit_config(src, lambda c: c["quantization_config"].update(fmt="e5m2"))
    return "config.json", "e5m2"


def fp8_tensors_without_config(src):
    edit_config(src, lambda c: c.pop("quantization_config"))
    return "model.layers.0.mlp.down_proj.weight", "no quantization_config"


def kv_cache_scales(src):
    edit_shard(src, lambda t: t.update({"model.layers.1.self_attn.k_scale": torch.ones(())}))
    return "model.layers.1.self_attn.k_scale"


FP8_BROKEN = [
    scale_missing,
    scale_named_otherwise,
    two_scales,
    scale_of_another_format,
    scale_wrong_shape,
    scale_per_channel_in_a_block_model,
    scale_e8m0,
    scale_integer,
    scale_without_fp8_weight,
    orphan_scale,
    three_d_fp8,
    e5m2_weight,
    static_without_input_scale,
    input_scale_but_dynamic,
    block_size_64,
    fmt_e5m2,
    fp8_tensors_without_config,
    kv_cache_scales,
]


@pytest.mark.parametrize("breaker", FP8_BROKEN, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "command", [["dequantize"], ["quantize", "--scheme", "channel"]], ids=["dequantize", "quantize"]
)
def test_bad_fp8_source_is_refused_before_any_output(tmp_path, capsys, breaker, command):
    src = fp8_checkpoint(tmp_path / "src", getattr(breaker, "layout", F.LAYOUTS["qwen-native-block-bf16"]))
    names = breaker(src)
    names = (names,) if isinstance(names, str) else names  # one name, not its letters
    out = tmp_path / "out"
    rc, err = run_cli(capsys, command[0], src, out, *command[1:], "-q", "--device", "cpu")
    assert_refused(rc, err, out, *names)
    rc, err = run_cli(capsys, "inspect", src)
    assert rc != 0 and names[0] in err


# ---------------------------------------------------------------- other quantization methods


def gptq(src):
    edit_config(src, lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128}))
    return "config.json", "'gptq'", "GPTQ"


def awq(src):
    edit_config(src, lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4, "version": "gemm"}))
    return "config.json", "'awq'", "AWQ"


def bitsandbytes_4bit(src):
    edit_config(src, lambda c: c.update(quantization_config={"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}))
    return "config.json", "bitsandbytes"


def gpt_oss_mxfp4(src):
    edit_config(src, lambda c: c.update(quantization_config={"quant_method": "mxfp4"}))
    return "config.json", "'mxfp4'", "MXFP4"


def modelopt_nvfp4(src):
    (src / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}})
    )
    return "hf_quant_config.json", "ModelOpt"


def ct_int4_packed(src):
    edit_config(
        src,
        lambda c: c.update(
            quantization_config={
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}
                },
            }
        ),
    )
    return "config.json", "pack-quantized", "integer"


def ct_nvfp4(src):
    edit_config(
        src,
        lambda c: c.update(
            quantization_config={
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {
                    "group_0": {
                        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
                    }
                },
            }
        ),
    )
    return "config.json", "NVFP4"


def ct_fp8_and_int4_groups(src):
    # Kimi-K2-Thinking-style: FP8 attention and int4 experts in one mixed-precision config
    fp8 = {"weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}
    int4 = {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
        "format": "pack-quantized",
    }
    edit_config(
        src,
        lambda c: c.update(
            quantization_config={
                "quant_method": "compressed-tensors",
                "format": "mixed-precision",
                "config_groups": {"group_0": fp8, "group_1": int4},
            }
        ),
    )
    return "config.json", "pack-quantized"


def ct_mxfp8(src):
    edit_config(
        src,
        lambda c: c.update(
            quantization_config={
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "group_0": {
                        "weights": {
                            "num_bits": 8,
                            "type": "float",
                            "strategy": "group",
                            "group_size": 32,
                            "scale_dtype": "torch.uint8",
                        }
                    }
                },
            }
        ),
    )
    return "config.json", "MXFP8"


def ct_asymmetric_static_activations(src):
    fp8 = {
        "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
        "input_activations": {
            "num_bits": 8,
            "type": "float",
            "strategy": "tensor",
            "dynamic": False,
            "symmetric": False,
        },
    }
    edit_config(
        src,
        lambda c: c.update(
            quantization_config={
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"group_0": fp8},
            }
        ),
    )
    return "config.json", "static input activations"


def fbgemm(src):
    edit_config(
        src, lambda c: c.update(quantization_config={"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200})
    )
    return "config.json", "'fbgemm_fp8'"


def gptq_tensors_without_config(src):
    edit_config(src, lambda c: c.pop("quantization_config"))
    edit_shard(src, lambda t: t.update({W + ".qweight": torch.zeros(8, 128, dtype=torch.int32)}))
    return "shows the model is already quantized", "has no quantization_config"  # (the first such tensor is named)


OTHER_METHODS = [
    gptq,
    awq,
    bitsandbytes_4bit,
    gpt_oss_mxfp4,
    modelopt_nvfp4,
    ct_int4_packed,
    ct_nvfp4,
    ct_fp8_and_int4_groups,
    ct_mxfp8,
    ct_asymmetric_static_activations,
    fbgemm,
    gptq_tensors_without_config,
]


@pytest.mark.parametrize("breaker", OTHER_METHODS, ids=lambda f: f.__name__)
def test_other_quantization_methods_are_refused_naming_the_method(tmp_path, capsys, breaker):
    src = fp8_checkpoint(tmp_path / "src")
    names = breaker(src)
    names = (names,) if isinstance(names, str) else names  # one name, not its letters
    for command in (["quantize"], ["dequantize"]):
        out = tmp_path / f"out-{command[0]}"
        rc, err = run_cli(capsys, command[0], src, out, "-q", "--device", "cpu")
        assert_refused(rc, err, out, *names)


def test_mxfp8_checkpoints_are_refused_as_sources(tmp_path, capsys):
    """fp8convert writes MXFP8 but does not read it: its own --scheme mxfp8 output is refused, format named."""
    bf16 = write_checkpoint(tmp_path / "bf16", llama_tensors())
    mxfp8 = tmp_path / "mxfp8"
    assert run_cli(capsys, "quantize", bf16, mxfp8, "--scheme", "mxfp8", "-q", "--device", "cpu")[0] == 0
    for command in (["quantize"], ["dequantize"]):
        out = tmp_path / f"out-{command[0]}"
        rc, err = run_cli(capsys, command[0], mxfp8, out, "-q", "--device", "cpu")
        assert_refused(rc, err, out, "config.json", "'mxfp8-quantized'", "does not read as a source")


def test_dequantize_takes_no_scale_format_scheme_or_format():
    from fp8convert import Settings
    from fp8convert.errors import FP8ConvertError

    with pytest.raises(FP8ConvertError, match="^scale_format does not apply to dequantize"):
        Settings(dequantize=True, scheme="block", scale_format="ue8m0")
    for given in ({"scheme": "channel"}, {"format": "fp8"}):  # the CLI's dequantize has neither option
        with pytest.raises(FP8ConvertError, match="^scheme and format do not apply to dequantize"):
            Settings(dequantize=True, **given)


@pytest.mark.parametrize("streamed", [False, True], ids=["copier", "pipeline"])
def test_ue8m0_source_scales_that_are_not_powers_of_two(tmp_path, capsys, monkeypatch, fake_hub, streamed):
    """A source declaring scale_fmt ue8m0 passes into a --scale-format ue8m0 output only if every scale
    is a power of two: one that is not is refused while reading, naming it, by the copier of passed
    tensors or (a streamed Hub source) by the pipeline. Into a float block output it passes (any positive
    scale is a float scale), and verify fails that output if its config claims ue8m0."""
    src = fp8_checkpoint(tmp_path / "src", F.LAYOUTS["deepseek-native-block-ue8m0"])
    tensors = load_file(str(src / SHARD2))
    tensors[W + ".weight_scale_inv"] = tensors[W + ".weight_scale_inv"] * 1.5
    save_file(tensors, str(src / SHARD2), metadata={"format": "pt"})
    out = tmp_path / "out"
    where = [src]
    if streamed:
        fake_hub.add_repo("acme/ue8m0", from_dir=src)
        monkeypatch.setenv("HF_TOKEN", fake_hub.token)
        where = ["acme/ue8m0", "--stream-download"]
    rc, err = run_cli(
        capsys,
        "quantize",
        where[0],
        out,
        *where[1:],
        "--format",
        "fp8",
        "--scheme",
        "block",
        "--scale-format",
        "ue8m0",
        "-q",
        "--device",
        "cpu",
    )
    line = assert_refused(rc, err, out, W + ".weight_scale_inv", SHARD2, preflight=False)
    assert "not a power of two" in line and "scale_fmt ue8m0" in line
    if streamed:
        return
    plain = tmp_path / "plain"
    rc, err = run_cli(capsys, "quantize", src, plain, "--format", "fp8", "--scheme", "block", "-q", "--device", "cpu")
    assert rc == 0, err
    from fp8convert.verify import verify

    assert verify(src, plain).ok
    edit_config(plain, lambda c: c["quantization_config"].update(scale_fmt="ue8m0"))
    report = verify(src, plain)
    assert not report.ok and any(W + ".weight" in f and "not a power of two" in f for f in report.failures)


def test_dequantize_of_a_bf16_source_and_a_bad_dtype_are_refused(tmp_path, capsys):
    bf16 = write_checkpoint(tmp_path / "bf16", llama_tensors())
    out = tmp_path / "out"
    rc, err = run_cli(capsys, "dequantize", bf16, out, "-q")
    assert_refused(rc, err, out, str(bf16), "nothing to dequantize")
    src = fp8_checkpoint(tmp_path / "src")
    rc, err = run_cli(capsys, "dequantize", src, out, "--dtype", "int8", "-q")
    assert_refused(rc, err, out, "--dtype", "int8")


# ---------------------------------------------------------------- refused while reading


def scale_zero(t):
    t[W + ".weight_scale_inv"] = torch.zeros_like(t[W + ".weight_scale_inv"])
    return W + ".weight_scale_inv"


def scale_infinite(t):
    t[W + ".weight_scale_inv"] = torch.full_like(t[W + ".weight_scale_inv"], float("inf"))
    return W + ".weight_scale_inv"


def scale_negative(t):
    t[W + ".weight_scale_inv"] = -t[W + ".weight_scale_inv"]
    return W + ".weight_scale_inv"


def nan_code(t):
    q = t[W + ".weight"].clone()
    q.view(torch.uint8)[7, 3] = 0x7F  # e4m3fn NaN
    t[W + ".weight"] = q
    return W + ".weight"


@pytest.mark.parametrize("breaker", [scale_zero, scale_infinite, scale_negative, nan_code], ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "command",
    [["dequantize"], ["quantize", "--scheme", "channel"], ["quantize", "--format", "fp8", "--scheme", "block"]],
    ids=["dequantize", "requantize", "pass-through"],
)
def test_bad_values_are_refused_while_reading_naming_the_tensor(tmp_path, capsys, breaker, command):
    src = fp8_checkpoint(tmp_path / "src")
    tensors = load_file(str(src / SHARD2))
    name = breaker(tensors)
    save_file(tensors, str(src / SHARD2), metadata={"format": "pt"})
    out = tmp_path / "out"
    rc, err = run_cli(capsys, command[0], src, out, *command[1:], "-q", "--device", "cpu")
    line = assert_refused(rc, err, out, name, SHARD2, preflight=False)
    assert "NaN" in line if breaker is nan_code else "finite and positive" in line


def test_values_beyond_float16_are_refused(tmp_path, capsys):
    src = fp8_checkpoint(tmp_path / "src")
    tensors = load_file(str(src / SHARD2))
    tensors[W + ".weight_scale_inv"] = torch.full_like(tensors[W + ".weight_scale_inv"], 1e4)  # 448 x 1e4 > 65504
    save_file(tensors, str(src / SHARD2), metadata={"format": "pt"})
    out = tmp_path / "out"
    rc, err = run_cli(capsys, "dequantize", src, out, "--dtype", "fp16", "-q", "--device", "cpu")
    line = assert_refused(rc, err, out, W + ".weight", preflight=False)
    assert "float16" in line
    assert run_cli(capsys, "dequantize", src, tmp_path / "bf16-out", "-q", "--device", "cpu")[0] == 0
