"""FP4 weight-only outputs (nvfp4a16, mxfp4a16) end to end: every FP4 tensor decoded by compressed-tensors'
own decompressor, one NVFP4 global scale per fused set (the check vLLM warns about), transformers'
logits, shapes FP4 cannot take, verify, and the refusals."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from harness import model_logits, read_json, read_safetensors_dir, run_quantize, tamper

import fp8convert
from fp8convert.cli import main
from fp8convert.run import fp4
from fp8convert.verify import verify

FP4 = ["nvfp4a16", "mxfp4a16"]
COMPRESSOR = {"nvfp4a16": NVFP4PackedCompressor, "mxfp4a16": MXFP4PackedCompressor}
# Tiny dense and MoE models (deepseek_v3: MLA and shared experts) and a family with fused 3-D experts
# that the plan splits per expert (qwen3_vl_moe's gate_up_proj [E, H, 2I]).
SUBJECTS = [("tiny", "llama"), ("tiny", "qwen3_moe"), ("tiny", "deepseek_v3"), ("zoo", "qwen3_vl_moe")]
SUBJECT_IDS = [k for _, k in SUBJECTS]
# vLLM's fused layers, by the leaf names of their members (its packed_modules_mapping).
FUSED = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"), ("q_a_proj", "kv_a_proj_with_mqa")]


@pytest.fixture(scope="module")
def fp4_output(source_model, zoo_source, tmp_path_factory):
    """fp4_output(where, kind, scheme) -> (source dir, output dir), converted once."""
    cache: dict = {}

    def get(where: str, kind: str, scheme: str) -> tuple[Path, Path]:
        if (where, kind, scheme) not in cache:
            src = source_model(kind) if where == "tiny" else zoo_source(kind)
            out = tmp_path_factory.mktemp(f"fp4-{kind}-{scheme}") / "out"
            run_quantize(src, out, scheme=scheme)
            cache[where, kind, scheme] = (src, out)
        return cache[where, kind, scheme]

    return get


def fp4_modules(tensors: dict) -> list[str]:
    return sorted(k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed"))


def ct_decode(tensors: dict, module: str, scheme: str) -> torch.Tensor:
    """compressed-tensors' own decompression of one module's FP4 tensors."""
    names = ("weight_packed", "weight_scale", "weight_global_scale")
    state = {s: tensors[f"{module}.{s}"] for s in names if f"{module}.{s}" in tensors}
    preset = preset_name_to_scheme(scheme.upper(), ["Linear"])
    return COMPRESSOR[scheme].decompress(state, preset)["weight"]


def fused_key(module: str) -> str | None:
    parent, _, leaf = module.rpartition(".")
    group = next((g for g in FUSED if leaf in g), None)
    return f"{parent}.{'/'.join(group)}" if group else None


@pytest.mark.parametrize("scheme", FP4)
@pytest.mark.parametrize(("where", "kind"), SUBJECTS, ids=SUBJECT_IDS)
def test_every_fp4_tensor_decodes_as_compressed_tensors_decodes_it(fp4_output, where, kind, scheme):
    """compressed-tensors' decompressor and fp8convert's decode agree on every FP4 tensor, each value is
    within half an E2M1 step at its group's scale of the source (the unit test's bound), and the layout
    is compressed-tensors' (no X.weight beside X.weight_packed; NVFP4's global scale float32 [1])."""
    src, out = fp4_output(where, kind, scheme)
    tensors, source = read_safetensors_dir(out), read_safetensors_dir(src)
    modules = fp4_modules(tensors)
    assert len(modules) >= 8
    size = fp4.GROUP_SIZE[scheme]
    compared = 0
    for m in modules:
        packed, scale = tensors[f"{m}.weight_packed"], tensors[f"{m}.weight_scale"]
        g = tensors.get(f"{m}.weight_global_scale")
        assert f"{m}.weight" not in tensors and packed.dtype == torch.uint8
        assert scale.dtype == (torch.float8_e4m3fn if scheme == "nvfp4a16" else torch.uint8)
        assert (g is not None and g.dtype == torch.float32 and g.shape == (1,)) == (scheme == "nvfp4a16")
        ours = fp4.dequantize(packed, scale, g, scheme)
        theirs = ct_decode(tensors, m, scheme)
        assert torch.equal(ours.to(theirs.dtype), theirs), m
        if (w := source.get(f"{m}.weight")) is None:
            continue  # a cut of a fused 3-D expert tensor: verify holds it to its source
        groups = w.float().unflatten(-1, (-1, size))
        step = groups.abs().amax(dim=-1, keepdim=True) / 6 * (2.0 if scheme == "mxfp4a16" else 1.0 + 2.0**-3)
        assert bool(((ours.unflatten(-1, (-1, size)) - groups).abs() <= step + 1e-30).all()), m
        compared += 1
    assert compared >= (8 if where == "tiny" else 4)


@pytest.mark.parametrize(("where", "kind"), SUBJECTS, ids=SUBJECT_IDS)
def test_every_fused_set_shares_one_global_scale_from_its_largest_member(fp4_output, where, kind):
    """q/k/v, gate/up (every routed expert's, the shared experts'), MLA's q_a/kv_a and the cuts of a fused
    3-D expert tensor: one NVFP4 global scale per set, 448 * 6 / the set's amax (1 for an all-zero set),
    so vLLM's fused GEMM scales every member right."""
    src, out = fp4_output(where, kind, "nvfp4a16")
    tensors, source = read_safetensors_dir(out), read_safetensors_dir(src)
    sets = defaultdict(list)
    for m in fp4_modules(tensors):
        if key := fused_key(m):
            sets[key].append(m)
    assert sets and all(len(members) > 1 for members in sets.values()), sets
    attention = "q_a_proj/kv_a_proj_with_mqa" if kind == "deepseek_v3" else "q_proj/k_proj/v_proj"  # MLA
    expected_kinds = {attention, "gate_proj/up_proj"}
    assert expected_kinds <= {k.rsplit(".", 1)[-1] for k in sets}
    if kind != "llama":
        assert any(re.search(r"experts\.\d+\.gate_proj/up_proj$", k) for k in sets)
    if kind == "deepseek_v3":
        assert any(k.endswith("shared_experts.gate_proj/up_proj") for k in sets)
    for key, members in sets.items():
        scales = {tensors[f"{m}.weight_global_scale"].item() for m in members}
        assert len(scales) == 1, (key, scales)
        weights = [source.get(f"{m}.weight") for m in members]
        if all(w is not None for w in weights):
            amax = max(w.float().abs().amax() for w in weights)
            expected = (torch.tensor(448.0 * 6) / amax).item() if amax > 0 else 1.0  # an all-zero set: 1
            assert scales.pop() == expected, key


