"""fp8convert and the Hugging Face Hub: every request with timeouts, bounded retries and one line for a
failure; a source repo pinned to one commit, read from its shards' headers (HTTP Range requests: planning
and `inspect` download no weights) or downloaded into the shared huggingface_hub cache (a rerun re-uses
every finished file and resumes a partial one)."""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import os
import queue
import re
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub as hf  # cheap: the package loads its HTTP client only when used
from huggingface_hub import constants

from ..errors import FP8ConvertError, first_line
from ..formats.sources import read_source_quantization
from ..options import HubAccess, env_number
from ..safetensors_io import INDEX_NAME, TensorInfo, header_length, parse_header
from ..units import format_size
from .checkpoint import Source, collect_tensors, is_copied_file, load_config, parse_index, shard_files

UPLOAD_READ_TIMEOUT_S = 300.0  # an upload's answer: a commit the Hub may take minutes to make
MAX_RETRY_WAIT_S = 8.0
RETRY_STATUS = (408, 429, 500, 502, 503, 504)
CHECK_AND_RERUN = "check the connection and rerun"
COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
CARD_NAME = "README.md"
FIRST_HEADER_READ = 100_000  # one Range request covers most headers (huggingface_hub does the same)
PARALLEL_REQUESTS = 8
# huggingface_hub turns a failed metadata request into LocalEntryNotFoundError and an interrupted
# download into other types: the network error is found by walking the exception's causes.
NETWORK_ERRNOS = {
    getattr(errno, name)
    for name in "ECONNREFUSED ECONNRESET ECONNABORTED ETIMEDOUT EHOSTUNREACH ENETUNREACH ENETDOWN EPIPE".split()
}


@functools.cache
def install_timeouts() -> None:
    """huggingface_hub's client has no timeout of its own (`model_info` waits forever on a server that never
    answers): once per process (the first Hub call is the main thread's), wrap its client factory, a user's own
    included, so every request gets them (their variables: docs/usage.md)."""
    from huggingface_hub.utils import _http

    base = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)

    def factory():
        client = base()
        client.event_hooks["request"].append(_bound_timeouts)
        return client

    _http.set_client_factory(factory)  # closes the current client: the next request makes one with the hook


def _bound_timeouts(request) -> None:
    """A request hook: the limits, or a request's own timeouts where shorter."""
    connect, read = float(constants.HF_HUB_ETAG_TIMEOUT), float(constants.HF_HUB_DOWNLOAD_TIMEOUT)
    if request.method not in ("GET", "HEAD"):
        read = max(read, UPLOAD_READ_TIMEOUT_S)
    timeout = dict(request.extensions.get("timeout") or {})
    for key, limit in (("connect", connect), ("pool", connect), ("read", read)):
        timeout[key] = min(timeout.get(key) or limit, limit)
    timeout["write"] = timeout.get("write") or read
    request.extensions = {**request.extensions, "timeout": timeout}


def causes(error: BaseException):
    """The error and every exception it was raised from."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def http_module():
    """The HTTP library huggingface_hub uses and re-exports (httpx2 from its 2.0, httpx in 1.x)."""
    try:
        from huggingface_hub.utils import httpx
    except ImportError:  # huggingface_hub 1.x before 1.30
        import httpx
    return httpx


def is_network_error(error: BaseException) -> bool:
    """Timeouts, refused or dropped connections, unreachable hosts: a rerun may succeed."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    http = http_module()
    for e in causes(error):
        if isinstance(e, OfflineModeIsEnabled):
            return False
        if isinstance(e, (http.TransportError, ConnectionError, TimeoutError)):
            return True
        if isinstance(e, OSError) and e.errno in NETWORK_ERRNOS:
            return True
    return False


def http_status(error: BaseException) -> int | None:
    from huggingface_hub.errors import HfHubHTTPError

    for e in causes(error):
        if isinstance(e, HfHubHTTPError):
            return getattr(getattr(e, "response", None), "status_code", None)
    return None


def is_transient(error: BaseException) -> bool:
    return is_network_error(error) or http_status(error) in RETRY_STATUS


def download_is_retryable(error: BaseException) -> bool:
    """A transient failure, unless it came out of huggingface_hub's content download (`http_get`), which
    has already retried a stalled or broken transfer five times, resuming it."""
    frames = traceback.walk_tb(error.__traceback__)
    return is_transient(error) and all(frame.f_code.co_name != "http_get" for frame, _ in frames)


