"""Mixed recipes (`--scheme PATTERN=SCHEME`, `--recipe FILE`): the docs' two examples convert into one
compressed-tensors checkpoint with a config group per scheme, hold exactly the bytes each scheme alone
writes for its modules, verify, load in transformers; recipes that split what vLLM runs as one layer are
refused in one line; files, resume and worker splits keep the recipe."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from harness import read_json, read_safetensors_dir, run_quantize, tamper
from tiny_ckpt import tree_bytes

import fp8convert
from fp8convert.cli import main
from fp8convert.verify import verify

EXPERTS = r"re:.*mlp\.experts\..*"
# The docs' examples: FP8 block attention + NVFP4A16 experts; FP8 channel dense + MXFP4A16 experts.
EXAMPLES = {"block+nvfp4a16": ("block", "nvfp4a16"), "channel+mxfp4a16": ("channel", "mxfp4a16")}
COMPRESSOR = {"nvfp4a16": NVFP4PackedCompressor, "mxfp4a16": MXFP4PackedCompressor}


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE whose attention has 128-wide inputs and outputs: the block scheme's 128x128 tiles
    fit it whole, so vLLM's fused q/k/v rule and compressed-tensors' activation groups both hold."""
    from tiny_models import make_model

    overrides = {"hidden_size": 128, "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 4}
    return make_model("qwen3_moe", tmp_path_factory.mktemp("mixed") / "src", config_overrides=overrides)


@pytest.fixture(scope="module")
def converted(moe_source, tmp_path_factory):
    """converted(default, expert_scheme or None) -> output dir: the recipe, or one scheme for everything."""
    cache: dict = {}

    def get(default: str, experts: str | None = None) -> Path:
        if (default, experts) not in cache:
            out = tmp_path_factory.mktemp(f"out-{default}-{experts}") / "out"
            recipe = {EXPERTS: experts} if experts else ()
            run_quantize(moe_source, out, scheme=default, recipe=recipe, max_shard_size="150KB")
            cache[default, experts] = out
        return cache[default, experts]

    return get


def modules_of(tensors: dict, suffix: str) -> set[str]:
    return {k.removesuffix(suffix) for k in tensors if k.endswith(suffix)}


def is_expert(name: str) -> bool:
    return re.match(EXPERTS[3:], name) is not None


@pytest.mark.parametrize(("default", "experts"), EXAMPLES.values(), ids=EXAMPLES.keys())
def test_a_recipe_writes_what_each_scheme_alone_writes_for_its_modules(converted, default, experts):
    """Every tensor of the mixed output is byte for byte the one-scheme output's: the experts' (codes,
    group scales, one global scale per gate/up) from an all-FP4 run, the rest from an all-FP8 run."""
    mixed = read_safetensors_dir(converted(default, experts))
    fp8, fp4 = read_safetensors_dir(converted(default)), read_safetensors_dir(converted(experts))
    assert modules_of(mixed, ".weight_packed") and all(map(is_expert, modules_of(mixed, ".weight_packed")))
    assert any(t.dtype == torch.float8_e4m3fn for n, t in mixed.items() if not is_expert(n))
    for name, tensor in mixed.items():
        want = (fp4 if is_expert(name) else fp8)[name]
        assert tensor.dtype == want.dtype and torch.equal(tensor.view(torch.uint8), want.view(torch.uint8)), name
    wanted = {n for n in fp4 if is_expert(n)} | {n for n in fp8 if not is_expert(n)}
    assert set(mixed) == wanted


@pytest.mark.parametrize(("default", "experts"), EXAMPLES.values(), ids=EXAMPLES.keys())
def test_the_config_has_one_group_per_scheme_whose_targets_match_exactly_its_modules(converted, default, experts):
    """format mixed-precision; the default scheme's group targets Linear as in a one-scheme output, the
    other lists regexes that match every FP4 module and nothing else the model names (compressed-tensors
    applies a module's first matching group, so a stray match would read FP8 bytes as FP4)."""
    out = converted(default, experts)
    qc = read_json(out / "config.json")["quantization_config"]
    alone = {s: read_json(converted(s) / "config.json")["quantization_config"] for s in (default, experts)}
    assert qc["format"] == "mixed-precision"
    (fp8_group, fp4_group) = qc["config_groups"].values()
    assert fp8_group["targets"] == ["Linear"] and fp8_group["format"] == "float-quantized"
    assert fp8_group["weights"] == alone[default]["config_groups"]["group_0"]["weights"]
    assert fp4_group["format"] == alone[experts]["format"] and fp4_group["input_activations"] is None
    assert fp4_group["weights"] == alone[experts]["config_groups"]["group_0"]["weights"]
    tensors = read_safetensors_dir(out)
    fp4_modules = modules_of(tensors, ".weight_packed")
    every = fp4_modules | modules_of(tensors, ".weight")
    targets = fp4_group["targets"]
    assert all(t.startswith("re:^") for t in targets) and len(targets) < len(fp4_modules)
    matched = {m for m in every if any(re.match(t[3:], m) for t in targets)}
    assert matched == fp4_modules
    assert qc["ignore"] == alone[default]["ignore"]


@pytest.mark.parametrize(("default", "experts"), EXAMPLES.values(), ids=EXAMPLES.keys())
def test_compressed_tensors_decodes_every_fp4_module_by_its_group(converted, moe_source, default, experts):
    """compressed-tensors' own FP4 decompressor, given the group the config assigns each module, decodes
    every expert to within its format's bound of the source (verify's: about twice the measured error)."""
    tensors, source = read_safetensors_dir(converted(default, experts)), read_safetensors_dir(moe_source)
    preset = preset_name_to_scheme(experts.upper(), ["Linear"])
    worst = 0.0
    for module in sorted(modules_of(tensors, ".weight_packed")):
        state = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.startswith(module + ".weight_")}
        decoded = COMPRESSOR[experts].decompress(state, preset)["weight"].float()
        w = source[f"{module}.weight"].float()
        worst = max(worst, float((decoded - w).norm() / w.norm()))
    assert 0.02 < worst < 0.2, worst


