"""KV events in vLLM's own wire format (vllm/distributed/kv_events.py, vLLM 0.33): each event encoded on its own,
batches assembled from the encoded events, and the ZMQ topic of a batch.

The structs encode exactly as vLLM 0.33's (same names, fields in the same order, same tag and options: a test
compares the bytes with vLLM's own encoder), so a subscriber decodes a batch with
``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)``. The batch is a positional array; each event in
it is a map tagged ``"type"`` (vLLM dropped ``array_like`` from the events in vllm #42892). ``encoding="array"``
writes the events as the tagged positional arrays of vLLM before that change, for routers whose decoders still
expect them; the fields and their positions are the same.

Block hashes take the form vLLM's events carry by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the low 64 bits
of the hash as an unsigned int; with ``int_hashes`` off, the hash's bytes.

An event is encoded when it is made, before it gets a sequence number (:meth:`EventCodec.encode`): an event that
cannot be encoded is refused alone (:class:`EventEncodeError`) and never takes another event's batch or number
with it. A table-backed publisher can encode the rows it reads with the same call.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from app.config import check_topic
from app.core.memo import NamespaceMemo

log = logging.getLogger("kvgate.events")

MEDIUM = "STORAGE"
"""vLLM's storage tiers publish ``STORAGE`` (vllm #48123); Dynamo 1.6 indexes it as its disk tier."""
LOCALITY: str | None = None
"""Unspecified, as vLLM's engines publish their own blocks: Dynamo 1.6 drops every event whose locality is not
``LOCAL`` or unspecified (``REMOTE``, vllm #48281, is dropped)."""
OWNERSHIP: str | None = None
"""Unspecified: Dynamo 1.6 drops every event that names an owner (a secondary tier's id, vllm #52067)."""


class EventEncodeError(ValueError):
    """An event that cannot be written in vLLM's format (it is dropped alone)."""


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: a map tagged by class name, as vLLM 0.33's."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None
    """Never set: declared so that the map's header has vLLM's form (msgspec sizes it by the field count)."""


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVEventBatch(EventBatch):
    """A batch as subscribers decode it."""

    events: list[BlockStored | BlockRemoved]


class _RawBatch(EventBatch):
    """A batch of events encoded one by one: the same bytes as a KVEventBatch of those events."""

    events: list[msgspec.Raw]


