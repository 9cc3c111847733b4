"""The command line as a user meets it: the conventions of the `hf` CLI (--version, -h, --token,
--cache-dir), help a person can read, and how every failure ends: one line, an exit code, a JSON error
object with --json, a traceback only with FP8CONVERT_DEBUG=1, and Ctrl-C or SIGTERM with a line that
says what a rerun does."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_ckpt import cli_subprocess, llama_tensors, looks_complete, tree_bytes, write_checkpoint

from fp8convert import FP8ConvertError, __version__, api
from fp8convert.cli import _failures, main
from fp8convert.demo import make_demo_model
from fp8convert.run.progress import Progress
from fp8convert.units import format_size, plural, size_option, size_text

COMMANDS = ["quantize", "dequantize", "inspect", "demo", "verify", "push", "finalize", "batch"]
HUB_COMMANDS = ["quantize", "dequantize", "inspect", "verify", "push", "finalize", "batch"]


def run(capsys, *args, env: dict | None = None, monkeypatch=None) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def help_text(capsys, *args) -> str:
    rc, out, err = run(capsys, *args, "-h")
    assert rc == 0, err
    return out


# ---------------------------------------------------------------- conventions


def test_version_and_short_help(capsys):
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.strip() == f"fp8convert {__version__}"
    top = help_text(capsys)
    assert "--version" in top and all(c in top for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_reads_as_a_user_types_it(capsys, command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    text = help_text(capsys, command)
    assert "<bool>" not in text and not re.search(r"\{\w+\}", text), text  # no type placeholders, no {src}
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    assert re.search(rf"Usage: fp8convert {command} \[OPTIONS\]( [A-Z_]+| \[[A-Z_]+\])*\s*$", usage), usage
    if command in ("quantize", "inspect", "demo"):
        assert "tensor|channel|block" in text and "compressed-tensors|fp8" in text
    if command == "quantize":  # the examples' regexes as typed, not read as Markdown emphasis
        assert "--scheme 're:.*mlp.experts.*=nvfp4a16'" in text and "--ignore 're:.*down_proj'" in text
    if command in HUB_COMMANDS:
        assert "--token" in text and "HF_TOKEN" in text
    if command in set(HUB_COMMANDS) - {"push"}:
        assert "--cache-dir" in text and "HF_HUB_CACHE" in text and "HF_HOME" in text


def test_plurals_and_units_of_the_demo(tmp_path, capsys):
    """The demo's summary line: no '1 shards', no '0.01 GB -> 0.00 GB'."""
    rc, out, err = run(capsys, "demo", tmp_path / "d", "--device", "cpu")
    assert rc == 0, err
    (line,) = [line for line in out.splitlines() if line.startswith("wrote ")]
    assert re.match(r"wrote \S+: 1 shard, 28 tensors quantized, 11 kept, \d+\.\d\d MB -> \d+\.\d\d MB in ", line), line
    assert "(s)" not in line and "0.00 GB" not in line
    rc, out, err = run(capsys, "demo", tmp_path / "d", "--device", "cpu", "-q")  # -q as quantize's
    assert rc == 0 and "wrote " not in out and "quantize " not in err and "next:" in out, (out, err)


@pytest.mark.slow
def test_the_demo_ends_with_what_to_try_next_and_each_of_it_works(tmp_path, capsys):
    """After the summary: a verify and an inspect command, and three lines of Python that load the output
    with transformers; each runs as printed."""
    rc, out, err = run(capsys, "demo", tmp_path / "d", "--device", "cpu")
    assert rc == 0, err
    after = out.split("\nnext:\n", 1)[1].splitlines()
    commands = [shlex.split(line.split("#")[0])[1:] for line in after if line.startswith("  fp8convert ")]
    assert [c[0] for c in commands] == ["verify", "inspect"] and after[
        2
    ] == "  in Python (pip install transformers compressed-tensors):"
    for command in commands:
        assert run(capsys, *command, "--device", "cpu")[0] == 0, command
    snippet = [line.strip() for line in after[3:]]
    assert len(snippet) == 3 and str(tmp_path / "d" / "fp8") in snippet[1]
    exec("\n".join(snippet), {})
    printed = capsys.readouterr().out
    assert re.fullmatch(r"tensor\(\[\[ +1, +2, +3(, +\d+){1,8}\]\]\)\n", printed), (
        printed
    )  # prompt, then up to 8 new tokens


