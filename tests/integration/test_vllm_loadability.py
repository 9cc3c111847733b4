"""Outputs vLLM cannot load are not written silently: the plan keeps what vLLM's loader cannot take, and
refuses what no choice of its own can fix. tests/integration/engine/test_engine.py shows the same
outputs failing and loading in vLLM itself."""

from __future__ import annotations

import pytest
from harness import fp8convert_module, read_json, read_safetensors_dir, run_quantize
from tiny_ckpt import llama_tensors, write_checkpoint

FP8 = "torch.float8_e4m3fn"


@pytest.fixture(autouse=True)
def refusals_on(monkeypatch):
    """tests/conftest.py lets the other tests write the tiny models' unloadable block outputs."""
    monkeypatch.delenv("FP8CONVERT_WRITE_UNLOADABLE", raising=False)


def kept(plan, module: str):
    (t,) = [t for t in plan.tensors if t.name == module + ".weight"]
    return None if t.quantize else t.reason


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8"])
def test_falcon_query_key_value_kept_under_block_and_quantized_otherwise(fmt, zoo_source):
    fp8convert = fp8convert_module()
    qkv = "transformer.h.0.self_attention.query_key_value"
    block = fp8convert.make_plan(str(zoo_source("falcon")), format=fmt, scheme="block")
    assert "regroups query_key_value rows per KV head" in kept(block, qkv)
    assert kept(block, "transformer.h.0.mlp.dense_h_to_4h") is None  # the rest is quantized
    other = fp8convert.make_plan(str(zoo_source("falcon")), format=fmt, scheme="channel" if fmt != "fp8" else "tensor")
    assert kept(other, qkv) is None


def test_falcon_block_output_lists_query_key_value(zoo_source, tmp_path):
    out = tmp_path / "out"
    run_quantize(zoo_source("falcon"), out, format="fp8", scheme="block")
    tensors = read_safetensors_dir(out)
    for layer in (0, 1):
        module = f"transformer.h.{layer}.self_attention.query_key_value"
        assert str(tensors[module + ".weight"].dtype) == "torch.bfloat16"
        assert module in read_json(out / "config.json")["quantization_config"]["modules_to_not_convert"]
        assert str(tensors[f"transformer.h.{layer}.mlp.dense_h_to_4h.weight"].dtype) == FP8


# llama with k/v of 32 rows: q_proj | k_proj | v_proj fuse into one block layer whose k_proj ends mid-block
NARROW_KV = dict(hidden=128, inter=256)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8"])
def test_fused_block_group_vllm_cannot_load_is_refused(fmt, tmp_path):
    fp8convert = fp8convert_module()
    src = write_checkpoint(tmp_path / "src", llama_tensors(**NARROW_KV))
    out = tmp_path / "out"
    with pytest.raises(fp8convert.FP8ConvertError) as ei:
        run_quantize(src, out, format=fmt, scheme="block")
    text = str(ei.value)
    assert "\n" not in text
    assert "vLLM cannot load model.layers.0.self_attn.q_proj/k_proj/v_proj" in text
    assert "model.layers.0.self_attn.k_proj.weight [32, 128]" in text
    # the API spells options by their keyword names (scheme, ignore, write_unloadable)
    assert "channel or tensor" in text and r"'re:.*\.(q_proj|k_proj|v_proj)$'" in text
    assert "write_unloadable writes it anyway" in text
    assert not out.exists() or not list(out.glob("*.safetensors"))


def test_the_refusal_names_the_way_out_and_the_opt_in_writes_it(tmp_path):
    src = write_checkpoint(tmp_path / "src", llama_tensors(**NARROW_KV))
    ignored = tmp_path / "ignored"
    run_quantize(src, ignored, scheme="block", ignore=(r"re:.*\.(q_proj|k_proj|v_proj)$",))
    assert str(read_safetensors_dir(ignored)["model.layers.0.self_attn.k_proj.weight"].dtype) == "torch.bfloat16"
    forced = tmp_path / "forced"
    report = run_quantize(src, forced, scheme="block", write_unloadable=True)
    assert str(read_safetensors_dir(forced)["model.layers.0.self_attn.k_proj.weight"].dtype) == FP8
    assert any("vLLM cannot load" in w for w in report.warnings)


def test_make_plan_warns_as_the_report_does_naming_keywords(tmp_path):
    """The plan a Python caller inspects holds every warning the conversion's report gives, where engines
    will not load it included, and both name the API's keywords rather than the command line's flags."""
    src = write_checkpoint(tmp_path / "src", llama_tensors(**NARROW_KV))
    plan = fp8convert_module().make_plan(str(src), scheme="block")
    report = run_quantize(src, tmp_path / "out", scheme="block", write_unloadable=True)
    assert plan.warnings == report.warnings
    assert any(w.startswith("vLLM cannot load") and "use scheme channel or tensor" in w for w in plan.warnings)
    assert not any("--" in w for w in plan.warnings)


