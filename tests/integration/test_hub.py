"""Hugging Face Hub in and out, against tests/support/fakehub.py (the real huggingface_hub client on 127.0.0.1).

Sources: a repo id converts with only the files it needs (never .bin, never original/), at a pinned
revision, with the token sent; gated / missing repos and network failures are one clear line; a rerun
re-uses what the failed run downloaded; `inspect` reads headers with Range requests only.
Streaming: StreamingFetcher keeps at most `keep` shards on disk. Publishing: push and
quantize --push-to-hub upload every file byte for byte with a model card, never .fp8convert/.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

try:
    from fakehub import FakeHub, fake_hub  # noqa: F401  (fake_hub is a fixture)
except ImportError:  # tests/ imported as a package
    from tests.fakehub import FakeHub, fake_hub  # noqa: F401
from tiny_ckpt import llama_tensors, slow_writes, write_checkpoint

from fp8convert import api, publish
from fp8convert.cli import main
from fp8convert.errors import FP8ConvertError
from fp8convert.options import HubAccess
from fp8convert.output.card import make_card, split_front_matter, with_verification
from fp8convert.publish import retarget_card
from fp8convert.safetensors_io import INDEX_NAME
from fp8convert.source import hub
from fp8convert.source.streaming import StreamingFetcher
from fp8convert.units import format_size

# huggingface_hub's own LFS upload passes a file object as `data=`, which httpx2 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

REPO = "acme/tiny-llama"
SOURCE_CARD = """---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
language: [en]
tags: [llama]
---
# tiny llama

