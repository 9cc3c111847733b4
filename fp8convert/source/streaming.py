"""--stream-download: source shards on demand, a few on disk at a time, for models larger than the disk.

The pipeline talks to a fetcher through four calls (`need`, `done_reading`, `release`, and the context
manager around the run). A source whose files are already on disk gets `NoFetcher`, which does nothing,
so the pipeline has one code path for both.
"""

from __future__ import annotations

import shutil
import threading
from collections import Counter
from pathlib import Path

from ..errors import FP8ConvertError
from ..options import HubAccess
from .checkpoint import Source
from .hub import RemoteRepo, remote_layout, resolve_repo, source_from_repo
from .hub_calls import hub_error


class NoFetcher:
    """The fetcher of a source already on disk: every file is there, nothing is ever deleted."""

    def start(self, order: list[str] | None = None) -> None:
        pass

    def need(self, files: list[str]) -> None:
        pass

    def done_reading(self, files: list[str]) -> None:
        pass

    def release(self, files: list[str]) -> None:
        pass

    def disk_bytes_needed(self) -> int:
        return 0

    def __enter__(self) -> NoFetcher:
        return self

    def __exit__(self, *exc) -> None:
        pass


class StreamingFetcher:
    """Source shards on demand for `--stream-download`: at most `keep` of them on disk at once.

    A background thread downloads shards (into `download_dir`, not the shared cache) in the order the
    pipeline will need them. The pipeline calls `need(files)` before reading a batch (blocks until they
    are on disk; raises a download's failure), `done_reading(files)` once no later batch reads them (their
    slots free up as soon as the batches in flight are written, so a blocked `need` waits for that) and
    `release(files)` once every batch reading them is written (deletes them). Only when no slot is about
    to free (every shard on disk is still to be read again, or one batch spans more than `keep` shards)
    does a blocked `need` go over `keep`, since waiting then would never end.

    `start(order)` comes after the output directory is prepared (it downloads the small side files, then
    starts the thread). Leaving the context after a finished run deletes the download directory; after a
    failure the finished files stay for the rerun, which also resumes a partial one.
    """

    PENDING, DOWNLOADING, PRESENT, RELEASED, FAILED = "pending", "downloading", "present", "released", "failed"

    def __init__(
        self, repo: RemoteRepo, download_dir: str | Path, shards: list[str], side_files: list[str] = (), keep: int = 2
    ):
        self.repo = repo
        self.dir = Path(download_dir)
        self.shards = list(shards)
        self.side_files = list(side_files)
        self.keep = max(1, int(keep))
        self.order: list[str] = list(self.shards)
        self.state: dict[str, str] = {f: self.PENDING for f in self.shards}
        self.errors: dict[str, FP8ConvertError] = {}
        self.events: list[tuple[str, str]] = []  # ("download" | "release", file), in order: for tests, logs
        self.peak_present = 0  # most shards on disk (or downloading) at once
        self._waiting: Counter = Counter()  # files some need() call is blocked on
        self._release_when_done: set[str] = set()
        self._read_done: set[str] = set()  # on disk, read for the last time, not yet released
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._started = False

    # -- pipeline side

    def __enter__(self) -> StreamingFetcher:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(remove=exc_type is None)

    def start(self, order: list[str] | None = None) -> None:
        """Begin: `order` lists the shards in the order `need` will first ask for them (files not in it
        are not prefetched; leftovers of an earlier run that no longer need reading are deleted)."""
        with self._cond:
            if self._started:
                return
            self._started = True
            if order is not None:
                unknown = [f for f in order if f not in self.state]
                if unknown:
                    raise FP8ConvertError(f"{self.repo.repo_id}: {unknown[0]} is not a shard of this checkpoint")
                self.order = list(dict.fromkeys(order))
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for name in self.side_files:
                self.repo.download(name, local_dir=self.dir, weights=True)
        except BaseException:
            with self._cond:
                self._started = False
            raise
        with self._cond:
            wanted = set(self.order)
            for f in self.shards:
                path = self.dir / f
                if path.is_file() and path.stat().st_size == self.repo.sizes.get(f):
                    if f in wanted:
                        self.state[f] = self.PRESENT  # finished by an earlier, interrupted run
                        self._note_present()
                    else:
                        self._delete(f)
        self._thread = threading.Thread(target=self._loop, name="fp8convert-fetch", daemon=True)
        self._thread.start()

    def need(self, files: list[str]) -> None:
        """Block until every file is on disk."""
        files = list(dict.fromkeys(files))
        if not self._started:
            self.start()
        with self._cond:
            for f in files:
                if f not in self.state:
                    raise FP8ConvertError(f"{self.repo.repo_id}: {f} is not a shard of this checkpoint")
                if self.state[f] in (self.FAILED, self.RELEASED):  # asked again: try again
                    self.state[f] = self.PENDING
                    self.errors.pop(f, None)
            self._waiting.update(files)
            self._cond.notify_all()
            try:
                while True:
                    failed = [f for f in files if self.state[f] == self.FAILED]
                    if failed:
                        raise self.errors[failed[0]]
                    if all(self.state[f] == self.PRESENT for f in files):
                        return
                    if self._closed:
                        raise FP8ConvertError(f"{self.repo.repo_id}: download stopped before {files[0]} arrived")
                    self._cond.wait()
            finally:
                self._waiting.subtract(files)
                self._waiting += Counter()  # drop zero counts

    def done_reading(self, files: list[str]) -> None:
        """No later batch reads these files: `release` follows once the batches in flight are written."""
        with self._cond:
            self._read_done.update(f for f in files if f in self.state)
            self._cond.notify_all()

    def release(self, files: list[str]) -> None:
        """Every batch reading these files is written: delete them and let the next download start."""
        with self._cond:
            for f in dict.fromkeys(files):
                if f not in self.state:
                    continue
                self._read_done.discard(f)
                if self.state[f] == self.DOWNLOADING:
                    self._release_when_done.add(f)  # released before it was needed: drop it on arrival
                    continue
                if self.state[f] == self.PRESENT:
                    self._delete(f)
                self.state[f] = self.RELEASED
                self.events.append(("release", f))
            self._cond.notify_all()

    def close(self, remove: bool = False) -> None:
        """Stop the download thread. `remove`: delete the download directory (after a finished run)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=2)  # a download in flight finishes on its own (daemon thread)
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)

    def disk_bytes_needed(self) -> int:
        """Disk the streamed shards may need at once (the `keep` largest)."""
        return sum(sorted((self.repo.sizes.get(f) or 0 for f in self.shards), reverse=True)[: self.keep])

    # -- background thread

    def _live(self) -> int:
        return sum(s in (self.DOWNLOADING, self.PRESENT) for s in self.state.values())

    def _note_present(self) -> None:
        self.peak_present = max(self.peak_present, self._live())

    def _next(self) -> str | None:
        full = self._live() >= self.keep
        slot_coming = any(self.state[f] in (self.DOWNLOADING, self.PRESENT) for f in self._read_done)
        if not (full and slot_coming):
            for f in self.order + [f for f in self._waiting if f not in self.order]:
                if self._waiting.get(f) and self.state[f] == self.PENDING:
                    return f  # a blocked need() and no slot about to free up: waiting would never end
        if full:
            return None
        for f in self.order:
            if self.state[f] == self.PENDING:
                return f
        return None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    name = self._next()
                    if name is not None:
                        self.state[name] = self.DOWNLOADING
                        self.events.append(("download", name))
                        self._note_present()
                        break
                    self._cond.wait()
            try:
                self.repo.download(name, local_dir=self.dir, weights=True)
                error = None
            except BaseException as e:  # handed to need(), which raises it in the pipeline
                error = e if isinstance(e, FP8ConvertError) else hub_error(self.repo.repo_id, e)
            with self._cond:
                if error is None and name in self._release_when_done:
                    self._release_when_done.discard(name)
                    self._delete(name)
                    self.state[name] = self.RELEASED
                    self.events.append(("release", name))
                elif error is None:
                    self.state[name] = self.PRESENT
                else:
                    self.state[name] = self.FAILED
                    self.errors[name] = error
                self._cond.notify_all()

    def _delete(self, name: str) -> None:
        (self.dir / name).unlink(missing_ok=True)
        # huggingface_hub's bookkeeping for local_dir downloads; stale metadata would be harmless but clutter.
        (self.dir / ".cache" / "huggingface" / "download" / f"{name}.metadata").unlink(missing_ok=True)


def streaming_source(
    repo_id: str, download_dir: Path, hub: HubAccess, keep: int = 2
) -> tuple[Source, StreamingFetcher]:
    """The remote Source rooted at `download_dir` (in OUT's work folder), and the fetcher that fills it.
    Nothing is written until `fetcher.start(order)`, which must come after the output directory is
    prepared (prepare_output may clear OUT)."""
    repo = resolve_repo(repo_id, hub)  # the small files go to the cache
    layout = remote_layout(repo)
    side = layout.side_files + ([layout.card] if layout.card else [])
    return source_from_repo(repo, layout, download_dir), StreamingFetcher(repo, download_dir, layout.shards, side, keep)


def need_order(batches) -> list[str]:
    """Shards in the order a list of batches (anything with `.tensors` of TensorPlan) first reads them."""
    return list(dict.fromkeys(info.file for batch in batches for t in batch.tensors for info in t.inputs))
