"""What only the S3 store has: digest metadata, multipart uploads, prefixes, bucket creation, outages."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import botocore.auth
import pytest
from aiobotocore.config import AioConfig
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from app.config import S3Backend
from app.errors import BackendUnavailable, BlockNotFound, DigestMismatch
from app.storage import s3_signing
from app.storage.s3 import DIGEST_META, S3Store
from app.storage.s3_signing import CHECKSUM_META, DIGEST_HEADER, KnownDigestS3SigV4Auth, sign_with_known_digest
from tests.conftest import crc, crc_header, random_bytes, sha
from tests.gateway import free_port
from tests.services import S3_CREDS, S3_SERVERS, S3TestServer, own_s3_server, start_or_skip, unique_bucket

MiB = 1024 * 1024


def backend(url: str, **over: object) -> S3Backend:
    fields: dict[str, object] = {
        "bucket": unique_bucket(),
        "endpoint_url": url,
        "multipart_threshold_bytes": 6 * MiB,
        "part_bytes": 5 * MiB,
        "max_attempts": 1,
        "connect_timeout_s": 1.0,
        **S3_CREDS,
    }
    fields.update(over)
    return S3Backend.model_validate(fields)


async def body(data: bytes) -> AsyncIterator[bytes]:
    for pos in range(0, len(data), 1 << 20):
        yield data[pos : pos + (1 << 20)]


@pytest.mark.parametrize(("size", "announce"), [(1000, False), (13 * MiB, True), (13 * MiB, False)])
async def test_digest_in_metadata(s3_server: S3TestServer, size: int, announce: bool) -> None:
    store = S3Store(cfg=backend(s3_server.url, prefix="p"))
    await store.start()
    calls: list[str] = []
    store.client.meta.events.register("before-call.s3", lambda model, **_: calls.append(model.name))
    try:
        data = random_bytes(size, size)
        meta = await store.put("k/x.bin", body(data), size=size, expected_digest=sha(data) if announce else None)
        assert meta.digest == (sha(data) if announce else crc(data))  # unannounced: kvgate's default, CRC64NVME
        head = await store.client.head_object(Bucket=store.bucket, Key="p/k/x.bin")
        assert head["Metadata"][CHECKSUM_META] == meta.digest
        assert head["Metadata"].get(DIGEST_META) == (sha(data) if announce else None)  # as earlier releases read it
        assert head["ContentLength"] == size
        # a multipart upload whose digest was not announced is copied onto itself afterwards to record it
        assert calls.count("UploadPart") == (3 if size > 6 * MiB else 0)
        assert ("CopyObject" in calls) == (size > 6 * MiB and not announce)
    finally:
        await store.close()


async def test_prefixes_are_isolated(s3_server: S3TestServer) -> None:
    a = S3Store(cfg=backend(s3_server.url, prefix="tenant-a/"))
    await a.start()
    b = S3Store(cfg=backend(s3_server.url, bucket=a.bucket, prefix="tenant-b", create_bucket=False))
    await b.start()
    try:
        await a.put("k.bin", body(b"aaa"), size=3)
        await b.put("k.bin", body(b"bbbb"), size=4)
        assert [(i.key, i.size) async for i in a.list()] == [("k.bin", 3)]
        assert [(i.key, i.size) async for i in b.list()] == [("k.bin", 4)]
        assert await a.delete("k.bin") is True
        assert await b.head("k.bin") == 4
    finally:
        await a.close()
        await b.close()


async def test_list_pages(s3_server: S3TestServer) -> None:
    store = S3Store(cfg=backend(s3_server.url, prefix="pre"), list_page_size=7)
    await store.start()
    try:
        keys = [f"n/{i:04d}.bin" for i in range(30)]  # five pages of seven and a short one
        await asyncio.gather(*(store.client.put_object(Bucket=store.bucket, Key=f"pre/{k}", Body=b"z") for k in keys))
        await store.client.put_object(Bucket=store.bucket, Key="outside/n/x.bin", Body=b"z")
        assert [i.key async for i in store.list("n/")] == keys
        assert [i.key async for i in store.list()] == keys
    finally:
        await store.close()


async def test_missing_bucket_without_create_is_an_outage(s3_server: S3TestServer) -> None:
    store = S3Store(cfg=backend(s3_server.url, create_bucket=False))
    with pytest.raises(BackendUnavailable):
        await store.start()


async def test_unreachable_endpoint_is_an_outage() -> None:
    store = S3Store(cfg=backend(f"http://127.0.0.1:{free_port()}"))
    with pytest.raises(BackendUnavailable):
        await store.start()


@pytest.mark.parametrize("kind", S3_SERVERS)
async def test_outage_is_never_a_miss(tmp_path: Path, kind: str) -> None:
    server = start_or_skip(own_s3_server(kind, root=tmp_path))
    store = S3Store(cfg=backend(server.url))
    try:
        await store.start()
        await store.put("k.bin", body(b"hello"), size=5)
        reader = await store.open("k.bin")
        server.kill()
        with pytest.raises(BackendUnavailable):
            await store.check()
        with pytest.raises(BackendUnavailable):
            await store.head("k.bin")
        with pytest.raises(BackendUnavailable):
            await store.open("k.bin")
        with pytest.raises(BackendUnavailable):
            _ = [c async for c in reader.chunks(start=0, end=5)]
        with pytest.raises(BackendUnavailable):
            await store.put("j.bin", body(b"x"), size=1)
        with pytest.raises(BackendUnavailable):
            await store.delete("k.bin")
        with pytest.raises(BackendUnavailable):
            _ = [i async for i in store.list()]
        server.start()  # same port: the client reconnects without a restart
        if kind == "moto":  # moto comes back empty; SeaweedFS with its data
            await store.client.create_bucket(Bucket=store.bucket)
        else:
            assert b"".join([c async for c in (await store.open("k.bin")).chunks(start=0, end=5)]) == b"hello"
        await store.check()
        await store.put("k.bin", body(b"again"), size=5)
        assert b"".join([c async for c in (await store.open("k.bin")).chunks(start=0, end=5)]) == b"again"
    finally:
        await store.close()
        server.stop()


async def test_a_version_is_read_in_one_store_round_trip(s3_server: S3TestServer) -> None:
    """A GET of a block version costs one GetObject (no HeadObject first); other ranges one more, each."""
    store = S3Store(cfg=backend(s3_server.url, prefix="p"), chunk_bytes=64 * 1024)
    await store.start()
    calls: list[str] = []
    store.client.meta.events.register("before-call.s3", lambda model, **_: calls.append(model.name))
    try:
        data = random_bytes(300 * 1024, 7)
        staged = await store.stage("k/x.bin", body(data), size=len(data))
        await store.publish(staged)
        calls.clear()
        async with await store.open("k/x.bin", stamp=staged.stamp) as reader:
            assert reader.size == len(data)
            assert b"".join([c async for c in reader.chunks(start=0, end=len(data))]) == data
        assert calls == ["GetObject"]
        calls.clear()
        async with await store.open("k/x.bin", stamp=staged.stamp) as reader:  # a range not at 0: one more GET
            assert b"".join([c async for c in reader.chunks(start=1000, end=5000)]) == data[1000:5000]
        assert calls == ["GetObject", "GetObject"]
        calls.clear()
        async with await store.open("k/x.bin", stamp=staged.stamp) as reader:  # opened, never read: closed cleanly
            pass
        async with await store.open("k/x.bin", stamp=staged.stamp) as reader:  # and the pool still serves
            assert b"".join([c async for c in reader.chunks(start=0, end=100)]) == data[:100]
        assert calls == ["GetObject", "GetObject"]
        with pytest.raises(BlockNotFound):
            await store.open("k/x.bin", stamp="0" * 32)
    finally:
        await store.close()


class HashedBytes:
    """Stands in for botocore.auth's ``sha256`` and records how many bytes each hash it makes is given."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, data: bytes = b"") -> Any:
        self.sizes.append(len(data))
        return self.Recording(hashlib.sha256(data), self.sizes, len(self.sizes) - 1)

    class Recording:
        """A sha256 object (also as HMAC's digest) that adds what ``update`` is given to its entry."""

        def __init__(self, real: Any, sizes: list[int], at: int) -> None:
            self._real, self._sizes, self._at = real, sizes, at

        def update(self, more: bytes) -> None:
            self._sizes[self._at] += len(more)
            self._real.update(more)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._real, name)


