"""fp8convert verify: a good conversion passes in every format and scheme; every kind of damage to
an output (a code, a scale, a dropped tensor, a kept tensor, config, ignore list, index) fails and
names the tensor or file."""

from __future__ import annotations

import json
import math
import re
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_ckpt import INDEX, llama_tensors, write_checkpoint

from fp8convert import files as files_mod
from fp8convert.cli import main
from fp8convert.verify import numbers as verify_numbers
from fp8convert.verify import pairs as verify_pairs
from fp8convert.verify import verify

COMBOS = [
    ("compressed-tensors", "tensor"),
    ("compressed-tensors", "channel"),
    ("compressed-tensors", "block"),
    ("fp8", "tensor"),
    ("fp8", "block"),
]
Q = "model.layers.1.self_attn.q_proj.weight"
NORM = "model.layers.1.input_layernorm.weight"
SHARD = "model-00001-of-00001.safetensors"


def convert(src, out, fmt="compressed-tensors", scheme="tensor"):
    assert main(["quantize", str(src), str(out), "-q", "--format", fmt, "--scheme", scheme]) == 0
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One source (inter=320: several 128-row blocks, a partial edge block) and its five conversions."""
    base = tmp_path_factory.mktemp("verify")
    src = write_checkpoint(base / "src", llama_tensors(inter=320))
    return src, {combo: convert(src, base / "-".join(combo), *combo) for combo in COMBOS}


@pytest.fixture
def damaged(made, tmp_path):
    """A fresh copy of a conversion to damage: damaged(fmt, scheme) -> out."""
    src, outs = made

    def copy(fmt="compressed-tensors", scheme="tensor"):
        out = tmp_path / "out"
        shutil.copytree(outs[(fmt, scheme)], out)
        return out

    return src, copy


def span(path, name) -> tuple[int, int]:
    """Absolute byte offset and length of tensor `name` in a safetensors file (parsed here, independently)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + begin, end - begin


