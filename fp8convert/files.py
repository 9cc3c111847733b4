"""Small files written whole and atomically: never seen half-written, whenever the process dies."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from .errors import FP8ConvertError


def fsync_dir(path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write under a temporary name, fsync, rename; a failure (disk full) is one resumable error. A file
    holding these bytes already is left alone, so finishing a complete output again works read-only."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:  # the size first: a file of another size is not read
        same = (
            path.is_file() and not path.is_symlink() and path.stat().st_size == len(data) and path.read_bytes() == data
        )
    except OSError:
        same = False
    if same:
        with contextlib.suppress(OSError):  # what a run killed mid-write left
            tmp.unlink()
        return
    try:
        replace_with(path, data, tmp)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise FP8ConvertError(
            f"{path}: cannot write ({e.strerror}); rerun the same command to resume once the problem is fixed"
        ) from e


def replace_with(path: Path, data: bytes, tmp: Path) -> None:
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def read_json_object(path: Path) -> dict:
    """A small JSON file written by fp8convert; {} when it is missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
