"""The Blackwell layouts: MXFP8 (`--scheme mxfp8`, compressed-tensors mxfp8-quantized) and power-of-two
block scales (`--scale-format ue8m0`, both formats).

- the numerics against tests/support/reference.py (an independent, loop-based implementation), bit for bit,
  on both code paths (the CPU one, tiled, and the one made for CUDA, both run here on the CPU), at the
  edges of the exponent rule (amax exactly 1.75 * 2^k, subnormal, huge, all-zero groups) and on every
  architecture of the zoo;
- the exponent rule against the rules in use: vLLM's own quantizer, exhaustively over bf16, and
  compressed-tensors', which differs exactly at amax = 1.75 * 2^k;
- experts cut from fused 3-D tensors with MXFP8 scales, end to end;
- configs, refusals, verify's exact checks, inspect's load table and TP limits, resume, finalize, the
  model card, batch jobs; transformers loading (slow) where the README's table says it can, and
  failing where it says it cannot.
The MXFP8 conversions of every tiny model and zoo architecture (bytes, verify, ignore lists, vLLM's
loader contract, transformers) run with the other schemes: it is in harness.FORMAT_SCHEMES.
"""

from __future__ import annotations

import json
import shutil

import pytest
import reference as R
import torch
import zoo
from checks import assert_codes_and_scales, assert_names_shapes_dtypes, same_bytes
from harness import cases_in_turn, fp8convert_module, read_json, read_safetensors_dir, run_quantize
from mxfp8_inputs import edge_groups, wide_experts
from tiny_ckpt import llama_tensors, tree_bytes, write_checkpoint
from zoo import MORE_ARCHS, ZOO_ARCHS

from fp8convert.cli import main
from fp8convert.run import numerics
from fp8convert.verify import verify

FP8 = torch.float8_e4m3fn
CT = "compressed-tensors"
MIN_COSINE = 0.99


def as_u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ------------------------------------------------------------------ the exponent rule


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mxfp8_edges_match_the_reference(dtype):
    w = edge_groups(dtype)
    (codes,), (scales,) = numerics.quantize_group([w], "mxfp8")
    assert scales.dtype == torch.uint8 and scales.shape == (2, 6, 2)
    for n in range(2):
        want_codes, want_bytes = R.quantize(w[n], "mxfp8")
        assert torch.equal(as_u8(codes[n]), as_u8(want_codes)), n
        assert torch.equal(scales[n], want_bytes), (n, scales[n], want_bytes)
    q = codes.float()
    assert not q.isnan().any() and q.abs().max() <= 448
    if dtype == torch.bfloat16:  # the edges themselves, in numbers
        assert scales[0, 0, 0] == 127 - 12 and q[0, 0, 5] == 448  # 1.75 * 2^-4 = 448 * 2^-12: full range
        assert scales[0, 0, 1] == 127 - 5 and q[0, 0, 39] == -448
        assert scales[0, 1, 0] == 0 and not q[0, 1, :32].any()  # zero group
        assert scales[0, 1, 1] == 127 - 12 and q[0, 1, 40] == 448  # 446 rounds to 448, never over
        assert scales[0, 2, 0] == 127 - 11 and q[0, 2, 3] == 224  # just above: one exponent up
        assert scales[0, 3, 0] == 0 and q[0, 3, 9] == 0.5  # subnormal amax 2^-128: the lowest exponent
        assert scales[0, 4, 1] == 127 + 120 and q[0, 4, 33] == 240  # 240 * 2^120: finite
        assert scales[0, 5, 0] == 127 and q[0, 5, 0] == 448
    if dtype == torch.float32:  # the exact rule: one exponent up, not a code clipped to 448
        assert scales[1, 4, 0] == 127 - 9


def test_mxfp8_exponent_is_vllms_rule_and_differs_from_compressed_tensors_only_at_1_75():
    """Over every positive finite bf16 amax: the bytes equal vLLM's own MXFP8 quantizer's
    (`_mxfp8_e4m3_quantize_torch`: ceil(log2(amax / 448)) + 127, clamped to [0, 254]); compressed-tensors'
    rule (`generate_mx_scales`) picks one more exactly where the significand is 1.75, and nowhere else
    where its result is finite (it is not for some subnormal and the largest amax, where it clamps)."""
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16)
    amax = bits.view(torch.bfloat16)
    ours = numerics.mx_scale_bytes(amax.float()).int()
    vllm = (torch.ceil(torch.log2(amax.float().clamp(min=torch.finfo(torch.float32).tiny) / 448)) + 127).clamp(0, 254)
    assert torch.equal(ours, vllm.int())
    ct = generate_mx_scales(amax, 8).float()
    finite = torch.isfinite(ct)
    ct = ct.clamp(0, 254).int()
    at_1_75 = (bits & 0x7F) == 0x60
    assert torch.equal(ct[finite & ~at_1_75], ours[finite & ~at_1_75])
    inside = finite & at_1_75 & (ours > 0)
    assert inside.sum() > 200 and torch.equal(ct[inside], ours[inside] + 1)
    assert finite.sum() > amax.numel() - 200
    # and the reference's exact search agrees on a spread of them (it is slow: loops in Python)
    pick = torch.arange(0, amax.numel(), 97)
    assert [R.smallest_exponent(a) + 127 for a in amax.float()[pick].tolist()] == ours[pick].tolist()


