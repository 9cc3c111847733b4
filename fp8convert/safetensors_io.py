"""safetensors headers, parsed and built (no torch needed).

A file is an 8-byte little-endian header length N, N bytes of JSON, then the data: the JSON maps tensor
names to {"dtype", "shape", "data_offsets": [begin, end]} (within the data, which they tile with no holes),
plus an optional "__metadata__" of strings.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

from .errors import FP8ConvertError

# safetensors dtype name -> (bytes per element, torch dtype name). The one dtype table of the package.
# fmt: off
DTYPES = {
    "BOOL": (1, "bool"), "U8": (1, "uint8"), "I8": (1, "int8"),
    "F8_E4M3": (1, "float8_e4m3fn"), "F8_E5M2": (1, "float8_e5m2"), "F8_E8M0": (1, "float8_e8m0fnu"),
    "I16": (2, "int16"), "U16": (2, "uint16"), "F16": (2, "float16"), "BF16": (2, "bfloat16"),
    "I32": (4, "int32"), "U32": (4, "uint32"), "F32": (4, "float32"),
    "I64": (8, "int64"), "U64": (8, "uint64"), "F64": (8, "float64"),
}
# fmt: on
DTYPE_SIZES = {name: size for name, (size, _) in DTYPES.items()}
FLOAT_SOURCE_DTYPES = ("BF16", "F16", "F32")  # what fp8convert quantizes
FP8 = "F8_E4M3"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's own limit
INDEX_NAME = "model.safetensors.index.json"


def torch_dtype(name: str):
    """The torch dtype of a safetensors dtype name (imports torch)."""
    import torch

    return getattr(torch, DTYPES[name][1])


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a source file. `offset` is absolute (header included)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str  # file name relative to the checkpoint directory
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def open_read(path) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:
        raise FP8ConvertError(f"{path}: cannot open ({e.strerror})") from e


def pread_into(fd: int, view: memoryview, offset: int, label: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise FP8ConvertError(f"{label}: unexpected end of file at byte {offset + done} (truncated?)")
        done += n


def read_header(path: str, file_name: str) -> dict[str, TensorInfo]:
    """One file's validated header, by tensor name; errors name the whole `path`."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb", buffering=0) as f:  # unbuffered: read the header, not the data after it
            header_len = header_length(f.read(8), size, path)
            raw = f.read(header_len)
    except OSError as e:
        raise FP8ConvertError(f"{path}: cannot read ({e.strerror})") from e
    return parse_header(raw, file_name, data_start=8 + header_len, file_size=size, where=path)


def header_length(first8: bytes, file_size: int | None, label: str) -> int:
    if len(first8) < 8:
        raise FP8ConvertError(f"{label}: not a safetensors file (shorter than its 8-byte header length)")
    (header_len,) = struct.unpack("<Q", first8[:8])
    if header_len > MAX_HEADER_BYTES or (file_size is not None and 8 + header_len > file_size):
        raise FP8ConvertError(f"{label}: corrupt safetensors header (claims {header_len} bytes, file has {file_size})")
    return header_len


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_header(
    raw: bytes, file: str, data_start: int, file_size: int | None, where: str | None = None
) -> dict[str, TensorInfo]:
    """Validate a header's JSON: a name given once (json would silently keep the last), known dtypes,
    sizes that match shapes, offsets that tile the data. Errors name `where`, by default `file`."""
    where = where or file

    def unique(pairs: list[tuple[str, object]]) -> dict:
        result = {}
        for key, value in pairs:
            if key in result:
                raise FP8ConvertError(f"{where}: tensor {key} is named twice in the header")
            result[key] = value
        return result

    try:
        header = json.loads(raw, object_pairs_hook=unique)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FP8ConvertError(f"{where}: corrupt safetensors header (not JSON: {e})") from e
    if not isinstance(header, dict):
        raise FP8ConvertError(f"{where}: corrupt safetensors header (not a JSON object)")
    if not isinstance(header.pop("__metadata__", None) or {}, dict):
        raise FP8ConvertError(f"{where}: corrupt safetensors header (__metadata__ is not an object)")
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise FP8ConvertError(f"{where}: corrupt header entry for tensor {name}") from e
        if dtype not in DTYPE_SIZES:
            raise FP8ConvertError(f"{where}: tensor {name} has unsupported dtype {dtype}")
        if not (all(_is_int(d) and d >= 0 for d in shape) and _is_int(begin) and _is_int(end) and 0 <= begin <= end):
            raise FP8ConvertError(
                f"{where}: tensor {name} has invalid shape {entry['shape']} or offsets {entry['data_offsets']}"
            )
        if end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise FP8ConvertError(
                f"{where}: tensor {name} is {end - begin} bytes but its shape {list(shape)} "
                f"and dtype {dtype} need {math.prod(shape) * DTYPE_SIZES[dtype]}"
            )
        tensors[name] = TensorInfo(name, dtype, shape, file, data_start + begin, end - begin)
        spans.append((begin, end, name))
    spans.sort()
    cursor = 0
    for begin, end, name in spans:
        if begin != cursor:
            raise FP8ConvertError(f"{where}: tensor {name} overlaps another or leaves a gap in the data")
        cursor = end
    if file_size is not None and data_start + cursor != file_size:
        what = "is truncated" if data_start + cursor > file_size else "has trailing bytes"
        raise FP8ConvertError(
            f"{where}: file {what} (header describes {data_start + cursor} bytes, file has {file_size})"
        )
    return tensors


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of an output shard, as the plan lays it out. `offset` is relative to the data buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def layout_shard(entries: list[tuple[str, str, tuple[int, ...]]]) -> tuple[bytes, dict[str, OutputTensor]]:
    """A shard's header bytes (JSON padded with spaces to a multiple of 8) and each tensor's place in its
    data: wider dtypes first, so every tensor is aligned to its element size."""
    placed: dict[str, OutputTensor] = {}
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    cursor = 0
    for name, dtype, shape in sorted(entries, key=lambda e: -DTYPE_SIZES[e[1]]):  # stable: plan order kept
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        placed[name] = OutputTensor(name, dtype, tuple(shape), cursor, nbytes)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [cursor, cursor + nbytes]}
        cursor += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, placed