@pytest.mark.parametrize(("default", "experts"), EXAMPLES.values(), ids=EXAMPLES.keys())
def test_verify_passes_a_mixed_output_per_module_scheme(converted, moe_source, default, experts):
    report = verify(moe_source, converted(default, experts), device="cpu")
    assert report.ok, report.problems[:3]
    assert report.scheme == f"{default}, {experts}"
    fp8 = [t for t in report.tensors if not is_expert(t.name)]
    fp4 = [t for t in report.tensors if is_expert(t.name)]
    assert fp8 and fp4 and all(t.rel_error <= t.bound for t in report.tensors)
    nonzero = [t for t in fp4 if t.bound != float("inf")]  # the source zeroes one expert: nothing to err
    assert max(t.rel_error for t in fp8) < 0.07 < min(t.rel_error for t in nonzero)  # FP8's error, FP4's


def test_verify_of_a_mixed_output_finds_a_split_global_scale_and_a_wrong_fp8_scale(converted, moe_source, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(converted("block", "nvfp4a16"), out)
    tamper(out, "model.layers.1.mlp.experts.5.up_proj.weight_global_scale", lambda g: g / 2)
    tamper(out, "model.layers.0.self_attn.k_proj.weight_scale", lambda s: s * 3)
    report = verify(moe_source, out, device="cpu")
    problems = [str(p) for p in report.problems]
    assert not report.ok
    assert any(p.startswith("model.layers.1.mlp.experts.5.gate_proj/up_proj: fused members have 2") for p in problems)
    assert any(p.startswith("model.layers.0.self_attn.k_proj.weight:") for p in problems), problems


def test_channel_and_mxfp4_experts_load_in_transformers_close_to_the_source(converted, moe_source):
    """transformers (compressed-tensors at load) dequantizes the FP8 attention and the MXFP4 experts; the
    logits stay as close to BF16's as an all-MXFP4 output's (0.95, test_fp4_output's bound)."""
    from harness import model_logits
    from transformers import AutoModelForCausalLM

    got = model_logits(
        AutoModelForCausalLM.from_pretrained(str(converted("channel", "mxfp4a16")), dtype=torch.bfloat16)
    )
    cos = torch.nn.functional.cosine_similarity(got, model_logits(moe_source), dim=-1)
    assert float(cos.min()) >= 0.95, cos


def test_block_attention_with_nvfp4_experts_loads_in_transformers_and_inspect_warns(converted, moe_source, capsys):
    """transformers dequantizes the block-FP8 attention to exactly codes x tile scale (rounded to BF16);
    its NVFP4 experts lose their global scale (#48371), so inspect of this recipe says so."""
    from transformers import AutoModelForCausalLM

    out = converted("block", "nvfp4a16")
    tensors = read_safetensors_dir(out)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # compressed-tensors decompresses on the first forward
    q_proj = "model.layers.0.self_attn.q_proj"
    codes, scale = tensors[f"{q_proj}.weight"], tensors[f"{q_proj}.weight_scale"]
    tiles = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[: codes.shape[0], : codes.shape[1]]
    assert torch.equal(
        model.model.layers[0].self_attn.q_proj.weight, codes.to(torch.bfloat16) * tiles.to(torch.bfloat16)
    )
    rc = main(["inspect", str(moe_source), "--scheme", "block", "--scheme", f"{EXPERTS}=nvfp4a16", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    info = json.loads(captured.out)
    text = " ".join(w["message"] if isinstance(w, dict) else str(w) for w in info["warnings"])
    assert "#48371" in text, text
    assert info["recipe"] and info["quantized_by_scheme"]["nvfp4a16"] > 0 and info["quantized_by_scheme"]["block"] > 0


def run_cli(capsys, *args) -> tuple[int, str]:
    rc = main([str(a) for a in args])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    ("rules", "says"),
    [
        (["re:.*self_attn\\.q_proj$=nvfp4a16"], "the recipe splits the fused set model.layers.0.self_attn.q_proj/"),
        (["re:.*experts\\.3\\..*=mxfp4a16"], "the recipe splits the experts of model.layers.0.mlp.experts"),
        ([f"{EXPERTS}=nvfp4a16", "re:.*experts\\.1\\..*=mxfp4a16"], "give it different schemes"),
        ([f"{EXPERTS}=nvfp4a16", f"{EXPERTS}=mxfp4a16"], f"another rule gives {EXPERTS} nvfp4a16"),
        (["re:.*experts.*=nvfp4a16", "--format", "fp8"], "needs --format compressed-tensors"),
        (["re:.*experts.*=fp4"], "--scheme re:.*experts.*=fp4:"),
        (["re:.*(experts=nvfp4a16"], "bad regular expression"),
        (["=nvfp4a16"], "--scheme =nvfp4a16: a rule needs a module pattern"),
        (["re:.*experts.*=nvfp4a16", "--scale-format", "ue8m0", "--scheme", "block"], "ue8m0"),
    ],
)
def test_a_recipe_vllm_could_not_load_as_written_is_refused_in_one_line(moe_source, tmp_path, capsys, rules, says):
    out = tmp_path / "out"
    rc, err = run_cli(capsys, *cli_args(moe_source, out, rules))
    assert rc != 0 and says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not out.exists()


def cli_args(src, out, rules: list[str]) -> list:
    """quantize SRC OUT with each rule as --scheme RULE and any --flag VALUE passed as it is."""
    args, it = ["quantize", src, out, "--device", "cpu", "-q"], iter(rules)
    for r in it:
        args += [r, next(it)] if r.startswith("--") else ["--scheme", r]
    return args


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("r.toml", "schemes = 3\n", "expected a `schemes` table"),
        ("r.toml", "", "expected `scheme`, a `schemes` table or `ignore`"),
        ("r.toml", 'scheme = "tensr"\n', "scheme 'tensr': expected one of"),
        ("r.toml", "[schemes\n", "not valid TOML"),
        ("r.yaml", "schemes: {a: [\n", "not valid YAML"),
        ("r.toml", 'scheme = "block"\nlayers = 1\n[schemes]\n"re:.*experts.*" = "nvfp4a16"\n', "unknown key 'layers'"),
        ("r.toml", '[schemes]\n"re:.*experts.*" = "nvfp5"\n', "rule 're:.*experts.*' = 'nvfp5': expected one of"),
        ("r.toml", 'scheme = "blok"\n[schemes]\n"re:.*experts.*" = "nvfp4a16"\n', "scheme 'blok': expected one of"),
        ("missing.toml", None, "cannot read it"),
    ],
)
def test_a_bad_recipe_file_is_refused_naming_it(moe_source, tmp_path, capsys, name, text, says):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    out = tmp_path / "out"
    rc, err = run_cli(capsys, "quantize", moe_source, out, "--recipe", path, "--device", "cpu", "-q")
    assert rc != 0 and f"--recipe {path}" in err and says in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("recipe.toml", 'scheme = "block"\n[schemes]\n"re:.*mlp\\\\.experts\\\\..*" = "NVFP4A16"\n'),
        ("recipe.yaml", "scheme: block\nschemes:\n  're:.*mlp\\.experts\\..*': nvfp4a16\n"),
    ],
)
def test_a_recipe_file_writes_the_bytes_of_the_command_line_rules(converted, moe_source, tmp_path, capsys, name, text):
    (tmp_path / name).write_text(text)
    out = tmp_path / "out"
    rc, err = run_cli(
        capsys,
        "quantize",
        moe_source,
        out,
        "--recipe",
        tmp_path / name,
        "--device",
        "cpu",
        "-q",
        "--max-shard-size",
        "150KB",
    )
    assert rc == 0, err
    assert tree_bytes(out) == tree_bytes(converted("block", "nvfp4a16"))


