"""A corpus of bad inputs. Each must end in one `error:` line naming the file or tensor, a non-zero
exit code, and no output that looks complete; inputs the headers already condemn must fail before
OUT is even created (preflight: seconds, not 97 %). Plus the edge inputs that are valid."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_ckpt import (
    CONFIG,
    INDEX,
    assert_refused,
    llama_tensors,
    looks_complete,
    rewrite_index,
    run_cli,
    tree_bytes,
    write_checkpoint,
    write_raw,
)

from fp8convert.cli import main
from fp8convert.run import prefetch

SHARD2 = "model-00002-of-00003.safetensors"  # layer 1 (shard_by_layer: layer 0, layer 1, the rest)


# ---------------------------------------------------------------- broken files and indexes
# Each builder gets a valid checkpoint directory, breaks it, and returns the names the error must contain.


def truncated_shard(src):
    path = src / SHARD2
    path.write_bytes(path.read_bytes()[:-10])
    return str(src / SHARD2), "truncated"  # the whole path: a batch converts many models


def trailing_bytes(src):
    with open(src / SHARD2, "ab") as f:
        f.write(b"\0" * 8)
    return str(src / SHARD2), "file has trailing bytes"


def corrupt_header_json(src):
    data = bytearray((src / SHARD2).read_bytes())
    data[8:20] = b"#" * 12
    (src / SHARD2).write_bytes(bytes(data))
    return str(src / SHARD2), "corrupt safetensors header"


def oversized_header(src):
    data = bytearray((src / SHARD2).read_bytes())
    data[:8] = struct.pack("<Q", 2**40)
    (src / SHARD2).write_bytes(bytes(data))
    return SHARD2, "corrupt safetensors header"


def header_longer_than_file(src):
    data = bytearray((src / SHARD2).read_bytes())
    data[:8] = struct.pack("<Q", len(data))
    (src / SHARD2).write_bytes(bytes(data))
    return SHARD2, "corrupt safetensors header"


def short_file(src):
    (src / SHARD2).write_bytes(b"\x01\x02")
    return str(src / SHARD2), "not a safetensors file"


def shape_disagrees_with_bytes(src):
    write_raw(
        src / SHARD2,
        {"model.layers.1.x.weight": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 30]}},
        b"\0" * 30,
    )
    rewrite_index(src, lambda ix: ix.update(weight_map={"model.layers.1.x.weight": SHARD2}))
    return SHARD2, "model.layers.1.x.weight"


def overlapping_tensors(src):
    write_raw(
        src / SHARD2,
        {
            "a.weight": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]},
            "b.weight": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]},
        },
        b"\0" * 8,
    )
    rewrite_index(src, lambda ix: ix.update(weight_map={"a.weight": SHARD2, "b.weight": SHARD2}))
    return SHARD2, "overlaps"


def non_integer_shape(src):
    write_raw(src / SHARD2, {"a.weight": {"dtype": "BF16", "shape": [2.5, 2], "data_offsets": [0, 8]}}, b"\0" * 8)
    rewrite_index(src, lambda ix: ix.update(weight_map={"a.weight": SHARD2}))
    return SHARD2, "a.weight"


def unsupported_dtype(src):
    # F8_E8M0 is a real safetensors dtype (MX scales) that no BF16 -> FP8 conversion can take
    write_raw(
        src / SHARD2,
        {"model.layers.1.mlp.up_proj.weight": {"dtype": "F8_E8M0", "shape": [16, 16], "data_offsets": [0, 256]}},
        b"\0" * 256,
    )
    rewrite_index(src, lambda ix: ix.update(weight_map={"model.layers.1.mlp.up_proj.weight": SHARD2}))
    return SHARD2, "model.layers.1.mlp.up_proj.weight", "F8_E8M0"


def named_twice_in_one_header(src):
    entry = '{"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}'
    raw = f'{{"model.norm.weight": {entry}, "model.norm.weight": {entry}}}'.encode()
    (src / SHARD2).write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)
    rewrite_index(src, lambda ix: ix.update(weight_map={"model.norm.weight": SHARD2}))
    return SHARD2, "model.norm.weight", "twice"


def named_twice_in_two_shards(src):
    os.remove(src / INDEX)  # without an index every *.safetensors is read
    extra = {"model.layers.0.mlp.up_proj.weight": torch.zeros(16, 16, dtype=torch.bfloat16)}
    save_file(extra, str(src / "extra.safetensors"))
    return (f"{src}: tensor model.layers.0.mlp.up_proj.weight appears twice",)  # which checkpoint: a batch has many


def index_names_missing_file(src):
    rewrite_index(src, lambda ix: ix["weight_map"].update({"model.norm.weight": "model-00009-of-00009.safetensors"}))
    return (f"{src / INDEX}: names model-00009-of-00009.safetensors, which does not exist",)


def index_dotdot(src):
    rewrite_index(src, lambda ix: ix["weight_map"].update({"model.norm.weight": "../outside.safetensors"}))
    return "../outside.safetensors"


def index_dotdot_inside(src):
    rewrite_index(src, lambda ix: ix["weight_map"].update({"model.norm.weight": f"sub/../{SHARD2}"}))
    return f"sub/../{SHARD2}"


def index_absolute(src):
    rewrite_index(src, lambda ix: ix["weight_map"].update({"model.norm.weight": str(src / SHARD2)}))
    return str(src / SHARD2)


def index_names_absent_tensor(src):
    rewrite_index(src, lambda ix: ix["weight_map"].update({"model.layers.1.ghost.weight": SHARD2}))
    return str(src / INDEX), "model.layers.1.ghost.weight", SHARD2


def index_wrong_file(src):
    rewrite_index(
        src,
        lambda ix: ix["weight_map"].update({"model.layers.1.mlp.up_proj.weight": "model-00001-of-00003.safetensors"}),
    )
    return str(src / INDEX), "model.layers.1.mlp.up_proj.weight", "model-00001-of-00003.safetensors", SHARD2


def index_omits_tensor(src):
    rewrite_index(src, lambda ix: ix["weight_map"].pop("model.layers.1.mlp.up_proj.weight"))
    return str(src / INDEX), "model.layers.1.mlp.up_proj.weight", SHARD2


def index_file_name_not_text(src):
    rewrite_index(src, lambda ix: ix["weight_map"].update({"model.norm.weight": [SHARD2]}))
    return INDEX, "model.norm.weight"


def index_not_json(src):
    (src / INDEX).write_text("{not json")
    return INDEX


def index_without_weight_map(src):
    (src / INDEX).write_text('{"metadata": {}}')
    return INDEX


def config_missing(src):
    os.remove(src / "config.json")
    return "config.json"


def config_is_a_directory(src):
    os.remove(src / "config.json")
    (src / "config.json").mkdir()
    return str(src / "config.json"), "cannot read"


def config_not_json(src):
    (src / "config.json").write_text("[1, 2")
    return "config.json"


def fp8_config_without_fp8_tensors(src):
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (src / "config.json").write_text(json.dumps(config))
    return "config.json", "no tensor is F8_E4M3"


def already_quantized_tensors(src):
    tensors = load_file(str(src / SHARD2))
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, str(src / SHARD2))
    return SHARD2, "model.layers.1.mlp.up_proj.weight", "already quantized"


def scale_tensor_in_source(src):
    tensors = load_file(str(src / SHARD2))
    tensors["model.layers.1.mlp.up_proj.weight_scale"] = torch.ones(1)
    save_file(tensors, str(src / SHARD2))
    rewrite_index(src, lambda ix: ix["weight_map"].update({"model.layers.1.mlp.up_proj.weight_scale": SHARD2}))
    return "model.layers.1.mlp.up_proj.weight_scale", "already quantized"


def three_d_linear(src):
    tensors = load_file(str(src / SHARD2))
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    save_file(tensors, str(src / SHARD2))
    return "model.layers.1.mlp.down_proj.weight", "3-D"


def empty_shard(src):
    for f in src.glob("*.safetensors"):
        f.unlink()
    os.remove(src / INDEX)
    save_file({}, str(src / "model.safetensors"))
    return str(src), "no tensors"


def no_weights_at_all(src):
    for f in src.glob("*.safetensors"):
        f.unlink()
    os.remove(src / INDEX)
    return str(src), "no safetensors"


def pickle_only(src):
    for f in src.glob("*.safetensors"):
        f.unlink()
    os.remove(src / INDEX)
    (src / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a zip")
    return str(src), "pickle"


def numbered_shard_missing_without_index(src):
    os.remove(src / INDEX)  # the folder's files are then the checkpoint: 1 and 3 of 3
    os.remove(src / SHARD2)
    return SHARD2, "is missing"


def layer_numbering_gap(src):
    """Layer 1's tensors renamed to layer 2: layers 0 and 2 of model.layers, no 1."""
    tensors = load_file(str(src / SHARD2))
    save_file({k.replace("layers.1.", "layers.2."): v for k, v in tensors.items()}, str(src / SHARD2))
    rewrite_index(
        src,
        lambda ix: ix.update(weight_map={k.replace("layers.1.", "layers.2."): f for k, f in ix["weight_map"].items()}),
    )
    return ("model.layers 0 and 2 but not 1",)


