"""The source checkpoint: which files, which tensors where, and its config. Reads headers, never data."""
from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path

from .errors import FP8ConvertError
from .safetensors_io import TensorInfo, read_header

INDEX_NAME = "model.safetensors.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx",
                   ".npz", ".pkl")
# Files rewritten or generated rather than copied.
NOT_COPIED = {"config.json", "README.md", INDEX_NAME, "pytorch_model.bin.index.json",
              "model.safetensors.index.json.lock"}
ALREADY_QUANTIZED_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale", ".qweight", ".weight_packed",
                              ".qzeros", ".scales")


def is_copied_file(name: str) -> bool:
    """Top-level non-weight files travel with the model: tokenizer, chat template, generation config,
    processor configs, remote-code .py files, license."""
    return ("/" not in name and not name.startswith(".") and name not in NOT_COPIED
            and not name.endswith(WEIGHT_SUFFIXES) and not name.endswith(".index.json"))


@dataclass
class Source:
    root: Path
    files: list[str]                  # safetensors shard names, sorted
    tensors: list[TensorInfo]         # every tensor, in (file, offset) order
    config: dict                      # config.json, key order kept
    copy_files: list[str]             # files copied verbatim into the output
    label: str                        # what the user passed (dir or repo id)
    fetcher: object | None = None     # --stream-download: brings shards on demand (hub.StreamingFetcher)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def safe_relative_name(name: str, where: str) -> str:
    """A shard name from an index must stay inside the checkpoint directory."""
    if not isinstance(name, str) or not name or name.startswith(("/", "\\")) or ":" in name[:3] \
            or ".." in posixpath.normpath(name).split("/") or posixpath.normpath(name) != name:
        raise FP8ConvertError(f"{where}: refusing shard file name {name!r} (absolute or outside the checkpoint)")
    return name


def load_config(root: Path) -> dict:
    path = root / "config.json"
    if not path.is_file():
        raise FP8ConvertError(f"{path}: missing; fp8convert needs the model's config.json")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FP8ConvertError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise FP8ConvertError(f"{path}: not a JSON object")
    return config


def shard_names(root: Path, listing: list[str]) -> list[str]:
    """Which safetensors files hold the model: the index's, else every top-level *.safetensors."""
    index_path = root / INDEX_NAME
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            names = {safe_relative_name(v, INDEX_NAME) for v in weight_map.values()}
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            if isinstance(e, FP8ConvertError):
                raise
            raise FP8ConvertError(f"{index_path}: not a valid safetensors index ({e})") from e
        return sorted(names)
    return sorted(n for n in listing if n.endswith(".safetensors") and "/" not in n)


def check_not_pickle_only(root: Path, listing: list[str], shards: list[str]) -> None:
    if not shards:
        if any(n.endswith((".bin", ".pt", ".pth", ".ckpt")) for n in listing):
            raise FP8ConvertError(f"{root}: holds only pickle weights (.bin/.pt); fp8convert never loads pickle. "
                                  "Convert to safetensors first")
        raise FP8ConvertError(f"{root}: no safetensors weights found")


def refuse_quantized(config: dict, tensors: list[TensorInfo], where: str) -> None:
    qc = config.get("quantization_config") or config.get("compression_config")
    if qc:
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        raise FP8ConvertError(f"{where}/config.json: the model is already quantized (quantization_config, "
                              f"quant_method {method}); fp8convert needs a BF16/FP16/FP32 source")
    for t in tensors:
        if t.dtype.startswith("F8") or t.name.endswith(ALREADY_QUANTIZED_SUFFIXES):
            raise FP8ConvertError(f"{t.file}: tensor {t.name} ({t.dtype}) shows the model is already quantized; "
                                  "fp8convert needs a BF16/FP16/FP32 source")


def collect_tensors(headers: dict[str, dict[str, TensorInfo]], index_map: dict[str, str] | None,
                    where: str = "the checkpoint") -> list[TensorInfo]:
    """Merge per-file headers; a tensor named twice, or where the index says it is not, is an error."""
    seen: dict[str, TensorInfo] = {}
    for file in sorted(headers):
        for name, info in headers[file].items():
            if name in seen:
                raise FP8ConvertError(f"tensor {name} appears twice: in {seen[name].file} and {file}")
            seen[name] = info
    if index_map is not None:
        for name, file in index_map.items():
            if name not in seen:
                raise FP8ConvertError(f"{INDEX_NAME}: names tensor {name} in {file}, but no shard holds it")
            if seen[name].file != file:
                raise FP8ConvertError(f"{INDEX_NAME}: says tensor {name} is in {file}, but it is in {seen[name].file}")
        for name, info in seen.items():
            if name not in index_map:
                raise FP8ConvertError(f"{INDEX_NAME}: does not list tensor {name} found in {info.file}")
    if not seen:
        raise FP8ConvertError(f"{where}: holds no tensors ({', '.join(sorted(headers))} empty)")
    return sorted(seen.values(), key=lambda t: (t.file, t.offset))


def open_local(root: Path, label: str | None = None) -> Source:
    """Read a local checkpoint's layout: headers of every shard, config, files to copy."""
    root = Path(root)
    if not root.is_dir():
        raise FP8ConvertError(f"{root}: not a directory (or Hub repo id)")
    listing = sorted(os.listdir(root))
    shards = shard_names(root, listing)
    check_not_pickle_only(root, listing, shards)
    config = load_config(root)
    headers = {}
    for name in shards:
        path = root / name
        if not path.is_file():
            raise FP8ConvertError(f"{INDEX_NAME}: names {name}, which does not exist in {root}")
        headers[name], _ = read_header(str(path), name)
    index_map = None
    if (root / INDEX_NAME).is_file():
        index_map = json.loads((root / INDEX_NAME).read_text())["weight_map"]
    tensors = collect_tensors(headers, index_map, str(root))
    refuse_quantized(config, tensors, str(root))
    copy = [n for n in listing if is_copied_file(n) and (root / n).is_file()]
    return Source(root, shards, tensors, config, copy, label or str(root))
