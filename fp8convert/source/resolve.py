"""What SRC names: a local checkpoint directory, or a Hub repo id (owner/name) when no such directory exists."""

from __future__ import annotations

from pathlib import Path

from ..errors import FP8ConvertError
from ..options import REPO_ID
from .checkpoint import Source
from .local import open_local


def looks_like_repo_id(src: str) -> bool:
    return bool(REPO_ID.match(src)) and not Path(src).exists()


def open_source(
    src: str | Path, revision: str | None = None, token: str | None = None, cache_dir: str | None = None
) -> Source:
    """The checkpoint with its data on this machine: a local directory, or a Hub repo downloaded into
    the huggingface_hub cache (`cache_dir`, else its default; only the files a conversion reads)."""
    text = str(src)
    if Path(text).exists():
        if revision:
            raise FP8ConvertError(f"--revision applies to Hub repo ids, but {text} is a local directory")
        return open_local(Path(text))
    if looks_like_repo_id(text):
        from .hub import download_source

        return download_source(text, revision=revision, token=token, cache_dir=cache_dir)
    raise FP8ConvertError(f"{text}: no such directory, and not a Hub repo id (owner/name)")


def plan_source(
    src: str | Path, revision: str | None = None, token: str | None = None, cache_dir: str | None = None
) -> Source:
    """The checkpoint's layout without its data: a Hub repo from remote headers (no weight download),
    a local directory as it is."""
    if looks_like_repo_id(str(src)):
        from .hub import remote_source

        return remote_source(str(src), revision, token, cache_dir=cache_dir)
    return open_source(src, revision, token, cache_dir)
