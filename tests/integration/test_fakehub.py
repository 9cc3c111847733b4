"""End-to-end checks that the real huggingface_hub client works against tests/support/fakehub.py.

Every call below goes through huggingface_hub's public API and real HTTP to 127.0.0.1;
the fake_hub fixture blocks any other network access.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

import pytest
import torch
from huggingface_hub import (
    HfApi,
    constants,
    get_safetensors_metadata,
    hf_hub_download,
    model_info,
    snapshot_download,
)
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors.torch import save_file

from fp8convert.source.hub import http_module

try:
    from fakehub import FakeHub, fake_hub  # noqa: F401  (fake_hub is a fixture)
except ImportError:  # tests/ imported as a package (e.g. --import-mode=importlib)
    from tests.fakehub import FakeHub, fake_hub  # noqa: F401

# huggingface_hub's own LFS upload passes a file object as `data=`, which httpx2 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

REPO = "acme/tiny-llama"
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "intermediate_size": 8,
    "vocab_size": 8,
}


def safetensors_bytes(tmp_path: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> bytes:
    path = tmp_path / name
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path.read_bytes()


@pytest.fixture
def tiny_model(fake_hub: FakeHub, tmp_path: Path) -> dict[str, bytes]:
    files = {
        "config.json": json.dumps(CONFIG).encode(),
        "tokenizer.json": b'{"version": "1.0"}',
        "README.md": b"# tiny\n",
        "model.safetensors": safetensors_bytes(
            tmp_path,
            {"model.embed_tokens.weight": torch.zeros(8, 4, dtype=torch.bfloat16), "model.norm.weight": torch.ones(4)},
        ),
    }
    fake_hub.add_repo(REPO, files)
    return files


# --------------------------------------------------------------------------- metadata


def test_model_info_siblings_sha_and_revisions(fake_hub: FakeHub, tiny_model: dict[str, bytes]) -> None:
    first_sha = fake_hub.repo_sha(REPO)
    info = HfApi().model_info(REPO, files_metadata=True)

    assert info.id == REPO and info.sha == first_sha and info.private is False and info.gated is False
    siblings = {s.rfilename: s for s in info.siblings}
    assert set(siblings) == set(tiny_model)
    weights = siblings["model.safetensors"]
    assert weights.size == len(tiny_model["model.safetensors"])
    assert weights.lfs is not None and weights.lfs.sha256 == hashlib.sha256(tiny_model["model.safetensors"]).hexdigest()
    assert siblings["config.json"].lfs is None and siblings["config.json"].size == len(tiny_model["config.json"])
    assert info.config == {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    assert info.safetensors.parameters == {"BF16": 32, "F32": 4} and info.safetensors.total == 36

    # A second commit: "main" moves, the old sha still resolves to the old tree.
    second_sha = fake_hub.commit_files(REPO, {"generation_config.json": b"{}"})
    assert model_info(REPO).sha == second_sha
    assert HfApi().model_info(REPO, revision=first_sha).sha == first_sha
    assert "generation_config.json" in HfApi().list_repo_files(REPO)
    assert "generation_config.json" not in HfApi().list_repo_files(REPO, revision=first_sha)
    assert HfApi().repo_info(REPO, revision=first_sha[:10]).sha == first_sha  # short sha

    with pytest.raises(RevisionNotFoundError):
        HfApi().model_info(REPO, revision="no-such-branch")


def test_list_repo_tree_paginates(fake_hub: FakeHub) -> None:
    fake_hub.add_repo("acme/many", {f"shards/{i:03d}.txt": str(i).encode() for i in range(25)})
    fake_hub.tree_page_size = 10
    assert sorted(HfApi().list_repo_files("acme/many")) == [f"shards/{i:03d}.txt" for i in range(25)]
    assert len(fake_hub.requests_to("/tree/")) == 3  # 10 + 10 + 6 entries (the folder is listed too)


# --------------------------------------------------------------------------- downloads


def test_hf_hub_download_regular_and_lfs_files(fake_hub: FakeHub, tiny_model: dict[str, bytes]) -> None:
    config_path = hf_hub_download(REPO, "config.json")
    weights_path = hf_hub_download(REPO, "model.safetensors")

    assert Path(config_path).read_bytes() == tiny_model["config.json"]
    assert Path(weights_path).read_bytes() == tiny_model["model.safetensors"]
    assert config_path.startswith(constants.HF_HUB_CACHE)  # isolated cache under tmp_path
    # The cache names blobs after the ETag: sha256 for LFS files.
    assert Path(weights_path).resolve().name == hashlib.sha256(tiny_model["model.safetensors"]).hexdigest()
    assert [r.method for r in fake_hub.requests_to("/resolve/main/model.safetensors")] == ["HEAD", "GET"]

    old_sha = fake_hub.repo_sha(REPO)
    fake_hub.commit_files(REPO, {"config.json": b'{"model_type": "changed"}'})
    assert Path(hf_hub_download(REPO, "config.json")).read_bytes() == b'{"model_type": "changed"}'
    assert Path(hf_hub_download(REPO, "config.json", revision=old_sha)).read_bytes() == tiny_model["config.json"]

    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(REPO, "missing.bin")


def test_snapshot_download_with_allow_patterns(fake_hub: FakeHub, tiny_model: dict[str, bytes], tmp_path: Path) -> None:
    folder = Path(snapshot_download(REPO, allow_patterns=["*.json"]))
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "tokenizer.json"]
    assert (folder / "config.json").read_bytes() == tiny_model["config.json"]
    assert folder.name == fake_hub.repo_sha(REPO)
    assert not any("safetensors" in r.path for r in fake_hub.requests_to("/resolve/"))

    local = Path(snapshot_download(REPO, local_dir=tmp_path / "local"))
    for name, data in tiny_model.items():
        assert (local / name).read_bytes() == data


def test_safetensors_metadata_with_range_requests(fake_hub: FakeHub, tiny_model: dict[str, bytes], tmp_path) -> None:
    meta = get_safetensors_metadata(REPO)
    assert not meta.sharded
    tensor = meta.files_metadata["model.safetensors"].tensors["model.embed_tokens.weight"]
    assert tensor.dtype == "BF16" and tensor.shape == [8, 4]
    assert meta.parameter_count == {"BF16": 32, "F32": 4}
    ranged = [r for r in fake_hub.requests_to("/resolve/main/model.safetensors", "GET") if "range" in r.headers]
    assert [r.headers["range"] for r in ranged] == ["bytes=0-100000"]

    # Sharded repo with an index, and a header larger than the first 100 kB read.
    many = {f"model.layers.{i}.a_rather_long_parameter_name.weight": torch.zeros(1) for i in range(2000)}
    shard1 = safetensors_bytes(tmp_path, many, "s1.safetensors")
    shard2 = safetensors_bytes(tmp_path, {"lm_head.weight": torch.zeros(2, 2, dtype=torch.float16)}, "s2.safetensors")
    index = {
        "metadata": {"total_size": 123},
        "weight_map": {
            **{k: "model-00001-of-00002.safetensors" for k in many},
            "lm_head.weight": "model-00002-of-00002.safetensors",
        },
    }
    fake_hub.add_repo(
        "acme/sharded",
        {
            "model.safetensors.index.json": json.dumps(index).encode(),
            "model-00001-of-00002.safetensors": shard1,
            "model-00002-of-00002.safetensors": shard2,
        },
    )
    meta = HfApi().get_safetensors_metadata("acme/sharded")
    assert meta.sharded and meta.metadata == {"total_size": 123}
    assert meta.parameter_count == {"F32": 2000, "F16": 4}
    ranges = [r.headers.get("range") for r in fake_hub.requests_to("model-00001-of-00002.safetensors", "GET")]
    assert ranges[0] == "bytes=0-100000" and ranges[1].startswith("bytes=8-")  # second read for the big header

    # The one-call variant (server-side parsing of every shard header), where the client has it.
    if hasattr(HfApi, "get_sharded_safetensors_metadata"):
        assert HfApi().get_sharded_safetensors_metadata("acme/sharded").parameter_count == {"F32": 2000, "F16": 4}


# --------------------------------------------------------------------------- repos & uploads


def test_create_repo_private_and_exist_ok(fake_hub: FakeHub) -> None:
    api = HfApi(token=fake_hub.token)
    url = api.create_repo("fake-user/fresh", private=True)
    assert url.repo_id == "fake-user/fresh" and url.startswith(fake_hub.url)
    assert api.repo_info("fake-user/fresh").private is True
    assert api.list_repo_files("fake-user/fresh") == [".gitattributes"]  # like a real new repo

    with pytest.raises(HfHubHTTPError) as exc:
        api.create_repo("fake-user/fresh")
    assert exc.value.response.status_code == 409
    assert api.create_repo("fake-user/fresh", exist_ok=True).repo_id == "fake-user/fresh"

    with pytest.raises(RepositoryNotFoundError):  # private: invisible without a token
        HfApi(token=False).model_info("fake-user/fresh")
    assert api.repo_exists("fake-user/fresh") and not api.repo_exists("fake-user/other")


def test_upload_folder_with_lfs_and_skip_unchanged(fake_hub: FakeHub, tmp_path: Path) -> None:
    folder = tmp_path / "out"
    (folder / "nested").mkdir(parents=True)
    local = {
        "config.json": json.dumps(CONFIG).encode(),
        "README.md": b"---\nlicense: apache-2.0\n---\n# converted\n",
        "nested/notes.txt": b"hello",
        "model.safetensors": safetensors_bytes(tmp_path, {"w": torch.ones(3, 3)}),
        "big.bin": os.urandom(12 * 1024 * 1024),  # > 10 MB: LFS whatever its name
    }
    for name, data in local.items():
        (folder / name).write_bytes(data)

    api = HfApi(token=fake_hub.token)
    api.create_repo("acme/upload")
    commit = api.upload_folder(repo_id="acme/upload", folder_path=folder, commit_message="fp8 weights")

    assert commit.oid == fake_hub.repo_sha("acme/upload")
    assert fake_hub.files("acme/upload") == {**local, ".gitattributes": fake_hub.files("acme/upload")[".gitattributes"]}
    puts = fake_hub.requests_to("/_lfs/upload/", "PUT")
    assert len(puts) == 2 and all("authorization" not in r.headers for r in puts)  # "S3" gets no token
    assert len(fake_hub.requests_to("/info/lfs/objects/batch", "POST")) == 1
    assert len(fake_hub.requests_to("/info/lfs/objects/verify", "POST")) == 2
    ops = [json.loads(line) for line in fake_hub.requests_to("/commit/main", "POST")[0].body.splitlines()]
    assert ops[0] == {"key": "header", "value": {"summary": "fp8 weights", "description": ""}}
    assert {op["value"]["path"]: op["key"] for op in ops[1:]} == {
        "config.json": "file",
        "README.md": "file",
        "nested/notes.txt": "file",
        "model.safetensors": "lfsFile",
        "big.bin": "lfsFile",
    }
    assert Path(hf_hub_download("acme/upload", "big.bin")).read_bytes() == local["big.bin"]

    # Re-running the same upload: preupload reports the remote oids, nothing changes, no commit.
    again = api.upload_folder(repo_id="acme/upload", folder_path=folder)
    assert again.oid == commit.oid and len(fake_hub.requests_to("/commit/main", "POST")) == 1
    assert len(fake_hub.requests_to("/_lfs/upload/", "PUT")) == 2


def test_upload_file_multipart_lfs_and_pull_request(fake_hub: FakeHub, tmp_path: Path) -> None:
    fake_hub.lfs_multipart_chunk_size = 5 * 1024 * 1024
    data = os.urandom(12 * 1024 * 1024)
    (tmp_path / "w.bin").write_bytes(data)
    api = HfApi(token=fake_hub.token)
    api.create_repo("acme/multipart")

    api.upload_file(path_or_fileobj=tmp_path / "w.bin", path_in_repo="weights/w.bin", repo_id="acme/multipart")
    assert fake_hub.files("acme/multipart")["weights/w.bin"] == data
    assert len(fake_hub.requests_to("/_lfs/part/", "PUT")) == 3
    assert len(fake_hub.requests_to("/_lfs/complete/", "POST")) == 1

    pr = api.upload_file(path_or_fileobj=b"pr", path_in_repo="pr.txt", repo_id="acme/multipart", create_pr=True)
    assert pr.pr_revision == "refs/pr/1"
    assert fake_hub.files("acme/multipart", "refs/pr/1")["pr.txt"] == b"pr"
    assert "pr.txt" not in fake_hub.files("acme/multipart")


def test_pipelined_multi_commit_upload_when_xet_enabled(
    fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With hf_xet enabled, upload_folder uses its resumable multi-commit pipeline. The fake hub
    cannot speak Xet, but it can answer "regular" for every file so the pipeline runs."""
    import huggingface_hub._upload_pipeline as pipeline

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    monkeypatch.setattr(pipeline, "COMMIT_SIZE_SCALE", [2])  # 2 files per commit
    monkeypatch.setattr(pipeline, "INITIAL_COMMIT_SIZE_INDEX", 0)
    fake_hub.force_regular_uploads = True
    folder = tmp_path / "out"
    folder.mkdir()
    for i in range(5):
        (folder / f"f{i}.txt").write_text(f"file {i}")
    api = HfApi(token=fake_hub.token)
    api.create_repo("acme/pipelined")

    # "Interrupted" run: only part of the folder made it.
    api.upload_folder(repo_id="acme/pipelined", folder_path=folder, allow_patterns=["f0.txt", "f1.txt"])
    # Re-run: already committed files are skipped, the rest goes in 2-file commits.
    api.upload_folder(repo_id="acme/pipelined", folder_path=folder, commit_message="rest")

    assert {k: v.decode() for k, v in fake_hub.files("acme/pipelined").items() if k.endswith(".txt")} == {
        f"f{i}.txt": f"file {i}" for i in range(5)
    }
    titles = [c.title for c in api.list_repo_commits("acme/pipelined")]
    assert titles[:2] == ["rest (part 2)", "rest"] and len(titles) == 4  # + first run + initial commit