def config_declares_more_layers(src):
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] += 2
    (src / "config.json").write_text(json.dumps(config))
    return "num_hidden_layers 4", "2 layers of model.layers"


def index_is_a_directory(src):
    os.remove(src / INDEX)
    (src / INDEX).mkdir()
    return str(src / INDEX), "not a regular file"


def shard_is_a_directory(src):
    os.remove(src / SHARD2)
    (src / SHARD2).mkdir()
    return SHARD2, "not a regular file"


BROKEN = [
    truncated_shard,
    trailing_bytes,
    corrupt_header_json,
    oversized_header,
    header_longer_than_file,
    short_file,
    shape_disagrees_with_bytes,
    overlapping_tensors,
    non_integer_shape,
    unsupported_dtype,
    named_twice_in_one_header,
    named_twice_in_two_shards,
    index_names_missing_file,
    index_dotdot,
    index_dotdot_inside,
    index_absolute,
    index_names_absent_tensor,
    index_wrong_file,
    index_omits_tensor,
    index_file_name_not_text,
    index_not_json,
    index_without_weight_map,
    config_missing,
    config_is_a_directory,
    config_not_json,
    fp8_config_without_fp8_tensors,
    already_quantized_tensors,
    scale_tensor_in_source,
    three_d_linear,
    empty_shard,
    no_weights_at_all,
    pickle_only,
    numbered_shard_missing_without_index,
    layer_numbering_gap,
    config_declares_more_layers,
    shard_is_a_directory,
    index_is_a_directory,
]


