"""Which S3 requests are retried, and by whom: one retry policy,
:meth:`S3Target.retry <ckptmgr.storage.s3.S3Target.retry>`.

* What an error means, read from the client's exception chain (botocore's ``response``
  dict, aiohttp's and s3fs's exception types): throttling (the store asks to slow down),
  worth another try (5xx, timeouts, dropped connections), a conditional write refused (412).
  The target retries and sizes its request window by these answers.
* :func:`s3_storage_options`: s3fs's and botocore's own retries off (unless the caller set
  them), and a connection pool as large as the upload window.
* :class:`RetryingFS`: the s3fs filesystem with every call under the target's policy, so the
  generic fsspec code paths (reads, sizes) retry too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ..options import S3Options

__all__ = ["RetryingFS", "has_code", "http_status", "is_retryable", "is_throttle", "precondition_failed",
           "s3_storage_options"]

T = TypeVar("T")

_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
                   "ServiceUnavailable", "503"}
_RETRY_CODES = _THROTTLE_CODES | {"RequestTimeout", "RequestTimeTooSkewed", "InternalError", "500", "502", "504"}
_RETRY_NAMES = {"ServerDisconnectedError", "ClientConnectorError", "ClientOSError", "ClientPayloadError",
                "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
                "IncompleteRead", "ResponseParserError", "ServerTimeoutError", "TimeoutError", "FSTimeoutError"}


def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(cur)
        cur = cur.__cause__
    return out


def _code_and_status(e: BaseException) -> tuple[str, int]:
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return "", 0
    return (str(response.get("Error", {}).get("Code", "")),
            int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0))


def is_throttle(exc: BaseException) -> bool:
    """The store asked to slow down (SlowDown, 503, 429, ...)."""
    for e in _chain(exc):
        code, status = _code_and_status(e)
        if code in _THROTTLE_CODES or status in (503, 429):
            return True
        if "SlowDown" in str(e) or "reduce your request rate" in str(e):
            return True
    return False


def is_retryable(exc: BaseException) -> bool:
    """Throttling, 5xx, timeouts and dropped connections: worth another try."""
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError)):
        return False
    if is_throttle(exc):
        return True
    for e in _chain(exc):
        code, status = _code_and_status(e)
        if code in _RETRY_CODES or status >= 500:
            return True
        if type(e).__name__ in _RETRY_NAMES or isinstance(e, (ConnectionError, TimeoutError)):
            return True
    return False


def precondition_failed(exc: BaseException) -> bool:
    """A conditional write found the key taken (412; s3fs maps it to FileExistsError only
    when the answer names the condition, which not every server does)."""
    if isinstance(exc, FileExistsError):
        return True
    return any(_code_and_status(e)[0] == "PreconditionFailed" or _code_and_status(e)[1] == 412 for e in _chain(exc))


def http_status(exc: BaseException) -> int:
    for e in _chain(exc):
        status = _code_and_status(e)[1]
        if status:
            return status
    return 0


def has_code(exc: BaseException, code: str) -> bool:
    """An exception of the chain is the store's answer with error code ``code``."""
    return any(_code_and_status(e)[0] == code for e in _chain(exc))


def s3_storage_options(storage_options: dict[str, Any] | None, opts: S3Options) -> dict[str, Any]:
    """The caller's storage options, plus a connection pool as large as the upload window and
    s3fs/botocore retries off (this target retries), unless the caller set those."""
    so = dict(storage_options or {})
    config = dict(so.get("config_kwargs") or {})
    config.setdefault("max_pool_connections", max(10, opts.concurrency + 4))
    config.setdefault("retries", {"max_attempts": 0, "mode": "standard"})  # retries beyond the first: none
    so["config_kwargs"] = config
    return so


class _Retries(Protocol):
    def retry(self, fn: Callable[[], T], what: str) -> T: ...


class RetryingFS:
    """The s3fs filesystem with every method call going through the target's retry policy,
    so the generic fsspec code paths (reads, sizes) retry too."""

    def __init__(self, fs: Any, target: _Retries) -> None:
        self._fs = fs
        self._target = target

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if not callable(attr) or name == "invalidate_cache":
            return attr

        def call(*args: Any, **kw: Any) -> Any:
            return self._target.retry(lambda: attr(*args, **kw), f"{name} {args[0] if args else ''}")

        return call
