"""Hugging Face Hub in and out.

In: a repo id resolves to one commit, then either
  * `remote_source`: a Source built from the shards' safetensors headers read with HTTP Range requests
    (planning and `inspect` download no weights), or
  * `download_source`: just the files a conversion needs, into the shared huggingface_hub cache
    (resumable: a rerun re-uses every finished file and resumes a partial one), or
  * `streaming_source`: the remote Source plus a `StreamingFetcher` that keeps only a few shards on
    disk at a time, for models larger than the free disk.
Out: `push` uploads a complete output directory (never `.fp8convert/`) with a model card.

Every huggingface_hub or network failure becomes one FP8ConvertError line that names the repo.
"""
from __future__ import annotations

import json
import re
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .errors import FP8ConvertError
from .safetensors_io import TensorInfo, decode_header, header_length, parse_header, read_header
from .source import (INDEX_NAME, Source, collect_tensors, is_copied_file, load_config, open_local,
                     refuse_quantized, safe_relative_name)

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
CARD_NAME = "README.md"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DOWNLOAD_DIR = "download"           # under OUT/.fp8convert/: where --stream-download puts source shards
FIRST_HEADER_READ = 100_000         # one Range request covers most headers (huggingface_hub does the same)
PARALLEL_REQUESTS = 8