def test_the_demo_reruns_into_its_own_folder_but_never_writes_over_other_files(tmp_path, capsys):
    """DIR/source holding the demo (an earlier `demo DIR`) is kept; holding anything else under the demo's
    common file names, it is refused with one line and left as it was."""
    assert run(capsys, "demo", tmp_path / "d", "--device", "cpu")[0] == 0
    before = tree_bytes(tmp_path / "d" / "source")
    rc, out, err = run(capsys, "demo", tmp_path / "d", "--device", "cpu")
    assert rc == 0, err
    assert tree_bytes(tmp_path / "d" / "source") == before and looks_complete(tmp_path / "d" / "fp8")
    mine = tmp_path / "mine" / "source"
    mine.mkdir(parents=True)
    (mine / "config.json").write_text('{"mine": 1}')
    (mine / "model-00001-of-00002.safetensors").write_text("precious")
    rc, out, err = run(capsys, "demo", tmp_path / "mine", "--device", "cpu")
    assert rc == 1 and err.count("\n") == 1 and f"{mine}: holds files that are not the demo model's" in err, err
    assert tree_bytes(mine) == {"config.json": b'{"mine": 1}', "model-00001-of-00002.safetensors": b"precious"}
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["source"]


def test_inspect_speaks_in_singulars_where_there_is_one(tmp_path, capsys):
    src = make_demo_model(tmp_path / "src")
    rc, out, err = run(capsys, "inspect", src, "--device", "cpu")
    assert rc == 0, err
    assert "in 1 shard " in out and "ignore list 1 module:" in out and "1 tensor " in out
    assert not re.search(r"\b1 (tensors|shards|modules|units|batches)\b", out), out


def test_inspect_json_is_the_same_in_every_process(tmp_path):
    """`fused_groups` lists the groups in plan order: a set's order would change with the hash seed."""
    src = make_demo_model(tmp_path / "src")
    outputs = set()
    for seed in range(1, 5):
        proc = cli_subprocess(["inspect", src, "--json"], env_extra={"PYTHONHASHSEED": str(seed)})
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.add(out)
    assert len(outputs) == 1
    assert list(json.loads(outputs.pop())["fused_groups"]) == ["gate_proj/up_proj", "q_proj/k_proj/v_proj"]


def test_settings_from_takes_the_parameters_named_as_fields_and_leaves_the_unset_to_the_defaults(monkeypatch):
    """A command's locals() become Settings: other names are skipped, None or a flag left off is the field's
    default (so $FP8CONVERT_WRITE_UNLOADABLE still decides), and the token falls back to $HF_TOKEN."""
    from fp8convert.cli._options import settings_from

    monkeypatch.setenv("FP8CONVERT_WRITE_UNLOADABLE", "1")
    monkeypatch.setenv("HF_TOKEN", "from-env")
    params = {"src": "s", "quiet": True, "scheme": ["FP8_BLOCK"], "ignore": None, "target_tp": [4, 2]}
    settings = settings_from({**params, "write_unloadable": False, "token": None}, progress=True)
    assert (settings.scheme, settings.ignore, settings.target_tp) == ("block", (), (2, 4))
    assert settings.write_unloadable and settings.progress and settings.token == "from-env"
    assert settings_from({"token": "given"}).token == "given"


def test_the_api_takes_one_ignore_pattern_or_one_tp_size_alone(tmp_path):
    """ignore="re:..." is one pattern (it was read letter by letter: '*' kept every weight), target_tp=3 one size."""
    plan = api.make_plan(write_checkpoint(tmp_path / "src"), ignore="re:.*down_proj$", target_tp=3)
    assert plan.options.ignore == ("re:.*down_proj$",) and plan.options.target_tp == (3,)
    kept = {t.name for t in plan.tensors if not t.quantize and t.name.endswith("_proj.weight")}
    assert kept and all(name.endswith("down_proj.weight") for name in kept), kept


def test_the_api_takes_one_recipe_rule_alone_and_refuses_values_of_the_wrong_kind(tmp_path):
    """recipe="PATTERN=SCHEME" is one rule (it was read letter by letter); a switch given "no", a size given
    True, a prefetch_threads below 1 (it failed in the reading threads, with their tracebacks) or settings
    that are not a Settings are refused in one line naming the keyword."""
    from fp8convert.errors import UsageError

    src = write_checkpoint(tmp_path / "src")
    plan = api.make_plan(src, recipe="re:.*down_proj$=channel")
    assert plan.options.recipe == (("re:.*down_proj$", "channel"),)
    assert api.make_plan(src, ignore=None).options.ignore == ()
    for keywords, says in [
        ({"overwrite": "no"}, "overwrite='no': expected True or False"),
        ({"max_shard_size": True}, "max_shard_size: cannot read True as a size"),
        ({"prefetch_threads": -3}, "prefetch_threads=-3: expected a whole number of threads, 1 or more"),
        ({"prefetch_threads": 0}, "prefetch_threads=0"),
    ]:
        with pytest.raises(UsageError, match=re.escape(says)):
            api.quantize(src, tmp_path / "out", **keywords)
    with pytest.raises(TypeError, match="settings must be an fp8convert.Settings, got 'block'"):
        api.quantize(src, tmp_path / "out", "block")
    assert not (tmp_path / "out").exists()


