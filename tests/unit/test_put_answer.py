"""The PUT's one answer (app/api/routes/put_answer.py) is the bytes the route answered with before it, when it
built a ``PutResponse`` and Starlette's ``Response``: what the route and the PUT lane now both send."""

from __future__ import annotations

import pytest
from starlette.responses import Response

from app.api.routes.blocks import PutResponse
from app.api.routes.put_answer import put_answer
from app.core.service import PutResult
from app.storage.base import Version
from tests.conftest import crc, key_for, sha


@pytest.mark.parametrize("created", [True, False])
@pytest.mark.parametrize("digest", [crc(b"abc"), sha(b"abc")])
def test_the_answer_is_the_pydantic_model_in_a_starlette_response(created: bool, digest: str) -> None:
    meta = Version(key=key_for(1), size=65_536, digest=digest)
    answer = put_answer(PutResult(meta=meta, created=created))
    want = Response(
        PutResponse(key=meta.key, size=meta.size, digest=meta.digest, created=created).model_dump_json(),
        status_code=201 if created else 200,
        media_type="application/json",
        headers={"ETag": f'"{digest}"', "Location": f"/v1/blocks/{meta.key}"},
    )
    assert (answer.status, answer.headers, answer.body) == (want.status_code, want.raw_headers, want.body)