def _array_twin(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """The struct with ``cls``'s name and fields, encoded as a tagged positional array (vLLM before #42892)."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(cls):
        fields.append((f.name, f.type) if f.required else (f.name, f.type, f.default))
    return msgspec.defstruct(cls.__name__, fields, array_like=True, omit_defaults=True, gc=False, tag=True)


_ARRAY_STORED = _array_twin(BlockStored)
_ARRAY_REMOVED = _array_twin(BlockRemoved)


def wire_hash(hex_hash: str, *, as_int: bool) -> int | bytes:
    """A key's block hash (hex) in the form vLLM's events carry it; ValueError if it is not whole bytes of hex."""
    raw = bytes.fromhex(hex_hash)
    return int.from_bytes(raw, "big") & ((1 << 64) - 1) if as_int else raw


@dataclass(frozen=True, slots=True)
class WireFormat:
    """What routers read besides the block: the tier's medium, locality and owner, and the encoding."""

    medium: str | None = MEDIUM
    locality: str | None = LOCALITY
    ownership: str | None = OWNERSHIP
    int_hashes: bool = True
    encoding: Literal["map", "array"] = "map"


class EventCodec:
    """Encodes events one by one, and batches of encoded events, in one wire format."""

    def __init__(self, fmt: WireFormat | None = None) -> None:
        self.format = fmt = fmt or WireFormat()
        self._stored: type[msgspec.Struct] = BlockStored if fmt.encoding == "map" else _ARRAY_STORED
        self._removed: type[msgspec.Struct] = BlockRemoved if fmt.encoding == "map" else _ARRAY_REMOVED
        self._encoder = msgspec.msgpack.Encoder()

    def encode(
        self,
        *,
        kind: Literal["stored", "removed"],
        block_hash: str,
        group: int,
        token_ids: Sequence[int] = (),
        parent: str | None = None,
    ) -> bytes:
        """One event's bytes; EventEncodeError if any of its values cannot be written."""
        fmt = self.format
        try:
            h = wire_hash(block_hash, as_int=fmt.int_hashes)
            if kind == "removed":
                event = self._removed(
                    block_hashes=[h], medium=fmt.medium, group_idx=group, locality=fmt.locality, ownership=fmt.ownership
                )
            else:
                event = self._stored(
                    block_hashes=[h],
                    parent_block_hash=wire_hash(parent, as_int=fmt.int_hashes) if parent else None,
                    token_ids=list(token_ids),
                    block_size=len(token_ids),
                    lora_id=None,
                    medium=fmt.medium,
                    lora_name=None,
                    group_idx=group,
                    locality=fmt.locality,
                    ownership=fmt.ownership,
                )
            return self._encoder.encode(event)
        except (ValueError, TypeError, OverflowError, msgspec.EncodeError) as exc:
            raise EventEncodeError(f"{kind} event of block {block_hash[:80]!r}: {exc}") from exc

    def batch(self, *, ts: float, events: Sequence[bytes]) -> bytes:
        """A KVEventBatch of events already encoded by :meth:`encode`."""
        return self._encoder.encode(_RawBatch(ts=ts, events=[msgspec.Raw(e) for e in events]))


TOPIC = "kv@pool:{name}@{model}"
"""llm-d keys events by the topic ``kv@<pod>@<model>``; a shared tier is a pool (llm-d-router #2586)."""


def model_of_namespace(namespace: str) -> str:
    """The model part of ``<safe_model>_<digest>`` (the name with ``/`` as ``_``), when no config names it."""
    return namespace.rsplit("_", 1)[0]


class Topics:
    """The ZMQ topic of a namespace's events: ``template`` with ``{name}``, ``{model}`` and ``{namespace}``."""

    def __init__(self, template: str = TOPIC, *, name: str = "kvgate") -> None:
        self.template = template
        self.name = name
        self.fields = check_topic(template)

    @property
    def per_namespace(self) -> bool:
        """True when namespaces can have different topics (a batch then holds one topic's events)."""
        return bool(self.fields & {"model", "namespace"})

    @property
    def needs_model(self) -> bool:
        return "model" in self.fields

    def render(self, *, namespace: str, model: str | None) -> str:
        """The topic of ``namespace``'s events; ``model`` None: the model part of the namespace's name."""
        return self.template.format(
            name=self.name, namespace=namespace, model=model if model is not None else model_of_namespace(namespace)
        )


class ModelNames:
    """Namespace -> the run's model name from its config (``model_name``), for ``{model}`` in the topic.

    Looked up once per namespace (app/core/memo.py) and kept: every configured one when a publisher takes its turn,
    others when their rows first come. A namespace without a config gets the model part of its name until its config
    is known: :meth:`learn` is told when a config is stored in this process, and one stored in another process (a
    worker, a replica) is found by looking the namespace up again, at most every ``NAMESPACE_RETRY_S``, while its
    rows come."""

    def __init__(self, lookup: Callable[[str], Awaitable[str | None]], *, entries: int = 4096) -> None:
        self._lookup = lookup
        self._names: NamespaceMemo[str] = NamespaceMemo(entries=entries)

    def known(self, namespace: str) -> bool:
        return self._names.known(namespace)

    def get(self, namespace: str) -> str | None:
        """The model name; None: not known (the topic then uses the model part of the namespace's name)."""
        return self._names.get(namespace)

    async def load(self, namespaces: Iterable[str]) -> None:
        for namespace in namespaces:
            try:
                name = await self._lookup(namespace)
            except Exception as exc:  # the index is out: the namespace's own name until its config is told
                log.warning("events: model name of %s not read: %s", namespace, exc)
                name = None
            self.learn(namespace, name)

    def learn(self, namespace: str, model: str | None) -> None:
        self._names.put(namespace, model)
