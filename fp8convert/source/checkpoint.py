"""What a source checkpoint is wherever it lives, the checks every source passes, and `open_local` for a
local directory. Reads headers, never tensor data."""

from __future__ import annotations

import json
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import FP8ConvertError
from ..formats.sources import SourceQuantization, read_source_quantization
from ..safetensors_io import INDEX_NAME, TensorInfo, read_header
from ..units import plural

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# weights and indexes, and the files rewritten or generated rather than copied
NOT_COPIED_SUFFIXES = (".safetensors", ".gguf", ".h5", ".msgpack", ".onnx", ".npz", *PICKLE_SUFFIXES, ".index.json")
NOT_COPIED = {"config.json", "README.md", f"{INDEX_NAME}.lock"}


@dataclass
class Source:
    """A checkpoint's layout."""

    root: Path  # where its files are (or will be, for a Hub source not yet downloaded)
    files: list[str]  # safetensors shard names, sorted
    tensors: list[TensorInfo]  # every tensor, in (file, offset) order
    config: dict  # config.json, key order kept
    copy_files: list[str]  # files copied verbatim into the output
    label: str  # what the user named: a directory or a repo id
    revision: str | None = None  # the Hub commit the layout was read at (None: a local directory)
    quant: SourceQuantization | None = None  # how a quantized source is quantized (None: high precision)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def is_copied_file(name: str) -> bool:
    """Top-level non-weight files travel with the model (tokenizer, chat template, remote code, license)."""
    return (
        "/" not in name
        and not name.startswith(".")
        and name not in NOT_COPIED
        and not name.endswith(NOT_COPIED_SUFFIXES)
    )


def parse_index(text: str | bytes, where: str) -> dict[str, str]:
    """The `weight_map` of a safetensors index; every file name must stay inside the checkpoint directory."""
    try:
        weight_map = json.loads(text)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object of tensor names")
        if (bad := next((k for k, file in weight_map.items() if not isinstance(file, str)), None)) is not None:
            raise TypeError(f"{bad}: the file is {weight_map[bad]!r}, not a file name")
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise FP8ConvertError(f"{where}: not a valid safetensors index ({e})") from e
    for name in set(weight_map.values()):
        if (
            name.startswith(("/", "\\"))
            or ":" in name[:3]
            or posixpath.normpath(name) != name
            or ".." in name.split("/")
        ):
            raise FP8ConvertError(f"{where}: refusing shard file name {name!r} (absolute or outside the checkpoint)")
    return weight_map


def index_files(weight_map: dict[str, str]) -> list[str]:
    return sorted(set(weight_map.values()))


NUMBERED_SHARD = re.compile(r"^(.+)-(\d+)-of-(\d+)\.safetensors$")  # model-00001-of-00003.safetensors


def refuse_missing_numbered(names: list[str], where: str) -> None:
    """Without an index, the shard files are what the folder holds: a numbered set with one missing
    (an interrupted copy or download) would silently lose its layers, so it is refused by name."""
    sets: dict[tuple[str, str], set[int]] = {}
    for m in filter(None, map(NUMBERED_SHARD.match, names)):
        sets.setdefault((m.group(1), m.group(3)), set()).add(int(m.group(2)))
    missing = [
        f"{stem}-{i:0{len(total)}d}-of-{total}.safetensors"
        for (stem, total), have in sorted(sets.items())
        for i in range(1, int(total) + 1)
        if i not in have
    ]
    if missing:
        raise FP8ConvertError(
            f"{where}: {missing[0]} is missing ({plural(len(missing), 'numbered shard')} of the set, "
            f"and no {INDEX_NAME} says which files hold the weights)"
        )


def shard_files(names: list[str], index_map: dict[str, str] | None, where: str) -> list[str]:
    """Those the index names, else the top-level safetensors files; refused when there are none."""
    if index_map is not None:
        shards = index_files(index_map)
    else:
        shards = sorted(n for n in names if n.endswith(".safetensors") and "/" not in n)
        refuse_missing_numbered(shards, where)
    if shards:
        return shards
    if any(n.endswith(PICKLE_SUFFIXES) for n in names):
        raise FP8ConvertError(
            f"{where}: holds only pickle weights (.bin/.pt); fp8convert never loads pickle. "
            "Convert to safetensors first"
        )
    raise FP8ConvertError(f"{where}: no safetensors weights found")


def load_config(root: Path) -> dict:
    path = root / "config.json"
    if not path.exists():
        raise FP8ConvertError(f"{path}: missing; fp8convert needs the model's config.json")
    try:
        config = json.loads(path.read_text())
    except OSError as e:  # a directory, unreadable
        raise FP8ConvertError(f"{path}: cannot read ({e.strerror})") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FP8ConvertError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise FP8ConvertError(f"{path}: not a JSON object")
    return config


def collect_tensors(headers: dict[str, dict], index_map: dict[str, str] | None, where: str) -> list[TensorInfo]:
    """Merge per-file headers; a tensor named twice, or not where the index says, is refused. `where`: the
    checkpoint (its directory, or a Hub repo id)."""
    seen: dict[str, TensorInfo] = {}
    for file in sorted(headers):
        for name, info in headers[file].items():
            if name in seen:
                raise FP8ConvertError(f"{where}: tensor {name} appears twice: in {seen[name].file} and {file}")
            seen[name] = info
    index = f"{where}/{INDEX_NAME}"
    if index_map is not None:
        for name, file in index_map.items():
            if name not in seen:
                raise FP8ConvertError(f"{index}: names tensor {name} in {file}, but no shard holds it")
            if seen[name].file != file:
                raise FP8ConvertError(f"{index}: says tensor {name} is in {file}, but it is in {seen[name].file}")
        for name, info in seen.items():
            if name not in index_map:
                raise FP8ConvertError(f"{index}: does not list tensor {name} found in {info.file}")
    if not seen:
        raise FP8ConvertError(f"{where}: holds no tensors ({', '.join(sorted(headers))} empty)")
    return sorted(seen.values(), key=lambda t: (t.file, t.offset))


NOT_A_FILE = "not a regular file (a directory, pipe, device or broken link)"


def open_local(root: Path, label: str | None = None, revision: str | None = None) -> Source:
    """A local checkpoint's layout. `revision`: the Hub commit, when the directory is a downloaded snapshot."""
    root = Path(root)
    if not root.is_dir():
        raise FP8ConvertError(f"{root}: not a directory (or Hub repo id)")
    listing = sorted(os.listdir(root))
    index = root / INDEX_NAME
    if (index.exists() or index.is_symlink()) and not index.is_file():  # not silently a folder without one
        raise FP8ConvertError(f"{index}: {NOT_A_FILE}")
    index_map = parse_index(index.read_bytes(), str(index)) if index.is_file() else None
    shards = shard_files(listing, index_map, str(root))
    config = load_config(root)
    headers = {}
    for name in shards:
        path = root / name
        if not path.is_file():
            if index_map is not None and not path.exists() and not path.is_symlink():
                raise FP8ConvertError(f"{index}: names {name}, which does not exist")
            raise FP8ConvertError(f"{path}: {NOT_A_FILE}, so it cannot be read as a shard")
        headers[name] = read_header(str(path), name)
    tensors = collect_tensors(headers, index_map, str(root))
    copy = [n for n in listing if is_copied_file(n) and (root / n).is_file()]
    quant = read_source_quantization(config, tensors, str(root), copy)
    return Source(root, shards, tensors, config, copy, label or str(root), revision, quant)
