"""Prefill/decode disaggregation through kvgate: what a producer hands to a consumer, free of vLLM.

A ``kv_producer`` (the prefill instance) stores a request's blocks and, when the request finishes, returns
``kv_transfer_params`` that name them; the router passes those params to a ``kv_consumer`` (the decode instance)
with the request, the way vLLM's disaggregated-serving examples pass ``do_remote_prefill``/``do_remote_decode``:

    {"do_remote_prefill": true, "do_remote_decode": false,
     "kvgate_url": "http://gw:8750", "kvgate_namespace": "...", "kvgate_num_blocks": 12,
     "kvgate_block_size": 16, "kvgate_block_hashes": ["<hex>", ...]}

The consumer computes the same block hashes from the same prompt; the params say how many of its leading blocks to
expect, so its lookup waits (bounded: ``POST /v1/lookup`` with ``wait_ms`` and ``min_prefix``) for the producer's
stores still in flight instead of finding none and recomputing the prompt. Params that do not match this consumer
(another gateway, another namespace, other hashes: a different hash seed) are not waited for: it looks up as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvgate.connector.handoff")

DO_REMOTE_PREFILL = "do_remote_prefill"
DO_REMOTE_DECODE = "do_remote_decode"


@dataclass(frozen=True, slots=True)
class Expected:
    """A consumer's request whose producer named ``blocks`` leading blocks: its lookup waits up to ``wait_s`` for
    them to be present."""

    blocks: int
    wait_s: float


def wants_handoff(params: Mapping[str, Any] | None, *, producer_only: bool) -> bool:
    """A producer's request whose stores a consumer will load: every request of a ``kv_producer``, and a
    ``kv_both`` request the router marked ``do_remote_decode``."""
    return producer_only or bool(params and params.get(DO_REMOTE_DECODE))


def producer_params(*, url: str, namespace: str, block_size: int, hashes: Sequence[bytes]) -> dict[str, Any]:
    """The ``kv_transfer_params`` a producer's finished request returns (for the router to pass on)."""
    return {
        DO_REMOTE_PREFILL: True,
        DO_REMOTE_DECODE: False,
        "kvgate_url": url,
        "kvgate_namespace": namespace,
        "kvgate_num_blocks": len(hashes),
        "kvgate_block_size": block_size,
        "kvgate_block_hashes": [h.hex() for h in hashes],
    }


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def expected(
    params: Mapping[str, Any] | None,
    *,
    url: str,
    namespace: str,
    block_size: int,
    hashes: Sequence[bytes],
    wait_s: float,
) -> Expected | None:
    """What a consumer's request's params let it expect (None: nothing to wait for). ``hashes``: the request's
    own block hashes, at block granularity; only the leading ones the producer named and this request has too."""
    if not params or not params.get(DO_REMOTE_PREFILL) or "kvgate_num_blocks" not in params:
        return None
    why = ""
    named = params.get("kvgate_block_hashes")
    count = params.get("kvgate_num_blocks")
    if not isinstance(count, int) or count < 0 or not isinstance(named, list) or len(named) != count:
        why = "malformed kvgate_num_blocks / kvgate_block_hashes"
    elif not _same_url(str(params.get("kvgate_url", "")), url):
        why = f"another gateway ({params.get('kvgate_url')!r}, this one uses {url!r})"
    elif params.get("kvgate_namespace") != namespace:
        why = f"another namespace ({params.get('kvgate_namespace')!r}; this run's is {namespace!r})"
    elif params.get("kvgate_block_size") != block_size:
        why = f"another block size ({params.get('kvgate_block_size')!r}; this run's is {block_size})"
    else:
        n = min(count, len(hashes))
        if [h.hex() for h in hashes[:n]] != named[:n]:
            why = "other block hashes (is PYTHONHASHSEED the same on both instances?)"
        elif n:
            return Expected(blocks=n, wait_s=wait_s)
        else:
            return None
    log.warning("kvgate: a P/D request's kv_transfer_params are not waited for: %s", why)
    return None
