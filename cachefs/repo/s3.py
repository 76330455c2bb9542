"""One linked bucket through boto3, run in worker threads from trio.

boto3 does the signing, the standard AWS credential chain (environment,
shared credentials file, profile) and its retry policy with back-off for
throttling (``standard`` mode: 503 SlowDown is retried); this module only
bounds how many calls run at once and turns botocore's errors into
:class:`~cachefs.errors.CacheFSError`\\ s that name the link, so an operator
reading a log line knows which association is misconfigured. Reading an
object version that is no longer there (deleted, or changed: the GET is
conditioned on the ETag) is ESTALE (:class:`~cachefs.errors.Stale`) naming
the key: an open file of it reads what the cache tier holds, and no more.

Ranged GETs of imported blocks (the cache node's miss path, one per block of
every cold file) go through obstore (Rust, object_store) instead: per GET it
costs about 0.4 ms of this process's CPU against 2.4-3.1 ms for boto3's
``get_object`` (micro-benchmark against SeaweedFS on loopback, 200 GETs of
110 KiB, 1 and 8 threads), and it holds no GIL while it waits. At a cold
epoch of small files a cache node's CPU is what bounds its fills under
load, so this is most of its work per fill. Credentials still come from
boto3's standard chain (obstore's ``Boto3CredentialProvider`` over a boto3
session), and obstore retries 5xx answers (503 SlowDown included) with
exponential back-off up to the same ``attempts``. ``CACHEFS_S3_RANGED=boto3``
in a daemon's environment (or obstore missing) makes them boto3's again.

boto3 is imported and the client made in the first call's worker thread,
not in the constructor: on a daemon's trio loop that took about 4.5 s
(mostly imports) at load ~20, during which a metanode leader sent no Raft
heartbeat and answered no request.
"""

from __future__ import annotations

import email.utils
import functools
import importlib.util
import os
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any, NamedTuple, TypeVar

import trio
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from cachefs.errors import CacheFSError, NotFound, PermissionDenied, Stale, Unavailable

from .hedge import Latencies, hedged

T = TypeVar("T")

# Ranged GETs through obstore, unless the environment asks for boto3's
# get_object (CACHEFS_S3_RANGED=boto3: a store obstore cannot talk to, or a
# comparison) or obstore is not installed.
_OBSTORE = os.environ.get("CACHEFS_S3_RANGED", "obstore") != "boto3" and importlib.util.find_spec("obstore") is not None

_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden"}
_THROTTLED = {"SlowDown", "503", "Throttling", "ThrottlingException", "RequestLimitExceeded"}


class ObjectInfo(NamedTuple):
    key: str
    size: int
    mtime_ns: int
    etag: str