def poke(path, offset, value: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(value)


def set_tensor(out, name, tensor) -> None:
    """Overwrite a tensor's bytes in place (same dtype and shape)."""
    offset, nbytes = span(out / SHARD, name)
    raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert len(raw) == nbytes
    poke(out / SHARD, offset, raw)


def failing(src, out) -> list[str]:
    report = verify(src, out)
    assert not report.ok and report.failures
    return report.failures


def cli_fails(capsys, src, out, *names) -> None:
    """Exit 1 with one error line; the report on stdout lists every failure, naming `names`."""
    rc = main(["verify", str(src), str(out)])
    captured = capsys.readouterr()
    assert rc == 1, captured.err
    lines = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "verification failed" in lines[0], captured.err
    failures = [line for line in captured.out.splitlines() if line.startswith("    - ")]
    assert failures and all(any(n in f for f in failures) for n in names), (names, captured.out)


# ---------------------------------------------------------------- good conversions


@pytest.mark.parametrize("fmt,scheme", COMBOS)
def test_good_conversion_verifies(made, capsys, fmt, scheme):
    src, outs = made
    out = outs[(fmt, scheme)]
    report = verify(src, out)
    assert report.ok, report.failures
    assert (report.format, report.scheme) == (fmt, scheme)
    assert report.tensors_quantized == 14 and report.tensors_kept == 7 and len(report.tensors) == 14
    for t in report.tensors:
        assert t.ok and t.off_grid == 0
        assert 0.005 < t.rel_error < 2.0**-4 <= t.bound, t  # real rounding error, inside the e4m3 bound
        assert t.snr_db == pytest.approx(-20 * math.log10(t.rel_error))
    assert report.max_rel_error == max(t.rel_error for t in report.tensors)

    # the reported error, recomputed here from the files alone: ||w - float(q) * scale|| / ||w||
    w = load_file(str(src / "model-00002-of-00003.safetensors"))[Q].double()
    got = load_file(str(out / SHARD))
    q = got[Q].double()
    scale = got[Q + ("_scale_inv" if (fmt, scheme) == ("fp8", "block") else "_scale")].double()
    if scheme == "block":
        scale = scale.repeat_interleave(128, 0)[: q.shape[0]].repeat_interleave(128, 1)[:, : q.shape[1]]
    expected = float(
        (w - q * scale.reshape(scale.shape if scale.dim() == 2 else (-1, 1) if scale.numel() > 1 else ())).norm()
        / w.norm()
    )
    assert next(t for t in report.tensors if t.name == Q).rel_error == pytest.approx(expected, rel=1e-5)

    # the CLI: exit 0, strict JSON, worst tensors first
    assert main(["verify", str(src), str(out), "--worst", "-1"]) == 2  # a usage error, before any reading
    capsys.readouterr()
    assert main(["verify", str(src), str(out), "--json", "--worst", "3"]) == 0
    doc = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert doc["ok"] is True and doc["failures"] == [] and len(doc["worst"]) == 3
    errors = [t["rel_error"] for t in doc["worst"]]
    assert errors == sorted(errors, reverse=True) and errors[0] == report.max_rel_error
    assert main(["verify", str(src), str(out)]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["verify", str(src), str(out), "--worst", "0"]) == 0
    assert "worst tensors" not in capsys.readouterr().out  # no heading over an empty list


def test_subnormal_allowance_in_the_bound(tmp_path):
    """A fused group shares the largest member's scale (per-tensor scheme): a member 10^4 times
    smaller then lands in e4m3's subnormal range, with a relative error well above 2^-4 that is
    still exactly what rounding allows. verify must pass it, and report the error honestly."""
    tensors = llama_tensors()
    k = "model.layers.0.self_attn.k_proj.weight"
    tensors[k] = (tensors[k].float() * 2e-5).to(torch.bfloat16)
    src = write_checkpoint(tmp_path / "src", tensors)
    report = verify(src, convert(src, tmp_path / "out"))
    assert report.ok, report.failures
    check = next(t for t in report.tensors if t.name == k)
    assert check.rel_error > 2.0**-4 and check.rel_error <= check.bound and check.off_grid == 0
    assert report.max_rel_error == check.rel_error and report.worst(1)[0].name == k


def test_verify_streams_in_slabs(made, damaged, monkeypatch):
    """Small slabs (several per tensor, block rows kept whole) give the same numbers, and damage in
    the last slab of a tensor or the last piece of a kept tensor is still found."""
    src, outs = made
    whole = {t.name: t.rel_error for t in verify(src, outs[("compressed-tensors", "block")]).tensors}
    monkeypatch.setattr(verify_pairs, "CHUNK_ELEMENTS", 300)
    monkeypatch.setattr(verify_pairs, "CHUNK_BYTES", 64)
    report = verify(src, outs[("compressed-tensors", "block")])
    assert report.ok and {t.name: t.rel_error for t in report.tensors} == pytest.approx(whole, rel=1e-9)

    src, copy = damaged
    out = copy("compressed-tensors", "block")
    up = "model.layers.0.mlp.up_proj.weight"  # [320, 64]: slabs of 128, 128, 64 rows
    codes = load_file(str(out / SHARD))[up].view(torch.uint8)
    codes[-1, -1] = codes[-1, -1] ^ 0x80 if codes[-1, -1] & 0x7F else 0x08  # flip the sign, or make 0 non-zero
    set_tensor(out, up, codes)
    norm = load_file(str(out / SHARD))["model.norm.weight"]
    norm[-1] += 1
    set_tensor(out, "model.norm.weight", norm)
    failures = failing(src, out)
    assert any(up in f and "nearest" in f for f in failures), failures
    assert any("model.norm.weight" in f and "differ" in f for f in failures), failures


# ---------------------------------------------------------------- damaged outputs


def test_one_corrupted_code_fails_though_the_norm_cannot_see_it(damaged, capsys):
    src, copy = damaged
    out = copy()
    codes = load_file(str(out / SHARD))[Q]
    flat = codes.view(torch.uint8).view(-1)
    i = int((flat & 0x7F > 8).nonzero()[0])
    offset, _ = span(out / SHARD, Q)
    poke(out / SHARD, offset + i, bytes([int(flat[i]) ^ 0x01]))  # the neighbouring code
    report = verify(src, out)
    assert not report.ok
    check = next(t for t in report.tensors if t.name == Q)
    assert check.rel_error <= check.bound  # the norm alone would have passed it
    assert check.off_grid == 1 and not check.ok
    assert report.worst(1)[0].name == Q
    cli_fails(capsys, src, out, Q)


@pytest.mark.parametrize("fmt,scheme", [("compressed-tensors", "channel"), ("fp8", "block")])
def test_nan_code_fails(damaged, fmt, scheme):
    src, copy = damaged
    out = copy(fmt, scheme)
    offset, _ = span(out / SHARD, Q)
    poke(out / SHARD, offset + 100, b"\x7f")  # e4m3fn NaN
    assert any(Q in f for f in failing(src, out))


@pytest.mark.parametrize(
    "fmt,scheme",
    [("compressed-tensors", "tensor"), ("compressed-tensors", "channel"), ("fp8", "tensor"), ("fp8", "block")],
)
@pytest.mark.parametrize("how", ["double", "nan", "zero", "negative"])
def test_corrupted_scale_fails(damaged, capsys, fmt, scheme, how):
    src, copy = damaged
    out = copy(fmt, scheme)
    name = Q + ("_scale_inv" if scheme == "block" and fmt == "fp8" else "_scale")
    scale = load_file(str(out / SHARD))[name]
    scale.view(-1)[0] = {
        "double": scale.view(-1)[0] * 2,
        "nan": float("nan"),
        "zero": 0.0,
        "negative": -scale.view(-1)[0],
    }[how]
    set_tensor(out, name, scale)
    failures = failing(src, out)
    assert any(f.startswith(Q) for f in failures), failures
    cli_fails(capsys, src, out, Q)


@pytest.mark.parametrize("fmt,scheme", COMBOS)
@pytest.mark.parametrize("factor", [4.0, 2.0**20])
def test_scale_larger_than_its_weights_need_fails_though_the_codes_fit_it(damaged, capsys, fmt, scheme, factor):
    """A scale too large with its codes recomputed exactly for it (RNE of w / scale): every code is right
    for the scale stored beside it, and at 2^20 every code is zero (relative error 1). Only the scale
    itself, held to at most twice amax / 448 of its weights (a fused group's, in the tensor scheme),
    shows it."""
    from fp8convert.run.numerics import expand_scale

    src, copy = damaged
    out = copy(fmt, scheme)
    name = Q + ("_scale_inv" if scheme == "block" and fmt == "fp8" else "_scale")
    scale = load_file(str(out / SHARD))[name] * factor
    w = load_file(str(src / "model-00002-of-00003.safetensors"))[Q].float()
    expanded = expand_scale(scale, tuple(w.shape), scheme) if scheme == "block" else scale
    codes = (w / expanded).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert factor == 4.0 or not codes.float().any()
    set_tensor(out, name, scale)
    set_tensor(out, Q, codes)
    failures = failing(src, out)
    assert any(f.startswith(Q) and "more than twice amax / 448" in f for f in failures), failures
    cli_fails(capsys, src, out, Q)


def rewrite_shard(out, edit) -> None:
    tensors = load_file(str(out / SHARD))
    edit(tensors)
    save_file(tensors, str(out / SHARD), metadata={"format": "pt"})


@pytest.mark.parametrize("dropped", [Q, Q + "_scale", NORM])
def test_tensor_dropped_from_a_shard_fails(damaged, capsys, dropped):
    src, copy = damaged
    out = copy()
    rewrite_shard(out, lambda t: t.pop(dropped))
    failures = failing(src, out)
    assert any(dropped in f and SHARD in f for f in failures), failures  # the index still names it
    assert any(f.startswith(dropped.removesuffix("_scale")) and "missing" in f for f in failures), failures
    cli_fails(capsys, src, out, dropped)


def test_extra_tensor_fails(damaged):
    src, copy = damaged
    out = copy()
    rewrite_shard(out, lambda t: t.update({"model.layers.0.stray.weight": torch.zeros(4)}))
    index = json.loads((out / INDEX).read_text())
    index["weight_map"]["model.layers.0.stray.weight"] = SHARD
    index["metadata"]["total_size"] += 16
    (out / INDEX).write_text(json.dumps(index))
    assert any("model.layers.0.stray.weight" in f and "not derived" in f for f in failing(src, out))


def test_kept_tensor_changed_fails(damaged, capsys):
    src, copy = damaged
    out = copy()
    norm = load_file(str(out / SHARD))[NORM]
    norm[3] += 0.5
    set_tensor(out, NORM, norm)
    assert any(NORM in f and "differ" in f for f in failing(src, out))
    cli_fails(capsys, src, out, NORM)


def test_kept_tensor_with_nan_fails(damaged):
    """A NaN copied faithfully from the source is still a broken checkpoint."""
    src, copy = damaged
    out = copy()
    norm = load_file(str(out / SHARD))[NORM]
    norm[0] = float("nan")
    set_tensor(out, NORM, norm)
    src2 = out.parent / "src"
    shutil.copytree(src, src2)
    offset, _ = span(src2 / "model-00002-of-00003.safetensors", NORM)
    poke(src2 / "model-00002-of-00003.safetensors", offset, norm[:1].view(torch.uint8).numpy().tobytes())
    assert any(NORM in f and "NaN" in f for f in failing(src2, out))


def edit_config(out, edit) -> None:
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))