def test_a_recipe_file_of_a_scheme_and_ignore_patterns_alone_writes_the_command_lines_bytes(
    moe_source, tmp_path, capsys
):
    (tmp_path / "r.toml").write_text('scheme = "channel"\nignore = ["re:.*layers\\\\.0\\\\.self_attn.*"]\n')
    rc, err = run_cli(capsys, "quantize", moe_source, tmp_path / "file", "-q", "--recipe", tmp_path / "r.toml")
    assert rc == 0, err
    flags = ["--scheme", "channel", "--ignore", "re:.*layers\\.0\\.self_attn.*"]
    assert run_cli(capsys, "quantize", moe_source, tmp_path / "flags", "-q", *flags)[0] == 0
    assert tree_bytes(tmp_path / "file") == tree_bytes(tmp_path / "flags")
    assert (
        "model.layers.0.self_attn.q_proj"
        in read_json(tmp_path / "file" / "config.json")["quantization_config"]["ignore"]
    )


def test_a_rule_that_matches_nothing_is_warned_of(moe_source, tmp_path, capsys):
    rc, err = run_cli(
        capsys,
        "quantize",
        moe_source,
        tmp_path / "out",
        "--device",
        "cpu",
        "--scheme",
        "channel",
        "--scheme",
        "re:.*shared_expert\\..*=nvfp4a16",
    )
    assert rc == 0 and "--scheme re:.*shared_expert\\..*=nvfp4a16 matched no module" in err, err
    qc = read_json(tmp_path / "out" / "config.json")["quantization_config"]
    assert len(qc["config_groups"]) == 1 and qc["format"] == "float-quantized"