class S3Store:
    """The calls cachefs makes on one bucket; ``name`` says which link in errors."""

    def __init__(self, bucket: str, *, name: str, endpoint: str = "", region: str = "",
                 max_calls: int = 16, timeout: float = 30.0, attempts: int = 4) -> None:  # fmt: skip
        self.bucket = bucket
        self.name = name
        self._options = (endpoint, region, max_calls, timeout, attempts)
        self._made: Any = None  # the boto3 client, once a worker thread has made it
        self._ranged: Any = None  # the obstore store of ranged GETs, likewise
        self._making = threading.Lock()
        self._limiter = trio.CapacityLimiter(max_calls)
        self.latencies = Latencies()  # of ranged GETs: when to hedge one (see hedge.py)
        self.hedges = 0

    def _client(self) -> Any:
        """The boto3 client, made by the first caller (a worker thread) and shared."""
        with self._making:
            if self._made is None:
                self._made = _make_client(*self._options)
            return self._made

    def _ranged_store(self) -> Any:
        """The obstore store of ranged GETs, made by the first caller (a worker thread)."""
        with self._making:
            if self._ranged is None:
                self._ranged = _make_ranged(self.bucket, self.name, *self._options)
            return self._ranged

    def _ranged_error(self, what: str, exc: Exception) -> CacheFSError:
        """An obstore error as :meth:`_error` words boto3's (the same classes, naming the link)."""
        from obstore.exceptions import (
            NotFoundError,
            PermissionDeniedError,
            PreconditionError,
            UnauthenticatedError,
        )

        if isinstance(exc, CacheFSError):
            return exc
        text = str(exc)
        code = _xml_field(text, "Code")
        message = _xml_field(text, "Message")
        head = f"{self.name}: {what}: {code} {message}".rstrip() if code else f"{self.name}: {what}"
        if code == "NoSuchBucket":
            return NotFound(f"{self.name}: bucket {self.bucket!r} does not exist")
        if isinstance(exc, PreconditionError) or code == "PreconditionFailed":
            return Stale(f"{head}: the object changed since it was imported; run cachefs repo sync")
        if isinstance(exc, NotFoundError | FileNotFoundError) or code == "NoSuchKey":
            return Stale(f"{head}: the object was deleted from the bucket since it was imported (an open "
                         "file reads only what the cache holds of it); run cachefs repo sync")  # fmt: skip
        if isinstance(exc, PermissionDeniedError | UnauthenticatedError | PermissionError) or code in _DENIED:
            return PermissionDenied(f"{head} (check the AWS credentials of this machine)")
        if code in _THROTTLED or "503 Service Unavailable" in text:
            return Unavailable(f"{head} (throttled: still slowed down after retries)")
        return Unavailable(f"{self.name}: {what} failed: {text.splitlines()[0] if text else type(exc).__name__}")

    def _hedge(self) -> None:
        self.hedges += 1

    async def _call(self, what: str, fn: str | Callable[[Any], T], /, **kwargs: Any) -> Any:
        """``fn(client)``, or the client's method named ``fn`` with ``kwargs``, in a worker thread."""

        def run() -> Any:
            client = self._client()
            return getattr(client, fn)(**kwargs) if isinstance(fn, str) else fn(client)

        try:
            return await trio.to_thread.run_sync(run, limiter=self._limiter, abandon_on_cancel=True)
        except ClientError as exc:
            raise self._error(what, exc) from None
        except NoCredentialsError:
            raise PermissionDenied(
                f"{self.name}: no AWS credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "a shared credentials file or AWS_PROFILE)"
            ) from None
        except BotoCoreError as exc:  # endpoint unreachable, timeouts, retries exhausted
            raise Unavailable(f"{self.name}: {what} failed: {exc}") from None

    def _error(self, what: str, exc: ClientError) -> CacheFSError:
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        text = f"{self.name}: {what}: {code or status} {err.get('Message', '')}".rstrip()
        if code == "NoSuchBucket":
            return NotFound(f"{self.name}: bucket {self.bucket!r} does not exist")
        if code in _DENIED or status == 403:
            return PermissionDenied(f"{text} (check the AWS credentials of this machine)")
        if code in _THROTTLED or status == 503:
            return Unavailable(f"{text} (throttled: still slowed down after retries)")
        if what.startswith("reading") and (code in ("NoSuchKey", "404") or status == 404):
            return Stale(f"{text}: the object was deleted from the bucket since it was imported (an open "
                         "file reads only what the cache holds of it); run cachefs repo sync")  # fmt: skip
        if code in ("NoSuchKey", "404") or status == 404:
            return NotFound(text)
        if code == "PreconditionFailed" or status == 412:
            return Stale(f"{text}: the object changed since it was imported; run cachefs repo sync")
        return Unavailable(text)

    async def check(self) -> None:
        """Raise the link's error if the bucket cannot be listed (what ``link`` checks first)."""
        await self._call("listing", "list_objects_v2", Bucket=self.bucket, MaxKeys=1)

    async def list_page(
        self, prefix: str, start_after: str = "", token: str = "", limit: int = 1000, delimiter: str = ""
    ) -> tuple[list[ObjectInfo], list[str], str]:
        """One page of the listing under ``prefix`` (keys in order), its common
        prefixes (with a ``delimiter``) and the continuation token ("" at the end)."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": limit}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        if token:
            kwargs["ContinuationToken"] = token
        elif start_after:
            kwargs["StartAfter"] = start_after
        page = await self._call("listing", "list_objects_v2", **kwargs)
        objects = [
            ObjectInfo(o["Key"], int(o["Size"]), _ns(o["LastModified"]), o.get("ETag", ""))
            for o in page.get("Contents", ())
        ]
        prefixes = [p["Prefix"] for p in page.get("CommonPrefixes", ())]
        token = page.get("NextContinuationToken", "") if page.get("IsTruncated") else ""
        return objects, prefixes, token

    async def head(self, key: str, *, what: str = "") -> ObjectInfo | None:
        """The object ``key`` as a listing shows it; None if there is none."""
        found = await self.head_meta(key, what=what)
        return found and found[0]

    async def head_meta(self, key: str, *, what: str = "") -> tuple[ObjectInfo, dict[str, str]] | None:
        """The object ``key`` and its user metadata (one HEAD); None if there is none."""
        try:
            reply = await self._call(what or f"looking up {key!r}", "head_object", Bucket=self.bucket,
                                     Key=key)  # fmt: skip
        except NotFound:
            return None
        info = ObjectInfo(key, int(reply["ContentLength"]), _ns(reply["LastModified"]), reply.get("ETag", ""))
        return info, dict(reply.get("Metadata", {}))

    async def get_range(self, key: str, start: int, end: int, etag: str) -> bytes:
        """Bytes ``[start, end)`` of ``key``, only if it still has ``etag``; a GET
        slower than the recent 95th percentile is sent again (hedged)."""
        if end <= start:
            return b""
        what = f"reading {key!r}"
        if not _OBSTORE:
            return await self._get_range_boto3(key, start, end, etag)
        options: dict[str, Any] = {"range": (start, end)}
        if etag:
            options["if_match"] = etag

        def get() -> bytes:
            import obstore

            return bytes(obstore.get(self._ranged_store(), key, options=options).bytes())  # type: ignore[arg-type]

        async def call() -> bytes:
            try:
                return await trio.to_thread.run_sync(get, limiter=self._limiter, abandon_on_cancel=True)
            except Exception as exc:
                raise self._ranged_error(what, exc) from None

        data = await hedged(call, self.latencies, self._hedge)
        if len(data) != end - start:
            raise Unavailable(f"{self.name}: {key!r} [{start}, {end}) came back {len(data)} bytes")
        return data

    async def _get_range_boto3(self, key: str, start: int, end: int, etag: str) -> bytes:
        """:meth:`get_range` through boto3's ``get_object`` (``CACHEFS_S3_RANGED=boto3``)."""

        def get(client: Any) -> bytes:
            ranged = {"IfMatch": etag} if etag else {}
            reply = client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}", **ranged)
            with reply["Body"] as body:
                return body.read()

        data = await hedged(lambda: self._call(f"reading {key!r}", get), self.latencies, self._hedge)
        if len(data) != end - start:
            raise Unavailable(f"{self.name}: {key!r} [{start}, {end}) came back {len(data)} bytes")
        return data

    async def put(self, key: str, data: bytes, *, what: str = "", metadata: dict[str, str] | None = None) -> str:
        """Store ``data`` as ``key`` in one PUT (with user ``metadata``); returns
        the object's ETag once the store has acknowledged it."""
        reply = await self._call(what or f"exporting {key!r}", "put_object", Bucket=self.bucket,
                                 Key=key, Body=data, Metadata=metadata or {})  # fmt: skip
        return str(reply.get("ETag", ""))

    async def get(self, key: str, start: int = 0, end: int = -1, *, what: str = "") -> tuple[bytes, dict[str, str]]:
        """Bytes ``[start, end)`` of ``key`` (``end`` -1: to its end) and its user
        metadata, unconditioned (for objects that are never rewritten); hedged
        as :meth:`get_range`. A missing key is NotFound."""

        def get(client: Any) -> tuple[bytes, dict[str, str]]:
            ranged = {} if start == 0 and end < 0 else {"Range": f"bytes={start}-{'' if end < 0 else end - 1}"}
            reply = client.get_object(Bucket=self.bucket, Key=key, **ranged)
            with reply["Body"] as body:
                return body.read(), dict(reply.get("Metadata", {}))

        return await hedged(lambda: self._call(what or f"getting {key!r}", get), self.latencies, self._hedge)

    async def start_upload(self, key: str) -> str:
        """Begin a multipart upload of ``key``; returns its upload id."""
        reply = await self._call(f"exporting {key!r}", "create_multipart_upload",
                                 Bucket=self.bucket, Key=key)  # fmt: skip
        return str(reply["UploadId"])

    async def put_part(self, key: str, upload: str, number: int, data: bytes) -> str:
        """Part ``number`` (from 1) of upload ``upload``; returns its ETag."""
        reply = await self._call(f"exporting {key!r} (part {number})", "upload_part", Bucket=self.bucket,
                                 Key=key, UploadId=upload, PartNumber=number, Body=data)  # fmt: skip
        return str(reply["ETag"])

    async def finish_upload(self, key: str, upload: str, etags: list[str]) -> str:
        parts = [{"PartNumber": i, "ETag": etag} for i, etag in enumerate(etags, 1)]
        reply = await self._call(f"exporting {key!r}", "complete_multipart_upload", Bucket=self.bucket,
                                 Key=key, UploadId=upload, MultipartUpload={"Parts": parts})  # fmt: skip
        return str(reply.get("ETag", ""))

    async def abort_upload(self, key: str, upload: str) -> None:
        await self._call(f"aborting the upload of {key!r}", "abort_multipart_upload",
                         Bucket=self.bucket, Key=key, UploadId=upload)  # fmt: skip

    async def delete(self, key: str) -> None:
        """Delete ``key`` (deleting a key that is not there succeeds, as S3 says)."""
        await self._call(f"deleting {key!r}", "delete_object", Bucket=self.bucket, Key=key)