A source model card.
"""
# Files a conversion must never fetch: other weight formats and the original/ folder.
UNWANTED = {
    "pytorch_model.bin": b"\x80\x02pickle" * 4096,
    "original/consolidated.00.pth": b"\x80\x02" * 4096,
    "original/params.json": b'{"dim": 64}',
}


def _hub_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def tiny_ckpt(tmp_path: Path) -> Path:
    """A 3-shard Llama-shaped BF16 checkpoint with tokenizer/generation config, remote code and a card."""
    root = write_checkpoint(tmp_path / "src")
    (root / "README.md").write_text(SOURCE_CARD)
    (root / "tokenizer.json").write_text('{"version": "1.0"}')
    (root / "modeling_tiny.py").write_text("# remote code\n")
    return root


@pytest.fixture
def tiny_repo(fake_hub: FakeHub, tiny_ckpt: Path) -> Path:
    """REPO on the fake hub: the checkpoint plus files nobody should download."""
    fake_hub.add_repo(REPO, {**_hub_files(tiny_ckpt), **UNWANTED})
    return tiny_ckpt


def resolve_requests(fake_hub: FakeHub, start: int = 0):
    """(method, file path in repo, request) of every file request since `start`."""
    out = []
    for r in fake_hub.requests[start:]:
        parts = r.path.lstrip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            out.append((r.method, "/".join(parts[4:]), r))
    return out


def out_files(out: Path) -> dict[str, bytes]:
    return {k: v for k, v in _hub_files(out).items() if not k.startswith(".fp8convert/")}


def same_conversion(a: Path, b: Path) -> bool:
    """Same files, byte for byte, except the card (its examples name the output directory)."""

    def strip(files):
        return {k: v for k, v in files.items() if k != "README.md"}

    return strip(out_files(a)) == strip(out_files(b))


# --------------------------------------------------------------------------- sources


def test_quantize_from_repo_id_pinned_revision_fetches_only_needed_files(fake_hub, tiny_repo, tmp_path):
    # A "dev" branch whose config differs from main's: the output must come from dev.
    dev_files = {**_hub_files(tiny_repo), **UNWANTED}
    dev_config = json.loads(dev_files["config.json"])
    dev_config["rms_norm_eps"] = 1e-6
    dev_files["config.json"] = json.dumps(dev_config).encode()
    fake_hub.commit_files(REPO, dev_files, branch="dev")

    out = tmp_path / "out"
    report = api.quantize(REPO, out, revision="dev", token=fake_hub.token, device="cpu")
    assert report.source == REPO

    config = json.loads((out / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-6 and "quantization_config" in config
    # Same bytes as converting the local copy.
    local = tmp_path / "local-out"
    api.quantize(tiny_repo, local, device="cpu")
    for name, data in out_files(local).items():
        if name.endswith(".safetensors") or name == INDEX_NAME:
            assert out_files(out)[name] == data, name
    # Side files travel; the card is read, never copied verbatim.
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "modeling_tiny.py"):
        assert (out / name).read_bytes() == (tiny_repo / name).read_bytes()

    fetched = resolve_requests(fake_hub)
    names = {path for _, path, _ in fetched}
    assert not any(n.endswith(".bin") or n.startswith("original/") for n in names), names
    assert {"config.json", "README.md", "model-00001-of-00003.safetensors"} <= names
    # Every request carried the token, and every file came from the dev commit.
    assert all(r.token == fake_hub.token for r in fake_hub.requests)
    dev_sha = fake_hub.repo_sha(REPO, "dev")
    assert {r.path.split("/")[4] for _, _, r in fetched} == {dev_sha}, "files must come from the pinned commit"


def test_bin_only_repo_is_refused_before_any_weight_download(fake_hub, tmp_path):
    fake_hub.add_repo("acme/pickled", {"config.json": b'{"model_type": "llama"}', **UNWANTED})
    with pytest.raises(FP8ConvertError, match=r"acme/pickled: holds only pickle weights"):
        api.quantize("acme/pickled", tmp_path / "out", device="cpu")
    assert not [p for _, p, _ in resolve_requests(fake_hub) if p != "config.json"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("with_token", [False, True])
def test_gated_repo_is_one_line_naming_the_repo_and_exit_1(
    fake_hub, tiny_ckpt, tmp_path, capsys, monkeypatch, with_token
):
    fake_hub.add_repo("acme/gated", from_dir=tiny_ckpt, gated=True)
    if with_token:  # logged in but not granted: 403 rather than 401, same message
        monkeypatch.setenv("HF_TOKEN", fake_hub.token)
    rc = main(["quantize", "acme/gated", str(tmp_path / "out"), "--device", "cpu", "-q"])
    err = capsys.readouterr().err.strip()
    assert rc == 1
    assert len(err.splitlines()) == 1 and "acme/gated" in err and "gated" in err, err
    assert not [p for _, p, _ in resolve_requests(fake_hub) if p.endswith(".safetensors")]
    # inspect too: the header Range requests are gated as well
    assert main(["inspect", "acme/gated"]) == 1
    assert "acme/gated: gated repository" in capsys.readouterr().err

    fake_hub.grant_access("acme/gated")
    api.quantize("acme/gated", tmp_path / "out2", token=fake_hub.token, device="cpu")
    assert (tmp_path / "out2" / "config.json").is_file()


def test_missing_repo_and_revision(fake_hub, tiny_repo, tmp_path, capsys):
    with pytest.raises(
        FP8ConvertError,
        match=r"^acme/nope: no local folder of that name .*, and as a Hub repo id: "
        r"repository not found",
    ):
        api.quantize("acme/nope", tmp_path / "out", device="cpu")
    with pytest.raises(FP8ConvertError, match=rf"^{REPO}: revision no-such-branch not found"):
        api.make_plan(REPO, revision="no-such-branch")
    assert main(["inspect", "acme/nope"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: acme/nope: no local folder") and "repository not found" in err
    assert len(err.splitlines()) == 1


def test_network_failure_is_clear_and_rerun_reuses_downloads(fake_hub, tiny_repo, tmp_path):
    out = tmp_path / "out"
    fake_hub.fail("drop", path_contains="model-00002-of-00003")
    with pytest.raises(FP8ConvertError) as e:
        api.quantize(REPO, out, device="cpu")
    msg = str(e.value)
    assert msg.startswith(f"{REPO}: ") and "network" in msg and "\n" not in msg, msg

    # The cache kept what arrived before the failure.
    cached = {p.name for p in (Path(fake_hub_cache(fake_hub))).rglob("model-*.safetensors")}
    assert cached and "model-00002-of-00003.safetensors" not in cached

    fake_hub.clear_failures()
    start = len(fake_hub.requests)
    api.quantize(REPO, out, device="cpu")
    assert (out / "config.json").is_file()
    refetched = {p for m, p, _ in resolve_requests(fake_hub, start) if m == "GET"}
    assert not (refetched & cached), f"re-downloaded {refetched & cached}"
    assert "model-00002-of-00003.safetensors" in refetched


def test_offline_rerun_uses_the_cached_snapshot(fake_hub, tiny_repo, tmp_path, monkeypatch):
    from huggingface_hub import constants

    api.quantize(REPO, tmp_path / "out", revision="main", device="cpu")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    start = len(fake_hub.requests)
    assert api.make_plan(REPO).fingerprint == api.make_plan(tiny_repo).fingerprint
    api.quantize(REPO, tmp_path / "out2", device="cpu")
    assert same_conversion(tmp_path / "out2", tmp_path / "out")
    assert len(fake_hub.requests) == start


def fake_hub_cache(fake_hub: FakeHub) -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def test_hub_error_lines():
    from huggingface_hub.errors import LocalEntryNotFoundError

    err = hub.hub_error("a/b", LocalEntryNotFoundError("long\nmessage"))
    assert str(err).startswith("a/b: cannot reach the Hub") and "\n" not in str(err)
    err = hub.hub_error("a/b", ConnectionResetError("reset\nby peer"))
    assert str(err).startswith("a/b: cannot reach the Hub (network error") and "\n" not in str(err)


# --------------------------------------------------------------------------- never hang, never mislead


def in_thread(fn, limit_s: float):
    """fn() on a daemon thread: (returned, raised), or a test failure if it is still running after
    `limit_s` (a Hub call without a read timeout would wait for ever)."""
    result: list = []

    def run():
        try:
            result.append((fn(), None))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result.append((None, e))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(limit_s)
    assert not worker.is_alive(), f"still waiting on the Hub after {limit_s} s"
    return result[0]


@pytest.fixture
def short_hub_limits(monkeypatch):
    """0.5 s timeouts and one retry (huggingface_hub reads its HF_HUB_*_TIMEOUT settings at import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 0.5)
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 0.5)
    monkeypatch.setenv("FP8CONVERT_HUB_RETRIES", "1")


def test_inspect_against_a_hub_that_never_answers_ends_in_one_line(fake_hub, tiny_repo, short_hub_limits, capsys):
    """The reported hang: the endpoint accepts the connection and never answers. Now a read timeout,
    one retry, then one line naming the repo and the wait; exit 1."""
    fake_hub.fail("hang", path_contains="/api/models/")
    started = time.monotonic()
    rc, raised = in_thread(lambda: main(["inspect", REPO]), limit_s=30)
    err = capsys.readouterr().err.strip()
    assert raised is None and rc == 1, (raised, err)
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {REPO}: "), err
    assert "did not answer within 0.5 s, 2 attempts" in err and "HF_HUB_DOWNLOAD_TIMEOUT" in err, err
    assert "finished downloads" not in err  # inspect downloads no weights
    assert len(fake_hub.requests_to("/api/models/")) == 2 and time.monotonic() - started < 20


