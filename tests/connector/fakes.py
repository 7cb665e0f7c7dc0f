"""A recording ``StreamOps`` for the ordering rules, used only because this machine has no CUDA.

Copies still run for real on CPU tensors (so the bytes are checked); what the fake adds is the stream/event
bookkeeping a GPU would do, written to one log: which thread recorded which event on which stream, which stream
waited on which event or stream, which thread waited on the host. "The GPU" can be paused: events recorded while it
is paused stay incomplete until ``resume()``; a host wait from another thread then blocks until ``resume()``, and a
host wait from the thread named in ``main_thread`` completes at once (the test then asserts it did not happen).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from connector.device.streams import CopyEvent


@dataclass(frozen=True, slots=True)
class FakeStream:
    name: str


@dataclass(frozen=True, slots=True)
class Op:
    kind: str  # record | wait_event | wait_stream | use | host_wait | query | bind | release
    thread: str
    stream: str | None = None
    event: int | None = None
    other: str | None = None


class FakeEvent:
    def __init__(self, ops: RecordingStreams, ident: int) -> None:
        self.ops, self.id = ops, ident
        self.stream: str | None = None
        self.recorded_by: str | None = None
        self._done = True
        self.fail_sync = False

    def record(self, stream: Any) -> None:
        if self.ops.fail_records:
            self.ops.fail_records -= 1
            raise RuntimeError("injected: event record failed")
        self.stream, self.recorded_by = stream.name, threading.current_thread().name
        self._done = self.ops.running.is_set()
        self.ops.note("record", stream=stream.name, event=self.id)

    def query(self) -> bool:
        self.ops.note("query", event=self.id)
        return self._done or self.ops.running.is_set()

    def synchronize(self) -> None:
        self.ops.note("host_wait", event=self.id)
        if self.fail_sync:
            raise RuntimeError("injected: sticky device error")
        other = threading.current_thread().name != self.ops.main_thread
        if other and not self.ops.running.wait(timeout=60):  # a safety net for a broken test, not a timing check
            raise TimeoutError("the fake GPU was never resumed")
        self._done = True


class RecordingStreams:
    """``StreamOps`` that records; the calling thread's current stream is ``default`` unless ``set_current``."""

    def __init__(self, *, main_thread: str = "MainThread") -> None:
        self.main_thread = main_thread
        self.log: list[Op] = []
        self.events: dict[int, FakeEvent] = {}
        self.running = threading.Event()
        self.running.set()
        self.fail_records = 0
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._streams = itertools.count(1)
        self._tls = threading.local()

    def note(self, kind: str, **kw: Any) -> None:
        with self._lock:
            self.log.append(Op(kind=kind, thread=threading.current_thread().name, **kw))

    # -- the GPU's progress ----------------------------------------------------------------------------------

    def pause(self) -> None:
        self.running.clear()

    def resume(self) -> None:
        self.running.set()

    # -- StreamOps -----------------------------------------------------------------------------------------

    def set_current(self, stream: FakeStream) -> None:
        self._tls.current = stream

    def current_stream(self) -> FakeStream:
        current: FakeStream = getattr(self._tls, "current", FakeStream("default"))
        return current

    def new_stream(self) -> FakeStream:
        return FakeStream(f"side{next(self._streams)}")

    def new_event(self) -> FakeEvent:
        event = FakeEvent(self, next(self._ids))
        with self._lock:
            self.events[event.id] = event
        return event

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        self.note("use", stream=stream.name)
        before = self.current_stream()
        self._tls.current = stream
        try:
            yield
        finally:
            self._tls.current = before

    def wait_event(self, stream: Any, event: CopyEvent) -> None:
        ident = event.id if isinstance(event, FakeEvent) else None
        self.note("wait_event", stream=stream.name, event=ident)

    def wait_stream(self, stream: Any, other: Any) -> None:
        self.note("wait_stream", stream=stream.name, other=other.name)

    def bind_thread(self) -> None:
        self.note("bind")

    # -- reading the log -----------------------------------------------------------------------------------

    def ops(self, kind: str, **match: Any) -> list[Op]:
        with self._lock:
            log = list(self.log)
        return [op for op in log if op.kind == kind and all(getattr(op, k) == v for k, v in match.items())]

    def index(self, op: Op) -> int:
        with self._lock:
            return self.log.index(op)

    def mark(self) -> int:
        with self._lock:
            return len(self.log)

    def since(self, mark: int) -> list[Op]:
        with self._lock:
            return self.log[mark:]
