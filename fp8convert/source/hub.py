"""A source on the Hugging Face Hub. A repo id resolves to one commit, then either
  * `remote_source`: a Source from the shards' safetensors headers, read with HTTP Range requests
    (planning and `inspect` download no weights), or
  * `download_source`: just the files a conversion needs, into the shared huggingface_hub cache
    (a rerun re-uses every finished file and resumes a partial one), or
  * `streaming.streaming_source`: the remote Source and a fetcher that keeps a few shards on disk.
Every request goes through hub_calls (timeouts, bounded retries, one error line naming the repo).
"""

from __future__ import annotations

import contextlib
import re
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import FP8ConvertError
from ..formats.sources import read_source_quantization
from ..options import HubAccess
from ..safetensors_io import INDEX_NAME, TensorInfo, decode_header, header_length, parse_header
from .checkpoint import Source, collect_tensors, is_copied_file, load_config, parse_index, shard_files
from .hub_calls import causes, download_is_retryable, hub_error, is_transient, with_retries
from .local import open_local

COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
CARD_NAME = "README.md"
FIRST_HEADER_READ = 100_000  # one Range request covers most headers (huggingface_hub does the same)
PARALLEL_REQUESTS = 8


# ----------------------------------------------------------------------------------- the source repo


@dataclass
class RemoteRepo:
    """A repo pinned to one commit: every later request uses `sha`, so a push to the branch in the
    middle of a conversion cannot mix files from two commits."""

    repo_id: str
    sha: str
    sizes: dict[str, int]  # every file of the commit -> size in bytes
    hub: HubAccess  # its revision is what the user asked for (branch, tag, commit), for messages

    def call(
        self,
        fn,
        *args,
        then: str = "check the connection and rerun",
        needed_bytes: int | None = None,
        retryable=is_transient,
        **kwargs,
    ):
        """Run a huggingface_hub call with timeouts and bounded retries (of failures `retryable` accepts);
        any failure becomes one FP8ConvertError line naming the repo (`then`, `needed_bytes`: see
        hub_calls.hub_error)."""
        try:
            return with_retries(fn, *args, retryable=retryable, **kwargs)
        except FP8ConvertError:
            raise
        except Exception as e:  # huggingface_hub, httpx and OS errors alike
            raise hub_error(self.repo_id, e, self.hub.revision, then=then, needed_bytes=needed_bytes) from e

    def download(self, filename: str, local_dir: Path | None = None, weights: bool = False) -> Path:
        """One file at the pinned commit: into the shared cache, or into `local_dir`. Resumes partial files.
        `weights`: a shard, which a rerun resumes (said when the download fails)."""
        from huggingface_hub import hf_hub_download

        then = "rerun to resume (finished downloads are kept)" if weights else "check the connection and rerun"
        path = Path(
            self.call(
                hf_hub_download,
                self.repo_id,
                filename,
                revision=self.sha,
                token=self.hub.token,
                cache_dir=self.hub.cache_dir,
                local_dir=str(local_dir) if local_dir else None,
                then=then,
                needed_bytes=self.sizes.get(filename),
                retryable=download_is_retryable,
            )
        )
        if filename in self.sizes and self.sizes[filename] is not None and path.stat().st_size != self.sizes[filename]:
            raise FP8ConvertError(
                f"{self.repo_id}: {filename} arrived with {path.stat().st_size} bytes, the Hub "
                f"lists {self.sizes[filename]}; rerun to fetch it again"
            )
        return path


def resolve_repo(repo_id: str, hub: HubAccess) -> RemoteRepo:
    """The commit `hub.revision` points to, and the size of every file in it (one API call)."""
    from huggingface_hub import HfApi

    with also_no_folder(repo_id):
        info = RemoteRepo(repo_id, "", {}, hub).call(
            HfApi(token=hub.token).model_info, repo_id, revision=hub.revision, files_metadata=True
        )
    return RemoteRepo(repo_id, info.sha, {s.rfilename: s.size for s in (info.siblings or [])}, hub)


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


@dataclass
class RemoteLayout:
    """Which files of a repo a conversion needs, decided from the listing (and the small index) alone."""

    shards: list[str]
    index_map: dict[str, str] | None
    side_files: list[str]  # copied into the output (tokenizer, chat template, .py, ...)
    card: str | None  # the source's README.md, read for the model card


def remote_layout(repo: RemoteRepo) -> RemoteLayout:
    """Refuse unusable repos (no config, pickle only, index naming absent shards) before any big download."""
    where = f"{repo.repo_id}@{repo.hub.revision}" if repo.hub.revision else repo.repo_id
    if "config.json" not in repo.sizes:
        raise FP8ConvertError(f"{where}: no config.json in the repository; fp8convert needs the model's config")
    index_map = None
    if INDEX_NAME in repo.sizes:
        index_map = parse_index(repo.download(INDEX_NAME).read_bytes(), f"{where}: {INDEX_NAME}")
    shards = shard_files(list(repo.sizes), index_map, where)
    if missing := [s for s in shards if s not in repo.sizes]:
        raise FP8ConvertError(f"{where}: {INDEX_NAME} names {missing[0]}, which is not in the repository")
    side = sorted(n for n in repo.sizes if is_copied_file(n))
    return RemoteLayout(shards, index_map, side, CARD_NAME if CARD_NAME in repo.sizes else None)