async def test_put_object_is_signed_with_the_digest_already_computed(
    s3_server: S3TestServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PutObject's body is hashed once, by the gateway: botocore's signer hashes only its canonical strings."""
    hashed = HashedBytes()
    monkeypatch.setattr(botocore.auth, "sha256", hashed)
    store = S3Store(cfg=backend(s3_server.url))
    await store.start()
    try:
        data = random_bytes(MiB, 7)
        meta = await store.put("k/x.bin", body(data), size=len(data), expected_digest=sha(data))
        assert meta.digest == sha(data)
        assert hashed.sizes, "botocore's signer did not run"
        assert max(hashed.sizes) < 4096, f"a body-sized hash in the signer: {sorted(hashed.sizes)[-3:]}"
        reader = await store.open("k/x.bin", stamp=None)
        try:
            assert b"".join([c async for c in reader.chunks(start=0, end=len(data))]) == data
        finally:
            await reader.aclose()
        # everything else is signed as before: a copy has no digest header, so its (empty) body is hashed
        await store.client.copy_object(Bucket=store.bucket, Key="k/y.bin", CopySource=f"{store.bucket}/k/x.bin")
        assert (await store.client.head_object(Bucket=store.bucket, Key="k/y.bin"))["ContentLength"] == len(data)
    finally:
        await store.close()


async def test_a_botocore_without_the_signers_helpers_keeps_its_own_signer(
    s3_server: S3TestServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If an upgrade drops what the known-digest signer builds on, PutObject is signed as botocore does it."""
    monkeypatch.setattr(s3_signing, "_USED", (*s3_signing._USED, "_a_helper_an_upgrade_dropped"))
    store = S3Store(cfg=backend(s3_server.url))
    await store.start()
    sent: list[dict[str, bytes]] = []
    store.client.meta.events.register("before-send.s3.PutObject", lambda request, **_: sent.append(request.headers))
    try:
        assert sign_with_known_digest(store.client) is False
        data = random_bytes(MiB, 8)
        assert (await store.put("k/x.bin", body(data), size=len(data), expected_digest=sha(data))).digest == sha(data)
        # botocore hashed the body to sign it (its Python signer, or awscrt's where botocore finds awscrt)
        assert sent[0]["X-Amz-Content-SHA256"] == sha(data).encode()
        head = await store.client.head_object(Bucket=store.bucket, Key="k/x.bin")
        assert head["ContentLength"] == len(data) and head["Metadata"][DIGEST_META] == sha(data)
    finally:
        await store.close()


async def test_a_crc64nvme_version_goes_up_with_s3s_checksum_and_no_sha256(
    s3_server: S3TestServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default version: S3's full-object x-amz-checksum-crc64nvme travels with the body and the request is signed
    UNSIGNED-PAYLOAD: no sha256 of the body anywhere, in the gateway or in botocore."""
    hashed = HashedBytes()
    monkeypatch.setattr(botocore.auth, "sha256", hashed)
    store = S3Store(cfg=backend(s3_server.url))
    await store.start()
    sent: list[dict[str, bytes]] = []
    store.client.meta.events.register("before-send.s3.PutObject", lambda request, **_: sent.append(request.headers))
    try:
        data = random_bytes(MiB, 9)
        meta = await store.put("k/x.bin", body(data), size=len(data))
        assert meta.digest == crc(data)
        assert sent[0]["x-amz-checksum-crc64nvme"] == crc_header(data).partition("=")[2].encode()
        assert sent[0]["X-Amz-Content-SHA256"] == b"UNSIGNED-PAYLOAD"
        assert max(hashed.sizes) < 4096, f"a body-sized hash in the signer: {sorted(hashed.sizes)[-3:]}"
        reader = await store.open("k/x.bin", stamp=None)
        async with reader:
            assert b"".join([c async for c in reader.chunks(start=0, end=len(data))]) == data
    finally:
        await store.close()


async def test_seaweedfs_refuses_a_body_that_is_not_its_crc64nvme(s3_server: S3TestServer) -> None:
    """A body changed between the gateway and the store (here by a hook after signing: UNSIGNED-PAYLOAD lets it
    through the signature) is refused by a store that checks x-amz-checksum-crc64nvme (SeaweedFS: BadDigest, a
    DigestMismatch here) and nothing is stored; moto does not check it and stores what it received."""
    store = S3Store(cfg=backend(s3_server.url))
    await store.start()

    def flip(request: Any, **_: Any) -> None:
        raw = bytearray(request.body.getvalue())  # a BytesIO of the signed body
        raw[len(raw) // 2] ^= 0x01
        request.body = io.BytesIO(bytes(raw))

    store.client.meta.events.register("before-send.s3.PutObject", flip)
    try:
        data = random_bytes(300 * 1024, 10)
        if s3_server.kind == "seaweedfs":
            with pytest.raises(DigestMismatch):
                await store.put("k/x.bin", body(data), size=len(data))
            assert await store.head("k/x.bin") is None
        else:
            await store.put("k/x.bin", body(data), size=len(data))
            assert await store.head("k/x.bin") == len(data)  # moto keeps the flipped bytes: the gateway's check stands
    finally:
        await store.close()


def signed(auth_cls: type[botocore.auth.S3SigV4Auth], data: bytes, headers: dict[str, str], *, url: str) -> Any:
    request = AWSRequest(method="PUT", url=f"{url}/bucket/k/x.bin", data=data, headers=headers)
    request.context["client_config"] = AioConfig(s3={"addressing_style": "path"})
    creds = Credentials(S3_CREDS["access_key_id"], S3_CREDS["secret_access_key"])
    auth_cls(creds, "s3", "us-east-1").add_auth(request)
    return request.headers


@pytest.mark.parametrize("url", ["http://store:9000", "https://store"])
@pytest.mark.parametrize("digest", ["right", "upper-case", "not hex", "absent"])
def test_the_known_digest_signature_is_botocores(monkeypatch: pytest.MonkeyPatch, url: str, digest: str) -> None:
    """Same request, same clock: the signature is byte for byte the one botocore's own S3 signer makes. A header
    that is not a lowercase hex sha256 is not used (the body is hashed, as botocore does)."""
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: datetime.datetime(2026, 12, 3, 10, 0, 0))
    data = random_bytes(100_000, 3)
    value = {"right": sha(data), "upper-case": sha(data).upper(), "not hex": "z" * 64}.get(digest)
    headers = {"Content-Type": "application/octet-stream"} | ({DIGEST_HEADER: value} if value else {})
    ours = signed(KnownDigestS3SigV4Auth, data, headers, url=url)
    theirs = signed(botocore.auth.S3SigV4Auth, data, headers, url=url)
    assert ours["Authorization"] == theirs["Authorization"]
    assert ours["X-Amz-Content-SHA256"] == theirs["X-Amz-Content-SHA256"] == sha(data)
    hashed = HashedBytes()
    monkeypatch.setattr(botocore.auth, "sha256", hashed)
    signed(KnownDigestS3SigV4Auth, data, headers, url=url)
    assert (max(hashed.sizes) >= len(data)) == (digest != "right")