@pytest.mark.parametrize("scheme", FP4)
@pytest.mark.parametrize(("where", "kind"), SUBJECTS, ids=SUBJECT_IDS)
def test_verify_passes_an_fp4_output(fp4_output, where, kind, scheme):
    src, out = fp4_output(where, kind, scheme)
    report = verify(src, out, device="cpu")
    assert report.ok, report.problems[:3]
    assert report.scheme == scheme and report.tensors_quantized == len(fp4_modules(read_safetensors_dir(out)))
    assert all(t.rel_error <= t.bound for t in report.tensors) and report.tensors


def test_verify_finds_a_member_with_its_own_global_scale_and_a_wrong_code(fp4_output, tmp_path):
    """One member of a fused set given its own global scale (what the peers write) and one flipped
    nibble: verify names both."""
    import shutil

    src, good = fp4_output("tiny", "qwen3_moe", "nvfp4a16")
    out = tmp_path / "out"
    shutil.copytree(good, out)
    tamper(out, "model.layers.0.mlp.experts.3.up_proj.weight_global_scale", lambda g: g / 2)
    tamper(
        out, "model.layers.1.self_attn.o_proj.weight_packed", lambda p: p.index_put_((torch.tensor([0]),), p[0] ^ 0x7)
    )
    report = verify(src, out, device="cpu")
    problems = [str(p) for p in report.problems]
    assert not report.ok
    assert any(
        p.startswith("model.layers.0.mlp.experts.3.gate_proj/up_proj: fused members have 2 different global scales")
        for p in problems
    ), problems
    assert any(p.startswith("model.layers.1.self_attn.o_proj.weight:") and "E2M1" in p for p in problems), problems
    # halving one member's global scale doubles its values: its error leaves the bound too
    assert any(p.startswith("model.layers.0.mlp.experts.3.up_proj.weight:") for p in problems), problems


@pytest.mark.parametrize("scheme", FP4)
def test_dense_logits_through_transformers_stay_close(fp4_output, source_logits, scheme):
    """A dense model loads in transformers (compressed-tensors dequantizes at load). FP4 weights carry
    about 10% (NVFP4) to 11.5% (MXFP4) relative error each (verify's figures on these models); through
    the tiny models' two layers the logits measured a cosine of 0.989 and 0.976 to BF16's. 0.95 leaves
    room for that and fails on any wrong scale or packing (a lost global scale gave 0.007)."""
    _, out = fp4_output("tiny", "llama", scheme)
    cos = torch.nn.functional.cosine_similarity(fp4_logits(out), source_logits("llama"), dim=-1)
    assert float(cos.min()) >= 0.95, cos