def _read_range(url: str, headers: dict, start: int, length: int, timeout: float | None) -> bytes:
    """`length` bytes from `start` with one Range request; streams and stops early if the server
    ignores the Range header, so a weight file is never read in full."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    with get_session().stream(
        "GET", url, headers={**headers, "Range": f"bytes={start}-{start + length - 1}"}, timeout=timeout
    ) as response:
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
    headers = build_hf_headers(token=repo.hub.token)
    timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
    size = repo.sizes.get(filename)
    if size is not None and size < 8:
        raise FP8ConvertError(f"{filename}: not a safetensors file ({size} bytes)")
    first = repo.call(
        _read_range, url, headers, 0, FIRST_HEADER_READ if size is None else min(size, FIRST_HEADER_READ), timeout
    )
    header_len = header_length(first, size, filename)
    raw = first[8 : 8 + header_len]
    if len(raw) < header_len:
        raw += repo.call(_read_range, url, headers, 8 + len(raw), header_len - len(raw), timeout)
    return parse_header(decode_header(raw, filename), filename, data_start=8 + header_len, file_size=size)


def _snapshot_dir(repo: RemoteRepo) -> Path:
    """Where the shared cache keeps this commit's files (download_source's root)."""
    return repo.download("config.json").parent


def source_from_repo(repo: RemoteRepo, layout: RemoteLayout, root: Path) -> Source:
    config = load_config(_snapshot_dir(repo))
    headers = dict(zip(layout.shards, parallel(lambda f: remote_header(repo, f)[0], layout.shards)))
    tensors = collect_tensors(headers, layout.index_map, repo.repo_id)
    quant = read_source_quantization(config, tensors, repo.repo_id, list(layout.side_files))
    return Source(
        Path(root), list(layout.shards), tensors, config, list(layout.side_files), repo.repo_id, repo.sha, quant
    )


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def offline_source(repo_id: str, hub: HubAccess) -> Source | None:
    """With HF_HUB_OFFLINE set: the cached snapshot of an earlier download (None when online). The
    snapshot directory's name is its commit."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if not hub_offline():
        return None
    with also_no_folder(repo_id):
        try:
            root = snapshot_download(repo_id, revision=hub.revision, cache_dir=hub.cache_dir, local_files_only=True)
        except LocalEntryNotFoundError as e:
            at = f" at {hub.revision}" if hub.revision else ""
            raise FP8ConvertError(
                f"{repo_id}: HF_HUB_OFFLINE is set and the download cache "
                f"({hub.cache_dir or constants.HF_HUB_CACHE}) holds no copy of it{at}; unset "
                "HF_HUB_OFFLINE to download it"
            ) from e
    return open_local(Path(root), label=repo_id, revision=Path(root).name)


def remote_source(repo_id: str, hub: HubAccess) -> Source:
    """A Source from the Hub without downloading weights: the repo listing, config.json and the index
    (small files, into the cache) and each shard's header (Range requests), rooted at the cache snapshot
    that `download_source` fills. Offline (HF_HUB_OFFLINE), the cached snapshot of an earlier download."""
    if (cached := offline_source(repo_id, hub)) is not None:
        return cached
    repo = resolve_repo(repo_id, hub)
    return source_from_repo(repo, remote_layout(repo), _snapshot_dir(repo))


def download_source(repo_id: str, hub: HubAccess) -> Source:
    """Download config, index, the shards (those the index names, or the top-level safetensors), the side
    files and README.md into the huggingface_hub cache, nothing else (no .bin, no original/ folder); the
    Source read from that snapshot. Offline (HF_HUB_OFFLINE), the cached snapshot as it is."""
    if (cached := offline_source(repo_id, hub)) is not None:
        return cached
    repo = resolve_repo(repo_id, hub)
    layout = remote_layout(repo)
    root = _fetch(repo, layout, layout.shards)
    _remember_ref(root, repo)
    return open_local(root, label=repo_id, revision=repo.sha)


def fetch_from_hub(source: Source, shards: list[str], hub: HubAccess) -> None:
    """Complete the cache snapshot a remote Source is rooted at with `shards` (the ones a worker reads)
    and the small files (what finalize reads). Offline (the source is the cached snapshot itself)
    there is nothing to fetch."""
    if source.revision is None or hub_offline():
        return
    repo = resolve_repo(source.label, replace(hub, revision=source.revision))
    _fetch(repo, remote_layout(repo), shards)


def _fetch(repo: RemoteRepo, layout: RemoteLayout, shards: list[str]) -> Path:
    """The small files (config, index, card, side files), then `shards`, biggest first, into the cache
    snapshot; returns it. Files the cache already holds for this commit cost no request, and a partial
    one resumes (the cache keeps `.incomplete` blobs)."""
    small = [n for n in ["config.json", INDEX_NAME, layout.card, *layout.side_files] if n and n in repo.sizes]
    for name in dict.fromkeys(small):
        repo.download(name)
    shards = sorted(dict.fromkeys(shards), key=lambda n: -(repo.sizes.get(n) or 0))
    parallel(lambda name: repo.download(name, weights=True), shards)
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

    threads = [
        threading.Thread(target=work, name="fp8convert-hub", daemon=True)
        for _ in range(max(1, min(workers, len(items))))
    ]
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
    ref = repo.hub.revision or "main"
    if COMMIT_SHA.match(ref) or snapshot.parent.name != "snapshots":
        return
    path = snapshot.parent.parent / "refs" / ref
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(repo.sha)
    except OSError:
        pass  # only offline reruns need it
