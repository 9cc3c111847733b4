"""verify's streaming engine (batches through quantize's reader, fast and exact sums, problems grouped by
cause) on every kind of output the converter writes: MXFP8 and UE8M0 scales, experts cut from fused 3-D
tensors, an FP8 source's dequantized, passed-through and requantized outputs. Each passes whatever the
batch and slab sizes, damage in any slab is found and named, and a truncated shard is one line."""

from __future__ import annotations

import json
import re
import shutil
import struct

import pytest
from safetensors.torch import load_file, save_file
from tiny_ckpt import llama_tensors, write_checkpoint

import fp8convert
from fp8convert.cli import main
from fp8convert.verify import numbers as verify_numbers
from fp8convert.verify import pairs as verify_pairs
from fp8convert.verify import verify

INDEX = "model.safetensors.index.json"


def span(path, name) -> tuple[int, int]:
    """Absolute byte offset and length of tensor `name` in a safetensors file (parsed here)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + begin, end - begin


def shard_of(out, name):
    return out / json.loads((out / INDEX).read_text())["weight_map"][name]


def poke(out, name, at: int, value: int) -> None:
    """Overwrite byte `at` of tensor `name` in place."""
    path = shard_of(out, name)
    offset, nbytes = span(path, name)
    assert 0 <= at < nbytes
    with open(path, "r+b") as f:
        f.seek(offset + at)
        f.write(bytes([value]))


def byte_of(out, name, at: int) -> int:
    path = shard_of(out, name)
    offset, _ = span(path, name)
    return path.read_bytes()[offset + at]


def truncate_first_shard(out) -> tuple[str, int]:
    """Cut 100 bytes off the first output shard; (its name, how many tensors the index puts in it)."""
    weight_map = json.loads((out / INDEX).read_text())["weight_map"]
    shard = sorted(set(weight_map.values()))[0]
    data = (out / shard).read_bytes()
    (out / shard).write_bytes(data[:-100])
    return shard, sum(f == shard for f in weight_map.values())


def assert_one_truncation_line(src, out, capsys) -> None:
    """A truncated shard: one cause, naming the shard, however many tensors it held; --all lists each."""
    shard, _ = truncate_first_shard(out)
    report = verify(src, out, device="cpu")
    causes = report.causes()
    assert len(causes) == 1 and causes[0].startswith(f"{shard}: file is truncated"), causes
    assert re.search(r"so \d+ tensors? in it could not be checked", causes[0]), causes
    assert len(report.failures) > 2
    assert main(["verify", str(src), str(out), "-q"]) == 1
    captured = capsys.readouterr()
    listed = [line for line in captured.out.splitlines() if line.startswith("    - ")]
    assert len(listed) == 1 and f"FAILED: 1 problem ({len(report.failures)} findings in all" in captured.out
    assert captured.err.count("\n") == 1 and "verification failed, 1 problem;" in captured.err
    assert main(["verify", str(src), str(out), "-q", "--all"]) == 1
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("    - ")]
    assert len(listed) == len(report.failures)


def same_figures(a, b) -> None:
    assert a.ok and b.ok, (a.failures[:3], b.failures[:3])
    assert (a.tensors_quantized, a.tensors_kept, a.tensors_dequantized) == (
        b.tensors_quantized,
        b.tensors_kept,
        b.tensors_dequantized,
    )
    fa, fb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert fa.keys() == fb.keys()
    for name, t in fa.items():
        u = fb[name]
        assert (t.off_grid, t.off_rule_scales, t.inexact_codes, t.ok) == (
            u.off_grid,
            u.off_rule_scales,
            u.inexact_codes,
            u.ok,
        ), name
        assert t.rel_error == pytest.approx(u.rel_error, rel=1e-9) and t.bound == pytest.approx(u.bound, rel=1e-9)


def small_stream(monkeypatch) -> None:
    """Slabs of a few rows (whole 128-row blocks where blocks need it) and pieces of 64 bytes."""
    monkeypatch.setattr(verify_pairs, "CHUNK_ELEMENTS", 300)
    monkeypatch.setattr(verify_pairs, "CHUNK_BYTES", 64)


# ---------------------------------------------------------------- MXFP8 and UE8M0 blocks


@pytest.fixture(scope="module")
def pow2_made(tmp_path_factory):
    """A llama-named source (inter 320: a partial 128-block, 3 slabs of 128 rows) in 3 source shards,
    converted to MXFP8 and to fp8 UE8M0 blocks, in 2 output shards each."""
    base = tmp_path_factory.mktemp("pow2")
    src = write_checkpoint(base / "src", llama_tensors(inter=320))
    outs = {}
    for name, args in (
        ("mx", ["--scheme", "mxfp8"]),
        ("ue8m0", ["--scheme", "block", "--format", "fp8", "--scale-format", "ue8m0"]),
    ):
        assert main(["quantize", str(src), str(base / name), "-q", "--max-shard-size", "150KB", *args]) == 0
        outs[name] = base / name
    return src, outs


@pytest.mark.parametrize("name", ["mx", "ue8m0"])
def test_power_of_two_outputs_stream_in_any_batch(pow2_made, name, monkeypatch):
    """The exact power-of-two checks run slab by slab and tile by tile: the same verdict and figures
    with tiny batches and slabs as with the defaults, and honest codes never need the exact sums."""
    src, outs = pow2_made
    whole = verify(src, outs[name], device="cpu")
    assert whole.ok and whole.tensors_quantized == 14, whole.failures[:3]
    assert all(t.off_rule_scales == 0 and t.inexact_codes == 0 for t in whole.tensors)

    def refuse(*args):
        raise AssertionError("exact_sums used on an honest conversion")

    monkeypatch.setattr(verify_numbers, "exact_sums", refuse)
    monkeypatch.setattr(verify_numbers, "TILE_ELEMENTS", 64 * 32)
    small_stream(monkeypatch)
    same_figures(whole, verify(src, outs[name], device="cpu", max_resident="64KB"))


def test_mxfp8_exponent_off_the_rule_in_a_late_slab_is_found(pow2_made, tmp_path, monkeypatch):
    """One E8M0 exponent raised by one in the last rows of up_proj, in a slab of its own: the rule
    catches it (the codes, rounded to the old exponent, are then off the grid too); one line."""
    src, outs = pow2_made
    out = tmp_path / "out"
    shutil.copytree(outs["mx"], out)
    up = "model.layers.0.mlp.up_proj.weight"  # [320, 64]: scale [320, 2] uint8
    at = 319 * 2 + 1
    poke(out, up + "_scale", at, byte_of(out, up + "_scale", at) + 1)
    small_stream(monkeypatch)
    report = verify(src, out, device="cpu", max_resident="64KB")
    assert not report.ok and len(report.causes()) == 1, report.failures
    (line,) = report.failures
    assert line.startswith(up) and "1 scale is not the smallest power of two that fits their group" in line
    check = next(t for t in report.tensors if t.name == up)
    assert check.off_rule_scales == 1 and not check.ok


@pytest.mark.parametrize("made,kind", [("pow2_made", "mx"), ("pow2_made", "ue8m0"), ("fp8_made", "dequantized")])
def test_output_with_a_truncated_shard_is_one_line(made, kind, request, tmp_path, capsys):
    """MXFP8, UE8M0 and dequantized outputs: a truncated shard is one line, whatever it held."""
    src, outs = request.getfixturevalue(made)
    out = tmp_path / "out"
    shutil.copytree(outs[kind], out)
    assert_one_truncation_line(src, out, capsys)


# ---------------------------------------------------------------- experts cut from fused 3-D tensors


def expert_pair(out) -> tuple[str, str]:
    """Two FP8 gate_proj weights of the same layer, experts 0 and 1."""
    names = json.loads((out / INDEX).read_text())["weight_map"]
    first = next(n for n in sorted(names) if re.search(r"\.experts\.0\.gate_proj\.weight$", n))
    return first, first.replace(".experts.0.", ".experts.1.")


def rewrite(out, edit) -> None:
    """Apply edit(tensors) to every shard (each shard's own tensors), rewriting the index's total size."""
    total = 0
    for shard in sorted(out.glob("model-*.safetensors")):
        tensors = load_file(str(shard))
        edit(tensors)
        save_file(tensors, str(shard), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = json.loads((out / INDEX).read_text())
    index["metadata"]["total_size"] = total
    (out / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("arch", ["llama4", "granitemoe"])
def test_cut_experts_stream_and_a_swapped_expert_fails(arch, zoo_source, tmp_path, monkeypatch):
    """Per-expert outputs are read with their expert's slice of the fused tensor: the same figures in
    tiny batches; two experts' gate weights swapped (codes and scales) fail, each named."""
    src = zoo_source(arch)
    out = tmp_path / "out"
    fp8convert.quantize(src, out, scheme="channel", device="cpu")
    whole = verify(src, out, device="cpu")
    assert whole.ok and whole.tensors_quantized > 0, whole.failures[:3]
    small_stream(monkeypatch)
    same_figures(whole, verify(src, out, device="cpu", max_resident="32KB"))
    a, b = expert_pair(out)

    def swap(tensors):
        for suffix in ("", "_scale"):
            if a + suffix in tensors and b + suffix in tensors:
                tensors[a + suffix], tensors[b + suffix] = tensors[b + suffix].clone(), tensors[a + suffix].clone()

    rewrite(out, swap)
    report = verify(src, out, device="cpu", max_resident="32KB")
    assert not report.ok
    assert any(f.startswith(a) for f in report.failures) and any(f.startswith(b) for f in report.failures), (
        report.failures
    )


def test_kept_cut_experts_are_compared_with_their_slice(zoo_source, tmp_path):
    """Experts kept in BF16 but still split per expert: each must be its own slice, byte for byte."""
    src = zoo_source("llama4")
    out = tmp_path / "out"
    fp8convert.quantize(src, out, scheme="tensor", device="cpu", ignore=("re:.*experts.*",))
    report = verify(src, out, device="cpu")
    assert report.ok, report.failures[:3]
    names = json.loads((out / INDEX).read_text())["weight_map"]
    a = next((n for n in sorted(names) if re.search(r"\.experts\.0\.gate_proj\.weight$", n)), None)
    if a is None:
        pytest.skip("the kept experts stay fused in this layout")
    b = a.replace(".experts.0.", ".experts.1.")
    rewrite(out, lambda t: t.update({a: t[b].clone(), b: t[a].clone()}) if a in t and b in t else None)
    failures = verify(src, out, device="cpu").failures
    assert any(f.startswith(a) and "bytes differ from" in f and "[0]" in f for f in failures), failures


# ---------------------------------------------------------------- FP8 sources


@pytest.fixture(scope="module")
def fp8_made(tmp_path_factory):
    """An FP8 source (fp8convert's own fp8 block output of a llama with inter 320: partial blocks), its
    dequantized output, a passed-through one (compressed-tensors block) and a requantized one (channel)."""
    base = tmp_path_factory.mktemp("fp8src")
    bf16 = write_checkpoint(base / "bf16", llama_tensors(inter=320))
    src = base / "src"
    fp8convert.quantize(bf16, src, scheme="block", format="fp8", device="cpu")
    outs = {
        "dequantized": base / "deq",
        "passed": base / "passed",
        "requantized": base / "requant",
        "mxfp8": base / "mx",
    }
    fp8convert.dequantize(src, outs["dequantized"], device="cpu", max_shard_size="150KB")
    report = fp8convert.quantize(src, outs["passed"], scheme="block", device="cpu")
    assert report.tensors_passed_through == report.tensors_quantized == 14
    report = fp8convert.quantize(src, outs["requantized"], scheme="channel", device="cpu")
    assert report.tensors_requantized == 14
    fp8convert.quantize(src, outs["mxfp8"], scheme="mxfp8", device="cpu")
    return src, outs


@pytest.mark.parametrize("kind", ["dequantized", "passed", "requantized", "mxfp8"])
def test_fp8_source_outputs_stream_in_any_batch(fp8_made, kind, monkeypatch):
    src, outs = fp8_made
    whole = verify(src, outs[kind], device="cpu")
    assert whole.ok, whole.failures[:3]
    if kind == "dequantized":
        assert whole.format == "dequantized" and whole.tensors_dequantized == 14 and not whole.tensors
    elif kind == "passed":
        assert all(t.rel_error == 0 and t.off_grid == 0 for t in whole.tensors) and len(whole.tensors) == 14
    else:
        assert len(whole.tensors) == 14 and all(0 < t.rel_error <= t.bound for t in whole.tensors)
    small_stream(monkeypatch)
    same_figures(whole, verify(src, outs[kind], device="cpu", max_resident="64KB"))


@pytest.mark.parametrize(
    "kind,what",
    [
        ("dequantized", "1 element differs from float32(q) * scale rounded once to BF16"),
        ("passed", "1 code is not the nearest e4m3 value of weight/scale"),  # no longer the source's: measured
        ("requantized", "1 code is not the nearest e4m3 value of weight/scale"),
        ("mxfp8", "1 code is not the round-to-nearest-even e4m3 value of weight/scale"),
    ],
)
def test_fp8_source_damage_in_the_last_slab_is_found(fp8_made, kind, what, tmp_path, monkeypatch):
    """One element of the last row of up_proj ([320, 64]: three slabs of 128 rows) changed: found in
    small slabs and named, one line."""
    src, outs = fp8_made
    out = tmp_path / "out"
    shutil.copytree(outs[kind], out)
    up = "model.layers.0.mlp.up_proj.weight"
    item = 2 if kind == "dequantized" else 1
    at = (
        (320 * 64 - 1) * item
        if kind == "dequantized"
        else next(i for i in range(320 * 64 - 1, 0, -1) if byte_of(out, up, i) & 0x7F not in (0, 0x7E, 0x7F))
    )
    value = byte_of(out, up, at)
    poke(out, up, at, value + 1 if kind == "dequantized" else value ^ 0x01)
    small_stream(monkeypatch)
    report = verify(src, out, device="cpu", max_resident="64KB")
    assert not report.ok and len(report.failures) == 1, report.failures
    assert report.failures[0].startswith(up) and what in report.failures[0], report.failures


def test_passed_through_scale_changed_fails(fp8_made, tmp_path):
    """A passed-through weight whose scale is no longer the source's is measured as a requantization:
    its codes, made with the old scale, are then far off."""
    src, outs = fp8_made
    out = tmp_path / "out"
    shutil.copytree(outs["passed"], out)
    q = "model.layers.1.self_attn.q_proj.weight"
    scale = q + "_scale"
    poke(out, scale, 3, byte_of(out, scale, 3) ^ 0x40)  # the exponent of the first block's scale
    failures = verify(src, out, device="cpu").failures
    assert len(failures) == 1 and failures[0].startswith(q), failures


def test_dequantized_verify_records_its_figures_in_the_card(fp8_made, tmp_path, capsys):
    src, outs = fp8_made
    out = tmp_path / "out"
    shutil.copytree(outs["dequantized"], out)
    assert main(["verify", str(src), str(out), "-q"]) == 0
    text = capsys.readouterr().out
    assert "dequantized" in text and "14 dequantized (each equal to its one rounding)" in text
    card = (out / "README.md").read_text()
    assert "tensors dequantized (every element its one rounding) | 14" in card