def test_units_helpers():
    assert [plural(n, "tensor") for n in (0, 1, 2)] == ["0 tensors", "1 tensor", "2 tensors"]
    assert format_size(6_320_000) == "6.32 MB" and format_size(999) == "999 B"
    from fp8convert.options import parse_size

    for n in (5 * 10**9, 2**31, 30_000, 1_500_000_000, 123_456_789, 512 << 20):
        assert parse_size(size_text(n)) == n
    assert (size_text(5 * 10**9), size_text(2**31), size_text(30_000)) == ("5GB", "2GiB", "30KB")
    assert size_option(3 * 2**30 // 2) == "1536MiB" and size_option(2**31) == "2GiB"


# ---------------------------------------------------------------- usage errors, scheme names, -q


def usage_error(rc: int, out: str, err: str) -> str:
    """The one `error:` line of a usage error: exit 2, nothing on stdout."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and not out and "Traceback" not in err, (rc, out, err)
    return lines[0]


@pytest.mark.parametrize(
    "command,option,value,meant",
    [
        ("quantize", "--scheme", "chanel", "channel"),
        ("quantize", "--format", "compresed-tensors", "compressed-tensors"),
        ("quantize", "--scale-format", "ue8mo", "ue8m0"),
        ("quantize", "--device", "cdua", "cuda"),
        ("inspect", "--scheme", "FP8_DYNAMC", "fp8_dynamic"),
        ("dequantize", "--dtype", "bf61", "bf16"),
    ],
)
def test_a_misspelt_option_value_exits_2_and_offers_the_close_match(tmp_path, capsys, command, option, value, meant):
    src = write_checkpoint(tmp_path / "src")
    outs = [] if command == "inspect" else [tmp_path / "out"]
    line = usage_error(*run(capsys, command, src, *outs, option, value))
    assert f"{option} {value!r}" in line and line.endswith(f"did you mean {meant!r}?"), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["--format", "fp8", "--scheme", "channel"],  # options that do not go together
        ["--max-shard-size", "5XB"],
        ["--target-tp", "0"],
        ["--ignore", "re:(unclosed"],
        ["--private"],  # only with --push-to-hub
        ["--push-to-hub", "not a repo"],
        ["--worker", "3/2"],
        ["--devices", "gpu0"],
    ],
)
def test_every_wrong_command_line_exits_2(tmp_path, capsys, args):
    src = write_checkpoint(tmp_path / "src")
    usage_error(*run(capsys, "quantize", src, tmp_path / "out", *args))
    assert not (tmp_path / "out").exists()


def test_a_command_line_wrong_twice_names_the_scheme_and_format_first(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src")
    args = ["--format", "fp8", "--scheme", "channel", "--max-shard-size", "5XB"]
    line = usage_error(*run(capsys, "quantize", src, tmp_path / "out", *args))
    assert "--format fp8 has no per-channel scheme" in line, line


@pytest.mark.parametrize("args", [["--scheme", "chanel"], ["--shceme", "channel"], ["--worst", "3"]])
def test_a_usage_error_with_json_prints_the_error_object(tmp_path, capsys, args):
    """Whether fp8convert or the option parser refuses the command line: exit 2 and, with --json, the
    error object on stdout (the parser's own usage text stays on stderr)."""
    src = write_checkpoint(tmp_path / "src")
    rc, out, err = run(capsys, "quantize", src, tmp_path / "out", *args, "--json")
    doc = json.loads(out)
    assert rc == 2 and doc["ok"] is False and doc["exit_code"] == 2, (rc, out, err)
    assert doc["error"] and doc["error"].split(";")[0] in " ".join(err.split()), (doc, err)


def test_llm_compressor_scheme_names_give_the_same_bytes(tmp_path, capsys):
    """FP8, FP8_DYNAMIC, FP8_BLOCK and MXFP8, in any case, are the schemes they name: from the command
    line, the Python API and a jobs file alike; inspect says which scheme it chose."""
    import fp8convert
    from fp8convert.cluster.batch import read_jobs

    src = write_checkpoint(tmp_path / "src")
    for alias, scheme in [("FP8", "tensor"), ("fp8_dynamic", "channel"), ("FP8_BLOCK", "block"), ("MXFP8", "mxfp8")]:
        assert run(capsys, "quantize", src, tmp_path / scheme, "--scheme", scheme, "--device", "cpu", "-q")[0] == 0
        rc, out, err = run(capsys, "quantize", src, tmp_path / alias, "--scheme", alias, "--device", "cpu", "-q")
        assert rc == 0, err
        assert tree_bytes(tmp_path / alias) == tree_bytes(tmp_path / scheme), alias
        rc, out, err = run(capsys, "inspect", src, "--scheme", alias)
        assert rc == 0 and re.search(rf"^scheme +{scheme} \(from {alias}\) ", out, re.M), out
        assert json.loads(run(capsys, "inspect", src, "--scheme", alias, "--json")[1])["scheme"] == scheme
    report = fp8convert.quantize(src, tmp_path / "api", scheme="FP8_DYNAMIC", device="cpu")
    assert report.scheme == "channel" and tree_bytes(tmp_path / "api") == tree_bytes(tmp_path / "channel")
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(f'[[job]]\nsource = "{src}"\nout = "{tmp_path / "j"}"\nscheme = "Fp8_Block"\n')
    assert read_jobs(jobs)[0].settings.scheme == "block"


def moe_checkpoint(root) -> Path:
    """A Qwen3-MoE-named checkpoint: four experts per layer, each 128 wide."""
    tensors = llama_tensors()
    g = torch.Generator().manual_seed(1)
    for n in range(2):
        mlp = f"model.layers.{n}.mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del tensors[f"{mlp}{name}.weight"]
        tensors[mlp + "gate.weight"] = torch.randn(4, 64, generator=g).bfloat16()
        for e in range(4):
            for name, shape in (("gate_proj", (128, 64)), ("up_proj", (128, 64)), ("down_proj", (64, 128))):
                tensors[f"{mlp}experts.{e}.{name}.weight"] = torch.randn(*shape, generator=g).bfloat16()
    from tiny_ckpt import CONFIG

    config = dict(
        CONFIG,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
    )
    return write_checkpoint(root, tensors, config)


MOE_WARNING = "warning: transformers cannot load compressed-tensors block scales for MoE experts"
IGNORE_WARNING = "--ignore 're:.*down_prj\\.' matched no weight that would otherwise be quantized"  # one backslash


def test_quiet_drops_progress_and_the_summary_but_never_a_warning(tmp_path, capsys):
    src = moe_checkpoint(tmp_path / "src")
    args = ["--scheme", "block", "--ignore", "re:.*down_prj\\.", "--device", "cpu"]
    rc, out, err = run(capsys, "quantize", src, tmp_path / "out", *args, "-q")
    assert rc == 0 and out == "", (out, err)
    assert MOE_WARNING in err and f"warning: {IGNORE_WARNING}" in err, err
    assert all(line.startswith(("warning: ", "note: ")) for line in err.splitlines()), err  # no progress
    rc, out, err = run(capsys, "quantize", src, tmp_path / "out", *args)  # without -q: the summary
    assert rc == 0 and out.startswith(f"{tmp_path / 'out'}: already complete") and MOE_WARNING in err, (out, err)

    jobs = tmp_path / "jobs.toml"
    jobs.write_text(
        f'[[job]]\nname = "moe"\nsource = "{src}"\nout = "{tmp_path / "b"}"\nscheme = "block"\n'
        f'ignore = ["re:.*down_prj\\\\."]\ndevice = "cpu"\n'
    )
    rc, out, err = run(capsys, "batch", jobs, "-q")
    assert rc == 0 and "done" in out, (out, err)
    assert f"warning: job 0 (moe): {IGNORE_WARNING}" in err and "job 0 (moe): transformers cannot load" in err, err


def test_json_lists_warnings_under_warnings_not_notes(tmp_path, capsys):
    src = moe_checkpoint(tmp_path / "src")
    args = ["--scheme", "block", "--ignore", "re:.*down_prj\\.", "--json"]
    for command in (["quantize", src, tmp_path / "out", "-q", "--device", "cpu"], ["inspect", src]):
        rc, out, err = run(capsys, *command, *args)
        doc = json.loads(out)
        assert rc == 0 and doc["ok"] is True and IGNORE_WARNING in doc["warnings"], doc["warnings"]
        assert any(w.startswith("transformers cannot load compressed-tensors block scales") for w in doc["warnings"])
        assert not any("--ignore" in n for n in doc["notes"]), doc["notes"]
        assert f"warning: {IGNORE_WARNING}" in err or command[0] == "inspect", err


def test_demo_takes_json(tmp_path, capsys):
    rc, out, err = run(capsys, "demo", tmp_path / "d", "--device", "cpu", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] is True and doc["out_dir"] == str(tmp_path / "d" / "fp8"), (out, err)
    assert doc["complete"] is True
    assert doc["tensors_quantized"] == 28 and "built demo model" in err
    assert looks_complete(tmp_path / "d" / "fp8")


# ---------------------------------------------------------------- how failures end


def test_json_failure_prints_an_error_object(tmp_path, capsys):
    """--json promises a JSON document on stdout: a failing command prints an error object there."""
    rc, out, err = run(capsys, "quantize", tmp_path / "nope", tmp_path / "out", "--json", "-q")
    assert rc == 1 and err.startswith("error: ")
    doc = json.loads(out)
    assert doc == {"ok": False, "error": err.strip().removeprefix("error: "), "exit_code": 1}
    rc, out, err = run(capsys, "inspect", tmp_path / "nope", "--json")
    assert rc == 1 and json.loads(out)["error"] in err


def test_json_failure_after_the_commands_own_document_prints_no_second_one(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    assert run(capsys, "quantize", src, out, "-q")[0] == 0
    (out / "config.json").write_text("{}")
    rc, stdout, err = run(capsys, "verify", src, out, "--json")
    assert rc == 1 and json.loads(stdout)["ok"] is False  # one document: the verify report


def fails_with(monkeypatch, error: BaseException):
    """Make the quantize API raise `error` (what some library or the OS would raise mid-run)."""

    def boom(*args, **kwargs):
        raise error

    monkeypatch.setattr(api, "quantize", boom)


@pytest.mark.parametrize(
    "error,expected",
    [
        (
            PermissionError(errno.EACCES, "Permission denied", "/data/model/config.json"),
            r"^error: /data/model/config.json: Permission denied$",
        ),
        (
            OSError(errno.EIO, "Input/output error", "/data/model/model-00001-of-00002.safetensors"),
            r"^error: /data/model/model-00001-of-00002.safetensors: Input/output error$",
        ),
        (
            IsADirectoryError(errno.EISDIR, "Is a directory", "/data/x", None, "/data/y"),
            r"^error: /data/x -> /data/y: Is a directory$",
        ),
        (
            ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
            r"^error: network error \(ConnectionResetError: .*Connection reset by peer\); check the connection",
        ),
        (MemoryError(), r"^error: out of host memory \(MemoryError\); try a smaller batch: --max-resident 512MiB"),
        (
            ValueError("something odd\nsecond line"),
            r"^error: unexpected ValueError: something odd "
            r"\(run with FP8CONVERT_DEBUG=1 to see where; please report it\)$",
        ),
    ],
)
def test_errors_other_than_fp8converts_own_are_one_line(tmp_path, capsys, monkeypatch, error, expected):
    monkeypatch.delenv("FP8CONVERT_DEBUG", raising=False)
    if isinstance(error, MemoryError):
        error.max_resident = 1 << 30  # as the pipeline notes it: the CPU default
    fails_with(monkeypatch, error)
    rc, out, err = run(capsys, "quantize", tmp_path / "a", tmp_path / "b", "-q")
    assert rc == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.search(expected, err.strip()), err


def test_disk_full_says_how_much_is_free_and_needed(tmp_path, capsys, monkeypatch):
    error = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "config.json"))
    error.bytes_needed = 3 * 10**9
    (tmp_path / "out").mkdir()
    fails_with(monkeypatch, error)
    rc, _, err = run(capsys, "quantize", tmp_path / "a", tmp_path / "out", "-q")
    assert rc == 1 and "Traceback" not in err
    assert re.search(
        r"config.json: no space left on the device \(\d+\.\d\d [KMGT]?B free there\); 3.00 GB more is "
        r"needed; free space and rerun the same command to resume",
        err,
    ), err


class FullStream(io.StringIO):
    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize(
    "args",
    [["quantize", "{src}", "{out}"], ["inspect", "{src}"], ["verify", "{src}", "{ref}", "-q"], ["demo", "{demo}"]],
)
def test_a_result_that_cannot_reach_stdout_is_one_line_naming_stdout(tmp_path, capsys, monkeypatch, args):
    """`> out.txt` on a full disk: the line names stdout (not "a file ... resume"), and the output is kept."""
    src = make_demo_model(tmp_path / "src")
    assert main(["quantize", str(src), str(tmp_path / "ref"), "-q", "--device", "cpu"]) == 0
    paths = {"src": src, "out": tmp_path / "out", "ref": tmp_path / "ref", "demo": tmp_path / "demo"}
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", FullStream())
    rc = main([a.format(**paths) for a in args])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 1 and "Traceback" not in err, err
    assert errors == ["error: stdout: cannot write the output (No space left on device)"], err
    if args[0] == "quantize":
        assert looks_complete(tmp_path / "out")


def test_a_line_meant_for_stderr_that_cannot_be_written_names_stderr(monkeypatch):
    from fp8convert.cli._options import print_out

    monkeypatch.setattr(sys, "stderr", FullStream())
    with pytest.raises(FP8ConvertError, match=r"^stderr: cannot write the output \(No space left on device\)$"):
        print_out("built demo model x", stderr=True)


def test_disk_full_while_writing_a_shard_says_free_and_needed(tmp_path, capsys, monkeypatch):
    """The shard writer's own full disk (pwrite failing with ENOSPC) reaches the same line: the partial
    shard named, the space free there and the bytes still to write."""
    import fp8convert.run.writer as writer_module

    src = write_checkpoint(tmp_path / "src")

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer_module.os, "pwrite", full)
    rc, _, err = run(capsys, "quantize", src, tmp_path / "out", "-q", "--device", "cpu")
    assert rc == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.search(
        r"\.safetensors\.partial: no space left on the device \(\d+\.\d\d [KMGT]?B free there\); "
        r"\d+\.\d\d [KMGT]?B more is needed; free space and rerun the same command to resume",
        err,
    ), err


