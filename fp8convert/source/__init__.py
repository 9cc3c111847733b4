"""Stage 1, source: what the checkpoint holds, read from headers alone, and a Hub repo's files brought into
the huggingface_hub cache. SRC names a local directory, or a Hub repo id (owner/name) when no such
directory exists."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import huggingface_hub as hf  # cheap: the package loads its HTTP client only when used
from huggingface_hub import constants

from ..errors import FP8ConvertError
from ..options import REPO_ID, HubAccess
from .checkpoint import Source, open_local
from .hub import also_no_folder, resolve_repo, source_from_repo
from .streaming import NoFetcher, StreamingFetcher


def looks_like_repo_id(src: str) -> bool:
    return bool(REPO_ID.match(src)) and not Path(src).exists()


def open_source(src: str | Path, hub: HubAccess, download: bool = True) -> Source:
    """The checkpoint: a local directory, or a Hub repo downloaded into the huggingface_hub cache (only
    the files a conversion reads), or without `download` its layout alone, from remote headers."""
    text = str(src)
    if looks_like_repo_id(text):
        return hub_source(text, hub, download)
    if not Path(text).exists():
        raise FP8ConvertError(f"{text}: no such directory, and not a Hub repo id (owner/name)")
    if hub.revision:
        raise FP8ConvertError(f"--revision applies to Hub repo ids, but {text} is a local directory")
    return open_local(Path(text))


def run_source(
    src: str | Path, hub: HubAccess, stream_to: Path | None, shared: bool
) -> tuple[Source, NoFetcher | StreamingFetcher]:
    """A conversion's source and the fetcher that brings its shards. `stream_to` (--stream-download): a
    Hub repo's shards arrive there as the run needs them, from `fetcher.start(order)` on. `shared` (one
    worker of several): a Hub repo is planned from its headers, and each worker fetches the shards it reads."""
    if stream_to is not None:
        repo = resolve_repo(str(src), hub)  # the small files go to the cache
        return source_from_repo(repo, stream_to), StreamingFetcher(repo, stream_to)
    if shared and looks_like_repo_id(str(src)) and not constants.HF_HUB_OFFLINE:
        repo = resolve_repo(str(src), hub)
        return source_from_repo(repo), NoFetcher(repo)
    return open_source(src, hub, download=not shared), NoFetcher()


def recorded_source(state: dict, hub: HubAccess) -> Source:
    """The source a manifest records, under the label the model card names: its local directory, or the
    Hub repo at the recorded commit from its headers, with the small files finalize reads fetched."""
    if state.get("source_path"):
        return open_local(Path(state["source_path"]), label=state["source"])
    if not looks_like_repo_id(state["source"]):
        raise FP8ConvertError(f"{state['source']}: the manifest's source is neither a directory nor a Hub repo id")
    hub = replace(hub, revision=state.get("revision"))
    if constants.HF_HUB_OFFLINE:
        return hub_source(state["source"], hub, download=False)
    repo = resolve_repo(state["source"], hub)
    source = source_from_repo(repo)
    repo.fetch([])
    return source


def hub_source(repo_id: str, hub: HubAccess, download: bool) -> Source:
    """Rooted at the cache snapshot a download fills; with HF_HUB_OFFLINE set, an earlier download's."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    if not constants.HF_HUB_OFFLINE:
        repo = resolve_repo(repo_id, hub)
        if download:
            return open_local(repo.fetch(repo.shards), label=repo_id, revision=repo.sha)
        return source_from_repo(repo)
    with also_no_folder(repo_id):
        try:
            root = hf.snapshot_download(repo_id, revision=hub.revision, cache_dir=hub.cache_dir, local_files_only=True)
        except LocalEntryNotFoundError as e:
            at = f" at {hub.revision}" if hub.revision else ""
            raise FP8ConvertError(
                f"{repo_id}: HF_HUB_OFFLINE is set and the download cache "
                f"({hub.cache_dir or constants.HF_HUB_CACHE}) holds no copy of it{at}; unset "
                "HF_HUB_OFFLINE to download it"
            ) from e
    return open_local(Path(root), label=repo_id, revision=Path(root).name)
