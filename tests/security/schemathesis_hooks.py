"""schemathesis hooks for tests/security/test_schemathesis.py (loaded by the CLI through ``SCHEMATHESIS_HOOKS``).

A positive case is one the spec says is valid, but two of kvgate's inputs have a relation to others that no JSON
schema states: a block PUT's checksum headers are its body's checksums (a Content-Range's span its body's length),
and a namespace's name ends in the digest of the config's fields. Left to chance, nearly every generated PUT is a
400 and the stateful phase never gets a block or a config to follow its links from. So positive PUTs are made
true to those relations here: the headers become the body's real checksums (a whole object, no part headers), the
namespace the one the fields name. Negative cases are left as generated.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import schemathesis
from schemathesis.generation import GenerationMode

from app.storage.checksums import crc64nvme
from contract.keys import NAMESPACE_PATTERN, namespace_for
from contract.wire import (
    CHECKSUM_HEADER,
    CRC64NVME,
    DIGEST_HEADER,
    PART_CHECKSUM_HEADER,
    PART_DIGEST_HEADER,
    SHA256,
    Checksum,
)

_PART_HEADERS = frozenset(h.lower() for h in ("Content-Range", PART_CHECKSUM_HEADER, PART_DIGEST_HEADER))


def _positive(case: schemathesis.Case) -> bool:
    return case.meta is not None and case.meta.generation.mode == GenerationMode.POSITIVE


def _checksum(body: bytes, algorithm: str) -> str:
    if algorithm == SHA256:
        return Checksum.of(SHA256, hashlib.sha256(body).digest()).header
    return Checksum.of(CRC64NVME, crc64nvme(body)).header


def _true_block_put(case: schemathesis.Case) -> None:
    body = case.body if isinstance(case.body, bytes) else None
    if body is None or case.headers is None:
        return
    for name in list(case.headers):
        lower = name.lower()
        if lower in _PART_HEADERS:
            del case.headers[name]
        elif lower == CHECKSUM_HEADER.lower():
            algorithm = str(case.headers[name]).split("=", 1)[0]
            case.headers[name] = _checksum(body, SHA256 if algorithm == SHA256 else CRC64NVME)
        elif lower == DIGEST_HEADER.lower():
            case.headers[name] = hashlib.sha256(body).hexdigest()


def _true_config_put(case: schemathesis.Case) -> None:
    fields: Any = case.body
    if not isinstance(fields, dict) or not isinstance(fields.get("model_name"), str) or case.path_parameters is None:
        return
    try:
        json.dumps(fields, allow_nan=False)
        namespace = namespace_for(fields)
    except (TypeError, ValueError):
        return  # fields no digest can be taken of (the gateway's 400): left as generated
    if re.fullmatch(NAMESPACE_PATTERN, namespace):  # else the model's name makes no namespace: left as generated
        case.path_parameters["namespace"] = namespace


@schemathesis.hook
def map_case(context: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
    if not _positive(case) or case.method.upper() != "PUT":
        return case
    if case.path == "/v1/blocks/{path}":
        _true_block_put(case)
    elif case.path == "/v1/namespaces/{namespace}/config":
        _true_config_put(case)
    return case
