"""The gateway freezes what it built at start-up out of the cyclic collector (gc.freeze), so a full collection
walks only what requests create, not the whole heap; it hands it back at shutdown."""

from __future__ import annotations

import gc
from pathlib import Path

from tests.inprocess.harness import running, settings_for


async def test_start_up_objects_are_frozen_while_serving_and_released_at_shutdown(tmp_path: Path) -> None:
    gc.unfreeze()  # whatever this process froze before is not this test's business
    assert gc.get_freeze_count() == 0
    async with running(settings_for(tmp_path)) as g:
        assert (await g.client.get("/healthz")).status_code == 200
        frozen = gc.get_freeze_count()
        oldest = len(gc.get_objects(generation=2))
        # the interpreter, the app and its backends: far more than a full collection now has to walk
        assert frozen > 50_000, frozen
        assert oldest * 10 < frozen, (oldest, frozen)
    assert gc.get_freeze_count() == 0