def test_cuda_out_of_memory_suggests_a_smaller_budget(tmp_path, capsys, monkeypatch):
    """torch's CUDA out-of-memory error, as the pipeline lets it through (budget noted on it)."""
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)")
    error.max_resident = 4 << 30
    fails_with(monkeypatch, error)
    rc, _, err = run(capsys, "quantize", tmp_path / "a", tmp_path / "b", "-q")
    assert rc == 1 and err.strip() == (
        "error: CUDA out of memory (CUDA out of memory. Tried to allocate 2.00 GiB "
        "(GPU 0; 79.1 GiB total)); try a smaller batch: --max-resident 2GiB"
    )


def test_out_of_memory_in_the_pipeline_carries_the_budget(tmp_path, capsys, monkeypatch):
    """A real run: the quantize stage runs out of memory; the line suggests half the budget it used."""
    import fp8convert.run.pipeline as pipeline

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(pipeline, "quantize_steps", oom)
    src = write_checkpoint(tmp_path / "src")
    rc, _, err = run(capsys, "quantize", src, tmp_path / "out", "-q", "--device", "cpu", "--max-resident", "3GiB")
    assert rc == 1 and "--max-resident 1536MiB" in err and "Traceback" not in err, err


def test_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    fails_with(monkeypatch, ValueError("odd"))
    monkeypatch.setenv("FP8CONVERT_DEBUG", "1")
    rc, _, err = run(capsys, "quantize", tmp_path / "a", tmp_path / "b")
    assert (
        rc == 1
        and "Traceback (most recent call last)" in err
        and err.strip().endswith(
            "error: unexpected ValueError: odd (run with FP8CONVERT_DEBUG=1 to see where; please report it)"
        )
    )
    rc, _, err = run(capsys, "inspect", tmp_path / "missing")
    assert rc == 1 and "Traceback" in err and "FP8ConvertError" in err