@pytest.mark.parametrize("breaker", BROKEN, ids=lambda f: f.__name__)
def test_broken_source_is_refused_before_any_output(tmp_path, capsys, breaker):
    src = write_checkpoint(tmp_path / "src")
    names = breaker(src)
    names = (names,) if isinstance(names, str) else names  # one name, not its letters
    out = tmp_path / "out"
    rc, err = run_cli(capsys, "quantize", src, out, "-q")
    assert_refused(rc, err, out, *names)
    # inspect plans from the same headers: it refuses the same way
    rc, err = run_cli(capsys, "inspect", src)
    assert rc != 0 and names[0] in err


# ---------------------------------------------------------------- bad weights (found while reading)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weight_names_the_tensor(tmp_path, capsys, value):
    tensors = llama_tensors()
    tensors["model.layers.1.self_attn.k_proj.weight"][5, 7] = value  # a fused q/k/v member
    src = write_checkpoint(tmp_path / "src", tensors)
    out = tmp_path / "out"
    rc, err = run_cli(capsys, "quantize", src, out, "-q")
    line = assert_refused(rc, err, out, "model.layers.1.self_attn.k_proj.weight", str(src / SHARD2), preflight=False)
    assert "NaN or Inf" in line
    # the repaired source is other weights: a plain rerun refuses to mix them with what was written,
    # naming the changed shard; --overwrite starts again and matches a clean conversion
    write_checkpoint(tmp_path / "src", llama_tensors())
    rc, err = run_cli(capsys, "quantize", src, out, "-q")
    assert rc == 1 and "changed since the output was started" in err and "--overwrite" in err, err
    assert "size and modification time, not its bytes" in err, err  # what it knows, and what it does not
    assert run_cli(capsys, "quantize", src, out, "-q", "--overwrite")[0] == 0
    assert run_cli(capsys, "quantize", src, tmp_path / "clean", "-q")[0] == 0
    assert tree_bytes(out) == tree_bytes(tmp_path / "clean")


@pytest.mark.parametrize("name", ["model.layers.1.input_layernorm.weight", "model.embed_tokens.weight"])
def test_non_finite_kept_weight_names_the_tensor(tmp_path, capsys, name):
    """Weights that stay in high precision are checked too: a NaN norm is as broken as a NaN linear."""
    tensors = llama_tensors()
    tensors[name].view(-1)[3] = float("nan")
    src = write_checkpoint(tmp_path / "src", tensors)
    out = tmp_path / "out"
    rc, err = run_cli(capsys, "quantize", src, out, "-q")
    assert rc != 0 and not looks_complete(out)
    assert name in err and "NaN or Inf" in err and len(err.strip().splitlines()) == 1
    assert f"error: {src}/model-0000" in err  # the shard named with its folder