def with_retries(fn, *args, retryable=is_transient, **kwargs):
    """fn(*args, **kwargs), retried on failures `retryable` accepts, with a doubling wait."""
    install_timeouts()
    retries = max(0, env_number(os.environ, "FP8CONVERT_HUB_RETRIES", 2))
    wait = max(0.0, env_number(os.environ, "FP8CONVERT_HUB_RETRY_WAIT", 1.0, float))
    for attempt in itertools.count(1):
        try:
            return fn(*args, **kwargs)
        except FP8ConvertError:
            raise
        except Exception as e:
            if attempt > retries or not retryable(e):
                e.attempts = attempt  # hub_error says how often it was tried
                raise
        time.sleep(wait)
        wait = min(MAX_RETRY_WAIT_S, wait * 2)


def _tries(error: BaseException) -> str:
    attempts = getattr(error, "attempts", 1)
    return f", {attempts} attempts" if attempts > 1 else ""


def hub_error(
    repo_id: str, error: Exception, revision: str | None = None, *, then: str = CHECK_AND_RERUN, needed_bytes=None
) -> FP8ConvertError:
    """One clear line for any huggingface_hub, network or download-cache failure. `then`: what to do
    about a network failure (e.g. that a rerun resumes it); `needed_bytes`: said when the disk is full."""
    from huggingface_hub import errors

    if isinstance(error, FP8ConvertError):
        return error
    known = {  # the first that fits: GatedRepoError is a RepositoryNotFoundError
        errors.GatedRepoError: "gated repository; accept its terms on the Hub and log in (hf auth login, or set "
        "HF_TOKEN or --token)",
        errors.RepositoryNotFoundError: "repository not found (or private: log in, or set HF_TOKEN or --token)",
        errors.RevisionNotFoundError: f"revision {revision or ''} not found".replace("  ", " "),
        errors.RemoteEntryNotFoundError: f"file not found on the Hub ({first_line(error)})",
        errors.OfflineModeIsEnabled: "HF_HUB_OFFLINE is set, so the Hub cannot be reached; unset it",
    }
    if kind := next((k for k in known if isinstance(error, k)), None):
        return FP8ConvertError(f"{repo_id}: {known[kind]}")
    http = http_module()
    if any(isinstance(e, (http.TimeoutException, TimeoutError)) for e in causes(error)):
        return FP8ConvertError(
            f"{repo_id}: the Hub did not answer within {float(constants.HF_HUB_DOWNLOAD_TIMEOUT):g} s{_tries(error)} "
            f"({first_line(error)}); {then} (HF_HUB_DOWNLOAD_TIMEOUT sets the wait)"
        )
    if is_network_error(error) or isinstance(error, errors.LocalEntryNotFoundError):
        cause = next((e for e in causes(error) if e is not error and is_network_error(e)), error)
        return FP8ConvertError(
            f"{repo_id}: cannot reach the Hub (network error{_tries(error)}: "
            f"{type(cause).__name__}: {first_line(cause)}); {then}"
        )
    status = http_status(error)
    by_status = {
        401: "the Hub refused the credentials (401); check HF_TOKEN or --token, or run hf auth login",
        403: f"access denied (403); the token may lack write or read permission ({first_line(error)})",
    }
    if status is not None:
        return FP8ConvertError(
            f"{repo_id}: {by_status.get(status) or f'Hub request failed{_tries(error)} ({first_line(error)})'}"
        )
    if isinstance(error, OSError):  # not the network: the disk the download cache lives on
        where = error.filename or constants.HF_HUB_CACHE
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            need = f" (the file being downloaded is {format_size(needed_bytes)})" if needed_bytes else ""
            return FP8ConvertError(
                f"{where}: no space left on the download cache's disk{need}; free space or point HF_HUB_CACHE "
                "(or --cache-dir) elsewhere, then rerun (finished downloads are kept)"
            )
        return FP8ConvertError(
            f"{where}: cannot write the download cache ({error.strerror or first_line(error)}); "
            "fix it or point HF_HUB_CACHE (or --cache-dir) elsewhere"
        )
    return FP8ConvertError(f"{repo_id}: Hub operation failed ({type(error).__name__}: {first_line(error)})")


