"""A checkpoint in a local directory: its layout from the index (or the top-level safetensors files) and
every shard's header."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import FP8ConvertError
from ..formats.sources import read_source_quantization
from ..safetensors_io import INDEX_NAME, read_header
from .checkpoint import Source, collect_tensors, is_copied_file, load_config, parse_index, shard_files

NOT_A_FILE = "not a regular file (a directory, pipe, device or broken link)"


def open_local(root: Path, label: str | None = None, revision: str | None = None) -> Source:
    """Read a local checkpoint's layout: headers of every shard, config, files to copy. `revision`: the
    Hub commit, when the directory is a downloaded snapshot."""
    root = Path(root)
    if not root.is_dir():
        raise FP8ConvertError(f"{root}: not a directory (or Hub repo id)")
    listing = sorted(os.listdir(root))
    index, index_map = root / INDEX_NAME, None
    if (index.exists() or index.is_symlink()) and not index.is_file():  # not silently a folder without one
        raise FP8ConvertError(f"{index}: {NOT_A_FILE}")
    if index.is_file():
        index_map = parse_index(index.read_bytes(), str(index))
    shards = shard_files(listing, index_map, str(root))
    config = load_config(root)
    headers = {}
    for name in shards:
        path = root / name
        if not path.is_file():
            if index_map is not None and not path.exists() and not path.is_symlink():
                raise FP8ConvertError(f"{INDEX_NAME}: names {name}, which does not exist in {root}")
            raise FP8ConvertError(f"{path}: {NOT_A_FILE}, so it cannot be read as a shard")
        headers[name], _ = read_header(str(path), name)
    tensors = collect_tensors(headers, index_map, str(root))
    copy = [n for n in listing if is_copied_file(n) and (root / n).is_file()]
    quant = read_source_quantization(config, tensors, str(root), copy)
    return Source(root, shards, tensors, config, copy, label or str(root), revision, quant)