def test_all_zero_weights_are_valid(tmp_path, capsys):
    tensors = {n: torch.zeros_like(t) if t.dim() == 2 else t for n, t in llama_tensors().items()}
    src = write_checkpoint(tmp_path / "src", tensors)
    for scheme in ("tensor", "channel", "block"):
        out = tmp_path / scheme
        assert run_cli(capsys, "quantize", src, out, "-q", "--scheme", scheme)[0] == 0
        converted = {}
        for shard in sorted(out.glob("model-*.safetensors")):
            converted.update(load_file(str(shard)))
        scales = {n: t for n, t in converted.items() if n.endswith("_scale")}
        assert len(scales) == 14
        for name, scale in scales.items():
            assert scale.dtype == torch.float32 and bool(torch.isfinite(scale).all()) and bool((scale > 0).all()), name
            codes = converted[name[: -len("_scale")]]
            assert codes.dtype == torch.float8_e4m3fn and not bool(codes.view(torch.uint8).any()), name
        assert run_cli(capsys, "verify", src, out)[0] == 0


# ---------------------------------------------------------------- where the output goes


def test_out_inside_src_is_refused(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src")
    out = src / "fp8"
    rc, err = run_cli(capsys, "quantize", src, out, "-q")
    assert_refused(rc, err, out, str(out), "inside")
    rc, err = run_cli(capsys, "quantize", src, src, "-q")
    assert rc != 0 and "must not be the source" in err and not (src / ".fp8convert").exists()


def test_out_containing_src_is_refused(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "out" / "src")
    before = tree_bytes(tmp_path / "out")
    rc, err = run_cli(capsys, "quantize", src, tmp_path / "out", "-q", "--overwrite")
    assert rc != 0 and "must not contain the source" in err
    assert tree_bytes(tmp_path / "out") == before  # --overwrite did not clear the source away


def test_out_with_unrelated_files_is_refused_even_with_overwrite(tmp_path, capsys):
    """`--overwrite` replaces only what fp8convert wrote: a folder of the user's own files is refused
    with or without it, naming a few of them, never suggesting --overwrite, and nothing is deleted."""
    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rc, err = run_cli(capsys, "quantize", src, out, "-q")
    line = assert_refused(rc, err, out, str(out), "notes.txt", "did not write", preflight=False)
    assert "pass --overwrite" not in line and tree_bytes(out) == {"notes.txt": b"mine"}
    rc, err = run_cli(capsys, "quantize", src, out, "-q", "--overwrite")
    line = assert_refused(rc, err, out, str(out), "notes.txt", preflight=False)
    assert "pass --overwrite" not in line and tree_bytes(out) == {"notes.txt": b"mine"}


def refusals(tmp_path, layers: int) -> tuple[list[tuple], Path, Path]:
    """Refused conversions of a source of `layers` layers (a file each): the user's own folder, OUT
    inside SRC, a source the plan refuses, a bad option value. The first three are refused once the
    source's read-ahead has begun (it starts while the plan is made). Also returns SRC and the folder."""
    src = write_checkpoint(tmp_path / "src", llama_tensors(layers=layers))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    lying = write_checkpoint(
        tmp_path / "lying", llama_tensors(layers=layers), config={**CONFIG, "num_hidden_layers": layers + 1}
    )
    return (
        [
            ("quantize", src, mine, "-q"),
            ("quantize", src, src / "fp8", "-q"),
            ("quantize", lying, tmp_path / "out", "-q"),
            ("quantize", src, tmp_path / "out", "--scheme", "chanel"),
        ],
        src,
        mine,
    )


def slow_reads(monkeypatch, delay: float) -> None:
    """In this process: each of the prefetcher's reads into the page cache takes `delay` seconds more."""
    pull = prefetch.pull_into_cache
    monkeypatch.setattr(prefetch, "pull_into_cache", lambda *args: (time.sleep(delay), pull(*args))[1])


def test_a_refused_run_leaves_no_thread_behind(tmp_path, capsys, monkeypatch):
    """The source's read-ahead, begun while the plan is made, has stopped when the refusal reaches the
    caller: a thread still reading as the process exits fails with a traceback of its own."""
    cases, _, _ = refusals(tmp_path, layers=8)
    slow_reads(monkeypatch, 0.05)  # a slow disk: its reads are still going when the run is refused
    for args in cases:
        before = set(threading.enumerate())
        rc, err = run_cli(capsys, *args)
        assert rc != 0 and err.startswith("error: "), err
        assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == [], args


# What a refused run's process is given: a slow disk (each read into the page cache 0.05 s more) and the
# read-ahead threads of a machine of 16 cores or more, where the stray traceback was reported.
SLOW_DISK_CLI = (
    "import sys, time; from fp8convert import api; from fp8convert.run import prefetch; "
    "pull = prefetch.pull_into_cache; "
    "prefetch.pull_into_cache = lambda *a: (time.sleep(0.05), pull(*a))[1]; "
    "api.default_threads = lambda: 4; "
    "from fp8convert.cli import run; run(sys.argv[1:])"
)
BUSY = "while True: pass"  # load beside a child run, so its threads are scheduled late


@pytest.mark.slow
def test_a_refusal_is_its_one_line_alone_in_a_real_process_under_load(tmp_path, capsys):
    """The reported stray traceback: a refused run printed its line, then `Exception in thread
    fp8convert-prefetch: ... cannot schedule new futures after shutdown`, from the source's read-ahead
    still reading as the interpreter exited. Each refusal in a process of its own, five times, beside
    none, one, then two busy loops: exactly the line and exit code of the same refusal made in this
    process, nothing else, and nothing written."""
    cases, src, mine = refusals(tmp_path, layers=200)  # a plan of 1,800 tensors: the reads are under way
    expected = []
    for args in cases:
        rc, err = run_cli(capsys, *args)
        assert rc != 0 and len(err.splitlines()) == 1 and err.startswith("error: "), err
        expected.append((rc, err))
    busy: list[subprocess.Popen] = []
    try:
        for round in range(5):
            if round in (2, 3):
                busy.append(subprocess.Popen([sys.executable, "-c", BUSY]))
            for args, (rc, err) in zip(cases, expected):
                child = subprocess.run(
                    [sys.executable, "-c", SLOW_DISK_CLI, *map(str, args)],
                    check=False,
                    capture_output=True,
                    text=True,
                    cwd=Path(__file__).parents[2],
                    timeout=60,
                )
                assert (child.returncode, child.stderr) == (rc, err), (round, args)
    finally:
        for loop in busy:
            loop.kill()
            loop.wait()
    assert tree_bytes(mine) == {"notes.txt": b"mine"} and not (src / "fp8").exists()
    assert not (tmp_path / "out").exists()


def test_overwrite_in_the_current_folder_keeps_the_users_work(tmp_path, capsys, monkeypatch):
    """The reported loss: `quantize SRC . --overwrite` run in a project folder deleted mywork.py and a
    sub-project. Now refused, naming them; every byte stays."""
    src = write_checkpoint(tmp_path / "src")
    work = tmp_path / "project"
    (work / "subproject" / "pkg").mkdir(parents=True)
    (work / "mywork.py").write_text("print('mine')\n")
    (work / "subproject" / "pkg" / "code.py").write_text("x = 1\n")
    for n in range(4):
        (work / f"data{n}.csv").write_text(str(n))
    before = tree_bytes(work)
    monkeypatch.chdir(work)
    rc, err = run_cli(capsys, "quantize", src, ".", "-q", "--overwrite")
    line = assert_refused(rc, err, work, "did not write", "and 3 more", preflight=False)
    assert "data0.csv" in line and "pass --overwrite" not in line
    assert tree_bytes(work) == before


def test_overwrite_replaces_an_earlier_output_but_not_files_added_to_it(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    assert run_cli(capsys, "quantize", src, out, "-q")[0] == 0
    first = tree_bytes(out)
    # an output of fp8convert's own (a folder with its manifest) is replaced
    assert run_cli(capsys, "quantize", src, out, "-q", "--scheme", "channel", "--overwrite")[0] == 0
    assert looks_complete(out) and tree_bytes(out) != first
    # a file the user put there is not fp8convert's to delete: refused, and the plan change does not
    # advise --overwrite either
    (out / "eval-results.json").write_text("{}")
    before = tree_bytes(out)
    rc, err = run_cli(capsys, "quantize", src, out, "-q", "--overwrite")
    assert rc == 1 and "eval-results.json" in err and tree_bytes(out) == before, err
    rc, err = run_cli(capsys, "quantize", src, out, "-q")
    assert rc == 1 and "different plan" in err and "move eval-results.json out of" in err, err
    assert "pass --overwrite" not in err and tree_bytes(out) == before


def test_errors_through_the_python_api_name_keywords_not_flags(tmp_path, capsys):
    """The same refusal names `--overwrite` on the command line and `overwrite=True` from Python."""
    import fp8convert
    from fp8convert.errors import PlanMismatchError

    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    fp8convert.quantize(src, out, max_shard_size="20KB")
    before = tree_bytes(out)
    with pytest.raises(PlanMismatchError) as refused:
        fp8convert.quantize(src, out, max_shard_size="30KB")
    assert "pass overwrite=True to replace it" in str(refused.value) and "--" not in str(refused.value)
    rc, err = run_cli(capsys, "quantize", src, out, "-q", "--max-shard-size", "30KB")
    assert rc == 1 and "pass --overwrite to replace it" in err, err
    assert tree_bytes(out) == before
    with pytest.raises(fp8convert.FP8ConvertError, match=r"^max_resident must be positive"):
        fp8convert.Settings(max_resident="0")
    with pytest.raises(fp8convert.FP8ConvertError, match=r"^stream_download=True applies to Hub repo ids"):
        fp8convert.quantize(src, tmp_path / "streamed", stream_download=True)


@pytest.mark.parametrize("manifest", ["unreadable", "older"])
def test_overwrite_never_guesses_whose_files_an_unknown_manifest_covers(tmp_path, capsys, manifest):
    """A manifest that cannot be read, or one from before fp8convert recorded its outputs, cannot tell
    fp8convert's files from the user's: --overwrite replaces nothing (before, it deleted notes.txt), and
    neither refusal advises --overwrite; a rerun without it refuses too when the manifest is unreadable."""
    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    assert run_cli(capsys, "quantize", src, out, "-q")[0] == 0
    (out / "notes.txt").write_text("mine")
    path = out / ".fp8convert" / "manifest.json"
    if manifest == "unreadable":
        path.write_text(path.read_text()[:40])
    else:
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "outputs"}))
    before = tree_bytes(out)

    def refusal(*args, says: str) -> None:
        rc, err = run_cli(capsys, "quantize", src, out, "-q", *args)
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err
        assert str(path) in lines[0] and says in lines[0] and "pass --overwrite" not in lines[0], lines[0]
        assert tree_bytes(out) == before

    refusal("--scheme", "channel", "--overwrite", says="delete the folder yourself")
    if manifest == "unreadable":
        refusal(says="cannot be resumed")


