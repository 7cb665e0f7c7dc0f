"""Parents before children: the order in which events of a block and of its parent block are published.

A router indexes a ``BlockStored`` by chaining it to its parent's (llm-d's indexer computes a block's key from its
parent's key and its token ids): a child's event that comes before its parent's is dropped or misfiled. Events are
made in commit order, and a writer storing a prompt's blocks sends their PUTs concurrently, so a child can commit
first. Two steps put the parent first without ever delaying a request:

- :class:`ParentFirst` holds a child's events while a PUT of its parent's key is in progress at this gateway (the
  PUT route brackets each PUT with :meth:`ParentFirst.begin` / :meth:`ParentFirst.end`), and releases them, in
  order, right after the parent's PUT ends (its own event, if it committed one, was made before that). Every later
  event of a held key waits behind it, so each key's events keep their commit order. Nothing waits on a timer:
  a hold lasts as long as the parent's PUT (bounded by the body timeouts), and chains that would wait on
  themselves are never held.
- :func:`parents_first` reorders one batch (stable) so that a child's events come after its parent's store when
  both are in it.

Both work on anything with ``key``, ``kind`` and ``parent_key``. With the event log (app/index/eventlog.py) the hold
is split in two: the process that commits a child's row knows whether a PUT of its parent is in progress there and
has not queued its change (:class:`Brackets`), and names those PUTs in the row (a token each); each such PUT ends
with a row of its key, after the child's, that carries its token (its store, or a release row if it stored nothing).
The publisher, reading the log in any process, runs :class:`ParentFirst` with "a PUT of the parent in progress"
standing for "a token some row waits for, not seen yet".
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from app.core.event_sink import PutInProgress
from contract.wire import BlockMetaValue

log = logging.getLogger("kvgate.events")


class Ordered(Protocol):
    @property
    def key(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def parent_key(self) -> str | None:
        """The key of the block this one continues (same namespace, rank and group), for a store that says it."""
        ...


E = TypeVar("E", bound=Ordered)
T = TypeVar("T", bound=Ordered)


class ParentFirst(Generic[E]):
    """Holds a child block's events while a PUT of its parent is in progress (see the module doc)."""

    def __init__(self, *, max_held: int = 100_000) -> None:
        self.max_held = max_held
        """Past this many held events, new ones go out at once (order best effort, memory bounded)."""
        self._writing: Counter[str] = Counter()
        self._held: dict[str, list[E]] = {}
        """Key -> its events waiting, in commit order."""
        self._blocked_on: dict[str, str] = {}
        """Held key -> the key it waits on."""
        self._waiters: dict[str, list[str]] = {}
        """Key -> held keys waiting on it, in the order they were held."""
        self._count = 0

    @property
    def held(self) -> int:
        return self._count

    def begin(self, key: str) -> None:
        """A PUT of ``key`` started."""
        self._writing[key] += 1

    def in_progress(self, key: str) -> bool:
        """A PUT of ``key`` has begun and not ended."""
        return key in self._writing

    def held_events(self) -> list[E]:
        """Every event held now, each key's in order."""
        return [e for events in self._held.values() for e in events]

    def end(self, key: str) -> list[E]:
        """A PUT of ``key`` ended (committed or not): the events that may go now, in order."""
        n = self._writing[key] - 1
        if n > 0:
            self._writing[key] = n
            return []
        del self._writing[key]
        return self._release(key)

    def add(self, event: E) -> list[E]:
        """``event`` was committed: the events that may go now (``[event]``, or none while it is held)."""
        key = event.key
        waiting = self._held.get(key)
        if waiting is not None:
            waiting.append(event)
            self._count += 1
            return []
        parent = event.parent_key
        if (
            parent is None
            or parent == key
            or (parent not in self._writing and parent not in self._held)
            or self._leads_to(parent, key)
        ):
            return [event]
        if self._count >= self.max_held:
            log.warning("events: %d held for their parents; publishing key=%s without waiting", self._count, key)
            return [event]
        self._held[key] = [event]
        self._blocked_on[key] = parent
        self._waiters.setdefault(parent, []).append(key)
        self._count += 1
        return []

    def drain(self) -> list[E]:
        """Every held event, parents first (the bus is closing: no PUT will end any more)."""
        self._writing.clear()
        out: list[E] = []
        while self._held:
            roots = [k for k in self._waiters if k not in self._held]
            if not roots:  # unreachable: holds never form a cycle
                break
            for key in roots:
                out.extend(self._release(key))
        for events in self._held.values():
            out.extend(events)
        self._held.clear()
        self._blocked_on.clear()
        self._waiters.clear()
        self._count = 0
        return out

    def _leads_to(self, start: str, key: str) -> bool:
        """True if ``start`` waits, directly or through others, on ``key`` (holding would make a cycle)."""
        seen = 0
        node: str | None = start
        while node is not None and seen <= len(self._blocked_on):
            if node == key:
                return True
            node = self._blocked_on.get(node)
            seen += 1
        return False

    def _release(self, key: str) -> list[E]:
        out: list[E] = []
        todo = [key]
        while todo:
            parent = todo.pop()
            if parent in self._writing or parent in self._held:
                continue
            for child in self._waiters.pop(parent, ()):
                events = self._held.pop(child, None)
                self._blocked_on.pop(child, None)
                if events is None:
                    continue
                self._count -= len(events)
                for event in events:
                    out.extend(self.add(event))  # held again if it now waits on another PUT in progress
                if child not in self._held:
                    todo.append(child)
        return out