def test_mxfp4_moe_logits_through_transformers_stay_close(fp4_output, source_logits):
    _, out = fp4_output("tiny", "qwen3_moe", "mxfp4a16")
    cos = torch.nn.functional.cosine_similarity(fp4_logits(out), source_logits("qwen3_moe"), dim=-1)
    assert float(cos.min()) >= 0.95, cos


def test_nvfp4_moe_is_judged_on_its_dequantized_weights_and_inspect_warns_of_transformers(fp4_output, capsys):
    """transformers drops NVFP4 experts' global scale (#48371), so its logits say nothing of the output:
    what it dequantizes for a dense layer is compressed-tensors' decode (the experts' decode is checked
    above), and inspect says transformers misreads the experts, for NVFP4 MoE only."""
    from transformers import AutoModelForCausalLM

    src, out = fp4_output("tiny", "qwen3_moe", "nvfp4a16")
    tensors = read_safetensors_dir(out)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # compressed-tensors decompresses the weights on the first forward
    used = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(used, ct_decode(tensors, "model.layers.0.self_attn.q_proj", "nvfp4a16"))
    for scheme, kind, warned in [("nvfp4a16", "qwen3_moe", True), ("mxfp4a16", "qwen3_moe", False)]:
        info = json.loads(run_cli(capsys, "inspect", fp4_output("tiny", kind, scheme)[0], "--scheme", scheme, "--json"))
        text = " ".join(w["message"] if isinstance(w, dict) else str(w) for w in info["warnings"])
        assert ("#48371" in text) == warned, text
        assert info["loads"]["transformers"].startswith("loads, but") == warned


def fp4_logits(out: Path) -> torch.Tensor:
    """Logits of an FP4 output through transformers, run in BF16 (compressed-tensors decompresses FP4
    weights to BF16, which a float32 model cannot multiply)."""
    from transformers import AutoModelForCausalLM

    return model_logits(AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).eval())


def run_cli(capsys, *args, ok: bool = True) -> str:
    rc = main([str(a) for a in args])
    captured = capsys.readouterr()
    assert (rc == 0) == ok, captured.err
    return captured.out


@pytest.mark.parametrize(("scheme", "kept"), [("mxfp4a16", True), ("nvfp4a16", False)])
def test_an_input_size_fp4_groups_do_not_divide_stays_high_precision_and_is_named(tmp_path, capsys, scheme, kept):
    """Experts 48 wide: their down_proj's input (48) is no multiple of MXFP4's 32, so it stays BF16, and
    with it every expert of the layer (vLLM's MoE layer takes one scheme), in the ignore list, with the
    reason in inspect; NVFP4's 16 divides it."""
    from tiny_models import make_model

    src = make_model("qwen3_moe", tmp_path / "src", config_overrides={"moe_intermediate_size": 48})
    out = tmp_path / "out"
    run_quantize(src, out, scheme=scheme)
    tensors = read_safetensors_dir(out)
    for leaf in ("down_proj", "gate_proj"):
        module = f"model.layers.0.mlp.experts.0.{leaf}"
        assert (f"{module}.weight" in tensors) == kept and (f"{module}.weight_packed" in tensors) == (not kept)
    assert "model.layers.0.self_attn.q_proj.weight_packed" in tensors
    if kept:
        down = "model.layers.0.mlp.experts.0.down_proj"
        assert tensors[f"{down}.weight"].dtype == torch.bfloat16
        ignore = read_json(out / "config.json")["quantization_config"]["ignore"]
        assert any(p == down or (p.startswith("re:") and re.match(p[3:], down)) for p in ignore), ignore
        text = run_cli(capsys, "inspect", src, "--scheme", scheme)
        assert re.search(r"^kept .*FP4: input dim not divisible by 32$", text, re.M), text
        assert f"because {down} is kept (FP4: input dim (48) not divisible by 32)" in text, text
    assert verify(src, out, device="cpu").ok


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--format", "fp8", "--scheme", "nvfp4a16"], "fp8"),
        (["--scheme", "MXFP4A16", "--scale-format", "ue8m0"], "ue8m0"),
    ],
)
def test_fp4_with_what_it_cannot_take_is_refused_in_one_line(source_model, tmp_path, capsys, args, says):
    out = tmp_path / "out"
    rc = main(["quantize", str(source_model("llama")), str(out), "--device", "cpu", "-q", *args])
    err = capsys.readouterr().err
    assert rc != 0 and len(err.strip().splitlines()) == 1 and says in err and "Traceback" not in err, err
    assert not out.exists()