def test_ue8m0_block_scales_match_the_reference():
    """Block scales rounded up to powers of two: amax exactly 448 * 2^k keeps 2^k; a block under 1e-4
    (and an all-zero one) gets DeepGEMM's floor 2^-22; partial edge blocks."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 300, 200, generator=g) * torch.tensor([0.01, 1.0, 30.0]).view(3, 1, 1)
    w[0, :128, :128] = 0.0
    w[0, 128:256, :128] *= 1e-6
    w[1, :128, :128] = w[1, :128, :128].clamp(-1, 1)
    w[1, 3, 3] = 448.0 * 2.0**-3
    w = w.to(torch.bfloat16)
    (codes,), (scales,) = numerics.quantize_group([w], "block", scale_format="ue8m0")
    for n in range(3):
        want_codes, want_scales = R.quantize(w[n], "block", scale_format="ue8m0")
        assert torch.equal(as_u8(codes[n]), as_u8(want_codes)), n
        assert torch.equal(scales[n], want_scales), n
    assert scales[0, 0, 0] == scales[0, 1, 0] == 2.0**-22 and not codes[0, :128, :128].float().any()
    assert scales[1, 0, 0] == 2.0**-3 and codes[1, 3, 3].float() == 448
    mantissa, _ = torch.frexp(scales)
    assert (mantissa == 0.5).all()
    assert codes.float().abs().max() <= 448


def test_e8m0_bytes_decode_exactly_and_dequantize_mxfp8():
    """The pure functions a dequantize path calls: byte b means 2^(b - 127) (0 is the subnormal 2^-127,
    255 is E8M0's NaN); MXFP8 codes dequantize to code * 2^(b - 127), group by group, as the reference."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = numerics.e8m0_to_float(b)
    assert v.dtype == torch.float32
    assert [v[i].item() for i in (0, 1, 126, 127, 128, 254)] == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(v[255])
    assert torch.equal(v[:255], torch.tensor([2.0 ** (i - 127) for i in range(255)], dtype=torch.float32))
    w = edge_groups(torch.bfloat16)[1]
    codes, scale_bytes = R.quantize(w, "mxfp8")
    got = numerics.dequantize(codes, scale_bytes, "mxfp8")
    assert torch.equal(got, R.dequant(codes, scale_bytes, "mxfp8"))
    err = (got - w.float()).abs()
    assert (
        err
        <= torch.maximum(
            w.float().abs() * 2.0**-4,
            numerics.expand_scale(numerics.e8m0_to_float(scale_bytes), tuple(w.shape), "mxfp8") * 2.0**-10,
        )
    ).all()


# ------------------------------------------------------------------ every architecture of the zoo


WIDE = ("llama4", "qwen3_vl_moe", "granitemoe", "gemma4")  # transposed, released [E, H, 2I], out_in, out_in


@pytest.fixture(scope="module")
def wide_zoo(tmp_path_factory):
    cache: dict = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = zoo.make(
                arch, tmp_path_factory.mktemp(f"wide-{arch}") / "model", config_overrides=wide_experts(arch)
            )
        return cache[arch]

    return get


def batch_outputs(src, scheme: str, scale_format: str) -> dict[str, torch.Tensor]:
    """Every quantized output and scale of the plan, made by quantize_steps."""
    from fp8convert.plan.batches import make_batches
    from fp8convert.run.quantizer import quantize_steps, read_order
    from fp8convert.run.reader import BatchReader

    plan = fp8convert_module().make_plan(str(src), scheme=scheme, scale_format=scale_format)
    names = {n for t in plan.tensors if t.quantize for n in (t.name, t.scale_name)}
    out = {}
    with BatchReader(plan.source.root, torch.device("cpu"), threads=2) as reader:
        for batch in make_batches(plan.units, 1 << 30):
            buf, offsets = reader.read(read_order(batch))
            for step in quantize_steps(batch, buf, offsets, scale_format=scale_format):
                for name, tensor, _ in step:
                    if name in names:
                        out[name] = tensor.clone()
    return out


LAYOUTS = [("mxfp8", "float"), ("block", "ue8m0")]
LAYOUT_ARGS, LAYOUT_IDS = [(s, f, False) for s, f in LAYOUTS], [f"{s}-{f}" for s, f in LAYOUTS]
# The fast loop takes each of ZOO_ARCHS in one layout, two of the four fused expert layouts, none of MORE_ARCHS.
ZOO_CASES = (
    cases_in_turn(ZOO_ARCHS, LAYOUT_ARGS, LAYOUT_IDS)
    + cases_in_turn(MORE_ARCHS, LAYOUT_ARGS, LAYOUT_IDS, per_subject=0)
    + [
        pytest.param(
            a,
            "mxfp8",
            "float",
            True,
            id=f"{a}-wide-mxfp8",
            marks=() if a in ("llama4", "granitemoe") else pytest.mark.slow,
        )
        for a in WIDE
    ]
)


@pytest.mark.parametrize("arch,scheme,scale_format,wide", ZOO_CASES)
def test_every_zoo_architecture_bit_exact(arch, scheme, scale_format, wide, zoo_source, wide_zoo):
    """Codes and scales of every quantized weight (experts cut from fused tensors included, through strided
    expert views and whole stacks) equal the reference's."""
    src = wide_zoo(arch) if wide else zoo_source(arch)
    exp, quant = R.expected_outputs(
        read_safetensors_dir(src),
        CT,
        scheme,
        arch=arch,
        config=read_json(src / "config.json"),
        scale_format=scale_format,
    )
    want = {k: exp[k] for n in quant for k in (n, n + "_scale")}
    got = batch_outputs(src, scheme, scale_format)
    assert sorted(got) == sorted(want)
    wrong = [n for n in want if not same_bytes(got[n], want[n])]
    assert not wrong, f"{len(wrong)} outputs differ from the reference: {wrong[:4]}"
    if wide:
        assert any(".experts.3." in n for n in quant), "the wide experts were not quantized"


@pytest.mark.parametrize("arch", ["llama4", "granitemoe"])  # [E, in, out] transposed, and [E, out, in]
def test_mxfp8_experts_cut_from_fused_tensors_end_to_end(arch, wide_zoo, tmp_path):
    """Per-expert MXFP8 weights from fused 3-D tensors: bytes as the reference, verify passes, every
    expert has its own [out, in/32] exponents, and the fused tensors are gone. (All four fused layouts'
    numerics: test_every_zoo_architecture_bit_exact.)"""
    src = wide_zoo(arch)
    out = tmp_path / "out"
    run_quantize(src, out, scheme="mxfp8")
    got = read_safetensors_dir(out)
    exp, quant = R.expected_outputs(
        read_safetensors_dir(src), CT, "mxfp8", arch=arch, config=read_json(src / "config.json")
    )
    assert_names_shapes_dtypes(got, exp)
    assert_codes_and_scales(got, exp, quant)
    gate = [n for n in quant if n.endswith(".gate_proj.weight") and ".experts." in n]
    assert len(gate) >= zoo.N_EXPERTS
    scales = [got[n + "_scale"] for n in gate]
    assert all(s.dtype == torch.uint8 and tuple(s.shape) == (96, zoo.HIDDEN // 32) for s in scales)
    assert len({bytes(as_u8(s).numpy()) for s in scales}) == len(scales)  # each expert its own
    report = verify(src, out)
    assert report.ok, report.failures[:3]


def test_zoo_moe_experts_whose_width_is_not_a_multiple_of_32_stay_whole(zoo_source, zoo_converted):
    """The zoo's experts are 48 wide: MXFP8 cannot take their down_proj (in = 48), so each MoE layer
    keeps every expert, with the reason; fused expert tensors stay as released (not split into BF16
    pieces), and the layer is named as a whole in the ignore list."""
    plan = fp8convert_module().make_plan(str(zoo_source("qwen3_moe")), scheme="mxfp8")
    reasons = {t.name: t.reason for t in plan.tensors}
    assert reasons["model.layers.0.mlp.experts.0.down_proj.weight"] == "MXFP8: input dim (48) not divisible by 32"
    assert "fused with" in reasons["model.layers.0.mlp.experts.0.gate_proj.weight"]
    assert reasons["model.layers.0.self_attn.q_proj.weight"] is None
    assert any("kept every expert of model.layers.0.mlp.experts" in n for n in plan.notes)
    src = zoo_source("granitemoe")
    out, _ = zoo_converted("granitemoe", CT, "mxfp8")
    got = read_safetensors_dir(out)
    fused = "model.layers.0.block_sparse_moe.input_linear.weight"
    assert same_bytes(got[fused], read_safetensors_dir(src)[fused])
    assert not any(".experts." in n for n in got)
    ignore = read_json(out / "config.json")["quantization_config"]["ignore"]
    assert r"re:^(model\.layers\.0\.block_sparse_moe\.experts)(\.|$)" in ignore


# ------------------------------------------------------------------ tiny models: UE8M0 end to end


UE8M0_CASES = [pytest.param(k, f, id=f"{k}-{f}") for k in ("llama", "qwen3", "deepseek_v3") for f in (CT, "fp8")]


@pytest.mark.parametrize("kind,fmt", UE8M0_CASES)
def test_ue8m0_converts_exactly_and_says_so(kind, fmt, converted, source_tensors):
    out = converted(kind, fmt, "block", scale_format="ue8m0")
    got = read_safetensors_dir(out)
    exp, quant = R.expected_outputs(source_tensors(kind), fmt, "block", scale_format="ue8m0")
    assert_names_shapes_dtypes(got, exp)
    assert_codes_and_scales(got, exp, quant)
    suffix = "_scale_inv" if fmt == "fp8" else "_scale"
    scales = torch.cat([got[n + suffix].flatten() for n in quant])
    assert scales.dtype == torch.float32 and (torch.frexp(scales)[0] == 0.5).all()  # float32 powers of two
    qc = read_json(out / "config.json")["quantization_config"]
    plain = read_json(converted(kind, fmt, "block") / "config.json")["quantization_config"]
    assert qc.pop("scale_fmt") == "ue8m0" and qc == plain  # the one difference from --scale-format float
    if fmt == CT:  # compressed-tensors' schema has no field for it, and ignores the top-level key
        from compressed_tensors import QuantizationConfig

        QuantizationConfig.model_validate({**qc, "scale_fmt": "ue8m0"})


def vllm_ue8m0_requant(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM 0.33 does to float32 block scales when DeepGEMM's UE8M0 mode is on, restated from
    `requant_weight_ue8m0_inplace` (model_executor/layers/quantization/utils/fp8_utils.py) and
    `per_block_cast_to_fp8(use_ue8m0=True)` (utils/deep_gemm.py): dequantize with the stored scales,
    then per 128x128 block amax clamped at 1e-4, sf = 2^ceil(log2(amax / 448)), codes (w * (1 / sf))."""
    m, k = q.shape
    w = q.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:m, :k]
    padded = torch.zeros(-(-m // 128) * 128, -(-k // 128) * 128)
    padded[:m, :k] = w
    view = padded.view(-1, 128, padded.size(1) // 128, 128)
    sf = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4) / 448.0
    sf = torch.pow(2.0, torch.ceil(torch.log2(sf.abs())))
    codes = (view * (1.0 / sf)).to(FP8).view_as(padded)[:m, :k]
    return codes, sf.view(view.size(0), view.size(2))


@pytest.mark.parametrize("kind", ["llama", "qwen3", "deepseek_v3"])
def test_vllms_ue8m0_rerounding_changes_no_value_of_ours(kind, converted):
    """Power-of-two scales leave DeepGEMM's load-time re-rounding nothing to change in value; float
    amax / 448 scales of the same weights do change (the extra error this option avoids)."""
    ours = read_safetensors_dir(converted(kind, "fp8", "block", scale_format="ue8m0"))
    plain = read_safetensors_dir(converted(kind, "fp8", "block"))
    moved = []
    for name, q in ours.items():
        if q.dtype != FP8:
            continue
        s = ours[name + "_scale_inv"]
        codes, sf = vllm_ue8m0_requant(q, s)
        assert torch.equal(R.dequant(codes, sf, "block"), R.dequant(q, s, "block")), name
        p, ps = plain[name], plain[name + "_scale_inv"]
        before = R.dequant(p, ps, "block")
        moved.append(((R.dequant(*vllm_ue8m0_requant(p, ps), "block") - before).norm() / before.norm()).item())
    assert len(moved) >= 8 and max(moved) > 0.01  # about 2.5-3.5 % per tensor here


@pytest.mark.parametrize("kind,fmt", UE8M0_CASES)
def test_ue8m0_output_verifies(kind, fmt, converted, source_model):
    report = verify(source_model(kind), converted(kind, fmt, "block", scale_format="ue8m0"))
    assert report.ok, report.failures[:3]
    assert report.scheme == "block" and all(t.off_rule_scales == 0 and t.inexact_codes == 0 for t in report.tensors)


# ------------------------------------------------------------------ options and refusals


@pytest.mark.parametrize(
    "args,words",
    [
        (
            ["--format", "fp8", "--scheme", "mxfp8"],
            ["--format fp8 has no MXFP8", "--format compressed-tensors --scheme mxfp8"],
        ),
        (["--scheme", "tensor", "--scale-format", "ue8m0"], ["--scale-format ue8m0 applies to --scheme block"]),
        (["--scheme", "mxfp8", "--scale-format", "ue8m0"], ["MXFP8 scales are powers of two already"]),
        (["--scheme", "block", "--scale-format", "e8m0"], ["--scale-format 'e8m0': expected one of float, ue8m0"]),
    ],
)
def test_bad_combinations_are_refused_in_one_line(args, words, tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    for command in (["quantize", str(src), str(tmp_path / "out")], ["inspect", str(src)]):
        rc = main([*command, *args])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert rc != 0 and len(lines) == 1 and "Traceback" not in err, err
        assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "out").exists()


def test_batch_jobs_take_the_scale_format(tmp_path):
    from fp8convert.cluster.batch import read_jobs
    from fp8convert.errors import FP8ConvertError

    jobs = tmp_path / "jobs.toml"
    jobs.write_text(
        '[[job]]\nsource = "a"\nout = "b"\nscheme = "block"\nscale_format = "ue8m0"\n'
        '[[job]]\nsource = "c"\nout = "d"\nscheme = "mxfp8"\n'
    )
    first, second = read_jobs(jobs)
    assert first.settings.options.scale_format == "ue8m0" and second.settings.options.scheme == "mxfp8"
    jobs.write_text('[[job]]\nsource = "a"\nout = "b"\nscale_format = "ue8m0"\n')
    with pytest.raises(FP8ConvertError, match="job.*: scale_format ue8m0 applies to scheme block"):
        read_jobs(jobs)


# ------------------------------------------------------------------ verify: exact checks


@pytest.fixture(scope="module")
def mx_made(tmp_path_factory):
    """A llama-named source with a partial 128-block (inter 320) and its MXFP8 and fp8 UE8M0 conversions."""
    base = tmp_path_factory.mktemp("mxverify")
    src = write_checkpoint(base / "src", llama_tensors(inter=320))
    outs = {}
    for name, args in (
        ("mx", ["--scheme", "mxfp8"]),
        ("ue8m0", ["--scheme", "block", "--format", "fp8", "--scale-format", "ue8m0"]),
    ):
        assert main(["quantize", str(src), str(base / name), "-q", *args]) == 0
        outs[name] = base / name
    return src, outs


Q = "model.layers.1.self_attn.q_proj.weight"
SHARD = "model-00001-of-00001.safetensors"


def rewrite(out, name, change) -> None:
    """Replace tensor `name` by change(tensor) in OUT's only shard (dtype and shape may change)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / SHARD))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(out / SHARD), metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["metadata"]["total_size"] = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "args",
    [
        ["--scheme", "mxfp8"],
        ["--scheme", "block", "--scale-format", "ue8m0"],
        ["--format", "fp8", "--scheme", "block", "--scale-format", "ue8m0"],
    ],
)
def test_values_whose_power_of_two_codes_would_read_back_as_inf_are_refused(args, tmp_path, capsys):
    """At 248 * 2^120 and above, a power-of-two scale (2^120) rounds the largest value to code 256, and
    256 * 2^120 = 2^128 is Inf in float32: refused by name. One BF16 step below, code 240 reads back
    finite, and the output verifies."""
    name = "model.layers.1.mlp.up_proj.weight"
    for bits, rc in ((0x7F77, 0), (0x7F78, 1)):
        tensors = llama_tensors()
        tensors[name].view(torch.int16)[5, 7] = bits
        src = write_checkpoint(tmp_path / f"src{bits:x}", tensors)
        out = tmp_path / f"out{bits:x}"
        assert main(["quantize", str(src), str(out), "--device", "cpu", "-q", *args]) == rc
        err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning: ")]
        if rc:
            assert len(err) == 1 and f"tensor {name} holds values within 3% of float32's maximum" in err[0], err
            assert not (out / "config.json").exists()
        else:
            report = verify(src, out)
            assert report.ok, report.failures[:3]
            assert float(read_safetensors_dir(out)[name][5, 7].float()) == 240  # times 2^120: finite


def test_quantize_group_refuses_the_overflow():
    w = torch.zeros(2, 128, 128, dtype=torch.bfloat16)
    w[1, 3, 4] = torch.tensor(numerics.POW2_OVERFLOW_AMAX).to(torch.bfloat16)
    assert float(w[1, 3, 4]) == numerics.POW2_OVERFLOW_AMAX  # exactly representable in BF16
    for scheme, fmt in (("mxfp8", "float"), ("block", "ue8m0")):
        with pytest.raises(numerics.NonFiniteWeight) as caught:
            numerics.quantize_group([w[:1], w], scheme, fmt)
        assert (caught.value.member, caught.value.index, caught.value.overflows) == (1, 1, True)
    codes, _ = numerics.quantize_group([w], "block")  # float scales: code 448, finite
    assert codes[0].float().abs().max() == 448


def test_verify_passes_mxfp8_and_ue8m0_with_exact_checks(mx_made):
    src, outs = mx_made
    for name, scheme in (("mx", "mxfp8"), ("ue8m0", "block")):
        report = verify(src, outs[name])
        assert report.ok, report.failures[:3]
        assert report.scheme == scheme and report.tensors_quantized == 14
        assert all(
            t.ok and t.off_rule_scales == 0 and t.inexact_codes == 0 and 0 < t.rel_error < 2.0**-4
            for t in report.tensors
        )


@pytest.mark.parametrize(
    "damage,what",
    [
        # one exponent one too high: codes re-rounded to it stay near w / scale, but the rule catches it
        ("exponent+1", "not the smallest power of two that fits their group"),
        ("exponent-1", "not the smallest power of two"),  # codes would overflow 448: the rule, the bound
        ("byte 255", "not finite and positive"),  # E8M0's NaN
        ("tie to odd", "not the round-to-nearest-even"),  # half a step off: only the exact check sees it
        ("scale F32", "expected U8 [64, 2]"),  # MXFP8 scales as float32 values: vLLM wants uint8
        ("byte 254", "not the smallest power of two"),  # 2^127: its codes read back as Inf
    ],
)
def test_verify_catches_damaged_mxfp8(damage, what, mx_made, tmp_path):
    src, outs = mx_made
    out = tmp_path / "out"
    shutil.copytree(outs["mx"], out)
    if damage.startswith("exponent"):
        step = 1 if damage.endswith("+1") else -1

        def change(t):
            t = t.clone()
            t[3, 1] += step
            return t

        rewrite(out, Q + "_scale", change)
        if step == 1:  # requantize that group's codes to the wrong exponent, so only the rule can tell
            from safetensors.torch import load_file

            w = load_file(str(src / "model-00002-of-00003.safetensors"))[Q].float()
            scale = numerics.e8m0_to_float(load_file(str(out / SHARD))[Q + "_scale"][3, 1])

            def requant(q):
                q = q.clone()
                q[3, 32:64] = (w[3, 32:64] / scale).clamp(-448, 448).to(FP8)
                return q

            rewrite(out, Q, requant)
    elif damage.startswith("byte"):
        byte = int(damage.split()[1])
        rewrite(
            out,
            Q + "_scale",
            lambda t: torch.where(torch.arange(t.numel()).view(t.shape) == 5, torch.tensor(byte, dtype=torch.uint8), t),
        )
    elif damage == "tie to odd":
        rewrite(out, Q, lambda q: tie_to_odd(q, src, out))
    else:
        rewrite(out, Q + "_scale", lambda t: numerics.e8m0_to_float(t))
    report = verify(src, out)
    assert not report.ok
    mine = [f for f in report.failures if f.startswith(Q)]
    assert len(mine) == 1 and what in mine[0], report.failures
    assert len(report.failures) == 1, report.failures
    check = next(t for t in report.tensors if t.name == Q) if damage != "scale F32" and damage != "byte 255" else None
    if damage == "tie to odd":  # within half a step: the tolerant check alone would have passed it
        assert check.inexact_codes == 1 and check.off_grid == 0 and check.off_rule_scales == 0
    if damage == "exponent+1":  # codes rounded to the wrong exponent: every other check passes
        assert check.off_rule_scales == 1 and check.off_grid == 0 and check.inexact_codes == 0
        assert check.rel_error <= check.bound


def tie_to_odd(q: torch.Tensor, src, out) -> torch.Tensor:
    """The codes with one exact tie (w / scale halfway between two e4m3 values) rounded to the odd
    neighbour instead of the even one."""
    from safetensors.torch import load_file

    w = load_file(str(src / "model-00002-of-00003.safetensors"))[Q].float()
    scale = numerics.e8m0_to_float(load_file(str(out / SHARD))[Q + "_scale"]).repeat_interleave(32, dim=-1)
    x, qf, bits = w / scale, q.float(), q.view(torch.uint8).to(torch.int32)
    other = (bits + torch.where(x.abs() > qf.abs(), 1, -1)).to(torch.uint8).view(FP8).float()
    ties = ((x - qf).abs() == (x - other).abs()) & (qf != 0) & (qf.abs() < 448)
    assert ties.any(), "no exact tie in this weight"
    r, c = [int(i) for i in ties.nonzero()[0]]
    q = q.clone()
    q[r, c] = torch.tensor(other[r, c].item()).to(FP8)
    return q


def test_verify_catches_a_ue8m0_scale_that_is_not_a_power_of_two(mx_made, tmp_path):
    """Under scale_fmt ue8m0 a block scale must be the power of two the rule gives; amax / 448 itself
    (with codes made from it, so every code is the nearest) fails, and without scale_fmt it passes."""
    src, outs = mx_made
    out = tmp_path / "out"
    shutil.copytree(outs["ue8m0"], out)
    from safetensors.torch import load_file

    w = load_file(str(src / "model-00002-of-00003.safetensors"))[Q]
    codes, scale = R.quantize(w, "block")  # float scales: amax / 448
    rewrite(out, Q, lambda q: codes)
    rewrite(out, Q + "_scale_inv", lambda s: scale)
    report = verify(src, out)
    assert not report.ok and len(report.failures) == 1
    assert (
        report.failures[0].startswith(Q) and "not the smallest power of two that fits their block" in report.failures[0]
    )
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]["scale_fmt"]
    (out / "config.json").write_text(json.dumps(config))
    assert verify(src, out).ok


# ------------------------------------------------------------------ inspect: load table, kept, TP


def test_inspect_says_who_loads_mxfp8_and_ue8m0_on_which_gpus(source_model, capsys, tmp_path):
    dense, moe = source_model("llama"), source_model("qwen3_moe")
    assert main(["inspect", str(dense), "--scheme", "mxfp8", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["scheme"] == "mxfp8" and info["quantized"]["tensors"] == 14
    assert [w for w in info["warnings"] if "tensor-parallel" not in w] == []  # hidden 128: 16 per rank at TP 8
    assert "MXFP8 GEMMs on Blackwell (SM100" in info["loads"]["vLLM"] and "Hopper" in info["loads"]["vLLM"]
    assert "at some tensor-parallel sizes only" in info["loads"]["vLLM"]
    assert info["loads"]["transformers"].startswith("yes") and info["transformers_cannot_load"] is None
    assert main(["inspect", str(moe), "--scheme", "mxfp8"]) == 0
    text = capsys.readouterr().out
    assert "loads       transformers: no: transformers cannot load MXFP8 MoE experts" in text
    from fp8convert.plan.summary import compatibility_warnings

    caveats = {w.caveat.value for w in compatibility_warnings(fp8convert_module().make_plan(str(moe), scheme="mxfp8"))}
    assert "transformers-cannot-load" in caveats
    tensors = llama_tensors(hidden=256, inter=512)  # every block GEMM shape vLLM takes (k/v 128 rows)
    for n in list(tensors):
        if n.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[n] = torch.randn(128, 256).to(torch.bfloat16)
    blocks = write_checkpoint(tmp_path / "blocks", tensors)
    for fmt in (CT, "fp8"):
        assert (
            main(
                [
                    "inspect",
                    str(blocks),
                    "--scheme",
                    "block",
                    "--format",
                    fmt,
                    "--scale-format",
                    "ue8m0",
                    "--target-tp",
                    "1",
                    "--json",
                ]
            )
            == 0
        )
        info = json.loads(capsys.readouterr().out)
        assert info["scale_format"] == "ue8m0" and not info["warnings"], info["warnings"]
        assert info["loads"]["vLLM"].startswith("yes") and "DeepGEMM (SM90, SM100, SM120)" in info["loads"]["vLLM"]
        assert info["loads"]["transformers"].startswith("yes")


def test_mxfp8_tensor_parallel_limits():
    """vLLM allocates in_per_rank // 32 exponents per row: row-parallel inputs and the experts'
    intermediate size must stay multiples of 32 per rank; output splits never matter."""
    from types import SimpleNamespace

    from fp8convert.plan.family import Caveat
    from fp8convert.plan.parallel import tp_warnings

    def t(name, shape):
        return SimpleNamespace(name=name, shape=shape)

    quantized = [
        t("model.layers.0.self_attn.q_proj.weight", (1344, 1344)),
        t("model.layers.0.self_attn.o_proj.weight", (1344, 1344)),
        t("model.layers.0.mlp.experts.0.gate_proj.weight", (1408, 1344)),
        t("model.layers.0.mlp.experts.0.down_proj.weight", (1344, 1408)),
    ]
    warnings = tp_warnings(quantized, {"hidden_size": 1344}, CT, "mxfp8", (1, 2, 4, 8))
    texts = {w.text.split(" across")[0]: w for w in warnings}
    o = texts["vLLM splits the input size 1344 of model.layers.*.self_attn.o_proj"]
    assert "per-rank size not a multiple of 32 (MXFP8 groups) at TP 4, 8 (336, 168 per rank)" in o.text
    assert "it loads at TP 1, 2" in o.text and "--scheme channel" in o.text and o.caveat is Caveat.VLLM_TP_LIMITS
    e = texts["vLLM splits the expert intermediate size 1408 of model.layers.*.mlp.experts"]
    assert "at TP 8 (176 per rank)" in e.text and "it loads at TP 1, 2, 4" in e.text
    assert not any("q_proj" in w.text for w in warnings)  # an output split: any size that divides


def test_the_card_describes_the_layout_and_reproduces_it(converted):
    card = (converted("llama", "fp8", "block", scale_format="ue8m0") / "README.md").read_text()
    assert (
        "power-of-two (UE8M0) scale per 128x128" in card and "--scheme block --format fp8 --scale-format ue8m0" in card
    )
    card = (converted("llama", CT, "mxfp8") / "README.md").read_text()
    assert "MXFP8: one power-of-two scale per 32 consecutive inputs" in card and "--scheme mxfp8" in card
    assert "--scale-format" not in card


# ------------------------------------------------------------------ resume and finalize


def test_mxfp8_resumes_and_finalizes_to_the_bytes_of_one_run(tmp_path, capsys):
    """Worker 0 of 2 writes its shards and stops; a plain rerun finishes the rest (resume). The same
    with two workers and `finalize` (the manifest carries the scale format). A rerun with another scale
    format is refused, naming it."""
    src = write_checkpoint(tmp_path / "src", llama_tensors(layers=4))
    args = ["--max-shard-size", "20KB", "-q"]
    for scheme in (["--scheme", "mxfp8"], ["--scheme", "block", "--scale-format", "ue8m0"]):
        ref, part, split = (tmp_path / f"{n}-{scheme[1]}" for n in ("ref", "part", "split"))
        assert main(["quantize", str(src), str(ref), *scheme, *args]) == 0
        reference = tree_bytes(ref)
        assert sum(n.startswith("model-") for n in reference) >= 4
        assert main(["quantize", str(src), str(part), *scheme, *args, "--worker", "0/2"]) == 0
        assert not (part / "config.json").exists()
        assert main(["quantize", str(src), str(part), *scheme, *args]) == 0
        assert tree_bytes(part) == reference
        for k in (0, 1):
            fp8convert_module().quantize(
                str(src),
                str(split),
                scheme=scheme[1],
                max_shard_size="20KB",
                scale_format=scheme[-1] if "ue8m0" in scheme else "float",
                worker=f"{k}/2",
                finalize=False,
                progress=False,
            )
        assert main(["finalize", str(split)]) == 0
        got = tree_bytes(split)
        assert {n: d for n, d in got.items() if "manifest" not in n} == {
            n: d for n, d in reference.items() if "manifest" not in n
        }
    capsys.readouterr()
    partial = tmp_path / "partial"
    assert main(["quantize", str(src), str(partial), "--scheme", "block", *args, "--worker", "0/2"]) == 0
    rc = main(["quantize", str(src), str(partial), "--scheme", "block", "--scale-format", "ue8m0", *args])
    err = capsys.readouterr().err
    assert rc != 0 and "--scale-format was 'float', now 'ue8m0'" in err, err


# ------------------------------------------------------------------ transformers (CPU)


@pytest.mark.slow
@pytest.mark.parametrize("kind,fmt", [("llama", CT), ("llama", "fp8"), ("qwen3_moe", "fp8"), ("deepseek_v3", "fp8")])
def test_ue8m0_loads_in_transformers(kind, fmt, converted, source_model, source_logits):
    """UE8M0 block checkpoints load where plain block ones do (the README's table): logits close to
    the source, every FP8 weight dequantized to exactly code * scale."""
    from harness import load_causal_lm, model_logits

    out = converted(kind, fmt, "block", scale_format="ue8m0")
    model = load_causal_lm(out)
    logits = model_logits(model)
    cos = torch.nn.functional.cosine_similarity(source_logits(kind).flatten(), logits.flatten(), dim=0).item()
    assert cos >= MIN_COSINE, cos
    got = read_safetensors_dir(out)
    params = dict(model.named_parameters())
    suffix = "_scale_inv" if fmt == "fp8" else "_scale"
    checked = 0
    for name, q in got.items():
        if q.dtype == FP8 and name in params:
            want = R.dequant(q, got[name + suffix], "block")
            assert torch.equal(params[name].detach().float(), want), name
            checked += 1
    assert checked >= 8  # every FP8 linear transformers keeps as one (MoE experts are fused in memory)


@pytest.mark.slow
def test_mxfp8_in_transformers_dense_in_bf16_only_and_not_moe(converted, source_model, source_logits):
    """What the README's table says about transformers 5.24 + compressed-tensors 0.20.1 and MXFP8:
    a dense model loads (in bfloat16: its decompressor yields bf16 weights, each exactly
    bf16(code * 2^(byte - 127))), a float32 load fails at the first matmul, and MoE experts do not load."""
    from harness import model_logits
    from transformers import AutoModelForCausalLM

    out = converted("llama", CT, "mxfp8")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    cos = torch.nn.functional.cosine_similarity(
        source_logits("llama").flatten(), model_logits(model).flatten(), dim=0
    ).item()
    assert cos >= MIN_COSINE, cos
    got = read_safetensors_dir(out)
    params = dict(model.named_parameters())
    q = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(params[q].detach(), R.dequant(got[q], got[q + "_scale"], "mxfp8").to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="same dtype"):
        model_logits(AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32))
    with pytest.raises(RuntimeError, match="conversion of the weights"):
        AutoModelForCausalLM.from_pretrained(str(converted("qwen3_moe", CT, "mxfp8")), dtype=torch.bfloat16)
