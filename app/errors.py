"""The domain's error hierarchy. Storage, index and service raise these; app/api/errors.py maps them to HTTP.

The grammars the gateway shares with the connector raise their own errors, one class per condition, mapped by the
same table: ``contract.keys.InvalidKey`` (a key or namespace that is not FileMapper's), ``contract.wire``'s
``MalformedHeader`` and ``RangeNotSatisfiable`` (re-exported here: the one class for a range that selects nothing).
"""

from __future__ import annotations

from contract.wire import RangeNotSatisfiable as RangeNotSatisfiable


class KVGateError(Exception):
    """Base of every error the gateway reports to a client."""


class InvalidRequest(KVGateError):
    """Malformed key, header or body (400)."""


class BlockNotFound(KVGateError):
    def __init__(self, key: str) -> None:
        super().__init__(f"no block at {key!r}")
        self.key = key


class VersionMismatch(KVGateError):
    """The stored object under a key is not the version its index row names (a write is replacing it)."""


class NamespaceNotFound(KVGateError):
    def __init__(self, namespace: str) -> None:
        super().__init__(f"no namespace {namespace!r}")
        self.namespace = namespace


class DigestMismatch(KVGateError):
    """The body's sha256 is not the one the client announced (nothing was published)."""


class SizeMismatch(KVGateError):
    """The body is shorter or longer than its Content-Length (nothing was published)."""


class CorruptData(KVGateError):
    """Stored bytes are not those their writer sealed (the checksum a file of this store's carries beside its
    stamp): they rotted while no row named them. Never adopted; moved aside by whoever found them. ``stamp``: the
    version found."""

    def __init__(self, message: str, *, stamp: str | None = None) -> None:
        super().__init__(message)
        self.stamp = stamp


class LengthRequired(KVGateError):
    pass


class PayloadTooLarge(KVGateError):
    pass


class PreconditionFailed(KVGateError):
    """If-None-Match: * on a key that is present."""


class Conflict(KVGateError):
    """The request contradicts what is stored (e.g. a namespace's fields do not hash to its name)."""


class LayoutMismatch(KVGateError):
    """A block whose size is not the one its namespace's recorded layout gives (422; nothing is stored)."""


class BackendUnavailable(KVGateError):
    """The block store cannot be reached or failed; retry later (503)."""


class StagingExpired(BackendUnavailable):
    """A staged version or part was swept before its commit (its writer took longer than a sweep allows, by the
    index's clock): nothing was written; retry (503)."""


class IndexUnavailable(KVGateError):
    """The index database cannot be reached, is locked or failed; retry later (503)."""


class CommitUnknown(IndexUnavailable):
    """An index transaction's COMMIT failed (the connection dropped with it, the reply was lost): it may have
    committed or not. ``result`` is what the transaction's statements returned before it, as if it had. Its caller
    never runs it again on a guess: it reads the key's row again (``Index.settled``) and decides from that."""

    def __init__(self, message: str, *, result: object) -> None:
        super().__init__(message)
        self.result = result


class InsufficientStorage(KVGateError):
    """The store is full (ENOSPC) or the capacity bound leaves no room (507)."""


class TooManyRequests(KVGateError):
    pass


class RequestTimeout(KVGateError):
    """The request body arrived too slowly or stalled (nothing was published)."""


class HeadersTooLarge(KVGateError):
    """The request line and headers are over the limit (431)."""


class Unauthorized(KVGateError):
    pass


class Forbidden(KVGateError):
    pass


class EventsDisabled(KVGateError):
    """KV events are off (KVGATE_EVENTS_ENABLED) (404)."""