def test_interrupt_lines_say_what_a_rerun_does():
    assert _failures.stop_line("quantize", False) == "interrupted: rerun the same command to resume"
    assert _failures.stop_line("verify", False) == "interrupted: nothing was changed; rerun it to verify"
    assert _failures.stop_line("push", True) == "terminated (SIGTERM): rerun the same push to resume the upload"
    assert "resume" not in _failures.stop_line("inspect", False)


def test_ctrl_c_in_verify_does_not_promise_a_resume(tmp_path, capsys, monkeypatch):
    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    assert run(capsys, "quantize", src, out, "-q")[0] == 0
    import fp8convert.verify as verify_mod

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(verify_mod, "verify", interrupted)
    rc, _, err = run(capsys, "verify", src, out)
    assert rc == 130 and err.strip() == "interrupted: nothing was changed; rerun it to verify"
    # with --json, stdout holds the error document as for any other failure (it held nothing)
    rc, stdout, err = run(capsys, "verify", src, out, "--json")
    assert rc == 130 and json.loads(stdout) == {"ok": False, "error": err.strip(), "exit_code": 130}


# ---------------------------------------------------------------- SIGTERM, as Slurm and Kubernetes stop jobs


def wait_for(predicate, proc, timeout=60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(f"exited early: {proc.communicate()}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail("timed out")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A 4-shard demo checkpoint and the bytes of its one-process conversion in 1 MB shards."""
    base = tmp_path_factory.mktemp("sigterm")
    src = make_demo_model(base / "src", shards=4)
    assert main(["quantize", str(src), str(base / "ref"), "-q", "--device", "cpu", "--max-shard-size", "1MB"]) == 0
    return src, tree_bytes(base / "ref")


@pytest.mark.slow
def test_sigterm_mid_run_is_one_line_exit_143_and_resumable(demo, tmp_path):
    src, reference = demo
    out = tmp_path / "out"
    proc = cli_subprocess(["quantize", src, out, "--device", "cpu", "--max-shard-size", "1MB", "-q"], write_delay=0.05)
    wait_for(lambda: len(list(out.glob("model-*.safetensors"))) >= 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip() == "terminated (SIGTERM): rerun the same command to resume"
    assert not looks_complete(out)
    assert main(["quantize", str(src), str(out), "-q", "--device", "cpu", "--max-shard-size", "1MB"]) == 0
    assert tree_bytes(out) == reference


# A worker that finds every shard written takes the finalize claim, then is held in finalize (a marker
# file says so) until SIGTERM arrives.
HELD_IN_FINALIZE = (
    "import sys, time, pathlib; from fp8convert.cluster import workers; real = workers.finalize; "
    "marker = pathlib.Path(sys.argv.pop(1)); "
    "workers.finalize = lambda *a, **k: (marker.write_text('in'), time.sleep(60), real(*a, **k))[-1]; "
    "from fp8convert.cli import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.slow
def test_sigterm_while_finalizing_releases_the_claim(demo, tmp_path):
    src, reference = demo
    out = tmp_path / "out"
    args = ["quantize", str(src), str(out), "--device", "cpu", "--max-shard-size", "1MB", "-q"]
    assert main([*args, "--worker", "0/2"]) == 0
    marker = tmp_path / "in-finalize"
    proc = subprocess.Popen(
        [sys.executable, "-c", HELD_IN_FINALIZE, str(marker), *args, "--worker", "1/2"],
        cwd=Path(__file__).parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    claim = out / ".fp8convert" / "finalize.claim"
    wait_for(marker.exists, proc)
    assert claim.exists()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and err.strip() == "terminated (SIGTERM): rerun the same command to resume", err
    assert not claim.exists() and not looks_complete(out)
    assert main(["finalize", str(out)]) == 0
    assert tree_bytes(out) == reference


# Every process of the run (the --devices workers are spawned: they import afresh) writes slowly.
SLOW_EVERYWHERE = (
    "from fp8convert.run.writer import ShardWriter\nimport time\nwrite = ShardWriter.write\n"
    "ShardWriter.write = lambda self, *a, **k: (time.sleep({delay}), write(self, *a, **k))[1]\n"
)


@pytest.mark.slow
def test_sigterm_reaches_the_device_workers(demo, tmp_path):
    """--devices: a SIGTERM sent to the parent alone (Kubernetes signals PID 1) stops its workers too,
    instead of the parent waiting for them to finish the whole conversion."""
    src, _ = demo
    out = tmp_path / "out"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_EVERYWHERE.format(delay=0.5))
    proc = cli_subprocess(
        ["quantize", src, out, "--devices", "cpu,cpu", "--max-shard-size", "1MB", "-q"],
        env_extra={"PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).parents[2])])},
    )
    wait_for(lambda: any(out.glob(".fp8convert/*.partial")), proc)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and time.monotonic() - started < 10, err
    assert "terminated (SIGTERM)" in err and not looks_complete(out)


def test_plain_progress_lines_use_the_units_of_the_sizes():
    """Without a terminal, progress is a timestamped line per interval; a demo-sized model reads in MB,
    not '0.01/0.01 GB'."""
    stream = io.StringIO()
    bar = Progress(5_770_000, "quantize demo", stream=stream)
    bar.advance(5_770_000)
    line = stream.getvalue().strip()
    assert re.fullmatch(r"\S+ quantize demo: 5\.77 MB of 5\.77 MB \(100%\), \d+\.\d\d [KMGT]B/s, eta 0s", line), line


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("columns", [80, 60])
def test_the_progress_bar_fits_the_terminal_on_one_line(monkeypatch, columns):
    """A long source path and layer name are shortened; the bar and its sizes stay on one line."""
    monkeypatch.setenv("COLUMNS", str(columns))
    stream = FakeTerminal()
    bar = Progress(456_700_000_000, "quantize /models/meta-llama/Llama-3.1-405B-Instruct", stream=stream)
    layer = "model.layers.125.mlp.experts.gate_up_proj (part 12/16)"
    bar.advance(123_400_000_000, layer)
    bar.close()
    frames = [
        line
        for line in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", stream.getvalue()).replace("\r", "\n").split("\n")
        if line.strip()
    ]
    assert frames and all(len(line) <= columns for line in frames), frames
    assert all(re.search(r" ━[━╸╺]+ \d+\.\d/456\.7 GB ", line) for line in frames), frames
    start, end = frames[-1].split(" ━")[0].split("…")  # shortened in the middle: which run, which layer
    assert bar.label.startswith(start) and layer.endswith(end) and len(start + end) >= 10, frames


# The program as installed (`run`), with an atexit hook that leaves a file: it shows whether the
# interpreter's teardown ran.
PROGRAM_WITH_ATEXIT_MARK = (
    "import atexit, pathlib, sys; mark = pathlib.Path(sys.argv.pop(1)); "
    "atexit.register(lambda: mark.write_text('torn down')); "
    "from fp8convert.cli import run; run(sys.argv[1:])"
)


def program(mark: Path, *args, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PROGRAM_WITH_ATEXIT_MARK, str(mark), *map(str, args)],
        cwd=Path(__file__).parents[2],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
    )


# The program, as `fp8convert` starts it, with Ctrl-C landing while the command line is imported (typer is
# its first import)
CTRL_C_DURING_IMPORTS = (
    "import builtins, sys; real = builtins.__import__\n"
    "def interrupted(name, *a, **k):\n"
    "    if name == 'typer':\n"
    "        raise KeyboardInterrupt\n"
    "    return real(name, *a, **k)\n"
    "builtins.__import__ = interrupted\n"
    "from fp8convert.__main__ import main; sys.argv[1:] = ['inspect', 'anything']; main()"
)


@pytest.mark.slow
def test_ctrl_c_while_the_program_imports_itself_is_one_line_and_130():
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_DURING_IMPORTS],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr == "interrupted before the command started: nothing was read or written\n"


@pytest.mark.slow
def test_the_program_skips_teardown_once_torch_is_loaded_and_loses_no_output(tmp_path):
    """A conversion (torch loaded) exits without the teardown, its whole JSON report flushed down the
    pipe; a failure keeps its exit code and its one line; a command without torch exits as usual."""
    src = write_checkpoint(tmp_path / "src", llama_tensors(dtype=torch.float16))  # FP16: only torch quantizes it
    done = program(tmp_path / "mark1", "quantize", src, tmp_path / "out", "--device", "cpu", "-q", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tensors_quantized"] > 0 and looks_complete(tmp_path / "out")
    assert not (tmp_path / "mark1").exists()

    tensors = llama_tensors(dtype=torch.float16)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 4] = float("nan")  # found once torch quantizes
    bad = write_checkpoint(tmp_path / "bad", tensors)
    failed = program(tmp_path / "mark2", "quantize", bad, tmp_path / "out2", "--device", "cpu", "--json")
    assert failed.returncode != 0 and len(failed.stderr.strip().splitlines()) == 1, failed.stderr
    assert "up_proj" in failed.stderr and "NaN" in json.loads(failed.stdout)["error"]
    assert not (tmp_path / "mark2").exists()

    with open("/dev/full", "w") as full:  # every write to stdout fails (no space left): a failure, one line
        unflushed = program(
            tmp_path / "mark4", "quantize", src, tmp_path / "out4", "--device", "cpu", "-q", "--json", stdout=full
        )
    err = unflushed.stderr
    assert unflushed.returncode != 0 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "stdout" in err and "space" in err.lower(), err

    help_only = program(tmp_path / "mark3", "--version")
    assert help_only.returncode == 0 and __version__ in help_only.stdout
    assert (tmp_path / "mark3").read_text() == "torn down"


@pytest.mark.parametrize("failure", [BrokenPipeError(32, "Broken pipe"), ValueError("I/O operation on closed file")])
def test_the_program_fails_when_its_last_output_cannot_be_flushed(monkeypatch, capsys, failure):
    """A report that could not leave the process is no success: exit 120, as Python's own exit does."""
    import fp8convert.cli as cli

    class Unflushable(io.StringIO):
        def flush(self):
            raise failure

    exits = []
    monkeypatch.setattr(cli, "main", lambda argv: 0)
    monkeypatch.setattr(cli.sys, "stdout", Unflushable())
    monkeypatch.setattr(cli.os, "_exit", exits.append)
    cli.run([])
    assert exits == [120]
    assert capsys.readouterr().err.startswith("error: cannot write the output to stdout")