def test_ignore_list_must_match_the_tensors(damaged):
    src, copy = damaged
    out = copy()
    edit_config(out, lambda c: c["quantization_config"]["ignore"].remove("lm_head"))
    assert any(f.startswith("lm_head.weight") and "ignore list" in f for f in failing(src, out))
    edit_config(out, lambda c: c["quantization_config"]["ignore"].extend(["lm_head", Q.removesuffix(".weight")]))
    assert any(f.startswith(Q) and "ignore list names" in f for f in failing(src, out))


@pytest.mark.parametrize("targets", [[], ["Embedding"], ["re:.*down_proj$"]])
def test_every_quantized_weight_must_be_targeted_by_a_config_group(damaged, targets):
    """A config group no longer covering the FP8 weights (engines would load them as unquantized layers)."""
    src, copy = damaged
    out = copy()
    edit_config(out, lambda c: c["quantization_config"]["config_groups"]["group_0"].update(targets=targets))
    failures = failing(src, out)
    assert any(f.startswith(Q) and "no config group targets its module" in f for f in failures)
    down_proj_targeted = targets == ["re:.*down_proj$"]
    assert any(".mlp.down_proj.weight:" in f for f in failures) != down_proj_targeted


def test_fp8_ignored_layers_checked(damaged):
    src, copy = damaged
    out = copy("fp8", "block")
    edit_config(out, lambda c: c["quantization_config"].update(ignored_layers=[], modules_to_not_convert=[]))
    assert any(f.startswith("lm_head.weight") for f in failing(src, out))


