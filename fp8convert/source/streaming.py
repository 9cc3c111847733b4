"""--stream-download: source shards on demand, a few on disk at a time, for models larger than the disk.
A source already on disk gets `NoFetcher`, so the pipeline has one code path for both."""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections import Counter
from pathlib import Path

from ..errors import FP8ConvertError
from .hub import RemoteRepo, hub_error


class NoFetcher(contextlib.nullcontext):
    """The fetcher of a source on disk, whose files are never deleted: all there, or (`repo`: one worker of
    several, planned from a Hub repo's headers) the ones `fetch` brings into the download cache."""

    def __init__(self, repo: RemoteRepo | None = None):
        super().__init__()
        self.repo = repo

    def fetch(self, shards: list[str]) -> None:
        if self.repo is not None:
            self.repo.fetch(shards)

    def start(self, order: list[str]) -> None: ...
    def need(self, files: list[str]) -> None: ...
    def done_reading(self, files: list[str]) -> None: ...
    def release(self, files: list[str]) -> None: ...

    def disk_bytes_needed(self) -> int:
        return 0


class StreamingFetcher(contextlib.AbstractContextManager):
    """At most `keep` source shards on disk: a background thread downloads them into `download_dir` (not
    the shared cache) in the order `start(order)` gives, after the small side files. `need(files)` blocks
    until they are on disk (a failed or released file is tried again); `done_reading(files)`: no later batch
    reads them, so their slots free up soon; `release(files)`: delete them. A finished run deletes the
    folder; after a failure the finished files stay for the rerun."""

    def __init__(self, repo: RemoteRepo, download_dir: str | Path, keep: int = 2):
        self.repo, self.dir, self.keep = repo, Path(download_dir), keep
        self.state = dict.fromkeys(repo.shards, "pending")  # | downloading | present | released | failed
        self.errors: dict[str, FP8ConvertError] = {}
        self.events: list[tuple[str, str]] = []  # ("download" | "release", file), in order: for tests, logs
        self.peak_present = 0  # most shards on disk (or downloading) at once
        self._waiting: Counter = Counter()  # files some need() call is blocked on
        self._read_done: set[str] = set()  # on disk, read for the last time, not yet released
        self._drop_on_arrival: set[str] = set()  # released while downloading
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def __exit__(self, exc_type, *exc) -> None:
        self.close(remove=exc_type is None)

    def start(self, order: list[str]) -> None:
        """`order`: the shards in the order `need` first asks for them. Runs after OUT is prepared (may clear it)."""
        self.order = list(order)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.repo.download_small_files(self.dir, weights=True)
        for f in self.state:
            path = self.dir / f
            if path.is_file() and path.stat().st_size == self.repo.sizes.get(f):
                if f in self.order:
                    self.state[f] = "present"  # finished by an earlier, interrupted run
                    self._note_present()
                else:
                    self._delete(f)
        self._thread = threading.Thread(target=self._loop, name="fp8convert-fetch", daemon=True)
        self._thread.start()

    def need(self, files: list[str]) -> None:
        with self._cond:
            for f in files:
                if self.state[f] in ("failed", "released"):
                    self.state[f] = "pending"
            self._waiting.update(files)
            self._cond.notify_all()
            try:
                while not all(self.state[f] == "present" for f in files):
                    if failed := [f for f in files if self.state[f] == "failed"]:
                        raise self.errors[failed[0]]
                    if self._closed:
                        raise FP8ConvertError(f"{self.repo.repo_id}: download stopped before {files[0]} arrived")
                    self._cond.wait()
            finally:
                self._waiting -= Counter(files)

    def done_reading(self, files: list[str]) -> None:
        with self._cond:
            self._read_done.update(files)
            self._cond.notify_all()

    def release(self, files: list[str]) -> None:
        with self._cond:
            for f in dict.fromkeys(files):
                self._read_done.discard(f)
                if self.state[f] == "downloading":
                    self._drop_on_arrival.add(f)
                else:
                    self._released(f)
            self._cond.notify_all()

    def close(self, remove: bool = False) -> None:
        """Stop the download thread; `remove`: delete the download directory."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=2)  # a download in flight finishes on its own (daemon thread)
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)

    def disk_bytes_needed(self) -> int:
        """Disk the streamed shards may need at once (the `keep` largest)."""
        return sum(sorted((self.repo.sizes.get(f) or 0 for f in self.state), reverse=True)[: self.keep])

    def _on_disk(self, f: str) -> bool:
        return self.state[f] in ("downloading", "present")

    def _note_present(self) -> None:
        self.peak_present = max(self.peak_present, sum(map(self._on_disk, self.state)))

    def _next(self) -> str | None:
        full = sum(map(self._on_disk, self.state)) >= self.keep
        if not (full and any(map(self._on_disk, self._read_done))):
            for f in self.order + [f for f in self._waiting if f not in self.order]:
                if self._waiting[f] and self.state[f] == "pending":
                    return f  # a blocked need() and no slot about to free up: waiting would never end
        return None if full else next((f for f in self.order if self.state[f] == "pending"), None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (name := self._next()) is None:
                    self._cond.wait()
                if self._closed:
                    return
                self.state[name] = "downloading"
                self.events.append(("download", name))
                self._note_present()
            try:
                self.repo.download(name, local_dir=self.dir, weights=True)
                error = None
            except BaseException as e:  # handed to need(), which raises it in the pipeline
                error = hub_error(self.repo.repo_id, e)
            with self._cond:
                if error is not None:
                    self.state[name], self.errors[name] = "failed", error
                elif name in self._drop_on_arrival:
                    self._released(name)
                else:
                    self.state[name] = "present"
                self._drop_on_arrival.discard(name)
                self._cond.notify_all()

    def _released(self, name: str) -> None:
        if self._on_disk(name):
            self._delete(name)
        self.state[name] = "released"
        self.events.append(("release", name))

    def _delete(self, name: str) -> None:
        (self.dir / name).unlink(missing_ok=True)
        # huggingface_hub's bookkeeping for local_dir downloads; stale metadata would be harmless but clutter.
        (self.dir / ".cache" / "huggingface" / "download" / f"{name}.metadata").unlink(missing_ok=True)


def need_order(batches) -> list[str]:
    """Shards in the order `batches` first read them."""
    return list(dict.fromkeys(info.file for batch in batches for t in batch.tensors for info in t.inputs))