def _make_client(endpoint: str, region: str, max_calls: int, timeout: float, attempts: int) -> Any:
    """A boto3 S3 client (seconds of imports the first time: call it off the trio loop)."""
    import boto3
    import botocore.session
    from botocore.config import Config

    config = Config(
        retries={"mode": "standard", "max_attempts": attempts},
        max_pool_connections=max_calls,
        connect_timeout=min(5.0, timeout),
        read_timeout=timeout,
    )
    # One session per store: boto3's default one is not thread-safe. Timestamps
    # stay the strings S3 sent (:func:`_ns` reads them): botocore's parser
    # (dateutil) was ~80% of a listing's CPU, about 0.1 s per 1,000 keys.
    core = botocore.session.get_session()
    core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=str)
    session = boto3.session.Session(botocore_session=core)
    return session.client("s3", endpoint_url=endpoint or None, region_name=region or None, config=config)


def _make_ranged(bucket: str, name: str, endpoint: str, region: str, max_calls: int, timeout: float,
                 attempts: int) -> Any:  # fmt: skip
    """The obstore store of ranged GETs, its credentials from boto3's standard chain."""
    from datetime import timedelta

    import boto3
    from obstore.auth.boto3 import Boto3CredentialProvider
    from obstore.store import S3Store as ObjectStore

    session = boto3.session.Session(region_name=region or None)
    if session.get_credentials() is None:
        raise PermissionDenied(
            f"{name}: no AWS credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "a shared credentials file or AWS_PROFILE)"
        )
    client_options: dict[str, Any] = {
        "timeout": timedelta(seconds=timeout),
        "connect_timeout": timedelta(seconds=min(5.0, timeout)),
        "allow_http": endpoint.startswith("http://"),
    }
    config: dict[str, Any] = {"region": region or session.region_name or "us-east-1"}
    if endpoint:
        config["endpoint"] = endpoint
    return ObjectStore(
        bucket, config=config, client_options=client_options,  # type: ignore[arg-type]
        retry_config={"max_retries": max(0, attempts - 1), "retry_timeout": timedelta(seconds=timeout)},
        credential_provider=Boto3CredentialProvider(session),
    )  # fmt: skip


def _xml_field(text: str, field: str) -> str:
    """``<field>...</field>`` of an S3 error body quoted in an obstore error ("" if none)."""
    start = text.find(f"<{field}>")
    end = text.find(f"</{field}>", start)
    return text[start + len(field) + 2 : end] if start >= 0 and end > start else ""


def _ns(when: datetime | str) -> int:
    """Nanoseconds since the epoch (to the microsecond) of a listing's ISO 8601
    time or a header's RFC 1123 one."""
    if isinstance(when, str):
        return _parse_ns(when)
    return int(when.timestamp() * 1_000_000) * 1000


@functools.lru_cache(maxsize=4096)
def _parse_ns(text: str) -> int:
    """Cached: the objects of a bulk upload share their few seconds (in a
    profile of a 100,000-key import, parsing the same times again was a
    tenth of the CLI's CPU)."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        when = email.utils.parsedate_to_datetime(text)
    return int(when.timestamp() * 1_000_000) * 1000
