"""An in-process fake of the Hugging Face Hub HTTP API, for tests.

The real ``huggingface_hub`` client (2.4.x) talks to this server exactly as it talks to
https://huggingface.co: only the endpoint changes. Nothing here touches the network; the
server binds 127.0.0.1 on a random free port and uses the standard library only.

What it serves (model repos only, repo ids must be ``namespace/name``):

* repo metadata:   GET  /api/models/{repo}[/revision/{rev}]    (model_info, repo_info)
                   GET  /api/models/{repo}/tree/{rev}[/{path}] (list_repo_files/tree, snapshot_download)
                   POST /api/models/{repo}/paths-info/{rev}    (get_paths_info)
                   GET  /api/models/{repo}/refs, /commits/{rev}
                   GET  /api/models/{repo}/safetensors-metadata/{index} (get_sharded_safetensors_metadata)
* file content:    HEAD/GET /{repo}/resolve/{rev}/{path}       (hf_hub_download, Range requests)
* repo admin:      POST /api/repos/create, DELETE /api/repos/delete, POST|DELETE /api/models/{repo}/branch/{b}
* uploads:         POST /api/models/{repo}/preupload/{rev}     (regular vs LFS decision)
                   POST /{repo}.git/info/lfs/objects/batch     (LFS batch API, basic + multipart)
                   PUT  /_lfs/...                              (the "S3" side of LFS uploads)
                   POST /{repo}.git/info/lfs/objects/verify
                   POST /api/models/{repo}/commit/{rev}        (NDJSON commit)
* misc:            GET /api/whoami-v2, POST /api/validate-yaml, GET /api/agent-harnesses

Xet is not implemented: the server never advertises Xet (no ``X-Xet-*`` headers, no xet
transfer), and the ``fake_hub`` fixture sets ``HF_HUB_DISABLE_XET`` so uploads take the
plain LFS path.

Typical use::

    def test_something(fake_hub):
        fake_hub.add_repo("org/model", {"config.json": b"{}"})
        path = huggingface_hub.hf_hub_download("org/model", "config.json")
"""

from __future__ import annotations

import base64
import contextlib
import fnmatch
import hashlib
import itertools
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

DEFAULT_TOKEN = "hf_fake_token"
DEFAULT_USER = "fake-user"

# Same rule of thumb as the Hub: these extensions (from the default .gitattributes) and any
# file over 10 MiB or with binary content go to LFS, everything else is a regular git blob.
LFS_PATTERNS = (
    "*.7z",
    "*.arrow",
    "*.bin",
    "*.bz2",
    "*.ckpt",
    "*.ftz",
    "*.gguf",
    "*.gz",
    "*.h5",
    "*.joblib",
    "*.lfs.*",
    "*.mlmodel",
    "*.model",
    "*.msgpack",
    "*.npy",
    "*.npz",
    "*.onnx",
    "*.ot",
    "*.parquet",
    "*.pb",
    "*.pickle",
    "*.pkl",
    "*.pt",
    "*.pth",
    "*.rar",
    "*.safetensors",
    "*.tar",
    "*.tflite",
    "*.tgz",
    "*.wasm",
    "*.xz",
    "*.zip",
    "*.zst",
    "*tfevents*",
)
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024

DEFAULT_GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()


def is_lfs_file(path: str, data: bytes) -> bool:
    """Whether the Hub would store this file with LFS (see LFS_PATTERNS)."""
    name = path.rsplit("/", 1)[-1]
    return (
        len(data) > LFS_SIZE_THRESHOLD
        or b"\x00" in data[:512]
        or any(fnmatch.fnmatch(name, pattern) for pattern in LFS_PATTERNS)
    )


def _git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


def _now_iso() -> str:
    # The client parses dates with '%Y-%m-%dT%H:%M:%S.%fZ' only.
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


# --------------------------------------------------------------------------- storage


@dataclass(eq=False)
class StoredFile:
    data: bytes
    lfs: bool

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n".encode()

    @cached_property
    def git_oid(self) -> str:
        # For LFS files git stores the pointer file, so that is what the blob id hashes.
        return _git_blob_oid(self.pointer if self.lfs else self.data)

    @property
    def etag(self) -> str:
        # The Hub's ETag is the sha256 for LFS files and the git blob id for regular ones;
        # hf_hub_download names cached blobs after it.
        return self.sha256 if self.lfs else self.git_oid


@dataclass
class Commit:
    oid: str
    parent: str | None
    title: str
    message: str
    date: str
    files: dict[str, StoredFile]


@dataclass
class Repo:
    repo_id: str
    private: bool = False
    gated: str | bool = False  # False, "auto" or "manual", as in the Hub's model_info
    created_at: str = field(default_factory=_now_iso)
    branches: dict[str, str] = field(default_factory=dict)  # branch or "refs/pr/N" -> commit oid
    commits: dict[str, Commit] = field(default_factory=dict)
    granted_tokens: set[str] = field(default_factory=set)  # tokens allowed through the gate

    def resolve(self, revision: str) -> Commit | None:
        """Branch name, full commit oid or unique oid prefix (>= 7 chars) -> commit."""
        if revision in self.branches:
            return self.commits[self.branches[revision]]
        if revision in self.commits:
            return self.commits[revision]
        if len(revision) >= 7:
            matches = [oid for oid in self.commits if oid.startswith(revision)]
            if len(matches) == 1:
                return self.commits[matches[0]]
        return None


@dataclass
class RecordedRequest:
    """One request as the server saw it. Header names are lower-cased."""

    method: str
    path: str  # path without the query string, still URL-encoded
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes | None  # None when larger than 64 KiB (LFS uploads)

    @property
    def token(self) -> str | None:
        auth = self.headers.get("authorization", "")
        return auth[len("Bearer ") :] if auth.startswith("Bearer ") else None


