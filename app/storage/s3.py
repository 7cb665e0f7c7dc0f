"""Blocks as objects in an S3-compatible bucket (MinIO, Ceph RGW, AWS S3), through aioboto3.

Each block version is its own object, ``<key>.v<stamp>`` (see VERSION_SEP); configs and part data keep plain names.
A PUT at or under ``multipart_threshold_bytes`` is buffered, verified (size, checksum) and sent as one PutObject; a
larger one streams as a multipart upload whose parts go up while the body arrives, is verified before
CompleteMultipartUpload and aborted on any error, so nothing wrong is ever published: S3 makes an object visible
atomically when PutObject or CompleteMultipartUpload succeeds. The checksum token travels in the object's metadata
(``x-amz-meta-checksum``; a sha256 also as ``x-amz-meta-sha256``, as earlier releases wrote it).

A CRC64NVME version goes up as S3's own full-object checksum, ``x-amz-checksum-crc64nvme``, so a store that checks
it (AWS S3, SeaweedFS) refuses a body that changed on the way (BadDigest: a DigestMismatch here, nothing stored), and
its PutObject is signed with ``UNSIGNED-PAYLOAD`` (app/storage/s3_signing.py): no sha256 of the body is computed for
the signature. A store that ignores the header (moto) stores the bytes the gateway has checked itself.

Every botocore/aiohttp failure becomes BackendUnavailable (503); only a missing key is a miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any, ClassVar

import aioboto3
from aiobotocore.config import AioConfig
from botocore.exceptions import ClientError

from app.config import S3Backend
from app.errors import BackendUnavailable, BlockNotFound, DigestMismatch, InvalidRequest
from app.storage.base import BlockStore, BodyChecker, ClosingReader, ObjectInfo, Staged, Version, coalesce
from app.storage.checksums import algorithm_of
from app.storage.s3_errors import FOREIGN, NO_BUCKET_CODES, code_of, is_missing, translate
from app.storage.s3_signing import CHECKSUM_META, DIGEST_META, sign_with_known_digest
from contract.wire import CRC64NVME, DEFAULT_ALGORITHM, SHA256, parse_checksum_token

log = logging.getLogger("kvgate.storage.s3")

VERSION_SEP = ".v"
"""A block version's object is ``<key>.v<stamp>``: every PUT writes a new object, and the index row says which
one is current, so two writers (on one gateway or several) never write the same object, and a reader that
opened a version reads that version to the end."""
_VERSIONED = re.compile(r"(.+\.bin)\.v([0-9a-f]{32})")


def split_version(name: str) -> tuple[str, str | None]:
    """``<key>.v<32 hex>`` -> (key, stamp); any other name -> (name, None)."""
    m = _VERSIONED.fullmatch(name)
    return (m[1], m[2]) if m else (name, None)


class S3Reader(ClosingReader):
    """An opened object. A version's object is opened by a whole-object GetObject whose body the first
    ``chunks(0, ...)`` reads: one store round trip per GET. Any other ``chunks`` call is one ranged GetObject, pinned
    to the ETag seen at open (an unversioned name, opened by HEAD, can be overwritten; a version's name cannot)."""

    __slots__ = ("_body", "_etag", "_key", "_store", "size")

    def __init__(self, store: S3Store, name: str, *, size: int, etag: str | None, body: Any = None) -> None:
        self._store = store
        self._key = name
        self._etag = etag
        self._body = body
        self.size = size

    async def chunks(self, *, start: int, end: int) -> AsyncIterator[bytes]:
        body, self._body = self._body, None
        if start >= end:
            if body is not None:
                body.close()
            return
        if body is not None and start == 0:
            async for chunk in self._store.stream(body, name=self._key, size=end):
                yield chunk
            return
        if body is not None:
            body.close()  # a range that does not start at 0: the whole-object body is dropped unread
        async for chunk in self._store.read_range(self._key, start=start, end=end, etag=self._etag):
            yield chunk

    async def aclose(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            body.close()


class S3Store(BlockStore):
    versioned: ClassVar[bool] = True
    """Each block version is its own object (Versions retires a replaced one after the swap)."""

    def __init__(self, *, cfg: S3Backend, chunk_bytes: int = 4 * 1024 * 1024, list_page_size: int = 1000) -> None:
        self.cfg = cfg
        self._page_size = list_page_size
        self.bucket = cfg.bucket
        prefix = cfg.prefix.strip("/")
        self.prefix = f"{prefix}/" if prefix else ""
        self._chunk = chunk_bytes
        self._threshold = cfg.multipart_threshold_bytes
        self._part = cfg.part_bytes
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Any = None

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.cfg
        config = AioConfig(
            max_pool_connections=cfg.max_pool_connections,
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.read_timeout_s,
            retries={"max_attempts": cfg.max_attempts, "mode": "standard"},
            s3={"addressing_style": cfg.addressing_style},
            # S3-compatible stores (older MinIO, Ceph RGW) reject botocore's default CRC trailers.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        secret = cfg.secret_access_key.get_secret_value() if cfg.secret_access_key else None
        stack = contextlib.AsyncExitStack()
        try:
            self._client = await stack.enter_async_context(
                aioboto3.Session().client(
                    "s3",
                    endpoint_url=cfg.endpoint_url,
                    region_name=cfg.region,
                    aws_access_key_id=cfg.access_key_id,
                    aws_secret_access_key=secret,
                    config=config,
                )
            )
            sign_with_known_digest(self._client)  # PutObject signs with the digest already computed
            self._stack = stack
            await self._ensure_bucket()
        except BaseException:
            self._stack = None
            self._client = None
            await stack.aclose()
            raise

    async def _ensure_bucket(self) -> None:
        try:
            await self._client.head_bucket(Bucket=self.bucket)
            return
        except ClientError as exc:
            if code_of(exc) not in NO_BUCKET_CODES or not self.cfg.create_bucket:
                raise translate(exc, f"head bucket {self.bucket!r}") from exc
        except FOREIGN as exc:
            raise translate(exc, f"head bucket {self.bucket!r}") from exc
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if self.cfg.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.cfg.region}
        try:
            await self._client.create_bucket(**kwargs)
            log.info("created bucket %s", self.bucket)
        except ClientError as exc:
            if code_of(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):  # another replica won
                raise translate(exc, f"create bucket {self.bucket!r}") from exc
        except FOREIGN as exc:
            raise translate(exc, f"create bucket {self.bucket!r}") from exc

    async def close(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    @property
    def client(self) -> Any:
        if self._client is None:
            raise BackendUnavailable("s3 store is not started")
        return self._client

    async def check(self) -> None:
        try:
            await self.client.head_bucket(Bucket=self.bucket)
        except FOREIGN as exc:
            raise translate(exc, "check") from exc

    def object_key(self, key: str) -> str:
        if not key or key.startswith("/") or "\0" in key:
            raise InvalidRequest(f"unsafe key {key[:120]!r}")
        return self.prefix + key

    # -- writes ----------------------------------------------------------------------------------------------

    def version_name(self, key: str, stamp: str | None) -> str:
        """The object holding version ``stamp`` of block ``key`` (None: the unversioned object, e.g. imported)."""
        return self.object_key(key) if stamp is None else f"{self.object_key(key)}{VERSION_SEP}{stamp}"

    async def put(
        self, key: str, body: AsyncIterable[bytes], *, size: int, expected_digest: str | None = None
    ) -> Version:
        checker = BodyChecker(size=size, expected_digest=expected_digest)
        return await self._write(self.object_key(key), body, checker)

    async def stage(
        self,
        key: str,
        body: AsyncIterable[bytes],
        *,
        size: int,
        expected_digest: str | None = None,
        algorithm: str | None = None,
        stamp: str | None = None,
    ) -> Staged:
        """Write the version under its own object name: visible to no reader until an index row names it."""
        stamp = stamp or self.new_stamp()
        name = self.version_name(key, stamp)
        checker = BodyChecker(size=size, expected_digest=expected_digest, algorithm=algorithm)
        meta = await self._write(name, body, checker)
        return Staged(key=key, meta=meta, stamp=stamp, handle=name)

    def new_stamp(self) -> str:
        return uuid.uuid4().hex

    async def publish(self, staged: Staged) -> None:
        return None  # the committed row names the version's object: nothing to move

    async def discard(self, staged: Staged) -> None:
        await self._delete_name(str(staged.handle))

    async def remove(self, key: str, *, stamp: str | None) -> bool:
        await self._delete_name(self.version_name(key, stamp))
        return True

    async def _delete_name(self, name: str) -> None:
        try:
            await self.client.delete_object(Bucket=self.bucket, Key=name)
        except FOREIGN as exc:
            if not is_missing(exc):
                raise translate(exc, "delete") from exc

    async def _write(self, name: str, body: AsyncIterable[bytes], checker: BodyChecker) -> Version:
        size = checker.size
        if size > self._threshold:
            return await self._put_multipart(name, body, checker)
        pieces: list[bytes] = []  # joined once at the end: one copy of the body, where a growing buffer made two
        async for chunk in body:
            checker.update(chunk)
            pieces.append(chunk if type(chunk) is bytes else bytes(chunk))  # a caller may reuse a mutable buffer
        meta = checker.finish()
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        del pieces
        checksum = parse_checksum_token(meta.digest)
        extra: dict[str, Any] = {}
        if checksum.algorithm == CRC64NVME:  # S3's full-object checksum: a store that checks it refuses other bytes
            extra["ChecksumCRC64NVME"] = checksum.header.partition("=")[2]
        try:
            await self.client.put_object(
                Bucket=self.bucket, Key=name, Body=data, ContentLength=size, Metadata=_metadata(meta.digest), **extra
            )
        except FOREIGN as exc:
            if isinstance(exc, ClientError) and code_of(exc) == "BadDigest":
                raise DigestMismatch(f"the store received other bytes than the {checksum.algorithm} says") from exc
            raise translate(exc, "put") from exc
        return meta

    async def _put_multipart(self, name: str, body: AsyncIterable[bytes], checker: BodyChecker) -> Version:
        # The digest is only known at the end; when the client announced it, it goes into the metadata up front
        # (CompleteMultipartUpload is reached only if it matched), else it is added by a copy afterwards.
        announced = checker.expected_digest
        try:
            created = await self.client.create_multipart_upload(
                Bucket=self.bucket, Key=name, Metadata=_metadata(announced) if announced else {}
            )
        except FOREIGN as exc:
            raise translate(exc, "create multipart upload") from exc
        upload_id = str(created["UploadId"])
        parts: list[dict[str, Any]] = []
        pending: asyncio.Task[dict[str, Any]] | None = None
        try:
            number = 0
            async for data in coalesce(body, chunk_bytes=self._part):
                checker.update(data)
                if pending is not None:  # at most one part in flight while the next one arrives
                    parts.append(await pending)
                    pending = None
                number += 1
                pending = asyncio.create_task(self._upload_part(name, upload_id, number, data))
            if pending is not None:
                parts.append(await pending)
                pending = None
            meta = checker.finish()
            await self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=name, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException as exc:
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            await asyncio.shield(self._abort(name, upload_id))
            if isinstance(exc, FOREIGN):
                raise translate(exc, "multipart upload") from exc
            raise
        if not announced:
            await self._set_digest(name, meta.digest)
        return meta

    async def _upload_part(self, name: str, upload_id: str, number: int, data: bytes) -> dict[str, Any]:
        resp = await self.client.upload_part(
            Bucket=self.bucket, Key=name, UploadId=upload_id, PartNumber=number, Body=data, ContentLength=len(data)
        )
        return {"ETag": resp["ETag"], "PartNumber": number}

    async def _abort(self, name: str, upload_id: str) -> None:
        try:
            await self.client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)
        except FOREIGN as exc:  # its parts linger until the bucket's AbortIncompleteMultipartUpload rule
            log.warning("abort multipart upload failed key=%s upload=%s error=%s", name, upload_id, exc)

    async def _set_digest(self, name: str, digest: str) -> None:
        """Copy the object onto itself with the digest in its metadata (same bytes, so readers see no change)."""
        try:
            await self.client.copy_object(
                Bucket=self.bucket,
                Key=name,
                CopySource={"Bucket": self.bucket, "Key": name},
                Metadata=_metadata(digest),
                MetadataDirective="REPLACE",
            )
        except FOREIGN as exc:  # published and correct; digest() recomputes when the metadata is absent
            log.warning("digest metadata not recorded key=%s error=%s", name, exc)

    async def delete(self, key: str) -> bool:
        name = self.object_key(key)
        if await self._head(name) is None:
            return False
        try:
            await self.client.delete_object(Bucket=self.bucket, Key=name)
        except FOREIGN as exc:
            raise translate(exc, "delete") from exc
        return True

    # -- reads -----------------------------------------------------------------------------------------------

    async def _head(self, name: str) -> dict[str, Any] | None:
        try:
            return dict(await self.client.head_object(Bucket=self.bucket, Key=name))
        except FOREIGN as exc:
            if is_missing(exc):
                return None
            raise translate(exc, "head") from exc

    async def open(self, key: str, *, stamp: str | None = None) -> S3Reader:
        """Open the object holding version ``stamp`` of ``key``: one GetObject, whose body the first read takes (a
        version's name never changes while it exists). An unversioned object (``stamp`` None) is opened by HEAD."""
        name = self.version_name(key, stamp)
        if stamp is None:
            head = await self._head(name)
            if head is None:
                raise BlockNotFound(key)
            etag = head.get("ETag")
            return S3Reader(self, name, size=int(head["ContentLength"]), etag=str(etag) if etag else None)
        resp = await self._get(name)
        return S3Reader(self, name, size=int(resp["ContentLength"]), etag=None, body=resp["Body"])

    async def _get(self, name: str, **kwargs: Any) -> dict[str, Any]:
        try:
            return dict(await self.client.get_object(Bucket=self.bucket, Key=name, **kwargs))
        except FOREIGN as exc:
            if is_missing(exc):
                raise BlockNotFound(name.removeprefix(self.prefix)) from exc
            raise translate(exc, "get") from exc

    async def read_range(self, name: str, *, start: int, end: int, etag: str | None) -> AsyncIterator[bytes]:
        """The bytes ``[start, end)`` of the object ``name`` from one ranged GetObject, streamed."""
        kwargs: dict[str, Any] = {"Range": f"bytes={start}-{end - 1}"}
        if etag:
            kwargs["IfMatch"] = etag
        resp = await self._get(name, **kwargs)
        async for chunk in self.stream(resp["Body"], name=name, size=end - start):
            yield chunk

    async def stream(self, body: Any, *, name: str, size: int) -> AsyncIterator[bytes]:
        """The first ``size`` bytes of a GetObject ``body``, in whole chunks (fewer, larger sends to the client)."""
        received = 0
        async with body as stream:
            while received < size:
                want = min(self._chunk, size - received)
                try:
                    data = await stream.content.readexactly(want)
                except asyncio.IncompleteReadError as exc:
                    raise BackendUnavailable(
                        f"s3 read of {name} ended after {received + len(exc.partial)} of {size} bytes"
                    ) from exc
                except FOREIGN as exc:
                    raise translate(exc, "read") from exc
                received += len(data)
                yield data

    async def has_version(self, key: str, stamp: str) -> bool:
        """One HeadObject (the default's open would start a GetObject of the whole version)."""
        return await self._head(self.version_name(key, stamp)) is not None

    async def head(self, key: str) -> int | None:
        head = await self._head(self.object_key(key))
        return None if head is None else int(head["ContentLength"])

    async def digest(self, key: str, *, algorithm: str = DEFAULT_ALGORITHM) -> Version:
        """The object's metadata: its recorded checksum when it is in ``algorithm`` (no chunk CRCs then: a Range GET
        of it checks the whole object), else the object read back and hashed."""
        head = await self._head(self.object_key(key))
        if head is None:
            raise BlockNotFound(key)
        size = int(head["ContentLength"])
        recorded = _recorded(head.get("Metadata", {}))
        if recorded is not None and algorithm_of(recorded) == algorithm:
            return Version(size=size, digest=recorded)
        checker = BodyChecker(size=size, expected_digest=None, algorithm=algorithm)
        reader = S3Reader(self, self.object_key(key), size=size, etag=head.get("ETag"))
        async for chunk in reader.chunks(start=0, end=size):
            checker.update(chunk)
        return checker.finish()

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every object under the store's prefix + ``prefix``, page by page (ListObjectsV2)."""
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix, PaginationConfig={"PageSize": self._page_size}
        ).__aiter__()
        while True:
            try:
                page = await pages.__anext__()
            except StopAsyncIteration:
                return
            except FOREIGN as exc:
                raise translate(exc, "list") from exc
            for obj in page.get("Contents", ()):
                key, stamp = split_version(str(obj["Key"])[len(self.prefix) :])
                yield ObjectInfo(key=key, size=int(obj["Size"]), mtime=obj["LastModified"].timestamp(), stamp=stamp)


def _metadata(token: str) -> dict[str, str]:
    """The object's user metadata for checksum ``token``: a sha256 also under the name earlier releases read."""
    meta = {CHECKSUM_META: token}
    if algorithm_of(token) == SHA256:
        meta[DIGEST_META] = token
    return meta


def _recorded(metadata: dict[str, Any]) -> str | None:
    """The checksum token an object's metadata records (an earlier release's hex sha256 too), if it is one."""
    for name in (CHECKSUM_META, DIGEST_META):
        token = str(metadata.get(name, "")).lower()
        try:
            return parse_checksum_token(token).token
        except ValueError:
            continue
    return None