def test_batch_job_into_a_foreign_folder_fails_and_keeps_it(tmp_path, capsys):
    """batch jobs follow the same rule; `overwrite = true` in a job replaces an earlier output only."""
    src = write_checkpoint(tmp_path / "src")
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("k")
    assert run_cli(capsys, "quantize", src, mine, "-q")[0] == 0
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(
        f'[defaults]\noverwrite = true\nscheme = "channel"\n'
        f'[[job]]\nsource = "{src}"\nout = "{mine}"\n[[job]]\nsource = "{src}"\nout = "{theirs}"\n'
    )
    rc = main(["batch", str(jobs), "-q"])
    captured = capsys.readouterr()
    assert rc == 1 and "keep.txt" in captured.err, captured
    assert tree_bytes(theirs) == {"keep.txt": b"k"}
    assert (
        json.loads((mine / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"][
            "strategy"
        ]
        == "channel"
    )


def test_out_is_a_file_or_under_one(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, err = run_cli(capsys, "quantize", src, blocker, "-q")
    assert rc != 0 and str(blocker) in err and "not a directory" in err and blocker.read_text() == "x"
    rc, err = run_cli(capsys, "quantize", src, blocker / "out", "-q")
    assert rc != 0 and str(blocker / "out") in err and "cannot create" in err


def test_out_not_writable(tmp_path, capsys, monkeypatch):
    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    real_access = os.access
    # chmod does not stop root, so deny write access the way the converter asks for it
    monkeypatch.setattr(
        os,
        "access",
        lambda p, mode, **kw: False if str(p) == str(out) and mode & os.W_OK else real_access(p, mode, **kw),
    )
    rc, err = run_cli(capsys, "quantize", src, out, "-q")
    assert_refused(rc, err, out, str(out), "not writable", preflight=False)


def test_not_enough_free_space_fails_before_writing_then_resumes(tmp_path, capsys, monkeypatch):
    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    rc, err = run_cli(capsys, "quantize", src, out, "-q")
    line = assert_refused(rc, err, out, str(out), "free")  # OUT, which it had to make to lock, is gone again
    assert "only 1.00 KB available" in line and " KB free for the output" in line, line  # not "0.00 GB"
    monkeypatch.undo()
    assert run_cli(capsys, "quantize", src, out, "-q")[0] == 0
    assert run_cli(capsys, "quantize", src, tmp_path / "clean", "-q")[0] == 0
    assert tree_bytes(out) == tree_bytes(tmp_path / "clean")


def test_a_failed_free_space_check_claims_nothing(tmp_path, capsys, monkeypatch):
    """Refused for want of space: the empty OUT the user made is left empty, so a retry with another
    --max-shard-size is not refused as another plan."""
    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    usage = shutil.disk_usage(tmp_path)
    with monkeypatch.context() as patch:
        patch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
        rc, err = run_cli(capsys, "quantize", src, out, "-q")
    assert_refused(rc, err, out, "available", preflight=False)
    assert list(out.iterdir()) == []
    assert run_cli(capsys, "quantize", src, out, "-q", "--max-shard-size", "10KB")[0] == 0
    assert run_cli(capsys, "quantize", src, tmp_path / "clean", "-q", "--max-shard-size", "10KB")[0] == 0
    assert tree_bytes(out) == tree_bytes(tmp_path / "clean")


def test_a_manifest_of_a_run_that_wrote_nothing_gives_way_to_another_plan(tmp_path, capsys, monkeypatch):
    """A run that failed at its first write (its shard's header) leaves a manifest and an empty partial
    file: another plan simply replaces them; a file the user put in OUT stays."""
    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, os.strerror(errno.EIO))))
        assert run_cli(capsys, "quantize", src, out, "-q")[0] == 1
    assert (out / ".fp8convert" / "manifest.json").exists()
    (out / "notes.txt").write_text("mine")
    assert run_cli(capsys, "quantize", src, out, "-q", "--max-shard-size", "10KB")[0] == 0
    assert run_cli(capsys, "quantize", src, tmp_path / "clean", "-q", "--max-shard-size", "10KB")[0] == 0
    assert tree_bytes(out) == {**tree_bytes(tmp_path / "clean"), "notes.txt": b"mine"}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds the file behind an fd in /proc")