def parents_first(events: Sequence[T]) -> list[T]:
    """``events`` with each child's events moved after its parent's last store in them; otherwise in order."""
    if all(e.parent_key is None for e in events):
        return list(events)
    last = {e.key: i for i, e in enumerate(events) if e.kind == "stored"}
    out: list[T] = []
    bucket: dict[str, list[tuple[int, T]]] = {}
    """Key -> events waiting for its last store in this batch."""
    blocked: dict[str, str] = {}

    def emit(i: int, event: T) -> None:
        stack: list[Iterator[tuple[int, T]]] = [iter(((i, event),))]
        while stack:
            item = next(stack[-1], None)
            if item is None:
                stack.pop()
                continue
            j, e = item
            out.append(e)
            if last.get(e.key) == j and (released := bucket.pop(e.key, None)):
                for _, r in released:
                    blocked.pop(r.key, None)
                stack.append(iter(released))

    for i, event in enumerate(events):
        waits_on = blocked.get(event.key)
        if waits_on is not None:
            bucket[waits_on].append((i, event))
            continue
        parent = event.parent_key
        if parent is not None and parent != event.key and last.get(parent, -1) > i:
            blocked[event.key] = parent
            bucket.setdefault(parent, []).append((i, event))
            continue
        behind = blocked.get(parent) if parent is not None and parent != event.key else None
        if behind is not None and behind != event.key:  # (its own key: a cycle, out in order)
            blocked[event.key] = behind  # its parent's store waits further on: it goes right after it
            bucket[behind].append((i, event))
            continue
        emit(i, event)
    rest = sorted((item for items in bucket.values() for item in items), key=lambda item: item[0])
    out.extend(e for _, e in rest)
    return out


@dataclass
class Brackets:
    """The PUTs in progress in this process, for the event-log row of a child: the PUTs of its parent in progress here
    that have not queued their transaction; each one's row (its store, or, if it writes none, the release row
    written when it ends) comes after the child's in the log, with its token."""

    _open: dict[str, list[PutInProgress]] = field(default_factory=dict)

    def begin(self, key: str, meta: BlockMetaValue | None = None) -> PutInProgress:
        bracket = PutInProgress(key, meta)
        self._open.setdefault(key, []).append(bracket)
        return bracket

    def end(self, bracket: PutInProgress) -> int | None:
        """The PUT ended; its token if children's rows wait for a row of it that it did not write (a release row is
        due)."""
        brackets = self._open.get(bracket.key)
        if brackets is not None:
            brackets.remove(bracket)
            if not brackets:
                del self._open[bracket.key]
        return bracket.token if not bracket.wrote else None

    def hold_for(self, parent: str) -> tuple[int, ...]:
        """A child of ``parent`` is committing: the tokens of the PUTs of the parent in progress here that have not
        queued their transaction yet (its row waits for them); each one now owes a row of its key."""
        pending = [b for b in self._open.get(parent, ()) if not b.submitted]
        for b in pending:
            if b.token is None:
                b.token = secrets.randbits(62)
        return tuple(b.token for b in pending if b.token is not None)