@pytest.mark.parametrize(
    "edit,what",
    [
        (lambda c: c.update(hidden_size=65), "hidden_size"),
        (lambda c: c.pop("quantization_config"), "quantization_config"),
        (
            lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(strategy="channel"),
            "weight_scale",
        ),
        (lambda c: c["quantization_config"]["ignore"].append("re:("), "ignore entry 're:(' is not a valid regular"),
        # what loaders act on though no tensor backs it (transformers ran the first into NaN logits)
        (
            lambda c: c["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
            "declares static input activations, but the output holds no input_scale",
        ),
        (
            lambda c: c["quantization_config"].update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
            "kv_cache_scheme",
        ),
        (
            lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(symmetric=False),
            "asymmetric",
        ),
        (lambda c: c["quantization_config"].update(quantization_status="frozen"), "quantization_status is 'frozen'"),
    ],
)
def test_config_inconsistent_fails(damaged, edit, what):
    src, copy = damaged
    out = copy()
    edit_config(out, edit)
    assert any(what in f for f in failing(src, out))


def test_index_inconsistent_fails(damaged):
    src, copy = damaged
    out = copy()
    index = json.loads((out / INDEX).read_text())
    index["metadata"]["total_size"] += 1
    (out / INDEX).write_text(json.dumps(index))
    assert any("total_size" in f for f in failing(src, out))
    index["metadata"]["total_size"] -= 1
    index["weight_map"][Q] = "model-00002-of-00002.safetensors"
    (out / INDEX).write_text(json.dumps(index))
    assert any("model-00002-of-00002.safetensors" in f for f in failing(src, out))
    index["metadata"] = "oops"  # a failure, not a crash
    (out / INDEX).write_text(json.dumps(index))
    assert any("metadata is 'oops', not an object" in f for f in failing(src, out))


def test_truncated_output_shard_fails(damaged, capsys):
    src, copy = damaged
    out = copy()
    data = (out / SHARD).read_bytes()
    (out / SHARD).write_bytes(data[:-100])
    failures = failing(src, out)
    assert any(SHARD in f and "truncated" in f for f in failures)
    cli_fails(capsys, src, out, SHARD)


def test_incomplete_output_fails(damaged, capsys):
    src, copy = damaged
    out = copy()
    manifest = out / ".fp8convert" / "manifest.json"
    manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), complete=False)))
    assert any("did not finish" in f for f in failing(src, out))
    (out / "config.json").unlink()
    assert any("config.json" in f and "incomplete" in f for f in failing(src, out))
    cli_fails(capsys, src, out, "config.json")