@dataclass
class Failure:
    """A fault to inject: answer `status` (kind="status"), close the socket without answering
    (kind="drop"), or keep the connection open and never answer (kind="hang", until the server
    stops) on matching requests, `times` times (None: until cleared)."""

    kind: str = "status"
    status: int = 500
    times: int | None = None
    method: str | None = None
    path_contains: str | None = None
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and (
            self.path_contains is None or self.path_contains in path
        )


class _HubError(Exception):
    """Raised by endpoint code to answer an error the way the Hub does (X-Error-Code header)."""

    def __init__(
        self, status: int, message: str, code: str | None = None, headers: dict | None = None, extra: dict | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}
        self.extra = extra or {}  # additional fields of the JSON error body


# --------------------------------------------------------------------------- server


class FakeHub:
    """The fake Hub: in-memory repos plus a ThreadingHTTPServer answering on `url`.

    Auth model (a simplification of the Hub's):
      * `tokens` maps accepted tokens to user names; any other Bearer token gets a 401
        "Invalid credentials in Authorization header", like the Hub.
      * writes (create repo, preupload, LFS, commit, branches) need an accepted token;
      * private repos are visible to any accepted token, and "not found" (401) otherwise;
      * gated repos show their metadata and file list to anyone, but file contents only
        to tokens given access with `grant_access`.
    """

    def __init__(self, token: str = DEFAULT_TOKEN, username: str = DEFAULT_USER) -> None:
        self.token = token
        self.username = username
        self.tokens: dict[str, str] = {token: username}
        self.requests: list[RecordedRequest] = []
        self.failures: list[Failure] = []
        # Behaviour switches, all off by default:
        self.lfs_multipart_chunk_size: int | None = None  # LFS uploads use multipart above this size
        self.lfs_redirect = False  # resolve of LFS files 302s to a "CDN" host (http://localhost:port)
        # preupload answers "regular" (inline in the commit) for every file: lets upload_folder's
        # Xet pipeline run with Xet enabled, since it then never needs a Xet transfer.
        self.force_regular_uploads = False
        self.tree_page_size = 1000  # entries per page of /tree before a Link: rel="next"

        self._repos: dict[str, Repo] = {}
        self._lfs_objects: dict[str, bytes] = {}  # sha256 -> content, shared by all repos
        self._lfs_parts: dict[tuple[str, int], bytes] = {}  # multipart uploads in progress
        self._lock = threading.RLock()
        self._counter = itertools.count()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()  # releases requests held by a "hang" failure

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> FakeHub:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.hub = self  # type: ignore[attr-defined]
        # A short poll interval keeps stop() (and so each test's teardown) fast.
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fakehub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._httpd is not None, "server not started"
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ----------------------------------------------------------------- python API for tests

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes | str] | None = None,
        *,
        from_dir: str | Path | None = None,
        gated: bool | str = False,
        private: bool = False,
        branch: str = "main",
    ) -> str:
        """Create a repo with one commit holding `files` (and/or the files under `from_dir`).
        `gated=True` means "auto". Returns the commit oid."""
        _check_repo_id(repo_id)
        content: dict[str, bytes | str] = {}
        if from_dir is not None:
            root = Path(from_dir)
            for p in sorted(root.rglob("*")):
                rel = p.relative_to(root).as_posix()
                if p.is_file() and ".git" not in rel.split("/"):
                    content[rel] = p.read_bytes()
        content.update(files or {})
        with self._lock:
            if repo_id in self._repos:
                raise ValueError(f"repo {repo_id} already exists")
            self._repos[repo_id] = Repo(repo_id, private=private, gated="auto" if gated is True else gated)
            return self.commit_files(repo_id, content, branch=branch, message="Initial commit")

    def commit_files(
        self,
        repo_id: str,
        files: dict[str, bytes | str],
        *,
        branch: str = "main",
        message: str = "Update files",
        delete: tuple[str, ...] = (),
    ) -> str:
        """Add a commit on `branch` (created if needed) that adds/replaces `files` and removes
        `delete`. Returns the new commit oid."""
        with self._lock:
            repo = self._repo_or_raise(repo_id)
            stored = {}
            for path, data in files.items():
                raw = data.encode() if isinstance(data, str) else bytes(data)
                f = StoredFile(raw, is_lfs_file(path, raw))
                if f.lfs:
                    self._lfs_objects[f.sha256] = raw
                stored[path] = f
            return self._add_commit(repo, branch, stored, delete, message, "")

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """Content of the repo at `revision` (branch, commit oid or prefix)."""
        with self._lock:
            commit = self._repo_or_raise(repo_id).resolve(revision)
            if commit is None:
                raise KeyError(f"revision {revision!r} not found in {repo_id}")
            return {path: f.data for path, f in commit.files.items()}

    def repo_sha(self, repo_id: str, revision: str = "main") -> str:
        with self._lock:
            commit = self._repo_or_raise(repo_id).resolve(revision)
            if commit is None:
                raise KeyError(f"revision {revision!r} not found in {repo_id}")
            return commit.oid

    def repo(self, repo_id: str) -> Repo:
        """The stored Repo object (branches, commits, flags) for inspection or tweaking."""
        return self._repo_or_raise(repo_id)

    def has_repo(self, repo_id: str) -> bool:
        return repo_id in self._repos

    def grant_access(self, repo_id: str, token: str | None = None) -> None:
        """Let `token` (default: the server's token) through the gate of a gated repo."""
        self._repo_or_raise(repo_id).granted_tokens.add(token or self.token)

    def fail(
        self,
        kind: str = "status",
        *,
        status: int = 500,
        times: int | None = None,
        method: str | None = None,
        path_contains: str | None = None,
    ) -> Failure:
        """Make matching requests fail: kind="status" answers `status`, kind="drop" closes the
        connection without any answer (the client sees a RemoteProtocolError), kind="hang" accepts the
        request and never answers (a client without a read timeout waits forever)."""
        assert kind in ("status", "drop", "hang"), kind
        failure = Failure(kind, status, times, method, path_contains)
        with self._lock:
            self.failures.append(failure)
        return failure

    def clear_failures(self) -> None:
        with self._lock:
            self.failures.clear()

    def requests_to(self, path_contains: str, method: str | None = None) -> list[RecordedRequest]:
        return [r for r in list(self.requests) if path_contains in r.path and (method is None or r.method == method)]

    # ----------------------------------------------------------------- internals

    def _repo_or_raise(self, repo_id: str) -> Repo:
        try:
            return self._repos[repo_id]
        except KeyError:
            raise KeyError(f"no repo {repo_id!r} on the fake hub") from None

    def _add_commit(
        self,
        repo: Repo,
        branch: str,
        added: dict[str, StoredFile],
        deleted: tuple[str, ...] | list[str],
        title: str,
        description: str,
        deleted_folders: tuple[str, ...] | list[str] = (),
    ) -> str:
        parent = repo.branches.get(branch)
        files = dict(repo.commits[parent].files) if parent else {}
        for path in deleted:
            files.pop(path, None)
        for folder in deleted_folders:
            prefix = folder.rstrip("/") + "/"
            for path in [p for p in files if p.startswith(prefix)]:
                del files[path]
        files.update(added)
        seed = f"{repo.repo_id}\0{parent}\0{title}\0{next(self._counter)}\0" + "\0".join(
            f"{p}:{f.git_oid}" for p, f in sorted(files.items())
        )
        oid = hashlib.sha1(seed.encode()).hexdigest()
        repo.commits[oid] = Commit(oid, parent, title, description, _now_iso(), files)
        repo.branches[branch] = oid
        return oid

    def _record(self, handler: _Handler, body: bytes) -> None:
        url = urlsplit(handler.path)
        self.requests.append(
            RecordedRequest(
                method=handler.command,
                path=url.path,
                query=parse_qs(url.query, keep_blank_values=True),
                headers={k.lower(): v for k, v in handler.headers.items()},
                body=body if len(body) <= 64 * 1024 else None,
            )
        )

    def _take_failure(self, method: str, path: str) -> Failure | None:
        with self._lock:
            for failure in self.failures:
                if failure.matches(method, path) and (failure.times is None or failure.hits < failure.times):
                    failure.hits += 1
                    return failure
        return None


