"""The bucket: the few S3 requests push and read-back make, through boto3, with errors by cause.

boto3 (AWS's own client, with botocore under it) signs requests, finds
credentials along the standard AWS chain (environment, shared config and
credential files, container and instance roles: botocore's
``credentials.py``) and retries transient failures.  This module adds what
push needs on top: files streamed in parts of ``part_bytes`` (one part in
memory per upload at a time), a conditional PUT (``If-None-Match: *``,
S3's conditional writes; a server that answers 501 to it is asked again
without, and :attr:`Bucket.conditional` turns false), one bandwidth limit for
all uploads, and every failure mapped to one :data:`CAUSES` word.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import boto3
import botocore.config
import botocore.exceptions

from buildidd.errors import PushError

__all__ = ["CAUSES", "FATAL_CAUSES", "BucketOptions", "Bucket", "Body", "Exists", "RateLimit"]

CAUSES = ("unreachable", "timeout", "credentials", "denied", "full", "throttled", "server", "client", "source",
          "config")
"""Why a request failed (PushError.cause)."""

FATAL_CAUSES = frozenset({"unreachable", "timeout", "credentials", "denied", "full", "throttled", "server",
                          "config"})
"""Causes that end a pass (the next request would fail alike); the others concern one object."""

_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                     "AuthorizationHeaderMalformed"}
_FULL_CODES = {"InsufficientStorage", "QuotaExceeded", "EntityTooLarge", "ServiceQuotaExceeded"}
_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests"}


CONNECT_TIMEOUT_MAX_S = 10.0
"""A connection not made within this long (or push_timeout_s when shorter) fails the attempt: a bucket that
does not complete a TCP handshake in 10 s is down, whatever the read timeout that large parts need."""


class Exists(Exception):
    """A conditional PUT found the key taken (412 Precondition Failed).

    Attributes:
        sent_bytes: body bytes sent by the refused request (they crossed the wire all the same).
    """

    def __init__(self, key: str, sent_bytes: int = 0):
        super().__init__(key)
        self.sent_bytes = sent_bytes


class RateLimit:
    """One byte budget for every upload thread: rate_bytes_per_s on average, bursts of one second's worth.

    ``acquire(n)`` sleeps (holding the lock, so waiters queue in turn) until n bytes may go; 0: no limit.
    """

    def __init__(self, rate_bytes_per_s: int):
        self.rate = rate_bytes_per_s
        self._tokens = float(rate_bytes_per_s)
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate, self._tokens + (now - self._t) * self.rate) - nbytes
            self._t = now
            if self._tokens < 0:
                time.sleep(-self._tokens / self.rate)


@dataclass(frozen=True)
class BucketOptions:
    """How to reach the bucket (from Config's push_* keys).

    Attributes:
        bucket: the bucket's name.
        endpoint_url: the S3 endpoint; "" for AWS's.
        region: the signing region; "" for the AWS chain's (else us-east-1).
        timeout_s: read timeout of each attempt of a request (and its connect timeout, up to
            CONNECT_TIMEOUT_MAX_S), seconds.
        part_bytes: parts of a multipart upload, bytes; files larger than this go in parts.
        rate_bytes_per_s: upload bandwidth for all uploads together (0: none).
        concurrency: connections kept (one per upload thread).
        attempts: tries of each request (botocore's standard retries).
    """

    bucket: str
    endpoint_url: str = ""
    region: str = ""
    timeout_s: float = 60.0
    part_bytes: int = 16 << 20
    rate_bytes_per_s: int = 0
    concurrency: int = 4
    attempts: int = 3

    @classmethod
    def from_config(cls, cfg) -> BucketOptions:
        """The options Config cfg gives. Raises PushError (``config``) when push_bucket is empty."""
        if not cfg.push_bucket:
            raise PushError("config", "no bucket: set push_bucket in the configuration (or --bucket)")
        return cls(cfg.push_bucket, cfg.push_endpoint_url, cfg.push_region, cfg.push_timeout_s,
                   cfg.push_part_bytes, cfg.push_rate_bytes_per_s, cfg.push_concurrency)


def cause_of(e: Exception) -> str:
    """The :data:`CAUSES` word for an exception boto3 raised (or an OSError reading a local file)."""
    if isinstance(e, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError,
                      botocore.exceptions.CredentialRetrievalError)):
        return "credentials"
    if isinstance(e, (botocore.exceptions.ConnectTimeoutError, botocore.exceptions.ReadTimeoutError)):
        return "timeout"
    if isinstance(e, (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectionClosedError,
                      botocore.exceptions.ConnectionError)):
        return "unreachable"
    if isinstance(e, botocore.exceptions.ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in _CREDENTIAL_CODES:
            return "credentials"
        if code in _FULL_CODES or status == 507:
            return "full"
        if code in _THROTTLE_CODES or status in (429, 503):
            return "throttled"
        if code == "AccessDenied" or status == 403:
            return "denied"
        return "server" if status >= 500 else "client"
    if isinstance(e, OSError):
        return "source"
    return "client"


def _error(e: Exception, what: str) -> PushError:
    return PushError(cause_of(e), f"{what}: {type(e).__name__}: {e}")


def _status(e: botocore.exceptions.ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


class Bucket:
    """One S3 bucket: head, put (streamed, conditional), copy, list, get.

    Attributes:
        name: the bucket's name.
        conditional: the server honours ``If-None-Match: *`` on PUT (until it answers 501 to it).
        sent_bytes: body bytes uploaded since construction (parts and whole objects, those a conditional PUT
            refused included; copies send none).
    """

    def __init__(self, opts: BucketOptions):
        cfg = botocore.config.Config(
            # both bounded: a bucket that accepts connections and never answers (a server stopping, a
            # listen backlog nobody accepts from) fails each attempt within connect + read timeout
            connect_timeout=min(opts.timeout_s, CONNECT_TIMEOUT_MAX_S), read_timeout=opts.timeout_s, tcp_keepalive=True,
            retries={"mode": "standard", "total_max_attempts": opts.attempts},
            max_pool_connections=max(10, opts.concurrency * 2),
            s3={"addressing_style": "path"},
            # CRC trailers (aws-chunked bodies) only where an operation requires them: S3-compatible
            # servers differ in what they accept, and S3 checks Content-MD5-less bodies by their signature.
            request_checksum_calculation="when_required", response_checksum_validation="when_required")
        session = boto3.session.Session()
        region = opts.region or session.region_name or "us-east-1"
        self._s3 = session.client("s3", endpoint_url=opts.endpoint_url or None, region_name=region, config=cfg)
        self.name = opts.bucket
        self.opts = opts
        self.conditional = True
        self.sent_bytes = 0
        self._sent_lock = threading.Lock()
        self._rate = RateLimit(opts.rate_bytes_per_s)
        self.journal = None
        """Optional: an object with ``begin_upload(key, upload_id)`` and ``end_upload(upload_id)`` told of each
        multipart upload (the ledger), so that one a failure left unfinished is aborted later."""

    def _sent(self, n: int) -> None:
        with self._sent_lock:
            self.sent_bytes += n

    def head(self, key: str) -> dict | None:
        """The object's user metadata (plus ``content-length``), or None when there is no such key.

        Raises:
            PushError: the request failed (cause_of).
        """
        try:
            r = self._s3.head_object(Bucket=self.name, Key=key)
        except botocore.exceptions.ClientError as e:
            if _status(e) == 404 or e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            if _status(e) == 403:
                raise PushError(self._refusal(key), f"HEAD {key}: {e}") from e
            raise _error(e, f"HEAD {key}") from e
        except (botocore.exceptions.BotoCoreError, OSError) as e:
            raise _error(e, f"HEAD {key}") from e
        return {**{k.lower(): v for k, v in r.get("Metadata", {}).items()}, "content-length": r.get("ContentLength")}

    def _refusal(self, key: str) -> str:
        """Why a HEAD was refused (403): an answer to HEAD has no body to name its error code, so one byte of
        the key is asked for with GET, whose error answer does (``InvalidAccessKeyId``: ``credentials``,
        ``AccessDenied``: ``denied``).  The cause word; ``denied`` when the GET does not say otherwise."""
        try:
            self._s3.get_object(Bucket=self.name, Key=key, Range="bytes=0-0")["Body"].close()
        except botocore.exceptions.ClientError as e:
            cause = cause_of(e)
            return cause if cause in ("credentials", "denied", "full", "throttled", "server") else "denied"
        except (botocore.exceptions.BotoCoreError, OSError) as e:
            return cause_of(e)
        return "denied"

    def put_bytes(self, key: str, data: bytes, metadata: dict | None = None, *, if_absent: bool = False) -> None:
        """PUT a small object from memory (a manifest, a marker).

        Raises:
            Exists: if_absent and the key is taken.
            PushError: the request failed.
        """
        self._rate.acquire(len(data))
        try:
            self._put(key, data, metadata or {}, if_absent)
        except Exists as e:
            self._sent(len(data))        # the body went (a lost race still costs its bytes)
            e.sent_bytes = len(data)
            raise
        self._sent(len(data))

    def _put(self, key: str, body: bytes, metadata: dict, if_absent: bool) -> None:
        kw = {"IfNoneMatch": "*"} if if_absent and self.conditional else {}
        try:
            self._s3.put_object(Bucket=self.name, Key=key, Body=body, Metadata=metadata, **kw)
        except botocore.exceptions.ClientError as e:
            if _status(e) == 412:
                raise Exists(key) from e
            if kw and _status(e) == 501:
                self.conditional = False      # the server does not do conditional writes: HEAD-first only
                return self._put(key, body, metadata, if_absent)
            raise _error(e, f"PUT {key}") from e
        except (botocore.exceptions.BotoCoreError, OSError) as e:
            raise _error(e, f"PUT {key}") from e

    def put_file(self, path: str | os.PathLike, key: str, metadata: dict, *, if_absent: bool = True) -> int:
        """Upload a local file to key, in parts of ``part_bytes`` when larger (at most one part in memory).

        Args:
            path: the file (read with positioned reads; a store file never changes once published).
            key: the object's key.
            metadata: user metadata (ASCII).
            if_absent: ``If-None-Match: *`` (on the single PUT, or on completing the multipart upload).

        Returns:
            Bytes sent.

        Raises:
            Exists: if_absent and the key is taken (nothing was written; its sent_bytes say what was sent).
            PushError: a request failed, or the file could not be read (``source``); an unfinished
                multipart upload is aborted.
        """
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:
            raise PushError("source", f"{path}: {e.strerror}") from e
        try:
            size = os.fstat(fd).st_size
            if size <= self.opts.part_bytes:
                data = _read(fd, 0, size, path)
                self.put_bytes(key, data, metadata, if_absent=if_absent)
                return size
            return self._multipart(fd, size, key, metadata, if_absent)
        finally:
            os.close(fd)

    def _multipart(self, fd: int, size: int, key: str, metadata: dict, if_absent: bool) -> int:
        try:
            upload = self._s3.create_multipart_upload(Bucket=self.name, Key=key, Metadata=metadata)["UploadId"]
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise _error(e, f"multipart {key}") from e
        if self.journal is not None:
            self.journal.begin_upload(key, upload)
        try:
            parts = []
            for number, offset in enumerate(range(0, size, self.opts.part_bytes), start=1):
                data = _read(fd, offset, min(self.opts.part_bytes, size - offset), key)
                self._rate.acquire(len(data))
                r = self._s3.upload_part(Bucket=self.name, Key=key, UploadId=upload, PartNumber=number, Body=data)
                self._sent(len(data))
                parts.append({"PartNumber": number, "ETag": r["ETag"]})
                del data
            kw = {"IfNoneMatch": "*"} if if_absent and self.conditional else {}
            self._s3.complete_multipart_upload(Bucket=self.name, Key=key, UploadId=upload,
                                               MultipartUpload={"Parts": parts}, **kw)
            if self.journal is not None:
                self.journal.end_upload(upload)
            return size
        except botocore.exceptions.ClientError as e:
            self._abort(key, upload)
            if _status(e) == 412:
                raise Exists(key, size) from e
            raise _error(e, f"multipart {key}") from e
        except (botocore.exceptions.BotoCoreError, OSError, PushError) as e:
            self._abort(key, upload)
            raise e if isinstance(e, PushError) else _error(e, f"multipart {key}") from e

    def _abort(self, key: str, upload: str) -> bool:
        """Abort a multipart upload (its parts are freed); False when the bucket could not be told (the
        journal keeps it, and :meth:`abort` is tried again later)."""
        try:
            self.abort(key, upload)
            return True
        except PushError:
            return False

    def abort(self, key: str, upload: str) -> None:
        """Abort a multipart upload; one the bucket no longer knows counts as aborted.

        Raises:
            PushError: the request failed.
        """
        try:
            self._s3.abort_multipart_upload(Bucket=self.name, Key=key, UploadId=upload)
        except botocore.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") != "NoSuchUpload" and _status(e) != 404:
                raise _error(e, f"abort {key}") from e
        except botocore.exceptions.BotoCoreError as e:
            raise _error(e, f"abort {key}") from e
        if self.journal is not None:
            self.journal.end_upload(upload)

    def delete(self, key: str) -> None:
        """Delete an object (one that is absent counts as deleted).

        Raises:
            PushError: the request failed.
        """
        try:
            self._s3.delete_object(Bucket=self.name, Key=key)
        except botocore.exceptions.ClientError as e:
            if _status(e) != 404:
                raise _error(e, f"DELETE {key}") from e
        except (botocore.exceptions.BotoCoreError, OSError) as e:
            raise _error(e, f"DELETE {key}") from e

    def copy(self, source_key: str, key: str, metadata: dict) -> None:
        """Server-side copy (no bytes uploaded), with new metadata.

        Raises:
            PushError: the request failed.
        """
        try:
            self._s3.copy_object(Bucket=self.name, Key=key, CopySource={"Bucket": self.name, "Key": source_key},
                                 Metadata=metadata, MetadataDirective="REPLACE")
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise _error(e, f"COPY {source_key} -> {key}") from e

    def list(self, prefix: str, *, delimiter: str = "", max_keys: int = 100_000) -> Iterator[tuple[str, int]]:
        """(key, size) of the objects under prefix, or (common prefix, -1) with a delimiter; at most max_keys.

        Raises:
            PushError: the request failed.
        """
        kw = {"Delimiter": delimiter} if delimiter else {}
        seen = 0
        try:
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix, **kw):
                for p in page.get("CommonPrefixes", []):
                    yield p["Prefix"], -1
                for o in page.get("Contents", []):
                    yield o["Key"], int(o["Size"])
                seen += page.get("KeyCount", 0)
                if seen >= max_keys:
                    return
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise _error(e, f"LIST {prefix}") from e

    def get_to(self, key: str, out, max_bytes: int) -> int:
        """Copy an object's body into the binary file out, at most max_bytes; returns bytes written.

        Raises:
            PushError: the request failed, or the object is larger than max_bytes (``client``).
        """
        try:
            r = self._s3.get_object(Bucket=self.name, Key=key)
            if int(r.get("ContentLength", 0)) > max_bytes:
                r["Body"].close()
                raise PushError("client", f"GET {key}: {r['ContentLength']} bytes, over the limit of {max_bytes}")
            done = 0
            for chunk in r["Body"].iter_chunks(1 << 20):
                done += len(chunk)
                if done > max_bytes:
                    raise PushError("client", f"GET {key}: more than {max_bytes} bytes")
                out.write(chunk)
            return done
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise _error(e, f"GET {key}") from e

    def open(self, key: str, size_bytes: int) -> "Body":
        """An object's body as a stream (:class:`Body`), refused unless it is exactly size_bytes long.

        Raises:
            PushError: the request failed, or the object's length differs (``client``).
        """
        try:
            r = self._s3.get_object(Bucket=self.name, Key=key)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise _error(e, f"GET {key}") from e
        if int(r.get("ContentLength", -1)) != size_bytes:
            r["Body"].close()
            raise PushError("client", f"GET {key}: {r.get('ContentLength')} bytes, expected {size_bytes}")
        return Body(r["Body"], key)


class Body:
    """An object's body being read: ``read(n)`` (at most n bytes; errors as PushError), a context manager."""

    def __init__(self, stream, key: str):
        self._stream, self.key = stream, key

    def read(self, n: int) -> bytes:
        try:
            return self._stream.read(n)
        except (botocore.exceptions.BotoCoreError, OSError) as e:
            raise _error(e, f"GET {self.key}") from e

    def __enter__(self) -> "Body":
        return self

    def __exit__(self, *exc) -> None:
        self._stream.close()


def _read(fd: int, offset: int, size: int, what) -> bytes:
    """Exactly size bytes of fd from offset. Raises PushError (``source``) when the file is shorter."""
    chunks, done = [], 0
    while done < size:
        chunk = os.pread(fd, min(size - done, 8 << 20), offset + done)
        if not chunk:
            raise PushError("source", f"{what}: shorter than expected ({offset + done} of {offset + size} bytes)")
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)