def test_verify_json_on_failure(damaged, capsys):
    src, copy = damaged
    out = copy()
    rewrite_shard(out, lambda t: t.pop(Q))
    assert main(["verify", str(src), str(out), "--json"]) == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert doc["ok"] is False and any(Q in f for f in doc["failures"])
    assert Q in captured.err


def test_passing_verify_puts_its_figures_in_the_card(tmp_path, capsys):
    """The card carries the verify figures once verify has passed (and only then), replacing old ones."""
    from fp8convert.cli import main

    src = write_checkpoint(tmp_path / "src", llama_tensors())
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out), "-q", "--device", "cpu"]) == 0
    assert "## Verification" not in (out / "README.md").read_text()
    assert main(["verify", str(src), str(out)]) == 0
    card = (out / "README.md").read_text()
    assert card.count("## Verification") == 1 and "worst relative error" in card
    assert card.index("## Verification") < card.index("## Reproduce")
    assert main(["verify", str(src), str(out)]) == 0  # again: still one section
    assert (out / "README.md").read_text().count("## Verification") == 1


def test_passing_verify_of_an_output_it_cannot_write_still_passes(tmp_path, capsys, monkeypatch):
    """A read-only output (a shared model store): verify passes, exit 0, and a warning says the card
    could not take the figures; a checkpoint that is not fp8convert's own keeps its card untouched."""
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out), "-q", "--device", "cpu"]) == 0
    capsys.readouterr()

    card = (out / "README.md").read_bytes()

    def read_only(source, target):  # the rename that puts a rewritten file in place (files.write_atomic)
        raise OSError(30, "Read-only file system", str(target))

    monkeypatch.setattr(files_mod.os, "replace", read_only)
    assert main(["verify", str(src), str(out), "-q", "--json"]) == 0
    monkeypatch.undo()
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ok"] is True
    assert captured.err.count("\n") == 1 and "error:" not in captured.err, captured.err
    assert (
        captured.err.startswith("warning:") and "README.md" in captured.err and "Read-only file system" in captured.err
    )
    assert "rerun" not in captured.err  # verify has nothing to resume
    assert (out / "README.md").read_bytes() == card and not list(out.glob(".*.tmp"))
    other = tmp_path / "other"  # the same files, without fp8convert's work folder: someone else's checkpoint
    shutil.copytree(out, other, ignore=shutil.ignore_patterns(".fp8convert"))
    card = (other / "README.md").read_bytes()
    assert main(["verify", str(src), str(other), "-q"]) == 0
    assert (other / "README.md").read_bytes() == card