def test_a_rule_whose_modules_all_stay_high_precision_is_warned_of_and_not_on_the_card(tmp_path, capsys):
    """Experts 48 wide take no MXFP4 (32 inputs a scale): the rule writes nothing, so it is warned of, and
    the card names only the FP8 weights written (it named MXFP4 in its title, tags and recipe lines)."""
    from tiny_models import make_model

    overrides = {"hidden_size": 128, "head_dim": 32, "num_attention_heads": 4, "moe_intermediate_size": 48}
    src = make_model("qwen3_moe", tmp_path / "src", config_overrides=overrides)
    out = tmp_path / "out"
    rc, err = run_cli(capsys, *cli_args(src, out, ["channel", f"{EXPERTS}=mxfp4a16"]))
    assert rc == 0 and f"--scheme {EXPERTS}=mxfp4a16 quantizes no weight: every weight it matches stays" in err, err
    card = (out / "README.md").read_text().split("## Reproduce")[0]  # its command still gives the rule
    assert "# src-FP8\n" in card and "MXFP4" not in card and "mxfp4" not in card, card
    assert "FP8 (e4m3) weights of" in card and "- Recipe:" not in card


def test_worker_splits_and_resume_keep_the_recipe_and_its_bytes(converted, moe_source, tmp_path):
    """Two workers then finalize (which rebuilds the plan from the manifest's recipe) and a resumed run
    write what one process writes; a rerun with another recipe is refused, naming the recipe."""
    from fp8convert import api

    reference = tree_bytes(converted("block", "nvfp4a16"))
    kw = {"scheme": "block", "recipe": {EXPERTS: "nvfp4a16"}, "device": "cpu", "max_shard_size": "150KB"}
    split = tmp_path / "split"
    for k in range(2):
        api.quantize(moe_source, split, worker=f"{k}/2", finalize=False, **kw)
    api.finalize_output(split)
    assert tree_bytes(split) == reference
    resumed = tmp_path / "resumed"
    api.quantize(moe_source, resumed, worker="0/2", finalize=False, **kw)
    with pytest.raises(fp8convert.FP8ConvertError, match=r"the recipe was 're:.*=nvfp4a16', now 're:.*=mxfp4a16'"):
        api.quantize(moe_source, resumed, **(kw | {"recipe": {EXPERTS: "mxfp4a16"}}))
    report = api.quantize(moe_source, resumed, **kw)
    assert report.complete and tree_bytes(resumed) == reference


def test_the_card_names_both_weights_and_its_command_rewrites_the_same_shards(converted, tmp_path, capsys):
    import shlex

    out = converted("block", "nvfp4a16")
    card = (out / "README.md").read_text()
    assert "FP8 (e4m3) and NVFP4 (4-bit E2M1) weights, chosen by module" in card
    assert f"- Recipe: modules matching `{EXPERTS}`: NVFP4" in card and "SGLang" not in card
    command = shlex.split(card.split("## Reproduce\n\n```bash\n")[1].split("\n")[0])
    assert command[:2] == ["fp8convert", "quantize"] and f"{EXPERTS}=nvfp4a16" in command
    again = tmp_path / "again"
    rc, err = run_cli(capsys, *command[1:3], again, *command[4:], "--device", "cpu", "-q")
    assert rc == 0, err
    shards = {k: v for k, v in tree_bytes(out).items() if k.endswith((".safetensors", ".json"))}
    assert shards == {k: v for k, v in tree_bytes(again).items() if k in shards}