def test_disk_full_while_finishing_is_resumable(tmp_path, capsys, monkeypatch):
    """ENOSPC surfaces at fsync (delayed allocation): here while the index is written, the step just
    before the output would look complete."""
    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(f".{INDEX}.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    rc, err = run_cli(capsys, "quantize", src, out, "-q")
    line = assert_refused(rc, err, out, INDEX, preflight=False)
    assert "No space left" in line and "rerun" in line
    assert not (out / f".{INDEX}.tmp").exists()
    monkeypatch.undo()
    assert run_cli(capsys, "quantize", src, out, "-q")[0] == 0
    assert run_cli(capsys, "quantize", src, tmp_path / "clean", "-q")[0] == 0
    assert tree_bytes(out) == tree_bytes(tmp_path / "clean")


def test_zero_sized_linear_weight(tmp_path, capsys):
    """A [0, 64] weight passes the divisible-by-16 test; it must be kept (or refused) up front, not
    crash amax() halfway through the run."""
    tensors = llama_tensors()
    tensors["model.layers.1.mlp.extra_proj.weight"] = torch.zeros(0, 64, dtype=torch.bfloat16)
    src = write_checkpoint(tmp_path / "src", tensors)
    out = tmp_path / "out"
    rc, err = run_cli(capsys, "quantize", src, out, "-q")
    assert "Traceback" not in err and "error:" in err or rc == 0, err
    if rc:
        assert_refused(rc, err, out, "model.layers.1.mlp.extra_proj.weight")
    else:
        assert run_cli(capsys, "verify", src, out)[0] == 0


def test_a_plan_that_quantizes_nothing_is_refused_before_out_exists(tmp_path, capsys):
    """An FP8 checkpoint without one FP8 weight is no conversion (and fp8convert itself would refuse it as
    a source): every weight kept by --ignore is refused up front; inspect shows the same plan and says so."""
    import fp8convert

    src = write_checkpoint(tmp_path / "src", llama_tensors())
    out = tmp_path / "out"
    rc, err = run_cli(capsys, "quantize", src, out, "-q", "--ignore", "re:.*")
    assert_refused(rc, err, out, f"{src}: no weight is quantized (e.g. model.layers.0.", ": --ignore re:.*)")
    with pytest.raises(fp8convert.FP8ConvertError, match="no weight is quantized") as refused:
        fp8convert.quantize(src, out, ignore="re:.*")
    assert ": ignore re:.*); nothing to write" in str(refused.value) and not out.exists()
    assert main(["inspect", str(src), "--ignore", "re:.*"]) == 0
    assert "every weight is kept in high precision; quantize refuses to write this" in capsys.readouterr().out


@pytest.mark.parametrize(
    "option,value",
    [
        ("--prefetch", "lots"),
        ("--max-resident", "0"),
        ("--max-shard-size", "-1GB"),
        ("--scheme", "row"),
        ("--format", "gguf"),
        ("--device", "tpu"),
    ],
)
def test_bad_option_fails_before_output_exists(tmp_path, capsys, option, value):
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    out = tmp_path / "out"
    rc, err = run_cli(capsys, "quantize", src, out, "-q", option, value)
    assert_refused(rc, err, out, option)


def test_different_plan_refusal_names_what_changed(tmp_path, capsys):
    """From the manifest: an option with both values, a config.json key with both values, or the shard
    whose tensors changed; the partial output is left as it was."""
    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    assert run_cli(capsys, "quantize", src, out, "-q", "--worker", "0/2", "--max-shard-size", "20KB")[0] == 0
    before = tree_bytes(out)
    rc, err = run_cli(capsys, "quantize", src, out, "-q", "--max-shard-size", "30KB")
    assert rc == 1 and "--max-shard-size was 20KB, now 30KB" in err, err

    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(config, rope_theta=10000.0, vocab_size=96)))
    rc, err = run_cli(capsys, "quantize", src, out, "-q", "--max-shard-size", "20KB")
    assert rc == 1 and "config.json changed (rope_theta was null, now 10000.0)" in err, err
    (src / "config.json").write_text(json.dumps(config))

    tensors = load_file(str(src / SHARD2))
    tensors["model.layers.0.extra.bias"] = torch.zeros(4, dtype=torch.bfloat16)
    save_file(tensors, str(src / SHARD2), metadata={"format": "pt"})
    rewrite_index(src, lambda i: i["weight_map"].update({"model.layers.0.extra.bias": SHARD2}))
    rc, err = run_cli(capsys, "quantize", src, out, "-q", "--max-shard-size", "20KB")
    assert rc == 1 and f"tensors (names, dtypes, shapes or offsets) changed in {SHARD2}" in err, err
    assert "config.json" not in err and tree_bytes(out) == before