def looks_like_repo_id(src: str) -> bool:
    return bool(REPO_ID.match(src)) and not Path(src).exists()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def hub_error(repo_id: str, error: Exception, revision: str | None = None) -> FP8ConvertError:
    """One clear line for any huggingface_hub / network failure."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RemoteEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    if isinstance(error, FP8ConvertError):
        return error
    if isinstance(error, GatedRepoError):
        return FP8ConvertError(f"{repo_id}: gated repository; accept its terms on the Hub and log in "
                               "(hf auth login, or set HF_TOKEN)")
    if isinstance(error, RepositoryNotFoundError):
        return FP8ConvertError(f"{repo_id}: repository not found (or private: log in or set HF_TOKEN)")
    if isinstance(error, RevisionNotFoundError):
        return FP8ConvertError(f"{repo_id}: revision {revision or ''} not found".replace("  ", " "))
    if isinstance(error, RemoteEntryNotFoundError):
        return FP8ConvertError(f"{repo_id}: file not found on the Hub ({_first_line(error)})")
    if isinstance(error, OfflineModeIsEnabled):
        return FP8ConvertError(f"{repo_id}: HF_HUB_OFFLINE is set, so the Hub cannot be reached")
    if isinstance(error, LocalEntryNotFoundError):
        return FP8ConvertError(f"{repo_id}: cannot reach the Hub (network error) and no cached copy; "
                               "check the connection and rerun (finished downloads are kept)")
    if isinstance(error, HfHubHTTPError):
        status = getattr(getattr(error, "response", None), "status_code", None)
        if status == 401:
            return FP8ConvertError(f"{repo_id}: the Hub refused the credentials (401); check HF_TOKEN or "
                                   "run hf auth login")
        if status == 403:
            return FP8ConvertError(f"{repo_id}: access denied (403); the token may lack write or read "
                                   f"permission ({_first_line(error)})")
        return FP8ConvertError(f"{repo_id}: Hub request failed ({_first_line(error)})")
    if isinstance(error, (OSError, ConnectionError)) or type(error).__module__.startswith(("httpx", "httpcore")):
        return FP8ConvertError(f"{repo_id}: network error talking to the Hub ({type(error).__name__}: "
                               f"{_first_line(error)}); rerun to resume (finished downloads are kept)")
    return FP8ConvertError(f"{repo_id}: Hub operation failed ({type(error).__name__}: {_first_line(error)})")


# ----------------------------------------------------------------------------------- the source repo


@dataclass
class RemoteRepo:
    """A repo pinned to one commit: every later request uses `sha`, so a push to the branch in the
    middle of a conversion cannot mix files from two commits."""

    repo_id: str
    sha: str
    sizes: dict[str, int]             # every file of the commit -> size in bytes
    token: str | None = None
    cache_dir: str | None = None
    revision: str | None = None       # what the user asked for (branch, tag, commit), for messages

    def call(self, fn, *args, **kwargs):
        """Run a huggingface_hub call; any failure becomes one FP8ConvertError line naming the repo."""
        try:
            return fn(*args, **kwargs)
        except FP8ConvertError:
            raise
        except Exception as e:  # huggingface_hub, httpx and OS errors alike
            raise hub_error(self.repo_id, e, self.revision) from e

    def download(self, filename: str, local_dir: Path | None = None) -> Path:
        """One file at the pinned commit: into the shared cache, or into `local_dir`. Resumes partial files."""
        from huggingface_hub import hf_hub_download
        path = Path(self.call(hf_hub_download, self.repo_id, filename, revision=self.sha, token=self.token,
                              cache_dir=self.cache_dir, local_dir=str(local_dir) if local_dir else None))
        if filename in self.sizes and self.sizes[filename] is not None and path.stat().st_size != self.sizes[filename]:
            raise FP8ConvertError(f"{self.repo_id}: {filename} arrived with {path.stat().st_size} bytes, the Hub "
                                  f"lists {self.sizes[filename]}; rerun to fetch it again")
        return path


def resolve_repo(repo_id: str, revision: str | None = None, token: str | None = None,
                 cache_dir: str | None = None) -> RemoteRepo:
    """The commit `revision` points to, and the size of every file in it (one API call)."""
    from huggingface_hub import HfApi
    probe = RemoteRepo(repo_id, "", {}, token, cache_dir, revision)
    info = probe.call(HfApi(token=token).model_info, repo_id, revision=revision, files_metadata=True)
    sizes = {s.rfilename: s.size for s in (info.siblings or [])}
    return RemoteRepo(repo_id, info.sha, sizes, token, cache_dir, revision)


@dataclass
class RemoteLayout:
    """Which files of a repo a conversion needs, decided from the listing (and the small index) alone."""

    shards: list[str]
    index_map: dict[str, str] | None
    side_files: list[str]             # copied into the output (tokenizer, chat template, .py, ...)
    card: str | None                  # the source's README.md, read for the model card


def remote_layout(repo: RemoteRepo) -> RemoteLayout:
    """Refuse unusable repos (no config, pickle only, index naming absent shards) before any big download."""
    where = f"{repo.repo_id}@{repo.revision}" if repo.revision else repo.repo_id
    if "config.json" not in repo.sizes:
        raise FP8ConvertError(f"{where}: no config.json in the repository; fp8convert needs the model's config")
    index_map = None
    if INDEX_NAME in repo.sizes:
        path = repo.download(INDEX_NAME)
        try:
            index_map = json.loads(path.read_text())["weight_map"]
            shards = sorted({safe_relative_name(v, INDEX_NAME) for v in index_map.values()})
        except FP8ConvertError:
            raise
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise FP8ConvertError(f"{where}: {INDEX_NAME} is not a valid safetensors index ({e})") from e
        missing = [s for s in shards if s not in repo.sizes]
        if missing:
            raise FP8ConvertError(f"{where}: {INDEX_NAME} names {missing[0]}, which is not in the repository")
    else:
        shards = sorted(n for n in repo.sizes if n.endswith(".safetensors") and "/" not in n)
    if not shards:
        if any(n.endswith(PICKLE_SUFFIXES) for n in repo.sizes):
            raise FP8ConvertError(f"{where}: holds only pickle weights (.bin/.pt); fp8convert never loads pickle. "
                                  "Convert to safetensors first")
        raise FP8ConvertError(f"{where}: no safetensors weights in the repository")
    side = sorted(n for n in repo.sizes if is_copied_file(n))
    return RemoteLayout(shards, index_map, side, CARD_NAME if CARD_NAME in repo.sizes else None)


def _read_range(url: str, headers: dict, start: int, length: int, timeout: float | None) -> bytes:
    """`length` bytes from `start` with one Range request; streams and stops early if the server
    ignores the Range header, so a weight file is never read in full."""
    from huggingface_hub.utils import get_session, hf_raise_for_status
    with get_session().stream("GET", url, headers={**headers, "Range": f"bytes={start}-{start + length - 1}"},
                              timeout=timeout) as response:
        if response.status_code >= 400:
            response.read()
            hf_raise_for_status(response)
        skip = start if response.status_code == 200 else 0
        out = bytearray()
        for chunk in response.iter_bytes():
            if skip:
                dropped = min(skip, len(chunk))
                chunk, skip = chunk[dropped:], skip - dropped
            out += chunk
            if len(out) >= length:
                break
        return bytes(out[:length])


def remote_header(repo: RemoteRepo, filename: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """One shard's safetensors header over HTTP Range requests, validated exactly as a local one
    (offsets absolute: 8 + header length + data_offsets begin; the file size from the repo listing)."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers
    url = hf_hub_url(repo.repo_id, filename, revision=repo.sha)
    headers = build_hf_headers(token=repo.token)
    timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
    size = repo.sizes.get(filename)
    if size is not None and size < 8:
        raise FP8ConvertError(f"{filename}: not a safetensors file ({size} bytes)")
    first = repo.call(_read_range, url, headers, 0, FIRST_HEADER_READ if size is None else min(size, FIRST_HEADER_READ),
                      timeout)
    header_len = header_length(first, size, filename)
    raw = first[8:8 + header_len]
    if len(raw) < header_len:
        raw += repo.call(_read_range, url, headers, 8 + len(raw), header_len - len(raw), timeout)
    return parse_header(decode_header(raw, filename), filename, data_start=8 + header_len, file_size=size)


