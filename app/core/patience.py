"""One start-up step tried again in place while the index or the store cannot be reached, until a deadline.

Start-up is a chain of steps (the snapshot of the rows, the store's listing, the usage read...), each of which may
fail on a flaky link: a refused connection, a partition, a COMMIT whose reply was lost. Given up on as a whole and
begun again from the top, start-up must get through every step in one go; under a link that loses a reply now and
then, a long chain (a late reconcile, with a large listing) did not, and a restarted replica never became ready. So
the steps that may be repeated as they are (reads, and writes whose repetition reads their own outcome back) are
tried again here, each alone, and start-up keeps what the earlier ones did.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from app.errors import BackendUnavailable
from app.index.engine import unreachable

T = TypeVar("T")
log = logging.getLogger("kvgate.startup")

PAUSES_S = (0.2, 2.0)
"""The first wait between tries of one step, and the longest (doubling in between)."""


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` says the index or the store cannot be reached now (worth another try later)."""
    return isinstance(exc, BackendUnavailable) or unreachable(exc)


async def patiently(step: Callable[[], Awaitable[T]], *, what: str, until: float | None) -> T:
    """``step()``, tried again while it fails on an unreachable index or store (a lost COMMIT reply included) and
    ``time.monotonic()`` is before ``until``; None: one try. Only for steps that are safe to run again: a read, or
    a write that settles its own unknown outcome."""
    pause = PAUSES_S[0]
    while True:
        try:
            return await step()
        except Exception as exc:
            if until is None or not transient(exc) or time.monotonic() + pause > until:
                raise
            log.warning("start-up step %s: %s: %s; trying it again in %.1f s", what, type(exc).__name__, exc, pause)
        await asyncio.sleep(pause)
        pause = min(2 * pause, PAUSES_S[1])
