"""S3 target (s3fs): parallel multipart uploads, bounded retries, a throttling-aware request
window, and the write-once manifest commit.

What it adds to the generic fsspec target:

* each data file is uploaded by multipart, its parts cut from the staged buffer (each part
  is copied to bytes only in the thread that sends it, never the whole file) and sent by a
  pool of ``S3Options.concurrency`` threads, a sliding window over the parts of every file of
  the step; the part size grows so that no file needs more than 10,000 parts; botocore's
  connection pool is sized to the concurrency;
* every request is retried with exponential backoff and full jitter on throttling
  (SlowDown, 503, 429), other 5xx, timeouts and dropped connections, bounded in attempts and
  in time; s3fs's and botocore's own retries are turned off (unless the caller set them), so
  this is the one retry policy (what each error means: :mod:`.s3_retry`);
* the requests in flight to the root are bounded by an :class:`~.throttle.AdaptiveWindow`:
  throttled answers shrink it (multiplicatively), successes grow it back (additively);
* the object-store primitives of the commit (:mod:`.objects`) are single S3 requests: an
  uncached paginated LIST, conditional PUTs (``If-None-Match: *``, and ``If-Match`` on an
  ETag for the lease), conditional DELETEs (``If-Match``), batched deletes, and the listing
  and abort of incomplete multipart uploads under this root's step prefixes only, never the
  bucket's. A failed step aborts its multipart uploads (no parts left behind). Whether the
  endpoint honours ``If-Match`` is asked once per target (:attr:`S3Target.conditional`);
  where it does not, the commit falls back to reads before writes (docs/SECURITY.md).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import re
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import wait
from typing import Any, TypeVar

import fsspec.asyn
import numpy as np

from .._threads import DaemonPool
from ..errors import CheckpointCorruptError, CkptError, StorageError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.manifest import read_manifest_bytes
from ..format.naming import ROOT_ID_NAME, is_lease_name, is_our_file, step_name
from ..options import S3Options
from .commit.manifest_last import ManifestLastCommit
from .fsspec import FsspecTarget, _FsspecStepWriter
from .objects import ConditionFailed, ObjectInfo
from .s3_retry import (
    RetryingFS,
    has_code,
    http_status,
    is_retryable,
    is_throttle,
    precondition_failed,
    s3_storage_options,
)
from .throttle import AdaptiveWindow, ReadTuner

__all__ = ["S3Target", "is_retryable", "is_throttle", "s3_storage_options"]

log = logging.getLogger("ckptmgr")
T = TypeVar("T")
MAX_PARTS = 10_000
class _S3StepWriter(_FsspecStepWriter):
    target: S3Target

    def __init__(self, target: S3Target, commit: ManifestLastCommit) -> None:
        super().__init__(target, commit)
        self._uploads: dict[str, str] = {}  # key -> upload id, while open
        self._mu = threading.Lock()  # guards _uploads

    def write_files(self, files: list[tuple[str, np.ndarray[Any, Any]]], chunk_size: int, *,
                    checksum: bool = True) -> list[tuple[str, ...]]:
        t = self.target

        def crcs(d: np.ndarray[Any, Any]) -> tuple[str, ...]:
            return tuple(crc32c_hex(d[b:e]) for b, e in chunk_ranges(d.size, chunk_size))

        crc_futures = [t.io_pool.submit(crcs, data) for _, data in files] if checksum else []
        tasks: list[Callable[[], None]] = []
        multipart: list[tuple[str, str, str, int, list[dict[str, Any]]]] = []
        for plain, data in files:
            name = self.strategy.object_name(plain)  # this claim's own key: never another writer's
            key = t.key(self.step, name)
            part = t.part_size(data.size)
            if data.size <= part:
                def put(key: str = key, name: str = name, data: np.ndarray[Any, Any] = data) -> None:
                    r = t.call("put_object", Key=key, Body=data.tobytes())
                    self.strategy.wrote(name, data.size, r.get("ETag"))
                tasks.append(put)
                continue
            upload_id = t.call("create_multipart_upload", Key=key)["UploadId"]
            with self._mu:
                self._uploads[key] = upload_id
            etags: list[dict[str, Any]] = []
            multipart.append((key, name, upload_id, data.size, etags))
            for i, b in enumerate(range(0, data.size, part)):
                def send(key: str = key, uid: str = upload_id, n: int = i + 1,
                         piece: np.ndarray[Any, Any] = data[b:b + part], etags: list[dict[str, Any]] = etags) -> None:
                    # One part at a time is copied to bytes, in the sending thread: a file-like body
                    # made aiohttp read it in 64 KiB hops through an executor (measured 1.6x
                    # slower than bytes); host memory in flight stays concurrency x part_size.
                    r = t.call("upload_part", Key=key, UploadId=uid, PartNumber=n, Body=piece.tobytes())
                    etags.append({"PartNumber": n, "ETag": r["ETag"]})
                tasks.append(send)
        futures = [t.upload_pool.submit(task) for task in tasks]  # the sliding window
        wait(futures)
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        if failed is not None:
            raise failed
        for key, name, upload_id, size, etags in multipart:
            r = t.call("complete_multipart_upload", Key=key, UploadId=upload_id,
                       MultipartUpload={"Parts": sorted(etags, key=lambda p: p["PartNumber"])})
            with self._mu:
                self._uploads.pop(key, None)
            self.strategy.wrote(name, size, r.get("ETag"))
        return [f.result() for f in crc_futures] if checksum else [() for _ in files]

    def abort(self) -> None:
        with self._mu:
            uploads = dict(self._uploads)
            self._uploads.clear()
        for key, upload_id in uploads.items():
            with contextlib.suppress(Exception):
                self.target.call("abort_multipart_upload", Key=key, UploadId=upload_id)
        super().abort()


class S3Target(FsspecTarget):
    """A checkpoint root under ``s3://bucket/prefix``."""

    def __init__(self, fs: Any, path: str, *, url: str, io_threads: int, opts: S3Options,
                 read_only: bool = False) -> None:
        self.opts = opts
        self.raw_fs = fs
        fs.retries = 1  # s3fs's own retry loop off: one policy, bounded by S3Options
        self.retries = 0  # retried requests, for telemetry and tests (counted from the first request)
        self.window = AdaptiveWindow(opts.concurrency, adaptive=opts.adaptive_concurrency)
        self.bucket, _, self.prefix = path.rstrip("/").partition("/")
        super().__init__(RetryingFS(fs, self), path, url=url, io_threads=io_threads, read_only=read_only)
        self.upload_pool = DaemonPool(opts.concurrency, thread_name_prefix="ckptmgr-s3")
        self._cond_mu = threading.Lock()  # guards _conditional
        self._conditional: bool | None = None  # whether the endpoint honours If-Match (asked once)

    @property
    def conditional(self) -> bool:
        """Whether the endpoint honours ``If-Match`` on PUT and DELETE (asked once, on first
        use, on a fresh name of ours, ``.ckptmgr-root-id.tmp-<hex>``, removed afterwards): a PUT
        with an ``If-Match`` no object can have must fail (412, or 404 as the name is free),
        and so must a DELETE of the then written object with it (412). A store that writes or
        deletes instead ignores the condition; one that answers 501 or 400 has none."""
        with self._cond_mu:
            if self._conditional is None:
                self._conditional = self._probe()
            return self._conditional

    def _probe(self) -> bool:
        rel = f"{ROOT_ID_NAME}.tmp-{secrets.token_hex(8)}"  # a name of ours that no one else uses
        never = '"00000000000000000000000000000000"'  # an ETag no object has
        key = self._key(rel)
        try:
            try:
                self.call("put_object", Key=key, Body=b"", IfMatch=never)
                ignored = "PUT"
            except OSError as exc:
                if not (isinstance(exc, FileNotFoundError) or precondition_failed(exc)
                        or http_status(exc) in (404, 412)):
                    raise
                self.call("put_object", Key=key, Body=b"")
                try:
                    self.call("delete_object", Key=key, IfMatch=never)
                    ignored = "DELETE"
                except OSError as exc:
                    if not (precondition_failed(exc) or http_status(exc) == 412):
                        raise
                    return True
        except OSError as exc:
            if http_status(exc) not in (400, 501):
                raise
            log.warning("%s does not support conditional writes (If-Match): claims on steps are checked by reading "
                        "before writing (see docs/SECURITY.md)", self.url)
            return False
        finally:
            with contextlib.suppress(OSError):
                self.remove([rel])
        log.warning("%s ignores conditional writes (If-Match on %s): claims on steps are checked by reading before "
                    "writing (see docs/SECURITY.md)", self.url, ignored)
        return False

    def _make_root(self) -> None:
        try:
            self.call("head_bucket")
            return
        except FileNotFoundError:
            pass
        except Exception as exc:
            if http_status(exc) != 404:
                raise StorageError(f"cannot use checkpoint root {self.url!r}: {type(exc).__name__}: {exc}") from exc
        try:  # a missing bucket is created for a writing manager (never for a reading one)
            self.raw_fs.mkdir(self.bucket)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StorageError(f"cannot create the bucket of {self.url!r}: {exc}") from exc

    def key(self, step: int, name: str) -> str:
        rel = f"{step_name(step)}/{name}"
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def part_size(self, size: int) -> int:
        """The configured part size, grown to keep a file under 10,000 parts."""
        return max(self.opts.part_size, math.ceil(size / MAX_PARTS))

    def retry(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` inside the request window, retrying retryable failures with exponential
        backoff and full jitter; throttled answers also shrink the window."""
        o = self.opts
        deadline = time.monotonic() + o.retry_deadline_s
        for attempt in range(1, o.max_attempts + 1):
            ticket = self.window.acquire(deadline)
            try:
                result = fn()
            except Exception as exc:
                self.window.release(ticket, ok=False, throttled=is_throttle(exc))
                delay = random.uniform(0, min(o.max_delay_s, o.base_delay_s * 2 ** (attempt - 1)))
                if attempt == o.max_attempts or not is_retryable(exc) or time.monotonic() + delay > deadline:
                    if isinstance(exc, (OSError, CkptError)):
                        raise
                    # the client's own types (botocore, aiohttp): a storage error naming the root
                    raise StorageError(f"{self.url}: {what} failed: {type(exc).__name__}: {exc}") from exc
                self.retries += 1
                log.info("s3: %s failed (%s: %s); retry %d in %.2f s", what, type(exc).__name__, exc, attempt, delay)
                time.sleep(delay)
                continue
            self.window.release(ticket, ok=True)
            return result
        raise AssertionError("unreachable")

    def call(self, method: str, **kw: Any) -> Any:
        """One S3 request under the retry policy. Bodies are bytes, so a retry resends them whole."""
        return self.retry(lambda: self.raw_fs.call_s3(method, Bucket=self.bucket, **kw),
                          f"{method} {kw.get('Key', '')}")

    # ------------------------------------------------------ the object store

    def listing(self, prefix: str) -> dict[str, ObjectInfo]:
        base = f"{self.prefix}/" if self.prefix else ""
        out: dict[str, ObjectInfo] = {}
        token: dict[str, Any] = {}
        while True:
            try:
                r = self.call("list_objects_v2", Prefix=base + prefix, **token)
            except FileNotFoundError:  # no such bucket
                return out
            for o in r.get("Contents", []):
                when = o.get("LastModified")
                out[o["Key"][len(base):]] = ObjectInfo(int(o.get("Size", 0)), o.get("ETag"),
                                                       when.timestamp() if when is not None else None)
            if not r.get("IsTruncated"):
                return out
            token = {"ContinuationToken": r["NextContinuationToken"]}

    def _read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """One GET of ``key`` (bytes ``[start, end)`` when given): s3fs's ``cat_file`` asks for
        the size first, and on a missing key LISTs to see whether it is a directory."""
        fs = self.raw_fs
        extra = {"Range": f"bytes={start or 0}-{end - 1}"} if end is not None else {}

        async def get() -> bytes:
            resp = await fs._call_s3("get_object", Bucket=self.bucket, Key=key, **extra)
            try:
                data: bytes = await resp["Body"].read()
            finally:
                resp["Body"].close()
            return data

        data: bytes = self.retry(lambda: fsspec.asyn.sync(fs.loop, get), f"get_object {key}")
        return data

    def get(self, rel: str) -> bytes:
        return self._read(self._key(rel))

    def get_manifest(self, rel: str) -> bytes:
        """One GET, refused by its Content-Length before the body is read; at most the limit
        + 1 bytes of the body are read (:func:`~ckptmgr.format.manifest.read_manifest_bytes`)."""
        fs, key = self.raw_fs, self._key(rel)

        async def read_at_most(body: Any, n: int) -> bytes:
            parts: list[bytes] = []
            while n > 0 and (part := await body.read(n)):
                parts.append(part)
                n -= len(part)
            return b"".join(parts)

        async def close(body: Any) -> None:
            body.close()

        def fetch() -> bytes:
            resp = fsspec.asyn.sync(fs.loop, fs._call_s3, "get_object", Bucket=self.bucket, Key=key)
            try:
                return read_manifest_bytes(resp.get("ContentLength"),
                                           lambda n: fsspec.asyn.sync(fs.loop, read_at_most, resp["Body"], n),
                                           f"{self.url}/{rel}")
            finally:
                fsspec.asyn.sync(fs.loop, close, resp["Body"])

        return self.retry(fetch, f"get_object {key}")

    def exists(self, rel: str) -> bool:
        try:
            self.call("head_object", Key=self._key(rel))
        except FileNotFoundError:
            return False
        return True

    def put(self, rel: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str | None:
        cond = {"IfNoneMatch": "*"} if if_absent else {"IfMatch": f'"{if_match}"'} if if_match else {}
        try:
            r = self.call("put_object", Key=self._key(rel), Body=data, **cond)
        except OSError as exc:
            if if_match and (isinstance(exc, FileNotFoundError) or precondition_failed(exc)
                             or http_status(exc) in (404, 412)):
                raise ConditionFailed(f"{self.url}/{rel} is not the object of ETag {if_match}") from None
            if if_absent and precondition_failed(exc):
                raise FileExistsError(f"{self.url}/{rel} exists") from None
            if not (if_absent and http_status(exc) == 501):
                raise
            # A store without conditional writes: check, then write (a race a store with
            # them closes; see docs/SECURITY.md).
            if self.exists(rel):
                raise FileExistsError(f"{self.url}/{rel} exists") from None
            r = self.call("put_object", Key=self._key(rel), Body=data)
        etag = r.get("ETag")
        return str(etag) if etag else None

    def remove(self, rels: list[str]) -> None:
        keys = [self._key(rel) for rel in rels]
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            r = self.call("delete_objects", Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            errors = [e for e in r.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                e = errors[0]
                err = PermissionError if e.get("Code") == "AccessDenied" else OSError
                raise err(f"cannot delete s3://{self.bucket}/{e.get('Key')}: {e.get('Code')}: {e.get('Message')}")

    def remove_if(self, rel: str, etag: str) -> bool:
        try:
            self.call("delete_object", Key=self._key(rel), IfMatch=f'"{etag}"')
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) or precondition_failed(exc) or http_status(exc) in (404, 412):
                return False
            raise
        return True

    def uploads(self, prefix: str) -> list[tuple[str, str]]:
        base = f"{self.prefix}/" if self.prefix else ""
        out: list[tuple[str, str]] = []
        marker: dict[str, Any] = {}
        while True:
            try:
                r = self.call("list_multipart_uploads", Prefix=base + prefix, **marker)
            except FileNotFoundError:
                return out
            out += [(u["Key"][len(base):], u["UploadId"]) for u in r.get("Uploads", [])]
            if not r.get("IsTruncated"):
                return out
            marker = {"KeyMarker": r["NextKeyMarker"], "UploadIdMarker": r["NextUploadIdMarker"]}

    def abort_upload(self, rel: str, upload_id: str) -> None:
        self.call("abort_multipart_upload", Key=self._key(rel), UploadId=upload_id)

    # ----------------------------------------------------------- the target

    def begin(self, step: int, prefix: str = "") -> _S3StepWriter:
        return _S3StepWriter(self, self._strategy(step, prefix))

    def read_tuner(self) -> ReadTuner:
        """A fresh tuner for one ranged read of this root (see
        :class:`~ckptmgr.restore.transports.ranged.RangedTransport`), inside the request
        window the writer uses too."""
        return ReadTuner(self.window)

    def _stat_size(self, step: int, name: str) -> int:
        r = self.call("head_object", Key=self.key(step, name))
        return int(r["ContentLength"])

    def read_into(self, step: int, name: str, offset: int, out: list[np.ndarray[Any, Any]]) -> None:
        size = sum(a.size for a in out)
        if size == 0:
            return
        try:
            raw = self._read(self.key(step, name), offset, offset + size)
        except OSError as exc:
            if http_status(exc) != 416 and not has_code(exc, "InvalidRange"):
                raise
            raw = b""  # the object ends before ``offset``
        data = np.frombuffer(raw, dtype=np.uint8)
        if data.size != size:
            raise CheckpointCorruptError(f"{self.url}/{step_name(step)}/{name} ended early, at byte "
                                         f"{offset + data.size}")
        pos = 0
        for a in out:
            a[:] = data[pos:pos + a.size]
            pos += a.size

    def delete(self, step: int) -> None:
        super().delete(step)
        d = step_name(step)
        if any(is_lease_name(k.rpartition("/")[2]) for k in self.listing(d + "/")):
            return  # a writer is saving this step again: the uploads are its own
        for rel, upload_id in self.uploads(d + "/"):  # of a writer that died before this step was saved again
            if is_our_file(rel.partition("/")[2]):
                with contextlib.suppress(FileNotFoundError):
                    self.abort_upload(rel, upload_id)

    def close(self) -> None:
        self.upload_pool.shutdown(wait=True)
        super().close()


def check_bucket_name(path: str, url: str) -> None:
    bucket = path.partition("/")[0]
    if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
        raise StorageError(f"{url!r}: {bucket!r} is not a valid S3 bucket name")