def test_llm_compressor_fp4_names_are_the_schemes(source_model, tmp_path):
    src = source_model("llama")
    a = run_quantize(src, tmp_path / "a", scheme="NVFP4A16")
    assert a.scheme == "nvfp4a16"
    assert read_json(tmp_path / "a" / "config.json")["quantization_config"]["format"] == "nvfp4-pack-quantized"


def test_an_fp8_source_converts_to_fp4_in_one_pass_and_verifies(source_model, tmp_path):
    fp8 = tmp_path / "fp8"
    run_quantize(source_model("llama"), fp8, scheme="channel")
    out = tmp_path / "fp4"
    run_quantize(fp8, out, scheme="nvfp4a16")
    assert read_json(out / "config.json")["quantization_config"]["format"] == "nvfp4-pack-quantized"
    report = verify(fp8, out, device="cpu")
    assert report.ok and report.tensors_quantized >= 14, report.problems[:3]


@pytest.mark.parametrize("scheme", FP4)
def test_worker_splits_and_a_resumed_run_give_the_bytes_of_one_process(source_model, tmp_path, scheme):
    """Two workers then finalize, and one worker's half finished by a plain rerun (resume), write what one
    process writes: fused sets and their global scales never depend on how the work is split."""
    from tiny_ckpt import tree_bytes

    from fp8convert import api

    src = source_model("qwen3_moe")
    one = tmp_path / "one"
    api.quantize(src, one, scheme=scheme, device="cpu", max_shard_size="150KB")
    reference = tree_bytes(one)
    split = tmp_path / "split"
    for k in range(2):
        api.quantize(src, split, scheme=scheme, device="cpu", max_shard_size="150KB", worker=f"{k}/2", finalize=False)
    api.finalize_output(split)
    assert tree_bytes(split) == reference
    resumed = tmp_path / "resumed"
    api.quantize(src, resumed, scheme=scheme, device="cpu", max_shard_size="150KB", worker="1/2", finalize=False)
    report = api.quantize(src, resumed, scheme=scheme, device="cpu", max_shard_size="150KB")
    assert report.complete and 0 < report.shards_written < len(list(one.glob("*.safetensors")))
    assert tree_bytes(resumed) == reference


@pytest.mark.parametrize("scheme", FP4)
@pytest.mark.parametrize(("where", "kind"), SUBJECTS[1:3], ids=SUBJECT_IDS[1:3])
def test_an_fp4_checkpoint_dequantizes_to_compressed_tensors_decode_and_verifies(
    fp4_output, tmp_path, capsys, where, kind, scheme
):
    """`dequantize` reads an FP4 checkpoint (fp8convert's, laid out as llm-compressor's): every weight
    is compressed-tensors' decode rounded once to BF16, the rest copied; verify holds each element to it;
    quantize refuses the source in one line."""
    src, out = fp4_output(where, kind, scheme)
    deq = tmp_path / "bf16"
    fp8convert.dequantize(out, deq, device="cpu")
    fp4_tensors, bf16 = read_safetensors_dir(out), read_safetensors_dir(deq)
    modules = fp4_modules(fp4_tensors)
    assert not any(k.endswith(("_packed", "_scale")) for k in bf16)
    for m in modules:
        assert torch.equal(bf16[f"{m}.weight"], ct_decode(fp4_tensors, m, scheme)), m
    for name, t in read_safetensors_dir(src).items():
        if name.removesuffix(".weight") not in modules:
            assert torch.equal(bf16[name], t), name
    assert "quantization_config" not in read_json(deq / "config.json")
    assert verify(out, deq, device="cpu").ok
    tamper(deq, f"{modules[0]}.weight", lambda w: w.index_put_((torch.tensor([0]),), w[0] * 2 + 1))
    report = verify(out, deq, device="cpu")
    assert not report.ok and any(str(p).startswith(f"{modules[0]}.weight:") for p in report.problems)
    rc = main(["quantize", str(out), str(tmp_path / "again"), "--device", "cpu", "-q"])
    err = capsys.readouterr().err
    assert rc != 0 and f"holds FP4 ({scheme}) weights" in err and len(err.strip().splitlines()) == 1, err


def test_an_fp4_source_with_a_nan_scale_is_refused_naming_it(fp4_output, tmp_path):
    import shutil

    _, good = fp4_output("tiny", "llama", "nvfp4a16")
    src = tmp_path / "src"
    shutil.copytree(good, src)
    name = "model.layers.1.mlp.up_proj.weight_global_scale"
    tamper(src, name, lambda g: g * float("nan"))
    with pytest.raises(fp8convert.FP8ConvertError, match=r"model.layers.1.mlp.up_proj.weight_scale \(or its global"):
        fp8convert.dequantize(src, tmp_path / "out", device="cpu")
    assert not (tmp_path / "out" / "config.json").exists()
