"""SigV4 for block bodies whose sha256 kvgate already holds: sign with that digest, do not hash the body again.

botocore's S3 signer puts the body's sha256 in ``x-amz-content-sha256`` and hashes every bytes body to get it
(always over http; over https unless a checksum header it knows is present). kvgate has just hashed the same bytes
while receiving the block, to check them, and sends that digest as the object's metadata, ``x-amz-meta-sha256``.
:class:`KnownDigestS3SigV4Auth` takes the payload hash from that header, so a PutObject hashes its body once, not
twice. The signature is byte for byte the one botocore's signer makes for the same body.

Nothing is trusted blindly: the store checks ``x-amz-content-sha256`` against the bytes it receives (SigV4 requires
it: AWS answers XAmzContentSHA256Mismatch, MinIO and Ceph RGW the same), so a header that did not match the body would
be refused, never stored. A header that is not 64 lowercase hex digits falls back to botocore's own hashing.

A CRC64NVME version has no sha256 at all: its PutObject carries S3's full-object checksum
(``x-amz-checksum-crc64nvme``), which the store checks against the bytes it receives, and is signed with
``UNSIGNED-PAYLOAD`` (what botocore itself does over https when a checksum header is present; here over http too),
so the body is never hashed with sha256, by the gateway or by botocore.

This hooks botocore where it invites it: a name in ``botocore.auth.AUTH_TYPE_MAPS`` and a ``choose-signer`` handler
on one client; the private helpers it calls are checked for when a client is set up, and botocore's own signer is
left in place if they are gone. ``tests/contract/test_s3_store.py`` checks that the fast path is the one that runs
(no body-sized hash on a PutObject) and that the signature equals botocore's, so an upgrade that changes either
fails there; pyproject.toml bounds aioboto3 (and with it aiobotocore's exact botocore range).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import botocore.auth

log = logging.getLogger("kvgate.storage.s3")

DIGEST_META = "sha256"
"""User-metadata key (x-amz-meta-sha256) holding the object's hex sha256."""

DIGEST_HEADER = f"x-amz-meta-{DIGEST_META}"
"""The header that carries it on a PutObject."""

CHECKSUM_META = "checksum"
"""User-metadata key (x-amz-meta-checksum) holding the object's checksum token (``contract.wire.Checksum.token``)."""

STORE_CHECKSUM_HEADER = "x-amz-checksum-crc64nvme"
"""S3's full-object CRC64NVME of the body, which the store checks against the bytes it receives."""

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"

SIGNATURE_VERSION = "kvgate-s3v4"
"""The name this signer is registered under; it signs exactly like botocore's ``s3v4``."""

_HEX64 = re.compile(r"[0-9a-f]{64}")


class KnownDigestS3SigV4Auth(botocore.auth.S3SigV4Auth):  # type: ignore[misc]  # botocore is untyped
    """botocore's S3 SigV4 signer, with the payload hash read from the request's digest metadata when present, and
    ``UNSIGNED-PAYLOAD`` for a body that carries S3's CRC64NVME checksum instead (the store checks that one)."""

    def payload(self, request: Any) -> str:
        if self._is_streaming_checksum_payload(request) or not self._should_sha256_sign_payload(request):
            return str(super().payload(request))
        known = request.headers.get(DIGEST_HEADER)
        if known is not None and _HEX64.fullmatch(known):
            return str(known)
        if request.headers.get(STORE_CHECKSUM_HEADER) is not None:
            return UNSIGNED_PAYLOAD
        return str(super().payload(request))


botocore.auth.AUTH_TYPE_MAPS[SIGNATURE_VERSION] = KnownDigestS3SigV4Auth


def _choose_known_digest_signer(
    signature_version: Any = None, signing_name: Any = None, context: Any = None, **_: Any
) -> str | None:
    # Runs before botocore's own choose-signer handlers (the most specific event name is called first), which would
    # map the operation's "v4" to "s3v4". Only that case is taken: SigV4a, S3 Express, an unsigned body, anonymous
    # access and presigned URLs fall through to botocore's choice.
    if signing_name != "s3" or (context or {}).get("unsigned_payload"):
        return None
    return SIGNATURE_VERSION if signature_version in ("v4", "s3v4") else None


_USED = ("payload", "_should_sha256_sign_payload", "_is_streaming_checksum_payload")


def sign_with_known_digest(client: Any) -> bool:
    """Have ``client`` sign PutObject with the digest kvgate sends as metadata (other operations are unchanged).
    False, and botocore's signer as it is, if this botocore lacks what the signer builds on."""
    missing = [name for name in _USED if not callable(getattr(botocore.auth.S3SigV4Auth, name, None))]
    if missing:
        log.warning("botocore's S3 signer has no %s: PutObject bodies are hashed again to sign them", missing)
        return False
    client.meta.events.register("choose-signer.s3.PutObject", _choose_known_digest_signer)
    return True
