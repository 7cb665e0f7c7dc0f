"""How S3 failures become kvgate's errors: a missing key is a miss, a full store 507, anything else an outage.

Every botocore and aiohttp failure of the S3 store goes through ``translate``; callers keep the cause with
``raise ... from exc``.
"""

from __future__ import annotations

import asyncio

import aiohttp
from botocore.exceptions import BotoCoreError, ClientError

from app.errors import BackendUnavailable, InsufficientStorage, KVGateError

MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
NO_BUCKET_CODES = frozenset({"NoSuchBucket", "NotFound", "404"})
FULL_CODES = frozenset({"XMinioStorageFull", "InsufficientStorage"})
FOREIGN = (BotoCoreError, ClientError, aiohttp.ClientError, asyncio.TimeoutError, OSError)
"""What the S3 client can raise; nothing of it leaves the store untranslated."""


def code_of(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def is_missing(exc: BaseException) -> bool:
    return isinstance(exc, ClientError) and code_of(exc) in MISSING_CODES


def translate(exc: BaseException, what: str) -> KVGateError:
    """A foreign failure as a domain error."""
    if isinstance(exc, ClientError):
        code = code_of(exc)
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in FULL_CODES or status == 507:
            return InsufficientStorage(f"s3 {what}: the object store is full ({code})")
        return BackendUnavailable(f"s3 {what} failed: {code or status}")
    return BackendUnavailable(f"s3 {what} failed: {type(exc).__name__}: {exc}")