@dataclass
class RemoteRepo:
    """A repo pinned to one commit (every later request uses `sha`, so a push to the branch in the middle
    of a conversion cannot mix files from two commits), and the files a conversion needs."""

    repo_id: str
    sha: str
    sizes: dict[str, int]  # every file of the commit -> size in bytes
    hub: HubAccess  # its revision is what the user asked for (branch, tag, commit), for messages
    shards: list[str] = field(default_factory=list)
    index_map: dict[str, str] | None = None
    side_files: list[str] = field(default_factory=list)  # copied into the output (tokenizer, chat template, ...)

    def call(self, fn, *args, then=CHECK_AND_RERUN, needed_bytes=None, retryable=is_transient, **kwargs):
        """with_retries(fn, ...); any failure becomes hub_error's one line naming the repo."""
        try:
            return with_retries(fn, *args, retryable=retryable, **kwargs)
        except FP8ConvertError:
            raise
        except Exception as e:  # huggingface_hub, httpx and OS errors alike
            raise hub_error(self.repo_id, e, self.hub.revision, then=then, needed_bytes=needed_bytes) from e

    def download(self, filename: str, local_dir: Path | None = None, weights: bool = False) -> Path:
        """One file at the pinned commit, into the shared cache or `local_dir`. `weights`: a shard, which a
        rerun resumes (said when the download fails)."""
        size = self.sizes.get(filename)
        path = Path(
            self.call(
                hf.hf_hub_download,
                self.repo_id,
                filename,
                revision=self.sha,
                token=self.hub.token,
                cache_dir=self.hub.cache_dir,
                local_dir=str(local_dir) if local_dir else None,
                then="rerun to resume (finished downloads are kept)" if weights else CHECK_AND_RERUN,
                needed_bytes=size,
                retryable=download_is_retryable,
            )
        )
        if size is not None and path.stat().st_size != size:
            raise FP8ConvertError(
                f"{self.repo_id}: {filename} arrived with {path.stat().st_size} bytes, the Hub lists {size}; "
                "rerun to fetch it again"
            )
        return path

    def snapshot_dir(self) -> Path:
        """Where the shared cache keeps this commit's files."""
        return self.download("config.json").parent

    def download_small_files(self, local_dir: Path | None = None, weights: bool = False) -> None:
        """The side files and model card: with config.json and the index (resolve_repo's), all an output reads."""
        for name in [*self.side_files, CARD_NAME]:
            if name in self.sizes:
                self.download(name, local_dir, weights)

    def fetch(self, shards: list[str]) -> Path:
        """The small files, then `shards`, biggest first, into the cache snapshot; returns it."""
        snapshot = self.snapshot_dir()
        self.download_small_files()
        shards = sorted(dict.fromkeys(shards), key=lambda n: -(self.sizes.get(n) or 0))
        parallel(lambda name: self.download(name, weights=True), shards)
        # Record branch -> commit (refs/<branch>) as huggingface_hub does, so an offline rerun finds this
        # snapshot: the files were fetched by commit, which records no ref.
        ref = self.hub.revision or "main"
        if not COMMIT_SHA.match(ref) and snapshot.parent.name == "snapshots":
            path = snapshot.parent.parent / "refs" / ref
            with contextlib.suppress(OSError):  # only offline reruns need it
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(self.sha)
        return snapshot


def resolve_repo(repo_id: str, hub: HubAccess) -> RemoteRepo:
    """The commit `hub.revision` points to, its files' sizes (one API call) and the files a conversion needs:
    unusable repos (no config, pickle only, an index naming absent shards) are refused before any download."""
    with also_no_folder(repo_id):
        info = RemoteRepo(repo_id, "", {}, hub).call(
            hf.HfApi(token=hub.token).model_info, repo_id, revision=hub.revision, files_metadata=True
        )
    repo = RemoteRepo(repo_id, info.sha, {s.rfilename: s.size for s in (info.siblings or [])}, hub)
    where = f"{repo_id}@{hub.revision}" if hub.revision else repo_id
    if "config.json" not in repo.sizes:
        raise FP8ConvertError(f"{where}: no config.json in the repository; fp8convert needs the model's config")
    if INDEX_NAME in repo.sizes:
        repo.index_map = parse_index(repo.download(INDEX_NAME).read_bytes(), f"{where}: {INDEX_NAME}")
    repo.shards = shard_files(list(repo.sizes), repo.index_map, where)
    if missing := [s for s in repo.shards if s not in repo.sizes]:
        raise FP8ConvertError(f"{where}: {INDEX_NAME} names {missing[0]}, which is not in the repository")
    repo.side_files = sorted(n for n in repo.sizes if is_copied_file(n))
    return repo