@pytest.mark.skipif(torch.cuda.is_available() or torch.version.cuda is not None, reason="needs a CPU build of torch")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_asked_of_a_cpu_build_is_refused_before_out_exists(tmp_path, capsys, device):
    """Known from the installed files alone: no OUT made and no shard space reserved for a run that
    cannot start."""
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    out = tmp_path / "out"
    rc, err = run_cli(capsys, "quantize", src, out, "--device", device)
    assert_refused(rc, err, out, f"--device {device}", "CUDA is not available")


def test_inspect_groups_kept_shapes_by_their_reason(tmp_path, capsys):
    """inspect's kept table groups tensors by reason without their own sizes: "shape not divisible by 16"
    (it read just "shape"), while each tensor's line keeps its shape."""
    tensors = llama_tensors()
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.randn(64, 72).bfloat16()
    src = write_checkpoint(tmp_path / "src", tensors)
    assert main(["inspect", str(src), "--json", "--tensors"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kept"]["shape not divisible by 16"]["tensors"] == 1, doc["kept"]
    reasons = {t["name"]: t["reason"] for t in doc["tensor_plan"]}
    assert reasons["model.layers.0.self_attn.o_proj.weight"] == "shape [64, 72] not divisible by 16"


def test_kept_reasons_name_an_unquantized_dtype_and_a_scalar(tmp_path, capsys):
    tensors = llama_tensors()
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].double()
    tensors["model.layers.0.self_attn.softmax_scale"] = torch.tensor(0.125, dtype=torch.bfloat16)
    src = write_checkpoint(tmp_path / "src", tensors)
    assert main(["inspect", str(src), "--json", "--tensors"]) == 0
    reasons = {t["name"]: t["reason"] for t in json.loads(capsys.readouterr().out)["tensor_plan"]}
    assert reasons["model.layers.0.mlp.up_proj.weight"] == "F64, not a dtype fp8convert quantizes (BF16, F16, F32)"
    assert reasons["model.layers.0.self_attn.softmax_scale"] == "0-D (a scalar)"
    # kept, the F64 linear is named in the ignore list: unnamed, engines would build it as an FP8 layer and
    # cast its float64 values into that (transformers did, with a missing scale: garbage logits)
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out), "-q"]) == 0
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.mlp.up_proj" in ignore, ignore
    assert main(["verify", str(src), str(out), "-q"]) == 0