# --------------------------------------------------------------------------- errors & auth


def test_gated_repo_raises_gated_repo_error(fake_hub: FakeHub) -> None:
    fake_hub.add_repo("acme/gated", {"config.json": b"{}"}, gated=True)
    assert model_info("acme/gated").gated == "auto"  # metadata stays public, like on the Hub

    with pytest.raises(GatedRepoError) as anonymous:
        hf_hub_download("acme/gated", "config.json")
    assert anonymous.value.response.status_code == 401
    with pytest.raises(GatedRepoError) as no_access:
        hf_hub_download("acme/gated", "config.json", token=fake_hub.token)
    assert no_access.value.response.status_code == 403
    with pytest.raises(GatedRepoError):
        snapshot_download("acme/gated", token=fake_hub.token)

    fake_hub.grant_access("acme/gated")
    assert Path(snapshot_download("acme/gated", token=fake_hub.token), "config.json").read_bytes() == b"{}"


def test_missing_repo_raises_repository_not_found(fake_hub: FakeHub) -> None:
    with pytest.raises(RepositoryNotFoundError):
        model_info("acme/nope")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("acme/nope", "config.json")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("acme/nope")
    with pytest.raises(RepositoryNotFoundError):
        HfApi(token=fake_hub.token).upload_file(path_or_fileobj=b"x", path_in_repo="x", repo_id="acme/nope")


