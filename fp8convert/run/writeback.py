"""fsync_dir, which output/ shares with the writer."""

from __future__ import annotations

import os


def fsync_dir(path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
