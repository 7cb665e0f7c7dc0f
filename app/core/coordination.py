"""Coordination of the processes that share one data directory: gateway workers, ``kvgate gc``, ``kvgate import``.

One file, ``<data_dir>/kvgate.coord``, holds two things, both keyed by a key's *stripe* (crc32 of the key, modulo
``STRIPES``):

- **locks**: an open-file-description lock (``F_OFD_SETLK``) on byte ``stripe`` of the file. Such a lock belongs to
  one open file description, not to a process, so it excludes other processes *and* other holders in the same
  process (each holder locks through a description of its own), and the kernel releases it when its holder dies
  (kill -9 included). A change of a key holds its stripe's lock from before it reads the key's row until after its
  data is published, so every process sees each key's changes one at a time, in commit order.
- **epochs**: a memory-mapped table of one 64-bit counter per stripe, shared by every process that maps the file.
  The holder of a stripe's lock moves its counter to an odd value before it changes the key's row and to the next
  even value after the change is done (a seqlock). A row read between two equal, even values of its stripe's
  counter is current, and a cached row stays good while the counter has not moved: that is how a process's
  metadata cache learns of another process's change.

The file has an identity: a random generation, written before the file is linked under its name. A process checks
that the file it opened still has one link at every metadata-cache hit, and that the name leads to it at every
change (and every ``PATH_CHECK_S`` on hits) (``intact``):
a file removed or replaced under running processes splits them into groups that share nothing, so a process whose
file is gone drops its cache, refuses changes (``CoordinationLost``, 503) and restarts.

Without a file (``LocalEpochs`` only, in-process tests over the memory store) the same protocol runs inside one
process. Across machines (replicas over S3 and PostgreSQL) nothing here is shared: there every change is a
compare-and-set on the version in the index, and the metadata cache is off by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import mmap
import os
import struct
import sys
import time
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Protocol

from app.errors import BackendUnavailable

STRIPES = 1 << 16
"""Stripes of the lock and epoch tables: two keys share a lock (and an epoch) with probability 1/STRIPES."""
_EPOCH = struct.Struct("<Q")
TABLE_BYTES = _EPOCH.size * STRIPES
NAMED_BASE = STRIPES
"""Byte offsets from here on are named locks (``exclusive(name)``): the evictor's, the events publisher's, one holder
at a time."""
NAMED = {"evict": 0, "reconcile": 1, "events": 2, "scrub": 3, "identity": 4}
GENERATION = TABLE_BYTES
"""Offset of the file's generation: 16 random bytes written before the file is linked under its name (or, for a
file of an earlier release, once, under the "identity" lock), never zero."""
FILE_BYTES = TABLE_BYTES + 64
PATH_CHECK_S = 0.1
"""How often, at most, a cache hit also checks that the file's name still leads to it (a change always does)."""
_FLOCK = struct.Struct("@hhqqi4x")
"""struct flock on Linux (l_type, l_whence, l_start, l_len, l_pid); l_pid must be 0 for OFD locks."""
WATCH_S = 1.0
"""How often a serving process checks its coordination file when nothing else does (``Coordinator.watch``)."""
POLL_FIRST_S = 0.0005
POLL_MAX_S = 0.02


def stripe_of(key: str) -> int:
    """The stripe of ``key``: stable across processes and runs (Python's own hash() is salted per process)."""
    return zlib.crc32(key.encode()) & (STRIPES - 1)


class Epochs(Protocol):
    """One counter per stripe: odd while a change of a key of that stripe is in flight, even at rest."""

    def get(self, stripe: int) -> int: ...

    def begin(self, stripe: int) -> None:
        """Move to the next odd value (the caller holds the stripe's lock)."""

    def end(self, stripe: int) -> None:
        """Move to the next even value (the caller holds the stripe's lock)."""

    def intact(self) -> bool:
        """The table is still the one every process of the data directory shares."""


def _next_odd(value: int) -> int:
    # a holder that died mid-change left an odd value: skip past it, never back
    return value + 1 if value % 2 == 0 else value + 2


