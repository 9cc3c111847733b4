"""FP8 sources get quantize's guarantees: a killed dequantize resumes into the bytes of an uninterrupted
one; workers with finalize, several devices and a streamed Hub source give the bytes of one process;
the result can be pushed. Also for requantize and pass-through (the path that copies codes and scales
without torch)."""

from __future__ import annotations

import signal

import fp8_reference as F
import pytest
from tiny_ckpt import cli_subprocess, llama_tensors, looks_complete, tree_bytes, wait_for, write_checkpoint

from fp8convert import api, publish
from fp8convert.cli import main
from fp8convert.verify import verify

try:
    from fakehub import fake_hub  # noqa: F401  (a fixture)
except ImportError:  # tests/ imported as a package
    from tests.fakehub import fake_hub  # noqa: F401

# huggingface_hub's own LFS upload passes a file object as `data=`, which httpx2 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

# 6 layers in 20 KB output shards, 8 KB batches: many shards and batches of a tiny model.
ARGS = ["--max-shard-size", "20KB", "--max-resident", "8KB", "--device", "cpu", "-q"]
COMMANDS = {
    "dequantize": ["dequantize"],
    "requantize": ["quantize", "--scheme", "channel"],
    "pass-through": ["quantize", "--format", "fp8", "--scheme", "block"],
}
API = {
    "dequantize": (api.dequantize, {}),
    "requantize": (api.quantize, {"scheme": "channel"}),
    "pass-through": (api.quantize, {"format": "fp8", "scheme": "block"}),
}


@pytest.fixture(scope="module")
def fp8_src(tmp_path_factory):
    """A 6-layer native fp8 block checkpoint (bfloat16 scales) and each command's uninterrupted output."""
    base = tmp_path_factory.mktemp("fp8-pipeline")
    bf16 = write_checkpoint(base / "bf16", llama_tensors(layers=6))
    src = F.write_fp8(bf16, base / "src", F.LAYOUTS["qwen-native-block-bf16"])
    refs = {}
    for name, command in COMMANDS.items():
        assert main([command[0], str(src), str(base / name), *command[1:], *ARGS]) == 0
        refs[name] = tree_bytes(base / name)
        assert sum(f.startswith("model-") for f in refs[name]) >= 6
    return src, refs


def without_card(files: dict) -> dict:
    return {k: v for k, v in files.items() if k != "README.md" and not k.startswith(".fp8convert")}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMMANDS))
def test_killed_run_resumes_into_the_same_bytes(fp8_src, tmp_path, name):
    src, refs = fp8_src
    out = tmp_path / "out"
    command = COMMANDS[name]
    proc = cli_subprocess([command[0], src, out, *command[1:], *ARGS], write_delay=0.03)
    assert wait_for(lambda: len(list(out.glob("model-*.safetensors"))) >= 2, proc)
    proc.kill()
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL and not looks_complete(out)
    assert main([command[0], str(src), str(out), *command[1:], *ARGS]) == 0
    assert tree_bytes(out) == refs[name]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_workers_then_finalize_give_the_bytes_of_one_process(fp8_src, tmp_path, capsys, name):
    """finalize rebuilds the plan from the manifest: a dequantize's one too."""
    src, refs = fp8_src
    out = tmp_path / "out"
    convert, options = API[name]
    for k in range(2):
        report = convert(
            src,
            out,
            device="cpu",
            max_shard_size="20KB",
            max_resident="8KB",
            worker=f"{k}/2",
            finalize=False,
            **options,
        )
        assert report.shards_written > 0 and not report.complete
    assert not looks_complete(out)
    assert main(["finalize", str(out)]) == 0
    assert tree_bytes(out) == refs[name]


@pytest.mark.slow
def test_devices_give_the_bytes_of_one_process(fp8_src, tmp_path):
    src, refs = fp8_src
    out = tmp_path / "out"
    args = [a for a in ARGS if a not in ("--device", "cpu")]
    assert main(["dequantize", str(src), str(out), *args, "--devices", "cpu,cpu"]) == 0
    assert tree_bytes(out) == refs["dequantize"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dequantize", "pass-through"])
def test_streamed_hub_source_and_push(fake_hub, fp8_src, tmp_path, monkeypatch, capsys, name):
    """From a Hub repo with --stream-download (source shards deleted as they are done; kept and passed-
    through tensors then go through the pipeline, not the copier), then pushed with its card."""
    src, refs = fp8_src
    fake_hub.add_repo("acme/tiny-fp8", from_dir=src)
    monkeypatch.setenv("HF_TOKEN", fake_hub.token)
    out = tmp_path / "out"
    command = COMMANDS[name]
    rc = main(
        [
            command[0],
            "acme/tiny-fp8",
            str(out),
            *command[1:],
            *ARGS,
            "--stream-download",
            "--push-to-hub",
            "fake-user/tiny-out",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert without_card(tree_bytes(out)) == without_card(refs[name])
    assert not (out / ".fp8convert" / "download").exists()
    remote = fake_hub.files("fake-user/tiny-out")
    assert all(remote[k] == v for k, v in without_card(tree_bytes(out)).items())
    card = remote["README.md"].decode()
    assert "base_model: acme/tiny-fp8" in card
    if name == "dequantize":
        assert "dequantized from the FP8 checkpoint" in card and "base_model_relation" not in card
        assert "fp8convert dequantize acme/tiny-fp8 " in card
        assert fake_hub.repo("fake-user/tiny-out").commits  # pushed although config.json has no quantization_config
    else:
        assert "passed through with their codes and scales unchanged" in card


def test_push_of_a_dequantized_output(fake_hub, fp8_src, tmp_path):
    src, refs = fp8_src
    out = tmp_path / "out"
    out.mkdir()
    for rel, data in refs["dequantize"].items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    publish.push(out, "fake-user/deq", token=fake_hub.token)
    repo = fake_hub.repo("fake-user/deq")
    assert any(c.title.startswith("checkpoint dequantized from FP8") for c in repo.commits.values())
    assert verify(src, out).ok


def test_batch_jobs_dequantize_and_requantize(fp8_src, tmp_path, capsys):
    """A [defaults] scheme is the quantize jobs': a dequantize job beside them is not refused for it."""
    src, refs = fp8_src
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(f"""
[defaults]
device = "cpu"
max_shard_size = "20KB"
max_resident = "8KB"
scheme = "channel"

[[job]]
source = "{src}"
out = "{tmp_path / "deq"}"
dequantize = true

[[job]]
source = "{src}"
out = "{tmp_path / "rq"}"
""")
    assert main(["batch", str(jobs), "-q"]) == 0, capsys.readouterr().err
    assert tree_bytes(tmp_path / "deq") == refs["dequantize"]
    assert tree_bytes(tmp_path / "rq") == refs["requantize"]
