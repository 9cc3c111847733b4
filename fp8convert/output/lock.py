"""One writer per share of OUT at a time: two runs writing one output could take each other's shards for
finished (or delete them) and leave an output that looks complete but is not, so a second is refused.

A run that writes every shard (one worker; `finalize`) holds OUT/.fp8convert/lock exclusively; a worker of
several holds it shared and its own share's lock-K-of-N exclusively. The locks are flock()s, which the
kernel drops however the process dies; a file system without locks (some network mounts), or a read-only
one, gets none.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from ..errors import FP8ConvertError
from .manifest import WORK_DIR

LOCK = "lock"
HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)  # what a non-blocking flock says when another holds it


def is_lock_file(name: str) -> bool:
    """Whether a work-folder entry is one of the lock files (--overwrite empties the folder but them)."""
    return name == LOCK or name.startswith(f"{LOCK}-")


class OutputLock(contextlib.AbstractContextManager):
    """The locks of worker `index` of `count`'s share of OUT (count 1: the whole output)."""

    def __init__(self, out_dir: Path, index: int = 0, count: int = 1):
        self.out_dir, self.index, self.count = Path(out_dir), index, count
        self.fds: list[int] = []

    def acquire(self) -> None:
        """Take the locks (making OUT's work folder); refused when another run holds one of them."""
        work = self.out_dir / WORK_DIR
        try:
            work.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise FP8ConvertError(f"{self.out_dir}: cannot create ({e.strerror})") from e
        locks = [(LOCK, fcntl.LOCK_EX if self.count == 1 else fcntl.LOCK_SH)]
        if self.count > 1:
            locks.append((f"{LOCK}-{self.index}-of-{self.count}", fcntl.LOCK_EX))
        for name, mode in locks:
            try:
                fd = os.open(work / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                if e.errno == errno.EROFS:  # no run can write here either; what reads it (finalize) goes on
                    continue
                self.release()
                raise FP8ConvertError(f"{work / name}: cannot open ({e.strerror})") from e
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in HELD:
                    continue  # no locks on this file system
                self.release()
                share = "" if self.count == 1 else f" (worker {self.index}/{self.count}, or a run of the whole output)"
                raise FP8ConvertError(
                    f"{self.out_dir}: another fp8convert run is writing it{share}; wait for that "
                    "run to end, or stop it, then run this command again"
                ) from None
            self.fds.append(fd)

    def share(self) -> None:
        """Hold the whole output's lock shared from now on, so that the workers this run starts (--devices)
        can join; refused if another run took it meanwhile (flock converts by dropping and retaking)."""
        if self.count > 1:  # a worker holds it shared already
            return
        for fd in self.fds:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in HELD:
                    raise FP8ConvertError(f"{self.out_dir}: another fp8convert run started writing it") from None

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def __exit__(self, *exc) -> None:
        self.release()
