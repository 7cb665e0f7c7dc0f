"""What the kvgate tier (connector/vllm/tier.py) says of each chunk it stores, for the gateway's KV events: the
chunk's token ids and its parent's hash, taken from vLLM's own request, as vLLM's self-describing offloading events
(vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py) take them.

A secondary tier is never shown the request: ``KVGateOffloadingConnector`` (connector/vllm/offloading.py) announces
it in :data:`announced` while vLLM tells the tiers of a new request, and the tier keeps its token and hash lists
in the request's ``ReqContext``. Under vLLM's own OffloadingConnector nothing is announced and chunks go without
meta (their events stay valid, without token ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass

from contract.keys import split_offload_key
from contract.wire import format_block_meta


@dataclass(frozen=True, slots=True)
class RequestTokens:
    """A request's live lists, as vLLM keeps them: ``all_token_ids`` and ``block_hashes`` (one per tokens_per_hash)."""

    tokens: Sequence[int]
    hashes: Sequence[bytes]


announced: ContextVar[RequestTokens | None] = ContextVar("kvgate_announced_request", default=None)
"""The request vLLM is telling the tiers about (set around ``on_new_request``)."""


@dataclass(frozen=True, slots=True)
class ChunkShape:
    """The run's offload chunks: tokens in a chunk of each KV-cache group, tokens per block hash."""

    tokens_per_chunk: tuple[int, ...]
    tokens_per_hash: int

    def meta(self, request: RequestTokens | None, *, key: bytes, end: int | None) -> str | None:
        """``X-KVGate-Block-Meta`` of the chunk stored under offload ``key`` whose tokens end at ``end`` (vLLM's
        ``ReqContext.get_offload_key_position``): the chunk's tokens and the hash before its first; None if unknown."""
        if request is None or end is None:
            return None
        _hash, group = split_offload_key(key)
        if group >= len(self.tokens_per_chunk):
            return None
        start = end - self.tokens_per_chunk[group]
        if start < 0 or end > len(request.tokens) or start % self.tokens_per_hash:
            return None
        first = start // self.tokens_per_hash
        if first > len(request.hashes):
            return None
        parent = bytes(request.hashes[first - 1]) if first else None
        return format_block_meta(parent=parent, tokens=request.tokens[start:end])