def test_token_is_sent_and_checked(fake_hub: FakeHub, tiny_model: dict[str, bytes], monkeypatch) -> None:
    HfApi(token=fake_hub.token).model_info(REPO)
    assert fake_hub.requests[-1].headers["authorization"] == f"Bearer {fake_hub.token}"

    hf_hub_download(REPO, "model.safetensors", token=fake_hub.token)
    assert {r.token for r in fake_hub.requests_to("/resolve/")} == {fake_hub.token}  # HEAD and GET

    model_info(REPO)  # the fixture leaves no token configured...
    assert fake_hub.requests[-1].token is None
    monkeypatch.setenv("HF_TOKEN", fake_hub.token)  # ...and HF_TOKEN is read at call time
    model_info(REPO)
    assert fake_hub.requests[-1].token == fake_hub.token
    assert HfApi().whoami()["name"] == fake_hub.username

    with pytest.raises(HfHubHTTPError) as exc:
        HfApi(token="hf_wrong").model_info(REPO)
    assert exc.value.response.status_code == 401


def test_injected_failures(fake_hub: FakeHub, tiny_model: dict[str, bytes], tmp_path: Path) -> None:
    # One 500 on the metadata HEAD: hf_hub_download retries and succeeds.
    once = fake_hub.fail(status=500, times=1, method="HEAD")
    assert Path(hf_hub_download(REPO, "config.json")).read_bytes() == tiny_model["config.json"]
    assert once.hits == 1

    # Persistent 500s: model_info does not retry; snapshot_download falls back to the cache...
    fake_hub.fail(status=500, path_contains="/api/models/")
    with pytest.raises(HfHubHTTPError) as exc:
        model_info(REPO)
    assert exc.value.response.status_code == 500
    with pytest.raises(LocalEntryNotFoundError):
        snapshot_download(REPO, cache_dir=tmp_path / "empty-cache")
    # ...and silently returns a cached snapshot even if incomplete (only config.json was fetched).
    partial = Path(snapshot_download(REPO))
    assert [p.name for p in partial.iterdir()] == ["config.json"]
    fake_hub.clear_failures()

    # Dropped connections surface as transport errors of huggingface_hub's HTTP library (httpx2 from its
    # 2.0, httpx before), not HfHubHTTPError.
    fake_hub.fail("drop", path_contains="/api/models/")
    with pytest.raises(http_module().TransportError):
        model_info(REPO)
    fake_hub.clear_failures()
    assert model_info(REPO).sha == fake_hub.repo_sha(REPO)


def test_lfs_redirect_to_cdn_host(fake_hub: FakeHub, tiny_model: dict[str, bytes]) -> None:
    fake_hub.lfs_redirect = True
    path = hf_hub_download(REPO, "model.safetensors", token=fake_hub.token)
    assert Path(path).read_bytes() == tiny_model["model.safetensors"]
    (cdn_get,) = fake_hub.requests_to("/_lfs/cdn/", "GET")
    assert cdn_get.headers["host"].startswith("localhost") and "authorization" not in cdn_get.headers


@pytest.mark.slow
def test_transformers_autoconfig_loads_from_fake_hub(fake_hub: FakeHub, tiny_model: dict[str, bytes]) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(REPO)
    assert config.model_type == "llama" and config.hidden_size == 4
    assert fake_hub.requests_to(f"/api/models/{REPO}")  # transformers resolves the commit via model_info first


def test_network_outside_loopback_is_blocked(fake_hub: FakeHub) -> None:
    with pytest.raises(OSError, match="blocked"):
        socket.create_connection(("huggingface.co", 443), timeout=1)
    with pytest.raises(OSError, match="blocked"):
        socket.create_connection(("8.8.8.8", 53), timeout=1)