# ---------------------------------------------------------------- the fast arithmetic is the exact one


def quantized(w: torch.Tensor, scheme: str):
    """Codes and scales as the converter makes them, and the scale as verify broadcasts it."""
    from fp8convert.run.numerics import quantize_group

    codes, scales = quantize_group([w.unsqueeze(0)], scheme)
    return codes[0][0], scales[0][0]


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", ["random", "tiny-member", "zeros", "ties", "outliers"])
def test_fast_sums_are_the_exact_sums(scheme, dtype, case):
    """fast_sums must give exact_sums' figures wherever it answers: the same off-grid count (0) and
    the same float64 sums up to summation order; it must answer for every honest conversion."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 272, generator=g) * 0.02
    if case == "tiny-member":  # most elements land in e4m3's subnormal range (the bound's second term)
        w[:, 200:] *= 1e-4
        w[:, :100] *= 1e-6
    elif case == "zeros":
        w[::3] = 0.0
    elif case == "ties":  # values halfway between e4m3 codes once divided by the scale
        w = (
            torch.tensor([448.0, 1.0625, 1.1875, 0.00146484375, -1.0625, 2.0**-10, 3 * 2.0**-11] * 40).repeat(300, 1)[
                :, :272
            ]
            * 0.5
        )
    else:
        w.view(-1)[::97] *= 40.0
    w = w.to(dtype)
    codes, scale = quantized(w, scheme)
    slab_scale = verify_numbers.slab_scale(scale, 0, w.shape[0], w.shape[1], scheme)
    exact = verify_numbers.exact_sums(w, codes, slab_scale)
    fast = verify_numbers.fast_sums(w, codes, slab_scale)
    assert fast is not None and exact.off_grid == fast.off_grid == 0
    for field in ("w2", "e2", "bound2"):
        assert getattr(fast, field) == pytest.approx(getattr(exact, field), rel=1e-12, abs=0), field


def test_fast_sums_step_aside_for_a_wrong_code_or_a_non_finite_weight():
    w = torch.randn(64, 64, dtype=torch.bfloat16) * 0.02
    codes, scale = quantized(w, "channel")
    s = verify_numbers.slab_scale(scale, 0, 64, 64, "channel")
    bad = codes.view(torch.uint8).clone()
    bad[5, 5] ^= 0x01
    assert verify_numbers.fast_sums(w, bad.view(torch.float8_e4m3fn), s) is None
    assert verify_numbers.exact_sums(w, bad.view(torch.float8_e4m3fn), s).off_grid == 1
    w2 = w.clone()
    w2[1, 1] = float("inf")
    assert verify_numbers.fast_sums(w2, codes, s) is None


def test_same_bytes_finds_a_difference_anywhere():
    a = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    assert verify_numbers.same_bytes(a, a.clone())
    for i in (0, 1, 2047, 3999):
        b = a.clone()
        b[i] ^= 0x10
        assert not verify_numbers.same_bytes(a, b) and not verify_numbers.same_bytes(a[i:], b[i:])


def test_a_good_conversion_is_measured_without_the_element_by_element_path(made, monkeypatch):
    """Speed comes from the fast path: an honest output never needs exact_sums."""
    src, outs = made

    def refuse(*args):
        raise AssertionError("exact_sums used on an honest conversion")

    monkeypatch.setattr(verify_numbers, "exact_sums", refuse)
    for out in outs.values():
        assert verify(src, out, device="cpu").ok


# ---------------------------------------------------------------- one cause, one line; the reader and progress


def test_truncated_shard_is_one_line_and_all_lists_every_tensor(damaged, capsys):
    """A truncated shard makes every tensor in it unreadable: one line for the cause (it used to be
    two per tensor), and `--all` lists each."""
    src, copy = damaged
    out = copy()
    data = (out / SHARD).read_bytes()
    (out / SHARD).write_bytes(data[:-100])
    report = verify(src, out)
    causes = report.causes()
    assert len(causes) == 1 and causes[0].startswith(f"{SHARD}: file is truncated"), causes
    assert "so 21 tensors in it could not be checked" in causes[0]
    assert len(report.failures) == 22  # the file, and each of its 21 source tensors
    assert main(["verify", str(src), str(out), "-q"]) == 1
    captured = capsys.readouterr()
    listed = [line for line in captured.out.splitlines() if line.startswith("    - ")]
    assert len(listed) == 1 and "FAILED: 1 problem (22 findings in all; --all lists each)" in captured.out
    assert captured.err.count("\n") == 1 and "verification failed, 1 problem;" in captured.err
    assert main(["verify", str(src), str(out), "-q", "--all"]) == 1
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("    - ")]
    assert len(listed) == 22 and sum(Q in line for line in listed) == 1


def test_the_same_problem_in_many_tensors_is_one_line(damaged):
    src, copy = damaged
    out = copy()
    names = [f"model.layers.{n}.input_layernorm.weight" for n in (0, 1)] + ["model.norm.weight"]
    for name in names:
        t = load_file(str(out / SHARD))[name]
        t[0] += 1
        set_tensor(out, name, t)
    report = verify(src, out)
    assert len(report.failures) == 3
    (line,) = report.causes()
    assert line.endswith(": kept in high precision, but its bytes differ from the source") and all(
        name in line for name in names
    ), line


def test_verify_reads_through_the_batch_reader_within_the_budget(made, monkeypatch):
    """verify streams through quantize's reader: batches of at most half the budget (two are in
    memory at once), the same figures whatever the budget."""
    from fp8convert.run.reader import BatchReader

    src, outs = made
    out = outs[("fp8", "block")]
    whole = {t.name: t.rel_error for t in verify(src, out, device="cpu").tensors}
    sizes = []
    real = BatchReader.start

    def spy(self, tensors):
        sizes.append(sum(t.nbytes for t in tensors))
        return real(self, tensors)

    monkeypatch.setattr(BatchReader, "start", spy)
    report = verify(src, out, device="cpu", max_resident="64KB")
    assert report.ok and {t.name: t.rel_error for t in report.tensors} == pytest.approx(whole, rel=1e-12)
    largest = 320 * 64 * 2  # up_proj: one read larger than a batch is a batch of its own
    assert len(sizes) > 10 and sum(sizes) == report.bytes_read and max(sizes) <= max(64_000 // 2, largest)


def test_verify_shows_progress_and_takes_a_device(made, capsys):
    src, outs = made
    out = outs[("compressed-tensors", "tensor")]
    assert main(["verify", str(src), str(out), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert re.search(rf"verify {re.escape(str(out))}\S*: \d+\.\d\d [KM]B of \d+\.\d\d [KM]B \(100%\)", err), err
    assert main(["verify", str(src), str(out), "-q"]) == 0 and capsys.readouterr().err == ""
    if not torch.cuda.is_available():
        assert main(["verify", str(src), str(out), "--device", "cuda"]) == 1
        assert "--device cuda: CUDA is not available" in capsys.readouterr().err