class LocalEpochs:
    """The epoch table of one process (no other process shares its keys)."""

    def __init__(self) -> None:
        self._values = [0] * STRIPES

    def get(self, stripe: int) -> int:
        return self._values[stripe]

    def begin(self, stripe: int) -> None:
        self._values[stripe] = _next_odd(self._values[stripe])

    def end(self, stripe: int) -> None:
        self._values[stripe] += 1

    def intact(self) -> bool:
        return True


class CoordinationUnavailable(RuntimeError):
    """The data directory cannot hold the coordination file (or the OS has no open-file-description locks)."""


class CoordinationLost(BackendUnavailable):
    """The coordination file this process opened is no longer the data directory's (removed, replaced): its locks
    and epochs are shared with nobody now. Changes are refused (503) and the process restarts."""


class Coordinator:
    """The shared lock and epoch tables of one data directory (see the module docstring)."""

    def __init__(self, path: Path, *, on_lost: Callable[[], None] | None = None) -> None:
        self.path = path
        self._on_lost = on_lost
        self.lost = False
        """Sticky: the file was found removed or replaced (``intact``)."""
        try:
            fd = _open_or_create(path)
        except OSError as exc:
            raise CoordinationUnavailable(f"cannot open {path}: {exc.strerror or exc}") from exc
        try:
            if os.fstat(fd).st_size < FILE_BYTES:
                os.ftruncate(fd, FILE_BYTES)  # zeros: every epoch even (at rest); growing never loses a value
            self._map = mmap.mmap(fd, FILE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if sys.platform != "linux":
                raise CoordinationUnavailable("this OS has no open-file-description locks (F_OFD_SETLK): Linux needed")
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._spare: list[int] = []
        """Open descriptions of the file, each able to hold one lock, kept for reuse (opening costs a syscall)."""
        if not any(self._map[GENERATION : GENERATION + 16]):  # a file of an earlier release: given one, once
            lock = self.try_lock(NAMED_BASE + NAMED["identity"])
            while lock is None:
                lock = self.try_lock(NAMED_BASE + NAMED["identity"])
            try:
                if not any(self._map[GENERATION : GENERATION + 16]):
                    self._map[GENERATION : GENERATION + 16] = _new_generation()
            finally:
                self.unlock(lock, NAMED_BASE + NAMED["identity"])
        self.generation = bytes(self._map[GENERATION : GENERATION + 16])
        st = os.fstat(fd)
        self._identity = (st.st_dev, st.st_ino)
        self._path_checked = time.monotonic()

    def intact(self, *, thorough: bool = False) -> bool:
        """The file is still the one this process opened, the data directory's: one link (removed, or replaced by
        a rename, it has none; linked elsewhere, two), and the name leads to it (checked by ``thorough`` calls, and
        at least every ``PATH_CHECK_S`` otherwise: one fstat per metadata-cache hit, a path lookup now and then).
        Once False, False for good; the first time, ``on_lost`` is called (a gateway worker restarts, opening the
        file that is there now)."""
        if self.lost:
            return False
        try:
            ok = os.fstat(self._fd).st_nlink == 1
            now = time.monotonic()
            if ok and (thorough or now - self._path_checked > PATH_CHECK_S):
                st = os.stat(self.path)
                ok = (st.st_dev, st.st_ino) == self._identity
                self._path_checked = now
        except OSError:
            ok = False
        if not ok:
            self.lost = True
            if self._on_lost is not None:
                self._on_lost()
        return ok

    async def watch(self, *, every_s: float = WATCH_S) -> None:
        """Check the file every ``every_s`` until it is found lost (then ``on_lost`` has been called): a process that
        gets no request and makes no change (one worker of several, idle) still learns of it and restarts, rather
        than waiting for its next request to find out."""
        while True:
            await asyncio.sleep(every_s)
            if not self.intact(thorough=True):
                return

    def check(self) -> None:
        """CoordinationLost unless ``intact``."""
        if not self.intact(thorough=True):
            raise CoordinationLost(f"{self.path} was removed or replaced while this process used it")

    def close(self) -> None:
        for fd in self._spare:
            os.close(fd)
        self._spare.clear()
        self._map.close()
        os.close(self._fd)

    # -- epochs (Epochs) --------------------------------------------------------------------------------------

    def get(self, stripe: int) -> int:
        value: int = _EPOCH.unpack_from(self._map, stripe * _EPOCH.size)[0]
        return value

    def begin(self, stripe: int) -> None:
        _EPOCH.pack_into(self._map, stripe * _EPOCH.size, _next_odd(self.get(stripe)))

    def end(self, stripe: int) -> None:
        _EPOCH.pack_into(self._map, stripe * _EPOCH.size, self.get(stripe) + 1)

    # -- locks ------------------------------------------------------------------------------------------------

    def _description(self) -> int:
        """A spare open file description of this process's file, or a new one of that same file (never of what
        the name leads to now: after a removal there is nothing there, after a replacement another file, whose
        locks exclude nobody who shares these epochs): ``/proc/self/fd`` opens the inode this process holds, even
        unlinked. CoordinationLost (503) where that fails."""
        if self._spare:
            return self._spare.pop()
        try:
            return os.open(f"/proc/self/fd/{self._fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            pass
        try:  # no /proc: by the name, if it still leads to this file
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            fd = -1
        if fd >= 0:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == self._identity:
                return fd
            os.close(fd)
        self.check()  # not intact: lost (the worker restarts)
        raise CoordinationLost(f"{self.path}: no description of it can be opened")

    def try_lock(self, offset: int) -> int | None:
        """Lock byte ``offset`` without waiting: the description holding it, or None if another holds it."""
        fd = self._description()
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
        except OSError as exc:
            self._spare.append(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return None
            raise
        return fd

    def unlock(self, fd: int, offset: int) -> None:
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, offset, 1, 0))
        except OSError:
            os.close(fd)  # closing the description releases its lock all the same
            return
        if len(self._spare) < 64:
            self._spare.append(fd)
        else:
            os.close(fd)

    @contextlib.asynccontextmanager
    async def locked(self, offset: int) -> AsyncIterator[None]:
        """Hold the lock on byte ``offset``, polling while another holds it (contention across processes is rare:
        two changes of one key, or of two keys of one stripe, at once)."""
        delay = POLL_FIRST_S
        while (fd := self.try_lock(offset)) is None:
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)
        try:
            yield
        finally:
            self.unlock(fd, offset)

    async def wait_free(self, offset: int) -> None:
        """Return once nobody holds the lock on ``offset`` (a change in flight elsewhere has finished)."""
        async with self.locked(offset):
            pass

    def exclusive(self, name: str) -> contextlib.AbstractAsyncContextManager[None]:
        """A named lock that one holder at a time has across processes (e.g. the evictor)."""
        return self.locked(NAMED_BASE + NAMED[name])

    def try_exclusive(self, name: str) -> int | None:
        return self.try_lock(NAMED_BASE + NAMED[name])

    def release_exclusive(self, name: str, fd: int) -> None:
        self.unlock(fd, NAMED_BASE + NAMED[name])

    def held(self, name: str) -> bool:
        """Some process of this machine (this one included) holds the named lock now (F_OFD_GETLK from a spare
        description, which holds no lock: every holder's is another)."""
        fd = self._description()
        try:
            probe = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, NAMED_BASE + NAMED[name], 1, 0)
            l_type = _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe))[0]
        finally:
            self._spare.append(fd)
        return bool(l_type != fcntl.F_UNLCK)


def _new_generation() -> bytes:
    while not any(generation := os.urandom(16)):
        pass
    return generation


def _open_or_create(path: Path) -> int:
    """Open the file, or create it whole (sized, its generation written) under another name and link it to
    ``path``: no process ever opens it without a generation, and of two creating it at once, one link wins."""
    while True:
        try:
            return os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            pass
        tmp = path.with_name(f".{path.name}.{os.urandom(8).hex()}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(fd, FILE_BYTES)
            os.pwrite(fd, _new_generation(), GENERATION)
            os.fsync(fd)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            os.close(fd)
            os.unlink(tmp)


def open_coordinator(data_dir: Path, *, on_lost: Callable[[], None] | None = None) -> Coordinator:
    """The coordinator of ``data_dir`` (created on first use); ``on_lost``: called once if the file is found
    removed or replaced (``Coordinator.intact``)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    return Coordinator(data_dir / "kvgate.coord", on_lost=on_lost)