def test_verify_of_an_unreachable_hub_source_promises_no_resume(fake_hub, tiny_repo, tmp_path, capsys):
    out = tmp_path / "out"
    api.quantize(tiny_repo, out, device="cpu")
    fake_hub.fail("drop", path_contains="/api/models/")
    assert main(["verify", REPO, str(out), "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert "cannot reach the Hub (network error" in err and "check the connection and rerun" in err, err
    assert "finished downloads" not in err and "resume" not in err


@pytest.mark.slow
def test_a_shard_download_that_never_answers_ends_in_one_line(
    fake_hub, tiny_repo, short_hub_limits, tmp_path, monkeypatch
):
    """huggingface_hub retries a stalled download itself (five times, resuming): fp8convert adds the
    read timeout that makes it stall at all, and no retries of its own."""
    from types import SimpleNamespace

    import huggingface_hub.file_download as file_download

    monkeypatch.setattr(file_download, "time", SimpleNamespace(sleep=lambda s: None))  # its 1 s between retries
    fake_hub.fail("hang", method="GET", path_contains="model-00002-of-00003")
    _, raised = in_thread(lambda: api.quantize(REPO, tmp_path / "out", device="cpu"), limit_s=60)
    assert isinstance(raised, FP8ConvertError), raised
    msg = str(raised)
    assert msg.startswith(f"{REPO}: the Hub did not answer within 0.5 s") and "rerun to resume" in msg, msg
    assert len(fake_hub.requests_to("model-00002-of-00003", "GET")) == 6
    assert "no local folder" not in msg  # the repo was found: only the download failed


def test_a_mistyped_relative_path_says_both_readings(fake_hub, tiny_repo, tmp_path, monkeypatch, capsys):
    """`models/does-not-exist` is a relative path and a repo id at once: the error says there is no
    such folder here, and what the Hub said of the repo id (not found, or the network failure)."""
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", "models/does-not-exist", str(tmp_path / "out"), "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"error: models/does-not-exist: no local folder of that name (in {tmp_path}), and as "
        "a Hub repo id: repository not found"
    ), err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()

    fake_hub.fail("drop", path_contains="/api/models/")
    assert main(["inspect", "models/does-not-exist"]) == 1
    err = capsys.readouterr().err.strip()
    assert "no local folder of that name" in err and "cannot reach the Hub (network error" in err, err


def test_offline_mode_is_not_reported_as_a_network_problem(fake_hub, tiny_repo, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for args in (["inspect", REPO], ["quantize", REPO, str(tmp_path / "out"), "-q"]):
        assert main(args) == 1
        err = capsys.readouterr().err.strip()
        assert "HF_HUB_OFFLINE is set and the download cache" in err and "holds no copy" in err, err
        assert "network" not in err and "connection" not in err and len(err.splitlines()) == 1, err
    assert not fake_hub.requests


def test_a_full_cache_disk_is_not_reported_as_a_network_problem(fake_hub, tiny_repo, tmp_path, monkeypatch):
    """ENOSPC while a shard lands in the download cache: the line names the cache file and the shard's
    size, and says where the cache can go instead."""
    import errno
    import os

    import huggingface_hub.file_download as file_download

    real_get = file_download.http_get

    def http_get(url, temp_file, *args, **kwargs):
        if "model-00002-of-00003" in url:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), temp_file.name)
        return real_get(url, temp_file, *args, **kwargs)

    monkeypatch.setattr(file_download, "http_get", http_get)
    with pytest.raises(FP8ConvertError) as e:
        api.quantize(REPO, tmp_path / "out", device="cpu")
    msg = str(e.value)
    size = (tiny_repo / "model-00002-of-00003.safetensors").stat().st_size
    assert "no space left on the download cache's disk" in msg and "HF_HUB_CACHE" in msg, msg
    assert f"the file being downloaded is {format_size(size)}" in msg, msg
    assert "network" not in msg and ".incomplete" in msg, msg


# --------------------------------------------------------------------------- inspect / remote headers


def plan_view(p):
    """The parts of a plan that do not depend on where the source lives."""
    return {
        "fingerprint": p.fingerprint,
        "tensors": [
            (
                t.name,
                t.source.dtype,
                t.source.shape,
                t.source.file,
                t.source.offset,
                t.source.nbytes,
                t.quantize,
                t.reason,
                t.group,
                t.scale_name,
                t.scale_shape,
            )
            for t in p.tensors
        ],
        "shards": [(s.name, s.header, s.units, sorted(s.tensors.items())) for s in p.shards],
        "ignore": p.ignore_list,
        "copy": p.source.copy_files,
        "config": p.source.config,
    }


@pytest.mark.parametrize("first_read", [hub.FIRST_HEADER_READ, 64])
def test_inspect_repo_id_reads_headers_only(fake_hub, tiny_repo, capsys, monkeypatch, first_read):
    monkeypatch.setattr(hub, "FIRST_HEADER_READ", first_read)  # 64: every header needs a second Range read
    remote = api.make_plan(REPO, scheme="channel")
    local = api.make_plan(tiny_repo, scheme="channel")
    assert plan_view(remote) == plan_view(local)
    assert remote.source.label == REPO

    assert main(["inspect", REPO, "--scheme", "channel", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fingerprint"] == local.fingerprint and info["source"] == REPO

    weights = [(m, p, r) for m, p, r in resolve_requests(fake_hub) if p.endswith(".safetensors")]
    assert weights, "headers must be read from the shards"
    for method, path, r in weights:
        assert method == "GET" and r.headers.get("range", "").startswith("bytes="), (method, path, r.headers)
        first, _, last = r.headers["range"][len("bytes=") :].partition("-")
        assert int(last) - int(first) < 100_001
    if first_read == 64:
        assert len(weights) == 2 * 3 * 2  # two Range reads per shard, 3 shards, two plans
    assert not [p for _, p, _ in resolve_requests(fake_hub) if p.endswith(".bin") or p.startswith("original/")]


def test_remote_source_validates_like_local(fake_hub, tiny_ckpt):
    data = (tiny_ckpt / "model-00001-of-00003.safetensors").read_bytes()
    files = _hub_files(tiny_ckpt)
    files["model-00001-of-00003.safetensors"] = data + b"\0" * 8  # trailing bytes: refused locally too
    fake_hub.add_repo("acme/padded", files)
    with pytest.raises(FP8ConvertError, match=r"model-00001-of-00003.safetensors: .*trailing bytes"):
        api.make_plan("acme/padded")


# --------------------------------------------------------------------------- streaming download


@pytest.fixture
def five_shards(fake_hub: FakeHub, tmp_path: Path) -> list[str]:
    """acme/five: five shards (one per layer plus one for the rest)."""
    tensors = llama_tensors(layers=4)
    root = write_checkpoint(tmp_path / "five", tensors=tensors)
    fake_hub.add_repo("acme/five", from_dir=root)
    return sorted(p.name for p in root.glob("*.safetensors"))


def make_fetcher(fake_hub, tmp_path, keep=2):
    return StreamingFetcher(hub.resolve_repo("acme/five", HubAccess(token=fake_hub.token)), tmp_path / "dl", keep)


def on_disk(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("*.safetensors"))


def wait_for(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_streaming_fetcher_need_release_keeps_at_most_keep(fake_hub, five_shards, tmp_path):
    fetcher = make_fetcher(fake_hub, tmp_path, keep=2)
    order = list(reversed(five_shards))  # any order the pipeline gives
    fetcher.start(order)
    try:
        assert (tmp_path / "dl" / "config.json").exists() is False  # config is read from the cache, not copied
        assert (tmp_path / "dl" / "tokenizer_config.json").is_file()  # side files arrive at start
        for i, name in enumerate(order):
            fetcher.need([name])
            assert (tmp_path / "dl" / name).is_file()
            assert (tmp_path / "dl" / name).stat().st_size == fetcher.repo.sizes[name]
            assert len(on_disk(tmp_path / "dl")) <= 2
            if i + 1 < len(order):  # the next one is prefetched while this one is in use...
                assert wait_for(lambda: order[i + 1] in on_disk(tmp_path / "dl"))  # noqa: B023 (waited for here)
                time.sleep(0.05)  # ...but no more than keep
                assert len(on_disk(tmp_path / "dl")) <= 2
            fetcher.release([name])
            assert not (tmp_path / "dl" / name).exists()
        assert on_disk(tmp_path / "dl") == []
        assert fetcher.peak_present <= 2
        assert [f for kind, f in fetcher.events if kind == "download"] == order
        assert [f for kind, f in fetcher.events if kind == "release"] == order
    finally:
        fetcher.close(remove=True)
    assert not (tmp_path / "dl").exists()


def test_streaming_fetcher_need_more_than_keep_and_failure(fake_hub, five_shards, tmp_path):
    fetcher = make_fetcher(fake_hub, tmp_path, keep=1)
    fetcher.start(five_shards)
    try:
        fetcher.need(five_shards[:3])  # one batch spanning three shards with keep=1: no deadlock
        assert on_disk(tmp_path / "dl") == five_shards[:3]
        fetcher.release(five_shards[:3])
        assert on_disk(tmp_path / "dl") == []

        fake_hub.fail("drop", path_contains=five_shards[3])  # (a 5xx would sit in huggingface_hub's backoff)
        with pytest.raises(FP8ConvertError, match=r"^acme/five: .*network"):
            fetcher.need([five_shards[3]])
        assert fake_hub.failures[0].hits >= 2  # retried once before giving up
        fake_hub.clear_failures()
        fetcher.need([five_shards[3]])  # asked again: tried again
        assert five_shards[3] in on_disk(tmp_path / "dl")
    finally:
        fetcher.close()


def test_streaming_fetcher_resume_reuses_finished_shards(fake_hub, five_shards, tmp_path):
    first = make_fetcher(fake_hub, tmp_path, keep=2)
    first.start(five_shards)
    first.need(five_shards[:1])
    first.close()  # interrupted: the finished file stays

    start = len(fake_hub.requests)
    second = make_fetcher(fake_hub, tmp_path, keep=2)
    second.start(five_shards[:1] + five_shards[2:])  # shard 1 already converted: no longer needed
    try:
        second.need(five_shards[:1])
        assert not [p for m, p, _ in resolve_requests(fake_hub, start) if m == "GET" and p == five_shards[0]]
        assert five_shards[1] not in on_disk(tmp_path / "dl")  # leftovers not needed are deleted
    finally:
        second.close()


def test_streaming_fetcher_waits_for_a_slot_about_to_free(fake_hub, five_shards, tmp_path):
    a, b, c = five_shards[:3]
    fetcher = make_fetcher(fake_hub, tmp_path, keep=2)
    fetcher.start([a, b, c])
    try:
        fetcher.need([a, b])  # a is read again later; b is not
        fetcher.done_reading([b])  # b's batch is in flight: its slot frees once that batch is written
        blocked = threading.Thread(target=fetcher.need, args=([c],))
        blocked.start()
        time.sleep(0.3)
        assert blocked.is_alive() and on_disk(tmp_path / "dl") == [a, b]  # waits instead of a third shard
        fetcher.release([b])
        blocked.join(timeout=10)
        assert not blocked.is_alive() and on_disk(tmp_path / "dl") == [a, c]
        assert fetcher.peak_present == 2
    finally:
        fetcher.close(remove=True)


@pytest.mark.slow
def test_quantize_stream_download_end_to_end(fake_hub, five_shards, tmp_path, monkeypatch):
    streamed, plain = tmp_path / "streamed", tmp_path / "plain"
    # A slow writer keeps batches in flight while the reader asks for the next shard: the case where
    # a fetcher that only counted shards on disk went over `keep`.
    slow_writes(monkeypatch, 0.02)
    seen: list[list[str]] = []
    real_need = StreamingFetcher.need

    def need(self, files):
        real_need(self, files)
        seen.append(on_disk(self.dir))

    monkeypatch.setattr(StreamingFetcher, "need", need)
    api.quantize("acme/five", streamed, device="cpu", stream_download=True, max_resident="64KB")
    assert seen and max(len(s) for s in seen) <= 2, seen  # never more than `keep` source shards on disk
    assert {f for s in seen for f in s} == set(five_shards)
    api.quantize("acme/five", plain, device="cpu")
    assert same_conversion(streamed, plain)
    assert not (streamed / ".fp8convert" / "download").exists()


# --------------------------------------------------------------------------- push and the card


@pytest.fixture
def converted(tiny_ckpt: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    api.quantize(tiny_ckpt, out, device="cpu")
    return out


def card_meta(text: str) -> dict:
    meta, _ = split_front_matter(text)
    return meta


def test_push_uploads_every_file_byte_identical_without_work_dir(fake_hub, converted):
    assert (converted / ".fp8convert" / "manifest.json").is_file()
    url = publish.push(converted, "fake-user/tiny-fp8", private=True, token=fake_hub.token).url
    assert "fake-user/tiny-fp8" in url
    assert fake_hub.repo("fake-user/tiny-fp8").private
    remote = fake_hub.files("fake-user/tiny-fp8")
    assert not [n for n in remote if n.startswith(".fp8convert")]
    local = out_files(converted)
    assert "README.md" in local  # written by finalize, or by push for outputs without one
    assert {n: remote[n] for n in local} == local
    assert set(remote) == set(local) | {".gitattributes"}
    meta = card_meta(remote["README.md"].decode())
    # A local source: no base_model to link, but the source card's license carries over.
    assert meta["license"] == "apache-2.0" and meta["tags"] == ["fp8", "compressed-tensors", "fp8convert"]

    # Pushing again, to a branch, with other sharding: stale top-level shards are removed there.
    api.quantize(converted.parent / "src", converted, device="cpu", max_shard_size="30KB", overwrite=True)
    publish.push(
        converted, "fake-user/tiny-fp8", revision="resharded", commit_message="resharded", token=fake_hub.token
    )
    branch = fake_hub.files("fake-user/tiny-fp8", "resharded")
    assert {n for n in branch if n.endswith(".safetensors")} == {
        n for n in out_files(converted) if n.endswith(".safetensors")
    }
    assert fake_hub.files("fake-user/tiny-fp8") == remote  # main untouched
    repo = fake_hub.repo("fake-user/tiny-fp8")
    assert repo.commits[repo.branches["resharded"]].title.startswith("resharded")


def test_push_leaves_out_the_files_fp8convert_did_not_write_and_says_so(fake_hub, converted, capsys):
    """A file or folder the user put in OUT after the conversion is not published unasked."""
    (converted / "notes.txt").write_text("private")
    (converted / "eval [draft]").mkdir()
    (converted / "eval [draft]" / "scores.json").write_text("{}")
    assert main(["push", str(converted), "fake-user/tiny-fp8", "--token", fake_hub.token, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["left_out"] == ["eval [draft]/", "notes.txt"]
    assert "note: not uploaded, as fp8convert did not write them: eval [draft]/, notes.txt" in captured.err
    remote = fake_hub.files("fake-user/tiny-fp8")
    assert "config.json" in remote and not [n for n in remote if n.startswith(("notes", "eval"))], sorted(remote)


def test_push_while_offline_is_one_line_that_says_so(fake_hub, converted, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["push", str(converted), "fake-user/tiny-fp8", "--token", fake_hub.token]) == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert line == "error: fake-user/tiny-fp8: HF_HUB_OFFLINE is set, so the Hub cannot be reached; unset it"


def test_push_through_the_multi_commit_pipeline(fake_hub, converted, monkeypatch):
    """With hf_xet installed (the default), upload_folder is huggingface_hub's resumable pipelined upload."""
    pytest.importorskip("hf_xet")
    import huggingface_hub._upload_pipeline as pipeline
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    monkeypatch.setattr(pipeline, "COMMIT_SIZE_SCALE", [2])  # 2 files per commit: several commits
    monkeypatch.setattr(pipeline, "INITIAL_COMMIT_SIZE_INDEX", 0)
    fake_hub.force_regular_uploads = True  # the pipeline runs; no Xet transfer is needed
    publish.push(converted, "fake-user/piped", token=fake_hub.token, commit_message="fp8")
    remote = fake_hub.files("fake-user/piped")
    local = out_files(converted)
    assert {n: remote[n] for n in local} == local and not [n for n in remote if n.startswith(".fp8convert")]
    titles = [c.title for c in fake_hub.repo("fake-user/piped").commits.values()]
    assert "fp8 (part 2)" in titles


@pytest.mark.parametrize(
    "breakage", ["no-config", "no-index", "manifest-incomplete", "missing-shard", "truncated-shard"]
)
def test_push_refuses_incomplete_output(fake_hub, converted, breakage, capsys):
    shard = sorted(converted.glob("model-*.safetensors"))[0]
    if breakage == "no-config":
        (converted / "config.json").unlink()
    elif breakage == "no-index":
        (converted / INDEX_NAME).unlink()
    elif breakage == "manifest-incomplete":
        manifest = converted / ".fp8convert" / "manifest.json"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "complete": False}))
    elif breakage == "missing-shard":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(FP8ConvertError, match="refusing to push|before pushing|not complete"):
        publish.push(converted, "fake-user/never", token=fake_hub.token)
    assert main(["push", str(converted), "fake-user/never"]) == 1
    assert "error:" in capsys.readouterr().err
    assert not fake_hub.has_repo("fake-user/never") and not fake_hub.requests


def test_quantize_push_to_hub_end_to_end(fake_hub, tiny_repo, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", fake_hub.token)
    out = tmp_path / "out"
    rc = main(
        [
            "quantize",
            REPO,
            str(out),
            "--device",
            "cpu",
            "-q",
            "--scheme",
            "channel",
            "--push-to-hub",
            "fake-user/tiny-llama-fp8",
            "--private",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert "pushed" in capsys.readouterr().out
    remote = fake_hub.files("fake-user/tiny-llama-fp8")
    assert fake_hub.repo("fake-user/tiny-llama-fp8").private
    local = out_files(out)
    assert {n: remote[n] for n in local} == local and "README.md" in remote
    card = remote["README.md"].decode()
    assert "vllm serve fake-user/tiny-llama-fp8\n" in card  # examples name the repo, not the local directory
    meta = card_meta(card)
    assert meta["base_model"] == REPO and meta["base_model_relation"] == "quantized"
    assert "compressed-tensors" in meta["tags"]
    assert not [n for n in remote if n.startswith(".fp8convert") or n.endswith(".bin")]

    assert main(["quantize", REPO, str(tmp_path / "o2"), "--private"]) == 2  # a usage error
    assert "--private applies only with --push-to-hub" in capsys.readouterr().err


def test_make_card_fields_command_and_loading(tiny_ckpt):
    p = api.make_plan(tiny_ckpt, scheme="block", format="fp8", ignore=["*.down_proj"])
    p.source.label, p.source.revision = REPO, "0" * 40  # as if converted from the Hub
    figures = {"worst_relative_error": 0.0123456, "min_snr_db": 31.5}
    text = with_verification(make_card(p, SOURCE_CARD, repo_id="me/tiny-fp8"), figures)
    meta, body = split_front_matter(text)
    assert meta["base_model"] == REPO and meta["base_model_relation"] == "quantized"
    assert meta["license"] == "apache-2.0" and meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-generation" and meta["language"] == ["en"]
    assert meta["tags"] == ["fp8", "fp8convert"]  # the source's own tags describe the source, not this
    assert "fp8convert quantize acme/tiny-llama ./" not in body  # the target is the repo
    assert f"fp8convert quantize {REPO} me/tiny-fp8 --scheme block --format fp8 --ignore '*.down_proj'" in body
    assert "vllm serve me/tiny-fp8" in body and "AutoModelForCausalLM" in body
    assert "| worst relative error | 0.01235 |" in body and "31.5" in body
    assert "| 1-D (norm or bias) |" in body  # kept reasons listed in the table

    # fp8 per-tensor does not load in transformers: the card says so instead of giving a snippet.
    p2 = api.make_plan(tiny_ckpt, scheme="tensor", format="fp8")
    meta2, body2 = split_front_matter(make_card(p2, None))
    assert "base_model" not in meta2 and "license" not in meta2  # local source, no card
    assert "Not loadable in transformers" in body2
    assert f"fp8convert quantize {tiny_ckpt} ./src-FP8 --scheme tensor --format fp8\n" in body2

    # A warning that transformers cannot load the output (here: dims of 64 under 128x128 blocks) makes
    # the card say so, with that warning as the reason.
    p3 = api.make_plan(tiny_ckpt, scheme="block", format="compressed-tensors")
    body3 = split_front_matter(make_card(p3, None))[1]
    assert "Not loadable in transformers: " in body3 and "dim not divisible by 128" in body3
    assert "from_pretrained" not in body3


def test_card_examples_follow_the_push_target():
    info = {
        "source": "/data/my model",
        "scheme": "channel",
        "format": "compressed-tensors",
        "kept": {},
        "ignore": ["lm_head"],
        "warnings": [],
    }
    text = make_card(info, SOURCE_CARD)
    assert "vllm serve './my model-FP8'\n" in text and 'from_pretrained("./my model-FP8"' in text
    pushed = retarget_card(text, "me/a")
    assert "vllm serve me/a\n" in pushed and 'from_pretrained("me/a"' in pushed and "--model-path me/a\n" in pushed
    assert retarget_card(pushed, "me/b").count("me/b") == 4 and "me/a" not in retarget_card(pushed, "me/b")
    assert split_front_matter(pushed)[0] == split_front_matter(text)[0]
    assert retarget_card("# my own card\n", "me/a") == "# my own card\n"


def test_source_card_front_matter_parsing():
    assert split_front_matter("no header\n") == ({}, "no header\n")
    assert split_front_matter("---\nlicense: mit\n---\nbody\n") == ({"license": "mit"}, "body\n")
    assert split_front_matter("---\n: : bad yaml [\n---\nbody") == ({}, "body")


def test_rerun_after_the_branch_moved_is_refused(fake_hub, tiny_repo, tmp_path, capsys):
    """Resume never mixes two commits: the tensors' names and shapes are the same after the push, only
    values differ, so the plan alone cannot tell; the recorded commit can."""
    out = tmp_path / "out"
    api.quantize(REPO, out, device="cpu", finalize=False, worker="0/2")  # half the shards, then stopped
    shard = sorted(p.name for p in tiny_repo.glob("*.safetensors"))[0]
    data = bytearray((tiny_repo / shard).read_bytes())
    data[-64:] = bytes(64)  # same header, other weights
    new = fake_hub.commit_files(REPO, {shard: bytes(data)}, message="retrained")
    with pytest.raises(FP8ConvertError) as e:
        api.quantize(REPO, out, device="cpu")
    msg = str(e.value)
    assert "another state of the source" in msg and new[:12] in msg and "pass overwrite=True" in msg, msg
    assert not (out / "config.json").exists()
    assert main(["quantize", REPO, str(out), "--device", "cpu", "-q", "--overwrite"]) == 0
    assert json.loads((out / ".fp8convert" / "manifest.json").read_text())["revision"] == new


def test_hub_workers_ask_the_hub_once_each_and_an_offline_run_finds_their_downloads(
    fake_hub, tiny_repo, tmp_path, monkeypatch
):
    """Each worker of a shared run plans from the headers and downloads its own shards: one model_info
    call each, and the branch recorded in the cache, so an offline run by branch name finds the files."""
    from huggingface_hub import constants

    out = tmp_path / "out"
    for k in range(2):
        start = len(fake_hub.requests)
        api.quantize(REPO, out, device="cpu", finalize=False, worker=f"{k}/2")
        assert len([r for r in fake_hub.requests[start:] if "/api/models/" in r.path]) == 1
    api.quantize(REPO, tmp_path / "online", device="cpu")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    start = len(fake_hub.requests)
    api.quantize(REPO, tmp_path / "offline", device="cpu")
    assert same_conversion(tmp_path / "offline", tmp_path / "online") and len(fake_hub.requests) == start


def test_finalize_of_a_hub_source_asks_the_hub_once(fake_hub, tiny_repo, tmp_path, capsys):
    """finalize rebuilds the plan from the recorded commit: one model_info call, not one per step."""
    out = tmp_path / "out"
    for k in range(2):
        api.quantize(REPO, out, device="cpu", finalize=False, worker=f"{k}/2")
    fake_hub.requests.clear()
    assert main(["finalize", str(out)]) == 0
    assert len(fake_hub.requests_to("/api/models/")) == 1
    assert (out / "model.safetensors.index.json").exists()


# --------------------------------------------------------------------------- --token, --cache-dir, --create-pr


def test_push_with_token_option_and_create_pr(fake_hub, converted, monkeypatch, capsys):
    """`push --token` works without HF_TOKEN or a saved login (the fake Hub refuses writes without an
    accepted token); `--create-pr` opens a pull request and leaves the branch as it was."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert main(["push", str(converted), "fake-user/tiny-fp8", "--token", fake_hub.token]) == 0
    main_before = fake_hub.files("fake-user/tiny-fp8")
    (converted / "README.md").write_text((converted / "README.md").read_text() + "\nA note.\n")
    assert main(["push", str(converted), "fake-user/tiny-fp8", "--token", fake_hub.token, "--create-pr"]) == 0
    out = capsys.readouterr().out
    assert "opened a pull request on fake-user/tiny-fp8" in out and "/discussions/1" in out, out
    assert fake_hub.files("fake-user/tiny-fp8") == main_before  # main untouched
    assert fake_hub.files("fake-user/tiny-fp8", "refs/pr/1")["README.md"].endswith(b"A note.\n")
    # a pull request of nothing the branch lacks is not opened, and not claimed (it was, with main's commit URL)
    (converted / "README.md").write_text((converted / "README.md").read_text().removesuffix("\nA note.\n"))
    assert main(["push", str(converted), "fake-user/tiny-fp8", "--token", fake_hub.token, "--create-pr", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pull_request"] is False and "/commit/" in doc["url"], doc
    assert main(["push", str(converted), "fake-user/tiny-fp8", "--token", fake_hub.token, "--create-pr"]) == 0
    assert "no pull request opened on fake-user/tiny-fp8" in capsys.readouterr().out


def test_push_takes_json(fake_hub, converted, capsys):
    assert main(["push", str(converted), "fake-user/tiny-fp8", "--token", fake_hub.token, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["out"] == str(converted) and doc["repo_id"] == "fake-user/tiny-fp8" and doc["pull_request"] is False
    assert "/fake-user/tiny-fp8/commit/" in doc["url"] and fake_hub.files("fake-user/tiny-fp8")["config.json"]
    assert main(["push", str(converted), "not a repo", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["exit_code"] == 2


def test_a_push_that_fails_on_the_network_says_a_rerun_resumes_the_upload(fake_hub, converted, monkeypatch):
    monkeypatch.setenv("FP8CONVERT_HUB_RETRIES", "0")
    fake_hub.fail("drop", path_contains="/api/repos/create")
    with pytest.raises(FP8ConvertError) as e:
        publish.push(converted, "fake-user/tiny-fp8", token=fake_hub.token)
    assert "rerun the same push to resume it" in str(e.value) and "downloads" not in str(e.value)


@pytest.mark.parametrize(
    "name, value, needle",
    [("FP8CONVERT_HUB_RETRIES", "two", "not an integer"), ("FP8CONVERT_HUB_RETRY_WAIT", "soon", "not a number")],
)
def test_a_retry_setting_that_is_not_a_number_is_refused(monkeypatch, name, value, needle):
    monkeypatch.setenv(name, value)
    with pytest.raises(FP8ConvertError) as e:
        hub.with_retries(lambda: None)
    assert str(e.value) == f"${name}={value!r}: {needle}"


def test_cache_dir_option_holds_the_downloads(fake_hub, tiny_repo, tmp_path, capsys):
    from huggingface_hub import constants

    cache = tmp_path / "my-cache"
    assert main(["inspect", REPO, "--cache-dir", str(cache)]) == 0
    assert main(["quantize", REPO, str(tmp_path / "out"), "--cache-dir", str(cache), "--device", "cpu", "-q"]) == 0
    assert list(cache.glob("models--acme--tiny-llama/snapshots/*/model-00002-of-00003.safetensors"))
    assert not list(Path(constants.HF_HUB_CACHE).glob("models--acme--tiny-llama"))


# --------------------------------------------------------------------------- the model card


def test_card_reproduce_line_and_base_model(tiny_ckpt, tmp_path, monkeypatch):
    """Sizes as a user types them, a local source has no base_model unless --base-model sets it (then
    the command repeats it), and a directory in huggingface_hub's cache is its repo."""
    out = tmp_path / "out"
    api.quantize(tiny_ckpt, out, device="cpu", max_shard_size="30KB")
    text = (out / "README.md").read_text()
    assert "--max-shard-size 30KB" in text and "30000" not in text
    assert "base_model" not in card_meta(text)
    assert main(["quantize", str(tiny_ckpt), str(tmp_path / "o2"), "-q", "--base-model", "acme/tiny-llama"]) == 0
    text = (tmp_path / "o2" / "README.md").read_text()
    meta = card_meta(text)
    assert meta["base_model"] == "acme/tiny-llama" and meta["base_model_relation"] == "quantized"
    assert "--base-model acme/tiny-llama" in text
    assert "[acme/tiny-llama](https://huggingface.co/acme/tiny-llama)" in text
    assert (
        main(["quantize", str(tiny_ckpt), str(tmp_path / "o3"), "-q", "--base-model", "not a repo"]) == 2
    )  # a usage error
    # a source named relative to the working folder: the card names it so that its command works from anywhere
    monkeypatch.chdir(tiny_ckpt.parent)
    assert main(["quantize", tiny_ckpt.name, str(tmp_path / "o5"), "-q"]) == 0
    assert f"fp8convert quantize {tiny_ckpt.resolve()} ./" in (tmp_path / "o5" / "README.md").read_text()
    snapshot = tmp_path / "hub" / "models--acme--cached" / "snapshots" / ("a" * 40)
    snapshot.parent.mkdir(parents=True)
    tiny_ckpt.rename(snapshot)
    api.quantize(snapshot, tmp_path / "o4", device="cpu")
    text = (tmp_path / "o4" / "README.md").read_text()
    assert card_meta(text)["base_model"] == "acme/cached"
    assert "\n# cached-FP8\n" in text and "./cached-FP8" in text  # named by its repo, not its commit hash


@pytest.mark.parametrize(
    "fmt,needs",
    [
        ("compressed-tensors", "pip install transformers compressed-tensors\n"),
        ("fp8", "pip install transformers accelerate\n"),
    ],
)
def test_card_says_what_its_transformers_snippet_needs(tiny_ckpt, tmp_path, fmt, needs):
    out = tmp_path / "out"
    api.quantize(tiny_ckpt, out, device="cpu", format=fmt, scheme="block" if fmt == "fp8" else "tensor")
    text = (out / "README.md").read_text()
    assert needs in text and "device_map" not in text and "from_pretrained(" in text


@pytest.mark.slow
def test_card_snippet_runs_with_only_what_the_card_installs(tmp_path):
    """The compressed-tensors card's snippet, run as written where accelerate is missing (the card does
    not ask for it): the model loads. (device_map="auto", which the card used to show, needs it.)"""
    import re
    import subprocess
    import sys

    from fp8convert.demo import make_demo_model

    src = make_demo_model(tmp_path / "src")
    out = tmp_path / "src-FP8"  # the card's examples say ./src-FP8 until a push names the repo
    api.quantize(src, out, device="cpu")
    text = (out / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert "pip install transformers compressed-tensors" in text and "accelerate" not in text
    # as if accelerate were not installed: import fails and importlib finds no such package
    no_accelerate = "import sys\nsys.modules['accelerate'] = None\n"
    run = subprocess.run(
        [sys.executable, "-c", no_accelerate + snippet + "\nprint(type(model).__name__)"],
        cwd=out.parent,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0 and "LlamaForCausalLM" in run.stdout, run.stderr[-2000:]


def test_fp4_from_the_hub_to_the_hub_and_back(fake_hub, tiny_repo, tmp_path, monkeypatch, capsys):
    """An NVFP4A16 conversion of a repo id, pushed byte for byte with an FP4 card; that repo then is an
    FP4 source: dequantize from its id writes the bytes dequantizing the local output writes."""
    monkeypatch.setenv("HF_TOKEN", fake_hub.token)
    out = tmp_path / "out"
    argv = ["quantize", REPO, str(out), "--device", "cpu", "-q", "--scheme", "NVFP4A16"]
    assert main([*argv, "--push-to-hub", "fake-user/tiny-nvfp4"]) == 0, capsys.readouterr().err
    remote, local = fake_hub.files("fake-user/tiny-nvfp4"), out_files(out)
    assert {n: remote[n] for n in local} == local
    assert any(n.endswith(".weight_packed") for n in json.loads(local[INDEX_NAME])["weight_map"])
    card = remote["README.md"].decode()
    assert card_meta(card)["tags"][0] == "nvfp4" and "vllm serve fake-user/tiny-nvfp4\n" in card
    assert "SGLang" not in card  # its compressed-tensors path has no weight-only FP4 scheme
    from_hub, from_disk = tmp_path / "bf16-hub", tmp_path / "bf16-disk"
    assert main(["dequantize", "fake-user/tiny-nvfp4", str(from_hub), "--device", "cpu", "-q"]) == 0
    assert main(["dequantize", str(out), str(from_disk), "--device", "cpu", "-q"]) == 0, capsys.readouterr().err
    shards = {n: d for n, d in out_files(from_disk).items() if n.endswith(".safetensors") or n == INDEX_NAME}
    assert shards and {n: out_files(from_hub)[n] for n in shards} == shards
