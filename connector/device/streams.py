"""The stream and event operations the transfers use, behind one small seam.

``CudaStreams`` is the real thing (``torch.cuda``); a CPU-only machine runs the transfers with no streams at all
(copies are synchronous and their events complete at once). The seam exists so that CI, which has no CUDA, can
hand the transfers a recording implementation and check the ordering rules: which thread recorded which event on
which stream, and which stream waited on it (tests/connector/fakes.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch

__all__ = ["CopyEvent", "CudaStreams", "DeviceEvent", "StreamOps"]


class CopyEvent(Protocol):
    """Marks the end of queued copies: ``query`` never waits, ``synchronize`` waits on the host."""

    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class DeviceEvent(CopyEvent, Protocol):
    def record(self, stream: Any) -> None: ...


class StreamOps(Protocol):
    """What a transfer needs from the device runtime. Streams are opaque; ``current_stream`` is per thread."""

    def current_stream(self) -> Any: ...
    def new_stream(self) -> Any: ...
    def new_event(self) -> DeviceEvent: ...
    def use(self, stream: Any) -> contextlib.AbstractContextManager[None]: ...
    def wait_event(self, stream: Any, event: CopyEvent) -> None: ...
    def wait_stream(self, stream: Any, other: Any) -> None: ...
    def bind_thread(self) -> None:
        """Make the calling thread use the transfers' device (its first CUDA call would pick device 0)."""
        ...


class CudaStreams:
    """``StreamOps`` on ``torch.cuda`` for one device."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaStreams needs a CUDA device, got {device}")
        self.device = device

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

    def new_event(self) -> DeviceEvent:
        event: DeviceEvent = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        return event  # blocking: a host wait sleeps the thread instead of spinning a core

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield

    def wait_event(self, stream: Any, event: CopyEvent) -> None:
        if isinstance(event, torch.cuda.Event):
            stream.wait_event(event)
        elif not event.query():  # not a device event (a CPU copy's): it is complete, or we must wait for it here
            event.synchronize()

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)