def _snapshot_dir(repo: RemoteRepo) -> Path:
    """Where the shared cache keeps this commit's files (download_source's root)."""
    return repo.download("config.json").parent


def _source_from_repo(repo: RemoteRepo, layout: RemoteLayout, root: Path) -> Source:
    config = load_config(repo.download("config.json").parent)
    headers = dict(zip(layout.shards, parallel(lambda f: remote_header(repo, f)[0], layout.shards)))
    tensors = collect_tensors(headers, layout.index_map, repo.repo_id)
    refuse_quantized(config, tensors, repo.repo_id)
    source = Source(Path(root), list(layout.shards), tensors, config, list(layout.side_files), repo.repo_id)
    source.revision = repo.sha  # the commit the plan describes (model card, reports)
    return source


def offline_snapshot(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> Path | None:
    """With HF_HUB_OFFLINE set: the cached snapshot of an earlier download (None when online)."""
    from huggingface_hub import constants, snapshot_download
    if not constants.HF_HUB_OFFLINE:
        return None
    probe = RemoteRepo(repo_id, "", {}, None, cache_dir, revision)
    return Path(probe.call(snapshot_download, repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))


def remote_source(repo_id: str, revision: str | None = None, token: str | None = None,
                  root: str | Path | None = None, cache_dir: str | None = None) -> Source:
    """A Source from the Hub without downloading weights: the repo listing, config.json and the
    index (small files, into the cache) and each shard's header (Range requests). `root` is where the
    files would be downloaded: by default the cache snapshot that `download_source` fills.
    Offline (HF_HUB_OFFLINE), the cached snapshot of an earlier download is read instead."""
    cached = offline_snapshot(repo_id, revision, cache_dir)
    if cached is not None:
        return open_local(cached, label=repo_id)
    repo = resolve_repo(repo_id, revision, token, cache_dir)
    layout = remote_layout(repo)
    return _source_from_repo(repo, layout, Path(root) if root is not None else _snapshot_dir(repo))


def download_source(repo_id: str, revision: str | None = None, token: str | None = None,
                    cache_dir: str | None = None) -> Path:
    """Download config, index, the shards the index names (or the top-level safetensors), the side
    files and README.md into the huggingface_hub cache; returns the snapshot directory.

    Nothing else is fetched (no .bin, no original/ folder). Offline (HF_HUB_OFFLINE), the cached
    snapshot of an earlier download is used as it is."""
    cached = offline_snapshot(repo_id, revision, cache_dir)
    if cached is not None:
        return cached
    repo = resolve_repo(repo_id, revision, token, cache_dir)
    layout = remote_layout(repo)
    root = _fetch(repo, layout, layout.shards)
    _remember_ref(root, repo)
    return root


def fetch_from_hub(source: Source, shards: list[str], token: str | None) -> None:
    """Complete the cache snapshot a remote Source is rooted at with `shards` (the ones a worker reads)
    and the small files (what finalize reads). Offline (the source is the cached snapshot itself)
    there is nothing to fetch."""
    if getattr(source, "revision", None) is None:
        return
    repo = resolve_repo(source.label, source.revision, token)
    _fetch(repo, remote_layout(repo), shards)


def _fetch(repo: RemoteRepo, layout: RemoteLayout, shards: list[str]) -> Path:
    """The small files (config, index, card, side files), then `shards`, into the cache snapshot; returns
    it. Files the cache already holds for this commit cost no request, so a rerun re-uses them; a
    partial one resumes, since the cache keeps `.incomplete` blobs."""
    small = [n for n in ["config.json", INDEX_NAME, layout.card, *layout.side_files] if n and n in repo.sizes]
    for name in dict.fromkeys(small):
        repo.download(name)
    parallel(repo.download, sorted(dict.fromkeys(shards), key=lambda n: -(repo.sizes.get(n) or 0)))  # biggest first
    return _snapshot_dir(repo)


def parallel(fn, items: list, workers: int = PARALLEL_REQUESTS) -> list:
    """fn over items on daemon threads, results in order. The first failure stops handing out items
    and is raised; Ctrl-C returns at once (a thread pool would wait for every download in flight,
    whose partial files a rerun resumes anyway)."""
    items = list(items)
    results: list = [None] * len(items)
    failed: list[BaseException] = []
    lock = threading.Lock()
    cursor = iter(range(len(items)))

    def work() -> None:
        while True:
            with lock:
                i = None if failed else next(cursor, None)
            if i is None:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as e:
                with lock:
                    failed.append(e)

    threads = [threading.Thread(target=work, name="fp8convert-hub", daemon=True)
               for _ in range(max(1, min(workers, len(items))))]
    for th in threads:
        th.start()
    for th in threads:
        while th.is_alive():
            th.join(timeout=0.2)
    if failed:
        raise failed[0]
    return results


def _remember_ref(snapshot: Path, repo: RemoteRepo) -> None:
    """Record branch -> commit in the cache as huggingface_hub does (refs/<branch>), so an offline rerun
    finds this snapshot: the files were fetched by commit, which records no ref."""
    ref = repo.revision or "main"
    if COMMIT_SHA.match(ref) or snapshot.parent.name != "snapshots":
        return
    path = snapshot.parent.parent / "refs" / ref
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(repo.sha)
    except OSError:
        pass  # only offline reruns need it


# ----------------------------------------------------------------------------------- streaming download


class StreamingFetcher:
    """Source shards on demand for `--stream-download`: at most `keep` of them on disk at once.

    A background thread downloads shards (into `download_dir`, not the shared cache) in the order the
    pipeline will need them. The pipeline calls `need(files)` before reading a batch (blocks until
    those files are on disk; raises FP8ConvertError if a download failed) and `release(files)` once
    every batch that reads them has been written (deletes them, freeing a slot). In between, the
    pipeline calls `done_reading(files)` once no later batch reads them: their slots free up as soon
    as the batches in flight are written, so a blocked `need` waits for that. Only when no slot is
    about to free (every shard on disk is still to be read again, or one batch spans more than `keep`
    shards) does a blocked `need` go over `keep`, since waiting then would never end.

    Lifecycle: `start(order)` after the output directory is prepared (it downloads the small side
    files synchronously, then starts the thread), `need`/`release` during the run, `close(remove=True)`
    after finalize (deletes the download directory), `close()` on failure (keeps finished files: a
    rerun re-uses them and resumes a partial one).
    """

    PENDING, DOWNLOADING, PRESENT, RELEASED, FAILED = "pending", "downloading", "present", "released", "failed"

    def __init__(self, repo: RemoteRepo, download_dir: str | Path, shards: list[str], side_files: list[str] = (),
                 keep: int = 2, retries: int = 2, retry_wait: float = 1.0):
        self.repo = repo
        self.dir = Path(download_dir)
        self.shards = list(shards)
        self.side_files = list(side_files)
        self.keep = max(1, int(keep))
        self.retries, self.retry_wait = retries, retry_wait
        self.order: list[str] = list(self.shards)
        self.state: dict[str, str] = {f: self.PENDING for f in self.shards}
        self.errors: dict[str, FP8ConvertError] = {}
        self.events: list[tuple[str, str]] = []    # ("download" | "release", file), in order: for tests, logs
        self.peak_present = 0                      # most shards on disk (or downloading) at once
        self._waiting: Counter = Counter()         # files some need() call is blocked on
        self._release_when_done: set[str] = set()
        self._read_done: set[str] = set()          # on disk, read for the last time, not yet released
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._started = False

    # -- pipeline side

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
                self._download_with_retries(name)
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
        return sum(sorted((self.repo.sizes.get(f) or 0 for f in self.shards), reverse=True)[:self.keep])

    def present(self) -> list[str]:
        with self._cond:
            return [f for f in self.shards if self.state[f] == self.PRESENT]

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
                self._download_with_retries(name)
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

    def _download_with_retries(self, name: str) -> Path:
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
        for attempt in range(self.retries + 1):
            try:
                return self.repo.download(name, local_dir=self.dir)
            except FP8ConvertError as e:
                permanent = isinstance(e.__cause__, (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError))
                if permanent or attempt == self.retries or self._closed:
                    raise
                time.sleep(self.retry_wait * (attempt + 1))  # the partial file resumes on the next attempt
        raise AssertionError("unreachable")

    def _delete(self, name: str) -> None:
        (self.dir / name).unlink(missing_ok=True)
        # huggingface_hub's bookkeeping for local_dir downloads; stale metadata would be harmless but clutter.
        (self.dir / ".cache" / "huggingface" / "download" / f"{name}.metadata").unlink(missing_ok=True)


def streaming_source(repo_id: str, out_dir: str | Path, revision: str | None = None, token: str | None = None,
                     keep: int = 2) -> Source:
    """The remote Source rooted at OUT/.fp8convert/download, with a StreamingFetcher as `source.fetcher`.

    Nothing is written until `source.fetcher.start(order)`, which must come after the output directory
    is prepared (prepare_output may clear OUT)."""
    from .output import WORK_DIR
    repo = resolve_repo(repo_id, revision, token)
    layout = remote_layout(repo)
    download_dir = Path(out_dir) / WORK_DIR / DOWNLOAD_DIR
    source = _source_from_repo(repo, layout, download_dir)
    side = layout.side_files + ([layout.card] if layout.card else [])
    source.fetcher = StreamingFetcher(repo, download_dir, layout.shards, side, keep=keep)
    return source


def need_order(batches) -> list[str]:
    """Shards in the order a list of batches (anything with `.tensors` of TensorPlan) first reads them."""
    order: dict[str, None] = {}
    for batch in batches:
        for t in batch.tensors:
            order.setdefault(t.source.file, None)
    return list(order)


# ----------------------------------------------------------------------------------- push


UPLOAD_IGNORE = [".fp8convert", ".fp8convert/*", "*.partial", ".*.tmp"]


def check_output_complete(out: str | Path) -> dict:
    """Refuse anything but a finished conversion: manifest complete (when present), config.json with a
    quantization_config, the index, and every shard it names present with the size its header implies.
    Returns the output's config.json."""
    out = Path(out)
    if not out.is_dir():
        raise FP8ConvertError(f"{out}: no such output directory")
    from .output import Manifest
    manifest_path = Manifest(out).path
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as e:
            raise FP8ConvertError(f"{manifest_path}: unreadable ({e}); refusing to push") from e
        if not manifest.get("complete"):
            raise FP8ConvertError(f"{out}: the conversion is not complete (manifest says so); rerun the same "
                                  "quantize command to finish it before pushing")
    for name in ("config.json", INDEX_NAME):
        if not (out / name).is_file():
            raise FP8ConvertError(f"{out}: no {name}, so the conversion is not complete; rerun the same quantize "
                                  "command to finish it before pushing")
    try:
        config = json.loads((out / "config.json").read_text())
        weight_map = json.loads((out / INDEX_NAME).read_text())["weight_map"]
        shards = sorted({safe_relative_name(v, INDEX_NAME) for v in weight_map.values()})
    except FP8ConvertError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise FP8ConvertError(f"{out}: config.json or {INDEX_NAME} unreadable ({e}); refusing to push") from e
    if not isinstance(config, dict) or "quantization_config" not in config:
        raise FP8ConvertError(f"{out}/config.json: has no quantization_config; not an FP8 output")
    for name in shards:
        if not (out / name).is_file():
            raise FP8ConvertError(f"{out / name}: missing (the index names it); refusing to push")
        try:
            read_header(str(out / name), name)  # a truncated or padded shard fails here
        except FP8ConvertError as e:
            raise FP8ConvertError(f"{out}: {e}; refusing to push") from e
    return config


def push(out: str | Path, repo_id: str, private: bool = False, revision: str | None = None,
         commit_message: str | None = None, token: str | None = None) -> str:
    """Upload a complete output directory to `repo_id` (created if needed). Returns the commit URL.

    Uses huggingface_hub's `upload_folder`, which (with hf_xet) uploads in resumable batched commits:
    rerunning an interrupted push skips what already arrived. `.fp8convert/` is never uploaded. A
    model card is generated first if OUT has none (a generated one is re-pointed at `repo_id`).
    Top-level `*.safetensors` on the remote that this output lacks (an earlier push with other
    sharding) are deleted in the same upload."""
    from huggingface_hub import HfApi
    out = Path(out)
    if not REPO_ID.match(repo_id):
        raise FP8ConvertError(f"{repo_id}: not a Hub repo id (owner/name)")
    config = check_output_complete(out)
    from .card import card_from_output, retarget_card
    card_path = out / CARD_NAME
    if card_path.is_file():  # a generated card's examples should name the repo, not the local directory
        text = card_path.read_text(encoding="utf-8")
        if retarget_card(text, repo_id) != text:
            card_path.write_text(retarget_card(text, repo_id), encoding="utf-8")
    else:
        card_path.write_text(card_from_output(out, repo_id=repo_id), encoding="utf-8")
    qc = config.get("quantization_config") or {}
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        # Top-level shards of an earlier push with other sharding would sit beside the new ones.
        stale = [f for f in api.list_repo_files(repo_id, revision=revision)
                 if "/" not in f and f.endswith(".safetensors") and not (out / f).is_file()]
        info = api.upload_folder(
            repo_id=repo_id, folder_path=str(out), revision=revision,
            commit_message=commit_message or f"FP8 checkpoint ({qc.get('quant_method', 'fp8')}) made with fp8convert",
            ignore_patterns=list(UPLOAD_IGNORE), delete_patterns=stale or None)
    except Exception as e:
        raise hub_error(repo_id, e, revision) from e
    return getattr(info, "commit_url", None) or str(info)