def test_cli_refuses_with_exit_1_and_writes_with_the_option(tmp_path, capsys, monkeypatch):
    from fp8convert.cli import main

    src = write_checkpoint(tmp_path / "src", llama_tensors(**NARROW_KV))
    assert main(["quantize", str(src), str(tmp_path / "a"), "--scheme", "block", "--device", "cpu", "-q"]) == 1
    err = capsys.readouterr().err
    assert "vLLM cannot load" in err and "--scheme channel or tensor" in err and "--write-unloadable" in err
    assert (
        main(
            [
                "quantize",
                str(src),
                str(tmp_path / "b"),
                "--scheme",
                "block",
                "--device",
                "cpu",
                "-q",
                "--write-unloadable",
            ]
        )
        == 0
    )
    assert (tmp_path / "b" / "config.json").exists()
    # inspect says beforehand that quantize will refuse it, unless told to write it
    refuses = "warning     quantize refuses to write this (vLLM cannot load it); --write-unloadable writes it"
    assert main(["inspect", str(src), "--scheme", "block"]) == 0 and refuses in capsys.readouterr().out
    monkeypatch.setenv("FP8CONVERT_WRITE_UNLOADABLE", "1")
    assert main(["inspect", str(src), "--scheme", "block"]) == 0 and "quantize refuses" not in capsys.readouterr().out
    assert main(["inspect", str(src), "--scheme", "channel"]) == 0 and "quantize refuses" not in capsys.readouterr().out


# Granite-4.0-H at 128-wide sizes: one Mamba2 layer (in_proj quantized: 560 or 784 rows), one attention
_GRANITE_HYBRID = {
    "hidden_size": 128,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "intermediate_size": 128,
    "shared_intermediate_size": 128,
    "mamba_n_heads": 16,
    "mamba_d_head": 16,
}


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8"])
def test_mamba2_in_proj_vllm_cannot_load_in_blocks_is_refused(fmt, tmp_path):
    """vLLM's MambaMixer2 splits in_proj into gate, x, B, C, dt: B and C of 16 rows end mid-block."""
    import zoo

    src = zoo.make("granitemoehybrid", tmp_path / "src", config_overrides={**_GRANITE_HYBRID, "mamba_d_state": 16})
    with pytest.raises(fp8convert_module().FP8ConvertError) as ei:
        run_quantize(src, tmp_path / "out", format=fmt, scheme="block")
    text = str(ei.value)
    assert "vLLM cannot load model.layers.0.mamba.in_proj" in text and "[256, 256, 16, 16, 16]" in text
    assert "channel or tensor" in text and r"'re:.*\.mamba\.in_proj$'" in text
    run_quantize(src, tmp_path / "ignored", format=fmt, scheme="block", ignore=(r"re:.*\.mamba\.in_proj$",))
    forced = run_quantize(src, tmp_path / "forced", format=fmt, scheme="block", write_unloadable=True)
    assert any("vLLM cannot load model.layers.0.mamba.in_proj" in w for w in forced.warnings), forced.warnings
    assert "vLLM cannot load model.layers.0.mamba.in_proj" in (tmp_path / "forced" / "README.md").read_text()


def test_mamba2_in_proj_given_blocks_by_a_recipe_is_refused(tmp_path):
    """The rule reads dt_bias's and out_proj's shapes, which a recipe leaves in another scheme."""
    import zoo

    src = zoo.make("granitemoehybrid", tmp_path / "src", config_overrides={**_GRANITE_HYBRID, "mamba_d_state": 16})
    with pytest.raises(fp8convert_module().FP8ConvertError) as ei:
        run_quantize(src, tmp_path / "out", scheme="channel", recipe={r"re:.*\.in_proj$": "block"})
    assert "vLLM cannot load model.layers.0.mamba.in_proj" in str(ei.value), ei.value


def test_mamba2_in_proj_on_block_boundaries_is_written(tmp_path):
    import zoo

    src = zoo.make("granitemoehybrid", tmp_path / "src", config_overrides={**_GRANITE_HYBRID, "mamba_d_state": 128})
    run_quantize(src, tmp_path / "out", scheme="block")
    assert str(read_safetensors_dir(tmp_path / "out")["model.layers.0.mamba.in_proj.weight"].dtype) == FP8


def test_granite_hybrid_kept_mamba_layer_is_ignored_under_vllm_name(zoo_source, tmp_path):
    """vLLM's granitemoehybrid.py names its Mamba2 mixer `.mixer` (its quant config matches that name)."""
    out = tmp_path / "out"
    run_quantize(zoo_source("granitemoehybrid"), out, format="fp8", scheme="tensor", ignore=(r"re:.*\.in_proj$",))
    ignored = read_json(out / "config.json")["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.mixer.in_proj" in ignored and "model.layers.0.mamba.in_proj" in ignored
