"""Every request fp8convert makes to the Hugging Face Hub: timeouts, bounded retries, and the one line a
failure becomes. huggingface_hub's client has no timeout of its own (`model_info` waits forever on a server
that never answers), so every request of its shared client gets one, or keeps its own where shorter. The
environment variables that set them: docs/usage.md.
"""

from __future__ import annotations

import errno
import functools
import itertools
import time
import traceback

from huggingface_hub import constants  # cheap: the package loads its HTTP client only when used

from ..errors import FP8ConvertError
from ..options import env_number
from ..units import format_size

UPLOAD_READ_TIMEOUT_S = 300.0  # an upload's answer: a commit the Hub may take minutes to make
MAX_RETRY_WAIT_S = 8.0
RETRY_STATUS = (408, 429, 500, 502, 503, 504)
CHECK_AND_RERUN = "check the connection and rerun"
# huggingface_hub turns a failed metadata request into LocalEntryNotFoundError and an interrupted
# download into other types: the network error is found by walking the exception's causes.
NETWORK_ERRNOS = {
    getattr(errno, name)
    for name in "ECONNREFUSED ECONNRESET ECONNABORTED ETIMEDOUT EHOSTUNREACH ENETUNREACH ENETDOWN EPIPE".split()
}


@functools.cache
def install_timeouts() -> None:
    """Once per process (the first Hub call is the main thread's): wrap the client factory, a user's own
    included, so every request carries them."""
    from huggingface_hub.utils import _http

    base = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)

    def factory():
        client = base()
        client.event_hooks["request"].append(_bound_timeouts)
        return client

    _http.set_client_factory(factory)  # closes the current client: the next request makes one with the hook


def _bound_timeouts(request) -> None:
    """A request hook: connect and read timeouts, none longer than the limits."""
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
    retries = max(0, env_number("FP8CONVERT_HUB_RETRIES", 2, int))
    wait = max(0.0, env_number("FP8CONVERT_HUB_RETRY_WAIT", 1.0, float))
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


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


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
        errors.RemoteEntryNotFoundError: f"file not found on the Hub ({_first_line(error)})",
        errors.OfflineModeIsEnabled: "HF_HUB_OFFLINE is set, so the Hub cannot be reached; unset it to download",
    }
    if kind := next((k for k in known if isinstance(error, k)), None):
        return FP8ConvertError(f"{repo_id}: {known[kind]}")
    http = http_module()
    if any(isinstance(e, (http.TimeoutException, TimeoutError)) for e in causes(error)):
        return FP8ConvertError(
            f"{repo_id}: the Hub did not answer within {float(constants.HF_HUB_DOWNLOAD_TIMEOUT):g} s{_tries(error)} "
            f"({_first_line(error)}); {then} (HF_HUB_DOWNLOAD_TIMEOUT sets the wait)"
        )
    if is_network_error(error) or isinstance(error, errors.LocalEntryNotFoundError):
        cause = next((e for e in causes(error) if e is not error and is_network_error(e)), error)
        return FP8ConvertError(
            f"{repo_id}: cannot reach the Hub (network error{_tries(error)}: "
            f"{type(cause).__name__}: {_first_line(cause)}); {then}"
        )
    status = http_status(error)
    by_status = {
        401: "the Hub refused the credentials (401); check HF_TOKEN or --token, or run hf auth login",
        403: f"access denied (403); the token may lack write or read permission ({_first_line(error)})",
    }
    if status is not None:
        return FP8ConvertError(
            f"{repo_id}: {by_status.get(status) or f'Hub request failed{_tries(error)} ({_first_line(error)})'}"
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
            f"{where}: cannot write the download cache ({error.strerror or _first_line(error)}); "
            "fix it or point HF_HUB_CACHE (or --cache-dir) elsewhere"
        )
    return FP8ConvertError(f"{repo_id}: Hub operation failed ({type(error).__name__}: {_first_line(error)})")
