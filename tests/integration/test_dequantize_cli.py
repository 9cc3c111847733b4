"""`fp8convert dequantize` at the edges a user meets: the same rules as quantize for what OUT may hold
(--overwrite replaces only fp8convert's own output), the same one-line failures and --json error
object, the same conventions (--token, --cache-dir, --base-model, plurals and units), and batch jobs."""

from __future__ import annotations

import json
import re

import pytest
from tiny_ckpt import llama_tensors, looks_complete, tree_bytes, write_checkpoint

import fp8convert
from fp8convert.cli import _failures, main


def run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def fp8_src(tmp_path_factory):
    """A native fp8 block checkpoint (fp8convert's own output of a tiny llama)."""
    base = tmp_path_factory.mktemp("deqcli")
    bf16 = write_checkpoint(base / "bf16", llama_tensors())
    src = base / "fp8"
    fp8convert.quantize(bf16, src, scheme="block", format="fp8", device="cpu")
    return src


def test_dequantize_refuses_a_foreign_folder_with_or_without_overwrite(fp8_src, tmp_path, capsys):
    """The issue's rule for dequantize: a folder of the user's files is refused, naming them, never
    suggesting --overwrite, and nothing in it is deleted."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "results").mkdir()
    (out / "results" / "a.json").write_text("{}")
    before = tree_bytes(out)
    for extra in ([], ["--overwrite"]):
        rc, _, err = run(capsys, "dequantize", fp8_src, out, "-q", "--device", "cpu", *extra)
        line = one_error(err)
        assert rc == 1 and str(out) in line and "notes.txt" in line and "results/" in line, line
        assert "did not write" in line and "pass --overwrite" not in line, line
        assert tree_bytes(out) == before and not looks_complete(out)


def test_dequantize_overwrite_replaces_only_its_own_output(fp8_src, tmp_path, capsys):
    out = tmp_path / "out"
    rc, stdout, err = run(capsys, "dequantize", fp8_src, out, "-q", "--device", "cpu")
    assert rc == 0 and looks_complete(out), err
    first = tree_bytes(out)
    # an earlier dequantize output is fp8convert's: --overwrite replaces it
    rc, _, err = run(capsys, "dequantize", fp8_src, out, "-q", "--device", "cpu", "--dtype", "fp32", "--overwrite")
    assert rc == 0 and looks_complete(out) and tree_bytes(out) != first, err
    assert json.loads((out / ".fp8convert" / "manifest.json").read_text())["dtype"] == "F32"
    # a file the user added is not: refused with --overwrite; the plan change advises moving it
    (out / "eval.json").write_text("{}")
    before = tree_bytes(out)
    rc, _, err = run(capsys, "dequantize", fp8_src, out, "-q", "--device", "cpu", "--overwrite")
    assert rc == 1 and "eval.json" in one_error(err) and tree_bytes(out) == before
    rc, _, err = run(capsys, "dequantize", fp8_src, out, "-q", "--device", "cpu")
    line = one_error(err)
    assert rc == 1 and "different plan" in line and "--dtype was 'F32', now None" in line, line
    assert "move eval.json out of" in line and "pass --overwrite" not in line and tree_bytes(out) == before


def test_dequantize_replaces_a_quantize_output_only_with_overwrite(fp8_src, tmp_path, capsys):
    """A quantize output in OUT is another plan: named as such, and --overwrite may replace it."""
    out = tmp_path / "out"
    assert fp8convert.quantize(fp8_src, out, scheme="channel", device="cpu").complete
    rc, _, err = run(capsys, "dequantize", fp8_src, out, "-q", "--device", "cpu")
    line = one_error(err)
    assert rc == 1 and "different plan" in line and "dequantize was False, now True" in line
    assert "pass --overwrite to replace it" in line
    assert run(capsys, "dequantize", fp8_src, out, "-q", "--device", "cpu", "--overwrite")[0] == 0
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_dequantize_json_failure_prints_an_error_object(fp8_src, tmp_path, capsys):
    rc, stdout, err = run(capsys, "dequantize", tmp_path / "nope", tmp_path / "out", "--json", "-q")
    doc = json.loads(stdout)
    assert rc == 1 and doc == {"ok": False, "error": one_error(err).removeprefix("error: "), "exit_code": 1}
    # a BF16 source is not something to dequantize: the refusal is the error object too
    bf16 = write_checkpoint(tmp_path / "bf16", llama_tensors())
    rc, stdout, err = run(capsys, "dequantize", bf16, tmp_path / "out2", "--json", "-q", "--device", "cpu")
    doc = json.loads(stdout)
    assert rc == 1 and doc["ok"] is False and doc["error"] == one_error(err).removeprefix("error: ")
    # a good run prints its own report, once
    rc, stdout, err = run(capsys, "dequantize", fp8_src, tmp_path / "out3", "--json", "-q", "--device", "cpu")
    doc = json.loads(stdout)
    assert rc == 0 and doc["dequantize"] is True and doc["tensors_dequantized"] == 14 and doc["complete"]
    assert (doc["format"], doc["scheme"]) == ("dequantized", None)  # as verify names such an output


def test_dequantize_summary_speaks_in_plurals_and_units(fp8_src, tmp_path, capsys):
    rc, stdout, err = run(capsys, "dequantize", fp8_src, tmp_path / "out", "--device", "cpu")
    assert rc == 0, err
    line = stdout.strip().splitlines()[-1]
    assert re.match(
        r"wrote \S+: 1 shard, 14 FP8 weights dequantized, \d+ kept, \d+\.\d\d (KB|MB) -> "
        r"\d+\.\d\d (KB|MB) in ",
        line,
    ), line
    assert "(s)" not in line and "0.00 GB" not in line


@pytest.mark.parametrize("command", ["dequantize", "quantize"])
def test_progress_lines_name_the_command_that_runs(command, fp8_src, tmp_path, capsys):
    """Without a terminal, the progress line begins with the command: a dequantize is not called a quantize."""
    rc, _, err = run(capsys, command, fp8_src, tmp_path / "out", "--device", "cpu")
    assert rc == 0, err
    progress = [line.split(" ", 1)[1] for line in err.splitlines() if " of " in line and "eta" in line]
    assert progress and all(line.startswith(f"{command} {fp8_src}:") for line in progress), err


def test_dequantize_takes_the_hub_options_and_base_model(fp8_src, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    rc, text, _ = run(capsys, "dequantize", "-h")
    assert rc == 0 and "Usage: fp8convert dequantize [OPTIONS] SRC OUT" in text
    for option in ("--token", "HF_TOKEN", "--cache-dir", "HF_HUB_CACHE", "--base-model", "bf16|fp16|fp32"):
        assert option in text, option
    assert "<bool>" not in text
    out = tmp_path / "out"
    rc, _, err = run(capsys, "dequantize", fp8_src, out, "-q", "--device", "cpu", "--base-model", "me/tiny-fp8")
    assert rc == 0, err
    card = (out / "README.md").read_text()
    assert "base_model: me/tiny-fp8" in card and "--base-model me/tiny-fp8" in card
    assert "fp8convert dequantize" in card and "device_map" not in card and "pip install transformers" in card


def test_quantize_help_lists_main_options_with_their_choices(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    rc, text, _ = run(capsys, "quantize", "-h")
    assert rc == 0 and "tensor|channel|block|mxfp8" in text and "float|ue8m0" in text and "--target-tp" in text
    assert "<bool>" not in text


def test_interrupted_dequantize_says_a_rerun_resumes():
    assert _failures.stop_line("dequantize", True) == "terminated (SIGTERM): rerun the same command to resume"
    assert _failures.stop_line("dequantize", False) == "interrupted: rerun the same command to resume"


def test_batch_dequantize_job_into_a_foreign_folder_keeps_it(fp8_src, tmp_path, capsys):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("k")
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(
        f'[[job]]\nsource = "{fp8_src}"\nout = "{theirs}"\ndequantize = true\noverwrite = true\ndevice = "cpu"\n'
    )
    rc, _, err = run(capsys, "batch", jobs, "-q")
    assert rc == 1 and "keep.txt" in err and tree_bytes(theirs) == {"keep.txt": b"k"}, err


def test_dequantize_to_another_dtype_says_so_in_config_json(fp8_src, tmp_path, capsys):
    """transformers loads a model in config.json's dtype: an fp32 dequantize that still said bfloat16 was
    rounded back to BF16 on load. verify accepts the new name and nothing else in its place."""
    from fp8convert.verify import verify

    out = tmp_path / "out"
    rc, _, err = run(capsys, "dequantize", fp8_src, out, "-q", "--device", "cpu", "--dtype", "fp32")
    config = json.loads((out / "config.json").read_text())
    assert rc == 0 and config["torch_dtype"] == "float32" and "quantization_config" not in config, err
    assert verify(fp8_src, out, device="cpu").ok
    for other in ("int8", "float16"):  # not a float dtype; another than the weights'
        (out / "config.json").write_text(json.dumps(config | {"torch_dtype": other}))
        failures = verify(fp8_src, out, device="cpu").failures
        assert any(f"torch_dtype is '{other}', but the dequantized weights are float32" in f for f in failures), (
            failures
        )


@pytest.mark.parametrize(
    "scheme,says",
    [
        ("channel", "14 FP8 weights: w = float32(q) * scale, one scale per output row, rounded once to BF16"),
        ("block", "14 FP8 weights: w = float32(q) * scale, one scale per 128x128 tile (edge tiles included)"),
        ("nvfp4a16", "14 FP4 weights: w = float32(q) * float32(scale) / global_scale, one scale per 16 inputs"),
    ],
)
def test_the_dequantized_cards_formula_is_the_sources_scheme(tmp_path, capsys, scheme, says):
    """The card said block scales over 128x128 tiles, and FP8, whatever the source was."""
    src = tmp_path / "src"
    fp8convert.quantize(write_checkpoint(tmp_path / "bf16", llama_tensors()), src, scheme=scheme, device="cpu")
    assert run(capsys, "dequantize", src, tmp_path / "out", "-q", "--device", "cpu")[0] == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert says in card, card