def _check_repo_id(repo_id: str) -> None:
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"fake hub repo ids must look like 'namespace/name', got {repo_id!r}")


# --------------------------------------------------------------------------- HTTP side


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 keeps connections alive, as httpx expects; every answer sets Content-Length.
    protocol_version = "HTTP/1.1"
    server_version = "FakeHub/1.0"
    timeout = 60  # idle keep-alive connections give up eventually

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = lambda self: self._handle()  # noqa: E731

    @property
    def hub(self) -> FakeHub:
        return self.server.hub  # type: ignore[attr-defined]

    # ----------------------------------------------------------------- plumbing

    def _handle(self) -> None:
        body = self._read_body()
        self.hub._record(self, body)
        url = urlsplit(self.path)
        self.query = parse_qs(url.query, keep_blank_values=True)
        self.body = body

        failure = self.hub._take_failure(self.command, url.path)
        if failure is not None and failure.kind == "hang":
            self.hub._stopping.wait()
            self.close_connection = True
            return
        if failure is not None and failure.kind == "drop":
            # Close without a single byte of answer: the client sees "Server disconnected".
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return
        if failure is not None:
            self._error(failure.status, f"Injected failure ({failure.status})")
            return

        try:
            self._check_token()
            self._route([unquote(p) for p in url.path.lstrip("/").split("/")], url.path)
        except _HubError as e:
            self._error(e.status, e.message, e.code, e.headers, e.extra)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug in the fake: answer 500 with the reason, don't hang the client
            self._error(500, f"fakehub internal error: {e!r}")

    def _read_body(self) -> bytes:
        # The client streams file uploads (data=fileobj), which httpx may send chunked.
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content_type: str | None = None):
        try:
            self.send_response(status)
            if content_type:
                self.send_header("Content-Type", content_type)
            for key, value in (headers or {}).items():
                self.send_header(key, str(value))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD" and body:
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _json(self, obj: Any, status: int = 200, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers, "application/json; charset=utf-8")

    def _error(
        self, status: int, message: str, code: str | None = None, headers: dict | None = None, extra: dict | None = None
    ) -> None:
        # huggingface_hub maps X-Error-Code to its exception classes (RepositoryNotFoundError,
        # GatedRepoError, RevisionNotFoundError, EntryNotFoundError) and shows X-Error-Message.
        h = {"X-Error-Message": _header_safe(message), **(headers or {})}
        if code:
            h["X-Error-Code"] = code
        self._json({"error": message, **(extra or {})}, status, h)

    def _json_body(self) -> Any:
        try:
            return json.loads(self.body or b"{}")
        except ValueError:
            raise _HubError(400, "Invalid JSON body") from None

    def _q(self, name: str, default: str | None = None) -> str | None:
        values = self.query.get(name)
        return values[0] if values else default

    def _q_bool(self, name: str) -> bool:
        return (self._q(name) or "").lower() in ("1", "true")

    # ----------------------------------------------------------------- auth

    def _check_token(self) -> None:
        auth = self.headers.get("Authorization")
        self.user: str | None = None
        self.token: str | None = None
        if not auth:
            return
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else auth
        if token not in self.hub.tokens:
            # Exactly the Hub's answer to a bad token: the client then raises a plain HfHubHTTPError 401.
            raise _HubError(401, "Invalid credentials in Authorization header")
        self.token, self.user = token, self.hub.tokens[token]

    def _require_write(self) -> None:
        if self.user is None:
            raise _HubError(401, "You must be authenticated to perform this action")

    def _readable_repo(self, repo_id: str) -> Repo:
        repo = self.hub._repos.get(repo_id)
        # Private repos look missing to anonymous users: 401 + RepoNotFound, as on the Hub.
        if repo is None:
            raise _HubError(404, "Repository not found", "RepoNotFound")
        if repo.private and self.user is None:
            raise _HubError(401, "Repository not found", "RepoNotFound")
        return repo

    def _check_gate(self, repo: Repo) -> None:
        # Gated repos: metadata is public, file contents need granted access.
        # Anonymous -> 401, logged in without access -> 403, both with X-Error-Code GatedRepo.
        if not repo.gated or self.token in repo.granted_tokens:
            return
        if self.user is None:
            raise _HubError(
                401,
                f"Access to model {repo.repo_id} is restricted. You must have access to it and be "
                "authenticated to access it. Please log in.",
                "GatedRepo",
            )
        raise _HubError(
            403,
            f"Access to model {repo.repo_id} is restricted and you are not in the authorized list. "
            f"Visit {self.hub.url}/{repo.repo_id} to ask for access.",
            "GatedRepo",
        )

    def _commit_at(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise _HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    # ----------------------------------------------------------------- routing

    def _route(self, parts: list[str], raw_path: str) -> None:
        """`parts` are the URL path segments, each URL-decoded (so a quoted revision like
        refs%2Fpr%2F1 stays one segment)."""
        m = self.command
        if parts[0] == "api":
            rest = parts[1:]
            if rest == ["whoami-v2"] and m == "GET":
                return self._whoami()
            if rest == ["agent-harnesses"]:
                # Fetched by huggingface_hub when building the user-agent: an empty registry.
                return self._json({"standardEnvVars": [], "harnesses": {}})
            if rest == ["validate-yaml"] and m == "POST":
                return self._json({"errors": [], "warnings": []})
            if rest == ["repos", "create"] and m == "POST":
                return self._create_repo()
            if rest == ["repos", "delete"] and m == "DELETE":
                return self._delete_repo()
            if len(rest) >= 3 and rest[0] == "models":
                return self._route_model_api("/".join(rest[1:3]), rest[3:])
            if rest and rest[0] in ("datasets", "spaces", "kernels"):
                raise _HubError(404, "Repository not found (the fake hub only serves models)", "RepoNotFound")
        elif parts[0] == "_lfs":
            return self._route_lfs_storage(parts[1:])
        elif len(parts) >= 5 and parts[1].endswith(".git") and parts[2:4] == ["info", "lfs"]:
            repo_id = f"{parts[0]}/{parts[1][: -len('.git')]}"
            if parts[4:] == ["objects", "batch"] and m == "POST":
                return self._lfs_batch(repo_id)
            if parts[4:] == ["objects", "verify"] and m == "POST":
                return self._lfs_verify()
        elif len(parts) >= 5 and parts[2] == "resolve" and m in ("GET", "HEAD"):
            return self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
        elif parts[0] in ("datasets", "spaces") and len(parts) >= 4 and parts[3] == "resolve":
            raise _HubError(404, "Repository not found (the fake hub only serves models)", "RepoNotFound")
        raise _HubError(404, f"fakehub: no route for {m} {raw_path}")

    def _route_model_api(self, repo_id: str, sub: list[str]) -> None:
        m = self.command
        if sub in ([], [""]) and m == "GET":
            return self._model_info(repo_id, "main")
        if len(sub) == 2 and sub[0] == "revision" and m == "GET":
            return self._model_info(repo_id, sub[1])
        if len(sub) >= 2 and sub[0] == "tree" and m == "GET":
            return self._tree(repo_id, sub[1], "/".join(sub[2:]).strip("/"))
        if len(sub) == 2 and sub[0] == "paths-info" and m == "POST":
            return self._paths_info(repo_id, sub[1])
        if sub == ["refs"] and m == "GET":
            return self._refs(repo_id)
        if len(sub) == 2 and sub[0] == "commits" and m == "GET":
            return self._commits(repo_id, sub[1])
        if len(sub) == 2 and sub[0] == "branch" and m in ("POST", "DELETE"):
            return self._branch(repo_id, sub[1])
        if len(sub) == 2 and sub[0] == "preupload" and m == "POST":
            return self._preupload(repo_id, sub[1])
        if len(sub) == 2 and sub[0] == "commit" and m == "POST":
            return self._create_commit(repo_id, sub[1])
        if len(sub) >= 2 and sub[0] == "safetensors-metadata" and m == "GET":
            return self._safetensors_metadata(repo_id, "/".join(sub[1:]))
        raise _HubError(404, f"fakehub: no route for {m} /api/models/{repo_id}/{'/'.join(sub)}")

    # ----------------------------------------------------------------- read endpoints

    def _whoami(self) -> None:
        if self.user is None:
            raise _HubError(401, "Invalid credentials in Authorization header")
        self._json(
            {
                "type": "user",
                "name": self.user,
                "fullname": self.user,
                "orgs": [],
                "auth": {"type": "access_token", "accessToken": {"displayName": "fakehub", "role": "write"}},
            }
        )

    def _model_info(self, repo_id: str, revision: str) -> None:
        with self.hub._lock:
            repo = self._readable_repo(repo_id)
            commit = self._commit_at(repo, revision)
        files = commit.files
        siblings = []
        for path in sorted(files):
            f = files[path]
            entry: dict[str, Any] = {"rfilename": path}
            if self._q_bool("blobs"):  # files_metadata=True
                entry.update(size=len(f.data), blobId=f.git_oid)
                if f.lfs:
                    entry["lfs"] = {"sha256": f.sha256, "size": len(f.data), "pointerSize": len(f.pointer)}
            siblings.append(entry)
        info: dict[str, Any] = {
            "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": commit.oid,
            "lastModified": commit.date,
            "createdAt": repo.created_at,
            "private": repo.private,
            "gated": repo.gated,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "usedStorage": sum(len(f.data) for f in files.values()),
        }
        config = _config_summary(files.get("config.json"))
        if config is not None:
            info["config"] = config
        safetensors = _safetensors_summary(files)
        if safetensors is not None:
            info["safetensors"] = safetensors
        expand = self.query.get("expand") or self.query.get("expand[]")
        if expand:  # the Hub then returns only the requested properties
            info = {k: v for k, v in info.items() if k in ("_id", "id") or k in expand}
        self._json(info)

    def _tree_entries(self, commit: Commit) -> list[dict]:
        """All files and folders of a commit, as the /tree and /paths-info endpoints list them."""
        entries: dict[str, dict] = {}
        for path in sorted(commit.files):
            f = commit.files[path]
            parents = path.split("/")[:-1]
            for i in range(1, len(parents) + 1):
                folder = "/".join(parents[:i])
                entries.setdefault(
                    folder,
                    {
                        "type": "directory",
                        "oid": hashlib.sha1(f"{commit.oid}:{folder}".encode()).hexdigest(),
                        "size": 0,
                        "path": folder,
                    },
                )
            entry: dict[str, Any] = {"type": "file", "oid": f.git_oid, "size": len(f.data), "path": path}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": len(f.pointer)}
            entries[path] = entry
        return [entries[k] for k in sorted(entries)]

    def _tree(self, repo_id: str, revision: str, path: str) -> None:
        with self.hub._lock:
            commit = self._commit_at(self._readable_repo(repo_id), revision)
        entries = self._tree_entries(commit)
        if path and not any(e["path"] == path and e["type"] == "directory" for e in entries):
            raise _HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        prefix = f"{path}/" if path else ""
        recursive = self._q_bool("recursive")
        listed = [
            e for e in entries if e["path"].startswith(prefix) and (recursive or "/" not in e["path"][len(prefix) :])
        ]
        # Cursor pagination with a GitHub-style Link header, like the Hub (1000 entries per page).
        start = int(self._q("cursor") or 0)
        page = listed[start : start + self.hub.tree_page_size]
        headers = {}
        if start + self.hub.tree_page_size < len(listed):
            params = {k: v[0] for k, v in self.query.items() if k != "cursor"}
            params["cursor"] = str(start + self.hub.tree_page_size)
            next_url = f"{self.hub.url}{urlsplit(self.path).path}?{urlencode(params)}"
            headers["Link"] = f'<{next_url}>; rel="next"'
        self._json(page, headers=headers)

    def _paths_info(self, repo_id: str, revision: str) -> None:
        with self.hub._lock:
            commit = self._commit_at(self._readable_repo(repo_id), revision)
        # The client posts a form ("paths=a&paths=b"); accept JSON too.
        if self.headers.get("Content-Type", "").startswith("application/json"):
            paths = self._json_body().get("paths", [])
        else:
            paths = parse_qs(self.body.decode()).get("paths", [])
        wanted = set(paths if isinstance(paths, list) else [paths])
        self._json([e for e in self._tree_entries(commit) if e["path"] in wanted])

    def _refs(self, repo_id: str) -> None:
        with self.hub._lock:
            repo = self._readable_repo(repo_id)
            branches = dict(repo.branches)

        def ref(name: str, oid: str) -> dict:
            full = name if name.startswith("refs/") else f"refs/heads/{name}"
            return {"name": name, "ref": full, "targetCommit": oid}

        body = {
            "branches": [ref(n, o) for n, o in branches.items() if not n.startswith("refs/pr/")],
            "converts": [],
            "tags": [],
        }
        if self._q_bool("include_prs"):
            body["pullRequests"] = [ref(n, o) for n, o in branches.items() if n.startswith("refs/pr/")]
        self._json(body)

    def _commits(self, repo_id: str, revision: str) -> None:
        with self.hub._lock:
            repo = self._readable_repo(repo_id)
            commit: Commit | None = self._commit_at(repo, revision)
            history = []
            while commit is not None:
                history.append(
                    {
                        "id": commit.oid,
                        "title": commit.title,
                        "message": commit.message,
                        "date": commit.date,
                        "authors": [{"user": self.hub.username}],
                    }
                )
                commit = repo.commits.get(commit.parent) if commit.parent else None
        self._json(history)

    def _resolve(self, repo_id: str, revision: str, path: str) -> None:
        with self.hub._lock:
            repo = self._readable_repo(repo_id)
            self._check_gate(repo)
            commit = self._commit_at(repo, revision)
        f = commit.files.get(path)
        if f is None:
            # X-Repo-Commit lets hf_hub_download cache the non-existence (.no_exist).
            raise _HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.oid})

        headers = {
            "X-Repo-Commit": commit.oid,
            "ETag": f'"{f.etag}"',
            "Accept-Ranges": "bytes",
            "Content-Disposition": f'inline; filename="{_header_safe(path.rsplit("/", 1)[-1])}"',
        }
        if f.lfs:
            headers["X-Linked-Etag"] = f'"{f.sha256}"'
            headers["X-Linked-Size"] = str(len(f.data))
        if f.lfs and self.hub.lfs_redirect:
            # Like the Hub's 302 to its CDN: a different origin (localhost vs 127.0.0.1), so the
            # client reads the metadata from this response and drops the Authorization header.
            location = f"http://localhost:{self.hub.port}/_lfs/cdn/{f.sha256}"
            return self._send(302, b"", {**headers, "Location": location})
        self._send_content(f.data, headers)

    def _send_content(self, data: bytes, headers: dict) -> None:
        """200 with the whole content, or 206 for a `Range: bytes=...` request
        (parse_safetensors_file_metadata reads the header with `bytes=0-100000`)."""
        total = len(data)
        range_header = self.headers.get("Range")
        if not range_header:
            return self._send(200, data, headers, "application/octet-stream")
        try:
            unit, _, spec = range_header.partition("=")
            assert unit.strip() == "bytes" and "," not in spec
            first, _, last = spec.strip().partition("-")
            if first == "":
                start, end = max(total - int(last), 0), total - 1
            else:
                start, end = int(first), min(int(last), total - 1) if last else total - 1
        except (AssertionError, ValueError):
            raise _HubError(400, f"Invalid Range header: {range_header}") from None
        if start >= total or start > end:
            return self._send(416, b"", {**headers, "Content-Range": f"bytes */{total}"})
        headers = {**headers, "Content-Range": f"bytes {start}-{end}/{total}"}
        self._send(206, data[start : end + 1], headers, "application/octet-stream")

    def _safetensors_metadata(self, repo_id: str, filename: str) -> None:
        # get_sharded_safetensors_metadata: the index plus every shard header in one answer.
        with self.hub._lock:
            repo = self._readable_repo(repo_id)
            self._check_gate(repo)
            commit = self._commit_at(repo, "main")
        index_file = commit.files.get(filename)
        if index_file is None:
            raise _HubError(404, "Entry not found", "EntryNotFound")
        index = json.loads(index_file.data)
        headers = {}
        for shard in sorted(set(index.get("weight_map", {}).values())):
            prefix = filename.rsplit("/", 1)[0] + "/" if "/" in filename else ""
            stored = commit.files.get(prefix + shard)
            if stored is None:
                raise _HubError(404, f"Shard not found: {shard}", "EntryNotFound")
            headers[shard] = _safetensors_header(stored.data)
        self._json({"index": {k: v for k, v in index.items() if k != "weight_map"}, "headers": headers})

    # ----------------------------------------------------------------- repo admin

    def _create_repo(self) -> None:
        self._require_write()
        payload = self._json_body()
        if payload.get("type") not in (None, "model"):
            raise _HubError(400, "The fake hub only creates model repos")
        name, org = payload.get("name"), payload.get("organization") or self.user
        repo_id = f"{org}/{name}"
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        with self.hub._lock:
            if repo_id in self.hub._repos:
                # create_repo(exist_ok=True) swallows exactly this 409, then reads "url" from its body.
                raise _HubError(409, "You already created this model repo", extra={"url": f"{self.hub.url}/{repo_id}"})
            repo = Repo(repo_id, private=private)
            self.hub._repos[repo_id] = repo
            # Like the Hub, a new repo starts with one commit holding a default .gitattributes.
            self.hub._add_commit(
                repo, "main", {".gitattributes": StoredFile(DEFAULT_GITATTRIBUTES, False)}, (), "initial commit", ""
            )
        self._json({"url": f"{self.hub.url}/{repo_id}", "name": repo_id, "id": repo.repo_id})

    def _delete_repo(self) -> None:
        self._require_write()
        payload = self._json_body()
        repo_id = f"{payload.get('organization') or self.user}/{payload.get('name')}"
        with self.hub._lock:
            if self.hub._repos.pop(repo_id, None) is None:
                raise _HubError(404, "Repository not found", "RepoNotFound")
        self._json({})

    def _branch(self, repo_id: str, branch: str) -> None:
        self._require_write()
        with self.hub._lock:
            repo = self._readable_repo(repo_id)
            if self.command == "DELETE":
                if repo.branches.pop(branch, None) is None:
                    raise _HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
                return self._json({})
            if branch in repo.branches:
                raise _HubError(409, f"Reference already exists: refs/heads/{branch}")
            start = self._json_body().get("startingPoint") or "main"
            repo.branches[branch] = self._commit_at(repo, start).oid
        self._json({})

    # ----------------------------------------------------------------- uploads

    def _writable_repo(self, repo_id: str) -> Repo:
        self._require_write()
        return self._readable_repo(repo_id)

    def _preupload(self, repo_id: str, revision: str) -> None:
        # First step of every upload: the client sends path/size/first 512 bytes of each file and
        # learns whether it goes to LFS or inline in the commit, plus the remote oid (so unchanged
        # files are skipped, which is what makes re-running an upload cheap).
        with self.hub._lock:
            repo = self._writable_repo(repo_id)
            commit = repo.resolve(revision)
            if commit is None and revision != "main":
                raise _HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        answer = []
        for item in self._json_body().get("files", []):
            sample = base64.b64decode(item.get("sample", ""))
            lfs = not self.hub.force_regular_uploads and (
                item["size"] > LFS_SIZE_THRESHOLD or is_lfs_file(item["path"], sample)
            )
            remote = commit.files.get(item["path"]) if commit else None
            oid = None
            if remote is not None:
                # The client compares this with sha256 (LFS) or the git blob oid (regular).
                oid = remote.sha256 if lfs else _git_blob_oid(remote.data)
            answer.append(
                {"path": item["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid}
            )
        self._json({"files": answer, "commitOid": commit.oid if commit else None})

    def _lfs_batch(self, repo_id: str) -> None:
        # git-lfs batch API: for each object either no "actions" (already stored -> the client
        # skips it) or an upload href (+ multipart part URLs when configured) and a verify href.
        with self.hub._lock:
            self._writable_repo(repo_id)
        payload = self._json_body()
        if payload.get("operation") != "upload":
            raise _HubError(400, "The fake hub only supports LFS uploads through the batch API")
        chunk = self.hub.lfs_multipart_chunk_size
        objects, transfer = [], "basic"
        for obj in payload.get("objects", []):
            oid, size = obj["oid"], int(obj["size"])
            entry: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if oid not in self.hub._lfs_objects:
                upload: dict[str, Any] = {"href": f"{self.hub.url}/_lfs/upload/{oid}/{size}"}
                if chunk and size > chunk and "multipart" in payload.get("transfers", []):
                    transfer = "multipart"
                    n_parts = -(-size // chunk)
                    upload["header"] = {"chunk_size": str(chunk)}
                    for i in range(1, n_parts + 1):
                        upload["header"][f"{i:05d}"] = f"{self.hub.url}/_lfs/part/{oid}/{i}"
                    upload["href"] = f"{self.hub.url}/_lfs/complete/{oid}/{size}"
                entry["actions"] = {
                    "upload": upload,
                    "verify": {"href": f"{self.hub.url}/{repo_id}.git/info/lfs/objects/verify", "header": {}},
                }
            objects.append(entry)
        self._json(
            {"transfer": transfer, "objects": objects, "hash_algo": "sha256"},
            headers={"Content-Type": "application/vnd.git-lfs+json"},
        )

    def _route_lfs_storage(self, parts: list[str]) -> None:
        # The "S3" side: presigned-style URLs, no auth needed (the client sends none).
        m = self.command
        if parts[:1] == ["upload"] and len(parts) == 3 and m == "PUT":
            oid, size = parts[1], int(parts[2])
            self._store_lfs_object(oid, size, self.body)
            return self._send(200, b"", {"ETag": f'"{hashlib.md5(self.body).hexdigest()}"'})
        if parts[:1] == ["part"] and len(parts) == 3 and m == "PUT":
            with self.hub._lock:
                self.hub._lfs_parts[(parts[1], int(parts[2]))] = self.body
            # The client needs each part's ETag for the completion call.
            return self._send(200, b"", {"ETag": f'"{hashlib.md5(self.body).hexdigest()}"'})
        if parts[:1] == ["complete"] and len(parts) == 3 and m == "POST":
            oid, size = parts[1], int(parts[2])
            payload = self._json_body()
            with self.hub._lock:
                try:
                    data = b"".join(
                        self.hub._lfs_parts.pop((oid, p["partNumber"]))
                        for p in sorted(payload["parts"], key=lambda p: p["partNumber"])
                    )
                except KeyError:
                    raise _HubError(400, "Missing uploaded part") from None
            self._store_lfs_object(oid, size, data)
            return self._json({})
        if parts[:1] == ["cdn"] and len(parts) == 2 and m in ("GET", "HEAD"):
            data = self.hub._lfs_objects.get(parts[1])
            if data is None:
                raise _HubError(404, "No such object")
            return self._send_content(data, {"ETag": f'"{parts[1]}"'})
        raise _HubError(404, f"fakehub: no LFS storage route for {m} /_lfs/{'/'.join(parts)}")

    def _store_lfs_object(self, oid: str, size: int, data: bytes) -> None:
        if hashlib.sha256(data).hexdigest() != oid or len(data) != size:
            raise _HubError(400, f"Uploaded content does not match oid {oid} / size {size}")
        with self.hub._lock:
            self.hub._lfs_objects[oid] = data

    def _lfs_verify(self) -> None:
        payload = self._json_body()
        data = self.hub._lfs_objects.get(payload.get("oid", ""))
        if data is None or len(data) != payload.get("size"):
            raise _HubError(404, "LFS object not found")
        self._json({"message": "Everything is fine"})

    def _create_commit(self, repo_id: str, revision: str) -> None:
        # NDJSON: a "header" line, then one line per operation (file = inline base64 content,
        # lfsFile = reference to an uploaded LFS object, deletedFile/deletedFolder).
        lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise _HubError(400, "Commit payload must start with a header line")
        header = lines[0]["value"]
        added: dict[str, StoredFile] = {}
        deleted_files, deleted_folders = [], []
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            if key == "file":
                data = (
                    base64.b64decode(value["content"])
                    if value.get("encoding") == "base64"
                    else value["content"].encode()
                )
                added[value["path"]] = StoredFile(data, False)
            elif key == "lfsFile":
                data = self.hub._lfs_objects.get(value["oid"])
                if data is None:
                    raise _HubError(
                        400,
                        f"Your push was rejected because an LFS pointer pointed to a file that "
                        f"does not exist ({value['path']})",
                    )
                added[value["path"]] = StoredFile(data, True)
            elif key == "deletedFile":
                deleted_files.append(value["path"])
            elif key == "deletedFolder":
                deleted_folders.append(value["path"])
            else:
                raise _HubError(400, f"Unknown commit operation {key!r}")

        with self.hub._lock:
            repo = self._writable_repo(repo_id)
            branch = revision
            if self._q_bool("create_pr"):
                base = self._commit_at(repo, revision)
                pr_num = 1 + sum(1 for b in repo.branches if b.startswith("refs/pr/"))
                branch = f"refs/pr/{pr_num}"
                repo.branches[branch] = base.oid
            elif branch not in repo.branches:
                raise _HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            parent = header.get("parentCommit")
            if parent and not repo.branches[branch].startswith(parent):
                raise _HubError(412, "A commit has happened since. Please refresh and try again.")
            current = repo.commits[repo.branches[branch]].files
            for path in deleted_files:
                if path not in current:
                    raise _HubError(404, "A file with this name doesn't exist", "EntryNotFound")
            oid = self.hub._add_commit(
                repo,
                branch,
                added,
                deleted_files,
                header.get("summary", ""),
                header.get("description", ""),
                deleted_folders,
            )
        answer = {
            "success": True,
            "commitOid": oid,
            "commitUrl": f"{self.hub.url}/{repo_id}/commit/{oid}",
            "hookOutput": "",
        }
        if branch.startswith("refs/pr/"):
            answer["pullRequestUrl"] = f"{self.hub.url}/{repo_id}/discussions/{branch.rsplit('/', 1)[-1]}"
        self._json(answer)


# --------------------------------------------------------------------------- helpers


def _header_safe(value: str) -> str:
    """HTTP header values must be latin-1: replace anything else (e.g. non-ASCII file names)."""
    return value.encode("latin-1", "replace").decode("latin-1")


def _safetensors_header(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


def _safetensors_summary(files: dict[str, StoredFile]) -> dict | None:
    """The `safetensors` field of model_info: parameter count per dtype over all shards."""
    params: dict[str, int] = {}
    found = False
    for path, f in files.items():
        if not path.endswith(".safetensors"):
            continue
        try:
            header = _safetensors_header(f.data)
        except (ValueError, struct.error):
            continue
        found = True
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for dim in tensor["shape"]:
                    count *= dim
                params[tensor["dtype"]] = params.get(tensor["dtype"], 0) + count
    return {"parameters": params, "total": sum(params.values())} if found else None


def _config_summary(config_file: StoredFile | None) -> dict | None:
    """The `config` field of model_info: the Hub echoes a few keys of config.json."""
    if config_file is None:
        return None
    try:
        config = json.loads(config_file.data)
    except ValueError:
        return None
    summary = {k: config[k] for k in ("architectures", "model_type") if k in config}
    if isinstance(config.get("quantization_config"), dict):
        summary["quantization_config"] = {k: v for k, v in config["quantization_config"].items() if k == "quant_method"}
    return summary


# --------------------------------------------------------------------------- pytest glue


def use_fake_hub(hub: FakeHub, monkeypatch: Any, hf_home: str | Path, *, block_network: bool = True) -> None:
    """Point huggingface_hub (already imported or not) at `hub`, with an isolated cache.

    huggingface_hub reads its settings into `huggingface_hub.constants` at import time, so the
    environment variables only help subprocesses and later imports; in-process we also patch
    the constants, the module-level HfApi instance and the list of trusted Hub origins.
    """
    import huggingface_hub
    import huggingface_hub.hf_api
    import huggingface_hub.utils._http as hf_http
    from huggingface_hub import constants

    hf_home = Path(hf_home)
    hub_cache = hf_home / "hub"
    hub_cache.mkdir(parents=True, exist_ok=True)

    # Environment: for subprocesses (e.g. running the CLI) and any code reading os.environ.
    for var in (
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_OIDC_RESOURCE",
        "HUGGINGFACE_CO_STAGING",
        "HF_HUB_ETAG_TIMEOUT",
        "HF_HUB_DOWNLOAD_TIMEOUT",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "TRANSFORMERS_CACHE",
        "HF_TOKEN_PATH",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_UPDATE_CHECK", "1")

    # In-process: the constants huggingface_hub computed at import time.
    patched = {
        "ENDPOINT": hub.url,
        "HUGGINGFACE_CO_URL_TEMPLATE": hub.url + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_URL_HOSTS": constants.HF_URL_HOSTS | {"127.0.0.1"},
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_UPDATE_CHECK": True,
        "HF_HUB_ETAG_TIMEOUT": constants.DEFAULT_ETAG_TIMEOUT,
        "HF_HUB_DOWNLOAD_TIMEOUT": constants.DEFAULT_DOWNLOAD_TIMEOUT,
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hub_cache),
        "HUGGINGFACE_HUB_CACHE": str(hub_cache),
        "HF_ASSETS_CACHE": str(hf_home / "assets"),
        "HF_XET_CACHE": str(hf_home / "xet"),
        "HF_TOKEN_PATH": str(hf_home / "token"),
        "HF_STORED_TOKENS_PATH": str(hf_home / "stored_tokens"),
        "AGENT_HARNESSES_PATH": str(hf_home / ".agent_harnesses.json"),
    }
    for name, value in patched.items():
        if hasattr(constants, name):
            monkeypatch.setattr(constants, name, value)
    # `huggingface_hub.model_info` & co. are bound methods of this instance, created at import.
    monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", hub.url)
    # Origins whose redirects keep the Authorization header (computed at import from ENDPOINT; releases
    # before that rule have no such set).
    if hasattr(hf_http, "_HUB_ORIGINS"):
        monkeypatch.setattr(hf_http, "_HUB_ORIGINS", hf_http._HUB_ORIGINS | {hf_http._url_origin(hub.url)})
    # The user-agent builder fetches an "agent harnesses" registry once per process: pin it empty.
    try:
        import huggingface_hub.utils._detect_agent as detect_agent

        monkeypatch.setattr(detect_agent, "_registry", {"standardEnvVars": [], "harnesses": {}})
    except (ImportError, AttributeError):
        pass
    # The shared httpx client may hold keep-alive connections to a previous fake hub.
    hf_http.close_session()

    if block_network:
        _block_non_loopback(monkeypatch)


_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _block_non_loopback(monkeypatch: Any) -> None:
    """Make any attempt to reach a non-loopback host fail loudly, so a test can't go online."""
    real_getaddrinfo = socket.getaddrinfo
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex

    def guarded_getaddrinfo(host, *args, **kwargs):
        if host is not None and str(host) not in _LOOPBACK:
            raise OSError(f"fakehub: network access to {host!r} is blocked in tests")
        return real_getaddrinfo(host, *args, **kwargs)

    def check(address):
        if isinstance(address, tuple) and str(address[0]) not in _LOOPBACK:
            raise OSError(f"fakehub: network access to {address!r} is blocked in tests")

    def guarded_connect(self, address):
        check(address)
        return real_connect(self, address)

    def guarded_connect_ex(self, address):
        check(address)
        return real_connect_ex(self, address)

    monkeypatch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket.socket, "connect_ex", guarded_connect_ex)


try:
    import pytest
except ImportError:  # pragma: no cover - the module is still usable without pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture
    def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
        """A running FakeHub that huggingface_hub (and transformers) talk to, with a private
        HF_HOME/cache under tmp_path, no token configured (pass `fake_hub.token` or set HF_TOKEN),
        Xet disabled and non-loopback network access blocked."""
        import huggingface_hub.utils._http as hf_http

        with FakeHub() as hub:
            use_fake_hub(hub, monkeypatch, tmp_path / "hf_home")
            try:
                yield hub
            finally:
                hf_http.close_session()
