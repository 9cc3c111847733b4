"""Hugging Face Hub sources: resolve a repo id to a local snapshot of just the files a conversion needs."""
from __future__ import annotations

import re
from pathlib import Path

from .errors import FP8ConvertError
from .source import INDEX_NAME, is_copied_file

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def looks_like_repo_id(src: str) -> bool:
    return bool(REPO_ID.match(src)) and not Path(src).exists()


def hub_error(repo_id: str, error: Exception) -> FP8ConvertError:
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    if isinstance(error, GatedRepoError):
        return FP8ConvertError(f"{repo_id}: gated repository; accept its terms on the Hub and log in "
                               "(huggingface-cli login or HF_TOKEN)")
    if isinstance(error, RepositoryNotFoundError):
        return FP8ConvertError(f"{repo_id}: repository not found (or private: log in or set HF_TOKEN)")
    if isinstance(error, RevisionNotFoundError):
        return FP8ConvertError(f"{repo_id}: revision not found")
    if isinstance(error, LocalEntryNotFoundError):
        return FP8ConvertError(f"{repo_id}: cannot reach the Hub and no cached copy ({error})")
    if isinstance(error, HfHubHTTPError):
        return FP8ConvertError(f"{repo_id}: Hub request failed ({str(error).splitlines()[0]})")
    return FP8ConvertError(f"{repo_id}: download failed ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")


def download_source(repo_id: str, revision: str | None = None, token: str | None = None,
                    cache_dir: str | None = None) -> Path:
    """Download config, index, the shards the index names (or top-level safetensors) and side files."""
    import json

    from huggingface_hub import HfApi, snapshot_download
    api = HfApi(token=token)
    try:
        files = api.list_repo_files(repo_id, revision=revision)
        wanted = ["config.json"] + [f for f in files if is_copied_file(f)]
        if INDEX_NAME in files:
            from huggingface_hub import hf_hub_download
            index_path = hf_hub_download(repo_id, INDEX_NAME, revision=revision, token=token, cache_dir=cache_dir)
            wanted += [INDEX_NAME] + sorted(set(json.loads(Path(index_path).read_text())["weight_map"].values()))
        else:
            wanted += [f for f in files if f.endswith(".safetensors") and "/" not in f]
        if not any(f.endswith(".safetensors") for f in wanted):
            if any(f.endswith((".bin", ".pt", ".pth")) for f in files):
                raise FP8ConvertError(f"{repo_id}: holds only pickle weights (.bin); fp8convert never loads pickle")
            raise FP8ConvertError(f"{repo_id}: no safetensors weights in the repository")
        path = snapshot_download(repo_id, revision=revision, token=token, allow_patterns=sorted(set(wanted)),
                                 cache_dir=cache_dir)
    except FP8ConvertError:
        raise
    except Exception as e:  # huggingface_hub and network errors become one clear line
        raise hub_error(repo_id, e) from e
    return Path(path)