@contextlib.contextmanager
def also_no_folder(repo_id: str):
    """`owner/name` is also a relative path: when the Hub cannot give that repo, the user may have
    meant a local folder (a typo, another working directory), so the error says both."""
    from huggingface_hub.errors import GatedRepoError, RevisionNotFoundError

    try:
        yield
    except FP8ConvertError as e:
        if Path(repo_id).exists() or any(isinstance(c, (GatedRepoError, RevisionNotFoundError)) for c in causes(e)):
            raise  # the Hub knows the repo: no doubt about what was meant
        hub_said = str(e).removeprefix(f"{repo_id}: ")
        raise FP8ConvertError(
            f"{repo_id}: no local folder of that name (in {Path.cwd()}), and as a Hub repo id: {hub_said}"
        ) from e


def _read_range(url: str, headers: dict, start: int, length: int) -> bytes:
    """`length` bytes from `start` with one Range request; a server that ignores the Range header sends
    the file from byte 0, read only as far as needed (a weight file is never read in full)."""
    headers = {**headers, "Range": f"bytes={start}-{start + length - 1}"}
    timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
    with hf.get_session().stream("GET", url, headers=headers, timeout=timeout) as response:
        if response.status_code >= 400:
            response.read()
            hf.hf_raise_for_status(response)
        skip = start if response.status_code == 200 else 0
        out = bytearray()
        for chunk in response.iter_bytes():
            out += chunk
            if len(out) >= skip + length:
                break
        return bytes(out[skip : skip + length])


def remote_header(repo: RemoteRepo, filename: str) -> dict[str, TensorInfo]:
    """One shard's safetensors header over HTTP Range requests, validated exactly as a local one."""
    from huggingface_hub.utils import build_hf_headers

    url, headers = hf.hf_hub_url(repo.repo_id, filename, revision=repo.sha), build_hf_headers(token=repo.hub.token)
    size = repo.sizes.get(filename)
    if size is not None and size < 8:
        raise FP8ConvertError(f"{filename}: not a safetensors file ({size} bytes)")
    first = repo.call(_read_range, url, headers, 0, min(size or FIRST_HEADER_READ, FIRST_HEADER_READ))
    header_len = header_length(first, size, filename)
    raw = first[8 : 8 + header_len]
    if len(raw) < header_len:
        raw += repo.call(_read_range, url, headers, 8 + len(raw), header_len - len(raw))
    return parse_header(raw, filename, data_start=8 + header_len, file_size=size)


def source_from_repo(repo: RemoteRepo, root: Path | None = None) -> Source:
    """The repo's checkpoint from its remote headers, rooted at `root`, else at the cache snapshot."""
    snapshot = repo.snapshot_dir()
    config = load_config(snapshot)
    headers = dict(zip(repo.shards, parallel(lambda f: remote_header(repo, f), repo.shards)))
    tensors = collect_tensors(headers, repo.index_map, repo.repo_id)
    quant = read_source_quantization(config, tensors, repo.repo_id, repo.side_files)
    return Source(
        root or snapshot, list(repo.shards), tensors, config, list(repo.side_files), repo.repo_id, repo.sha, quant
    )


def parallel(fn, items: list) -> list:
    """fn over items on daemon threads, results in order; the first failure stops handing out items and
    is raised. Ctrl-C returns at once (a thread pool would wait for every download in flight, whose
    partial files a rerun resumes anyway)."""
    results, failed, todo = [None] * len(items), [], queue.SimpleQueue()

    def work() -> None:
        while not failed and (i := todo.get()) is not None:
            try:
                results[i] = fn(items[i])
            except BaseException as e:
                failed.append(e)

    threads = [threading.Thread(target=work, name="fp8convert-hub", daemon=True) for _ in items[:PARALLEL_REQUESTS]]
    for i in [*range(len(items)), *[None] * len(threads)]:  # a None ends each thread
        todo.put(i)
    for th in threads:
        th.start()
    for th in threads:
        while th.is_alive():
            th.join(timeout=0.2)
    if failed:
        raise failed[0]
    return results
