"""A store in an S3 bucket (AWS or any S3-compatible endpoint: MinIO, Ceph, moto), through boto3.

This is the only module of the project that imports boto3. ``S3Store.from_url("s3://bucket/prefix")``
takes the endpoint from $DSECFS_S3_ENDPOINT or $AWS_ENDPOINT_URL (an http:// or https:// URL), the
profile from $DSECFS_S3_PROFILE (else boto3's $AWS_PROFILE), the region from $DSECFS_S3_REGION or
$AWS_REGION, and everything else from boto3's standard chain (environment, shared config files, instance
roles). The CLI's --endpoint-url, --profile and --region set the DSECFS_S3_* variables, so that a daemon
it starts reads the same store. A custom endpoint is addressed
path-style (``http://host/bucket/key``), which S3-compatible servers expect.

Policies live elsewhere: botocore's own retries are turned off (``RetryStore`` retries, with one policy
for every backend), and callers bound concurrency with ``LimitStore``; ``concurrency`` here only sizes
the HTTP connection pool so that many threads do not queue for a socket.

What S3 says, and what we raise (see base.py for the contract):
- NoSuchKey, a 404 on HEAD -> NotFoundError. A HEAD on a missing bucket is also a bare 404, so the
  first 404 from HEAD checks the bucket once (HeadBucket) before calling the object missing;
- NoSuchBucket, AccessDenied/403, rejected or missing credentials -> UnavailableError(transient=False),
  with a message that names the bucket ("bucket X does not exist", "access denied to bucket X");
- 5xx, SlowDown and other throttling, connection errors, timeouts, a body cut short by the network ->
  UnavailableError(transient=True);
- a complete answer with fewer bytes than the range asked for, or an unsatisfiable range ->
  CorruptError (the object is shorter than the index that sent us there promised).
Messages carry the error code, HTTP status and s3:// location, never credentials or signatures. botocore
logs request headers (the session token, the signature) at DEBUG, so its logger is held at INFO or above
whatever level the program logs at (``dsecfs daemon --log-level debug``).

Threads: any thread may call any method at the same time. The boto3 client is thread-safe and shared;
the only other shared state is ``_bucket_seen``, a flag written once (a race merely repeats HeadBucket).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from typing import TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ChecksumError,
    ClientError,
    ConnectionError as BotoConnectionError,
    CredentialRetrievalError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)

from ..errors import CorruptError, DsecError, InputError, NotFoundError, UnavailableError
from .base import Store, check_key, check_range, too_large

T = TypeVar("T")

MiB = 1024 * 1024
ENDPOINT_ENVS = ("DSECFS_S3_ENDPOINT", "AWS_ENDPOINT_URL")
PROFILE_ENVS = ("DSECFS_S3_PROFILE",)  # boto3 reads AWS_PROFILE itself
REGION_ENVS = ("DSECFS_S3_REGION", "AWS_REGION")  # boto3 reads AWS_DEFAULT_REGION itself
DEFAULT_REGION = "us-east-1"
# S3 allows at most 10,000 parts per upload; larger objects get larger parts.
MAX_PARTS = 10_000
READ_PIECE = 4 * MiB  # the most a bounded read asks the HTTP body for at once (_read_at_most)

_botocore_log = logging.getLogger("botocore")  # see the module docstring: credentials stay out of logs
_botocore_log.setLevel(max(_botocore_log.level, logging.INFO))

_ENDPOINT = re.compile(r"https?://[^/\s?#]+(/\S*)?")
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_ACCESS_DENIED = {"AccessDenied", "403", "Forbidden", "AllAccessDisabled", "AccountProblem"}
_BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "TokenRefreshRequired",
    "InvalidSecurity",
}
_THROTTLED = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestThrottled",
    "RequestLimitExceeded",
    "TooManyRequests",
    "TooManyRequestsException",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
}


class S3Store(Store):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        concurrency: int = 16,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        multipart_threshold: int = 64 * MiB,
        part_size: int = 16 * MiB,
    ):
        """``part_size`` must be at least 5 MiB on real S3 (every part but the last); objects of
        ``multipart_threshold`` bytes or more are uploaded in parts, smaller ones with one PUT."""
        if not bucket:
            raise InputError("an S3 store needs a bucket name", where="s3://")
        if part_size <= 0 or multipart_threshold <= 0 or concurrency <= 0:
            raise InputError(
                f"part_size={part_size}, multipart_threshold={multipart_threshold} and "
                f"concurrency={concurrency} must be positive",
                where=f"s3://{bucket}",
            )
        if endpoint_url is not None and not _ENDPOINT.fullmatch(endpoint_url):
            raise InputError(f"the S3 endpoint must be an http:// or https:// URL, got {endpoint_url!r}",
                             where=f"s3://{bucket}")
        prefix = prefix.strip("/")
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.endpoint_url = endpoint_url
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self._bucket_seen = False
        try:
            session = boto3.session.Session(region_name=region, profile_name=profile)
        except BotoCoreError as exc:  # ProfileNotFound and friends
            raise InputError(f"{type(exc).__name__}: {exc}", where=f"s3://{bucket}") from None
        config = Config(
            max_pool_connections=concurrency,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            # One attempt: RetryStore owns the retry policy, the same for every backend.
            retries={"mode": "standard", "total_max_attempts": 1},
            # Path-style for custom endpoints: S3-compatible servers rarely have wildcard DNS.
            s3={"addressing_style": "path" if endpoint_url else "auto"},
            # Chunks are re-hashed with sha256 after every read; botocore's default CRC on every request
            # costs CPU and is refused by several S3-compatible servers.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._client = session.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=session.region_name or DEFAULT_REGION,
            config=config,
        )

    @classmethod
    def from_url(cls, url: str, **options) -> "S3Store":
        """``s3://bucket[/prefix]``; ``options`` are the constructor's keyword arguments."""
        if not url.startswith("s3://"):
            raise InputError(f"not an s3:// URL: {url!r}")
        bucket, _, prefix = url[len("s3://"):].partition("/")
        for option, envs in (("endpoint_url", ENDPOINT_ENVS), ("profile", PROFILE_ENVS), ("region", REGION_ENVS)):
            if option not in options:
                options[option] = next((os.environ[e] for e in envs if os.environ.get(e)), None)
        return cls(bucket, prefix, **options)

    def create_bucket_if_missing(self) -> bool:
        """Create the bucket unless it exists (in the client's region); whether it was created."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return False
        except ClientError as exc:
            if _status(exc) != 404:
                raise self._translate(exc, "") from None
        except BotoCoreError as exc:
            raise self._translate(exc, "") from None
        region = self._client.meta.region_name
        where = {} if region == DEFAULT_REGION else {"CreateBucketConfiguration": {"LocationConstraint": region}}
        self._call("", lambda: self._client.create_bucket(Bucket=self.bucket, **where))
        self._bucket_seen = True
        return True

    # -- the Store interface

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        check_range(key, offset, length)
        name = self._name(key)
        if length == 0:
            self._check_offset(key, offset, self._head(key)["ContentLength"])
            return b""
        params = {}
        if length is not None:
            params["Range"] = f"bytes={offset}-{offset + length - 1}"
        elif offset:
            params["Range"] = f"bytes={offset}-"

        def fetch() -> bytes:
            with contextlib.closing(self._client.get_object(Bucket=self.bucket, Key=name, **params)["Body"]) as body:
                # One byte past the range at most: an endpoint (a proxy) may ignore Range and send the
                # whole object, a pack of any size; more than asked for is refused below, never held.
                return body.read() if length is None else _read_at_most(body, length + 1)

        try:
            data = self._call(key, fetch)
        except CorruptError:
            # S3 answers 416 when the range starts at or past the end; reading from exactly the end
            # to "the end" is a valid empty answer, anything else is a range past the end.
            if length is None:
                self._check_offset(key, offset, self._head(key)["ContentLength"])
                return b""
            raise
        if length is not None and len(data) > length:
            raise CorruptError(f"the endpoint answered range [{offset}, {offset + length}) with more bytes "
                               "(it ignored the range)", where=self._where(key))
        if length is not None and len(data) != length:
            raise CorruptError(
                f"range [{offset}, {offset + length}) runs past the end ({offset + len(data)})",
                where=self._where(key),
            )
        return data

    def get_at_most(self, key: str, limit: int) -> bytes:
        name = self._name(key)

        def fetch() -> bytes:
            # A range one byte past the limit: S3 answers what there is, and its Content-Range the size.
            answer = self._client.get_object(Bucket=self.bucket, Key=name, Range=f"bytes=0-{limit}")
            with contextlib.closing(answer["Body"]) as body:
                # An endpoint may send neither (a chunked answer): then the bounded read below decides.
                size = answer.get("ContentRange", "").rpartition("/")[2]
                size = int(size) if size.isdigit() else answer.get("ContentLength")
                if size is not None and size > limit:
                    raise too_large(self._where(key), size, limit)
                return _read_at_most(body, limit + 1)

        try:
            data = self._call(key, fetch)
        except CorruptError:  # 416: an empty object has no byte 0
            if self._head(key)["ContentLength"]:
                raise
            return b""
        if len(data) > limit:
            raise too_large(self._where(key), f"more than {limit}", limit)
        return data

    def put(self, key: str, data: bytes | memoryview) -> None:
        name = self._name(key)
        view = memoryview(data).cast("B")
        if view.nbytes < self.multipart_threshold:
            body = data if isinstance(data, bytes) else view.tobytes()
            self._call(key, lambda: self._client.put_object(Bucket=self.bucket, Key=name, Body=body))
        else:
            self._put_multipart(key, name, view)

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
        except NotFoundError:
            return False
        return True

    def size(self, key: str) -> int:
        return self._head(key)["ContentLength"]

    def mtime(self, key: str) -> float:
        return self._head(key)["LastModified"].timestamp()

    def list(self, prefix: str) -> Iterator[str]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix
        )
        page_iter = iter(pages)
        while True:
            page = self._call(prefix, lambda: next(page_iter, None))
            if page is None:
                return
            for obj in page.get("Contents", ()):
                yield obj["Key"][len(self.prefix):]

    def delete(self, key: str) -> None:
        name = self._name(key)
        # S3 answers 204 for a missing key too, which is what the interface promises.
        self._call(key, lambda: self._client.delete_object(Bucket=self.bucket, Key=name))

    def close(self) -> None:
        self._client.close()

    # -- helpers

    def _put_multipart(self, key: str, name: str, view: memoryview) -> None:
        """Upload in parts; the object appears only at CompleteMultipartUpload, so readers never see a
        partial one. Parts go one after another: callers already put many objects in parallel."""
        part_size = max(self.part_size, math.ceil(view.nbytes / MAX_PARTS))
        upload_id = self._call(
            key, lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=name)["UploadId"]
        )
        try:
            parts = []
            for number, start in enumerate(range(0, view.nbytes, part_size), start=1):
                body = view[start:start + part_size].tobytes()
                etag = self._call(
                    key,
                    lambda: self._client.upload_part(
                        Bucket=self.bucket, Key=name, UploadId=upload_id, PartNumber=number, Body=body
                    )["ETag"],
                )
                parts.append({"PartNumber": number, "ETag": etag})
            self._call(
                key,
                lambda: self._client.complete_multipart_upload(
                    Bucket=self.bucket, Key=name, UploadId=upload_id, MultipartUpload={"Parts": parts}
                ),
            )
        except BaseException:
            # Best effort: an upload left behind costs storage until a bucket lifecycle rule expires it.
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)
            except (ClientError, BotoCoreError):
                pass
            raise

    def _head(self, key: str) -> dict:
        name = self._name(key)
        try:
            return self._call(key, lambda: self._client.head_object(Bucket=self.bucket, Key=name))
        except NotFoundError:
            self._require_bucket()
            raise

    def _require_bucket(self) -> None:
        """Tell a missing bucket from a missing object after a HEAD 404 (both are a bare 404)."""
        if self._bucket_seen:
            return
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if _status(exc) == 404:
                raise self._no_bucket() from None
            raise self._translate(exc, "") from None
        except BotoCoreError as exc:
            raise self._translate(exc, "") from None
        self._bucket_seen = True

    def _check_offset(self, key: str, offset: int, size: int) -> None:
        if offset > size:
            raise CorruptError(f"offset {offset} is past the end ({size})", where=self._where(key))

    def _call(self, key: str, fn: Callable[[], T]) -> T:
        """Run one boto3 request, turning whatever it raises into the errors of the Store contract."""
        try:
            return fn()
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(exc, key) from None

    def _translate(self, exc: Exception, key: str) -> DsecError:
        where = self._where(key)
        if isinstance(exc, ClientError):
            code = exc.response.get("Error", {}).get("Code", "")
            status = _status(exc)
            detail = f"({code or 'no code'}, HTTP {status})"
            if code in _NOT_FOUND:
                return NotFoundError("no such object", where=where)
            if code == "NoSuchBucket":
                return self._no_bucket()
            if code == "InvalidRange" or status == 416:
                return CorruptError(f"range past the end of the object {detail}", where=where)
            if code in _BAD_CREDENTIALS:
                return UnavailableError(f"credentials rejected by the endpoint {detail}", where=where, transient=False)
            if code in _ACCESS_DENIED:
                return UnavailableError(f"access denied to bucket {self.bucket} {detail}", where=where, transient=False)
            if code in _THROTTLED or status == 429 or status >= 500:
                return UnavailableError(f"S3 is unavailable or throttling {detail}", where=where, transient=True)
            message = exc.response.get("Error", {}).get("Message", "")
            return UnavailableError(f"S3 refused the request {detail}: {message}", where=where, transient=False)
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)):
            return UnavailableError(
                "no usable S3 credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or a role)",
                where=where,
                transient=False,
            )
        if isinstance(exc, (BotoConnectionError, HTTPClientError, IncompleteReadError, ChecksumError)):
            # The network failed us (refused, reset, timed out, body cut short): the next try may work.
            return UnavailableError(f"{type(exc).__name__}: {exc}", where=where, transient=True)
        return UnavailableError(f"{type(exc).__name__}: {exc}", where=where, transient=False)

    def _no_bucket(self) -> UnavailableError:
        endpoint = self.endpoint_url or "AWS"
        return UnavailableError(f"bucket {self.bucket} does not exist at {endpoint}", where=self.url, transient=False)

    def _name(self, key: str) -> str:
        # The same keys as the filesystem store accepts, so that a store can be copied between backends.
        check_key(key, self.url)
        return self.prefix + key

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"


def _read_at_most(body, count: int) -> bytes:
    """Up to ``count`` bytes of ``body``, read a piece at a time: one read of ``count`` would allocate all
    of it first on an answer of unknown length, and ``count`` may be a size a manifest gave (gigabytes)."""
    pieces, left = [], count
    while left > 0:
        piece = body.read(min(left, READ_PIECE))
        if not piece:
            break
        pieces.append(piece)
        left -= len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
