"""Blocks as files under a root directory, laid out exactly as vLLM's fs tier lays them out.

A write goes to a unique hidden temp file in the target directory and is fsynced (``stage``); it is ``os.replace``d
into place (and the directory fsynced) by ``publish``, which BlockService calls after the index row naming the new
version committed. A crash leaves the old file or the new one, never a torn block; each file version is named by
its stamp (inode and mtime), which the row records, so a file that is not the row's version is found by a stat.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

import anyio.to_thread

from app.errors import (
    BackendUnavailable,
    BlockNotFound,
    DigestMismatch,
    InsufficientStorage,
    InvalidRequest,
    SizeMismatch,
    VersionMismatch,
)
from app.storage.base import BodyChecker, ClosingReader, ObjectInfo, ObjectMeta, Region, Staged

TEMP_PREFIX = ".kvgate-tmp-"
T = TypeVar("T")


def _translate(exc: OSError, what: str) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientStorage(f"{what}: no space left on the block store")
    return BackendUnavailable(f"{what}: {exc.strerror or exc}")


async def _io(fn: Callable[..., T], *args: object, what: str) -> T:
    try:
        return await anyio.to_thread.run_sync(fn, *args)
    except (FileNotFoundError, NotADirectoryError):
        raise
    except OSError as exc:
        raise _translate(exc, what) from exc


def stamp_of(st: os.stat_result) -> str:
    """A file version's stamp: its inode and its mtime in ns. The rename that publishes a file keeps both, every
    write makes a new inode (never written in place), and the old inode is not free for reuse while its file is
    still the one under the key, so two versions of one key never share a stamp."""
    return f"{st.st_ino}:{st.st_mtime_ns}"


def written_before(stamp: str, other: str | None) -> bool:
    """``stamp``'s file was written before ``other``'s (both stamps of this store; False if either is not)."""
    try:
        return int(stamp.split(":")[1]) < int((other or "").split(":")[1])
    except (IndexError, ValueError):
        return False


def _write_all(fd: int, pieces: list[bytes], offset: int | None) -> None:
    """All of ``pieces`` in one writev (at the file position) or pwritev (at ``offset``), short writes resumed."""
    views = [memoryview(p) for p in pieces]
    while views:
        written = os.writev(fd, views) if offset is None else os.pwritev(fd, views, offset)
        if offset is not None:
            offset += written
        while views and written >= len(views[0]):
            written -= len(views.pop(0))
        if views and written:
            views[0] = views[0][written:]


def _fsync_dir(path: Path) -> None:
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK)
"""errnos of a filesystem (or a file) that takes no more hard links."""


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` as ``dst``; where the filesystem has no hard links, copy it (shutil: in the kernel where it
    can) and fsync the copy."""
    try:
        os.link(src, dst)
        return
    except OSError as exc:
        if exc.errno not in NO_LINKS:
            raise
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def batched(body: AsyncIterable[bytes], *, chunk_bytes: int, max_pieces: int = 512) -> AsyncIterator[list[bytes]]:
    """Group network chunks into lists of at least ``chunk_bytes`` (at most ``max_pieces``, under IOV_MAX)."""
    pieces: list[bytes] = []
    held = 0
    async for piece in body:
        if not piece:
            continue
        pieces.append(piece)
        held += len(piece)
        if held >= chunk_bytes or len(pieces) >= max_pieces:
            yield pieces
            pieces, held = [], 0
    if pieces:
        yield pieces


class FsReader(ClosingReader):
    __slots__ = ("_chunk", "_fd", "size", "stamp")

    def __init__(self, fd: int, size: int, chunk_bytes: int, stamp: str) -> None:
        self._fd = fd
        self.size = size
        self._chunk = chunk_bytes
        self.stamp = stamp

    async def chunks(self, *, start: int, end: int) -> AsyncIterator[bytes]:
        pos = start
        while pos < end:
            n = min(self._chunk, end - pos)
            data = await _io(os.pread, self._fd, n, pos, what="read")
            if not data:
                raise BackendUnavailable("block file shrank while being read")
            pos += len(data)
            yield data

    async def aclose(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


class FilesystemStore:
    def __init__(self, *, root: Path, fsync: bool = True, chunk_bytes: int = 4 * 1024 * 1024) -> None:
        self.root = root.resolve()
        self._fsync = fsync
        self._chunk = chunk_bytes

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        await _io(lambda: self.root.mkdir(parents=True, exist_ok=True), what="create data root")

    async def close(self) -> None:
        return None

    async def check(self) -> None:
        def probe() -> None:
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "data root is not writable")

        try:
            await _io(probe, what="check")
        except FileNotFoundError as exc:
            raise BackendUnavailable("data root is missing") from exc

    # -- paths -----------------------------------------------------------------------------------------------

    def path_of(self, key: str) -> Path:
        """The file of ``key``; keys are validated by contract.keys, this is defence in depth."""
        parts = key.split("/")
        if key.startswith("/") or "\\" in key or "\0" in key or any(p in ("", ".", "..") for p in parts):
            raise InvalidRequest(f"unsafe key {key[:120]!r}")
        if any(p.startswith(".") for p in parts):
            raise InvalidRequest("key segments must not start with '.'")
        return self.root.joinpath(*parts)

    # -- writes ----------------------------------------------------------------------------------------------

    async def put(
        self, key: str, body: AsyncIterable[bytes], *, size: int, expected_digest: str | None = None
    ) -> ObjectMeta:
        staged = await self.stage(key, body, size=size, expected_digest=expected_digest)
        try:
            await self.publish(staged)
        except BaseException:
            await self.discard(staged)
            raise
        return staged.meta

    async def stage(
        self, key: str, body: AsyncIterable[bytes], *, size: int, expected_digest: str | None = None
    ) -> Staged:
        """Stream ``body`` into a unique hidden temp file beside the key's file, check it, fsync it; not renamed."""
        final = self.path_of(key)
        tmp = final.parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
        checker = BodyChecker(size=size, expected_digest=expected_digest)

        def create() -> int:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            try:  # the key's directory is there for all but a prefix's first block: no mkdir walk per PUT
                return os.open(tmp, flags, 0o644)
            except FileNotFoundError:
                final.parent.mkdir(parents=True, exist_ok=True)
                return os.open(tmp, flags, 0o644)

        def write(fd: int, pieces: list[bytes]) -> None:
            # the network chunks go down as one writev: hashed and written in place, never joined (no copy)
            for piece in pieces:
                checker.update(piece)
            _write_all(fd, pieces, None)

        fd = -1

        def seal() -> str:
            nonlocal fd
            if self._fsync:
                os.fsync(fd)
            st = os.fstat(fd)
            done, fd = fd, -1
            os.close(done)
            return stamp_of(st)

        def step(pieces: list[bytes], last: bool) -> Staged | None:
            # one worker-thread hop per batch; a body that fits one batch is created, written and sealed in one
            nonlocal fd
            if fd < 0:
                fd = create()
            write(fd, pieces)
            if not last:
                return None
            meta = checker.finish()
            return Staged(key=key, meta=meta, stamp=seal(), handle=tmp)

        try:
            batches = aiter(batched(body, chunk_bytes=self._chunk))
            pending = await anext(batches, None)
            while True:
                following = await anext(batches, None) if pending is not None else None
                staged = await _io(step, pending or [], following is None, what="write")
                if staged is not None:
                    return staged
                pending = following
        except BaseException:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            raise

    # -- uploads: the parts of one object written into the object's own file ---------------------------------

    async def write_at(self, key: str, offset: int, pieces: list[bytes]) -> None:
        """Write ``pieces`` at ``offset`` of upload file ``key`` (created if missing; fsynced if the store fsyncs).
        The caller orders writes to one upload (app/core/parts.py: under the key's lock, checked regions only)."""
        path = self.path_of(key)

        def run() -> None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
            try:
                fd = os.open(path, flags, 0o644)
            except FileNotFoundError:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, flags, 0o644)
            try:
                _write_all(fd, pieces, offset)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

        await _io(run, what="write")

    async def stage_upload(self, key: str, target: str, regions: list[Region], total: int) -> Staged:
        """Stage upload file ``key`` as a version of ``target`` by a hard link beside ``target``'s file (no copy):
        one read pass checks each region's digest and hashes the whole. The link is what ``publish`` renames and
        ``discard`` drops; the upload's own name stays until ``delete``, so a failed commit loses no part."""
        src = self.path_of(key)
        final = self.path_of(target)
        tmp = final.parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}"

        def run() -> Staged:
            fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if (held := os.fstat(fd).st_size) != total:
                    raise SizeMismatch(f"upload holds {held} bytes of {total}")
                whole = hashlib.sha256()
                for region in regions:
                    part = hashlib.sha256()
                    pos = region.start
                    while pos < region.end:
                        data = os.pread(fd, min(self._chunk, region.end - pos), pos)
                        if not data:
                            raise SizeMismatch("upload shrank while being read")
                        part.update(data)
                        whole.update(data)
                        pos += len(data)
                    if part.hexdigest() != region.digest:
                        raise DigestMismatch(f"bytes {region.start}-{region.end - 1} are not the part recorded")
                if self._fsync:
                    os.fsync(fd)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            try:
                _link_or_copy(src, tmp)
            except FileNotFoundError:
                final.parent.mkdir(parents=True, exist_ok=True)
                _link_or_copy(src, tmp)
            if not os.path.samefile(src, tmp):  # copied: the copy is the version, with a stamp of its own
                st = os.stat(tmp)
            return Staged(
                key=target, meta=ObjectMeta(size=total, digest=whole.hexdigest()), stamp=stamp_of(st), handle=tmp
            )

        try:
            return await _io(run, what="stage upload")
        except FileNotFoundError as exc:
            raise BlockNotFound(key) from exc

    async def publish(self, staged: Staged) -> None:
        """Rename the staged file over the key's file (atomic), then fsync the directory."""
        tmp = Path(str(staged.handle))
        final = self.path_of(staged.key)

        def rename() -> None:
            os.replace(tmp, final)
            if self._fsync:
                _fsync_dir(final.parent)

        await _io(rename, what="publish")

    async def discard(self, staged: Staged) -> None:
        await _io(Path(str(staged.handle)).unlink, True, what="discard")

    async def remove(self, key: str, *, stamp: str | None) -> bool:
        """Unlink the key's file. One file per key: the caller (holding the key) removes whatever version is there."""
        return await self.delete(key)

    async def delete(self, key: str) -> bool:
        path = self.path_of(key)
        try:
            await _io(path.unlink, what="delete")
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    # -- reads -----------------------------------------------------------------------------------------------

    async def open(self, key: str, *, stamp: str | None = None) -> FsReader:
        """Open the key's file; with ``stamp``, only if the open file is that version (the fd then pins it)."""
        path = self.path_of(key)

        def do_open() -> tuple[int, int, str]:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                return fd, st.st_size, stamp_of(st)
            except BaseException:
                os.close(fd)
                raise

        try:
            fd, size, found = await _io(do_open, what="open")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise BlockNotFound(key) from exc
        if stamp is not None and found != stamp:
            os.close(fd)
            raise VersionMismatch(f"{key!r} holds version {found}, the index names {stamp}")
        return FsReader(fd, size, self._chunk, found)

    async def head(self, key: str) -> int | None:
        path = self.path_of(key)
        try:
            st = await _io(os.stat, path, what="stat")
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size

    async def digest(self, key: str) -> ObjectMeta:
        reader = await self.open(key)
        try:
            checker = BodyChecker(size=reader.size, expected_digest=None)
            async for chunk in reader.chunks(start=0, end=reader.size):
                checker.update(chunk)
            meta = checker.finish()
            return ObjectMeta(size=meta.size, digest=meta.digest, stamp=reader.stamp)
        finally:
            await reader.aclose()

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Walk the root in a worker thread, yielding published files in batches (temp files are skipped)."""

        def walk() -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            for dirpath, dirnames, filenames in os.walk(self.root):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                rel_dir = os.path.relpath(dirpath, self.root)
                for name in sorted(filenames):
                    if name.startswith("."):
                        continue
                    rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                    if not rel.startswith(prefix):
                        continue
                    try:
                        st = os.stat(os.path.join(dirpath, name))
                    except FileNotFoundError:
                        continue
                    key = rel.replace(os.sep, "/")
                    found.append(ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime, stamp=stamp_of(st)))
            return found

        for info in await _io(walk, what="list"):
            yield info

    def written_before(self, stamp: str, other: str | None) -> bool:
        """Reconcile: the file under a key is older than the version its row names (a crash before the rename)."""
        return written_before(stamp, other)

    async def remove_empty_dirs(self, prefix: str, *, older_than_s: float) -> int:
        """Remove empty directories under ``prefix`` (not ``prefix`` itself) untouched for ``older_than_s``; how
        many. A write that needs one again makes it again (``write_at``, ``stage``)."""
        top = self.path_of(prefix.rstrip("/"))

        def sweep() -> int:
            removed = 0
            cutoff = time.time() - older_than_s
            for dirpath, _dirnames, _filenames in os.walk(top, topdown=False):
                if dirpath == str(top):
                    continue
                try:
                    if os.stat(dirpath).st_mtime <= cutoff:
                        os.rmdir(dirpath)  # fails on a directory that is not empty (or no longer is)
                        removed += 1
                except OSError:
                    pass
            return removed

        return await _io(sweep, what="sweep")

    async def remove_temp_files(self, *, older_than_s: float = 0.0) -> int:
        """Delete temp files of interrupted writes; returns how many were removed."""

        def sweep() -> int:
            removed = 0
            cutoff = time.time() - older_than_s
            for dirpath, _dirnames, filenames in os.walk(self.root):
                for name in filenames:
                    if name.startswith(TEMP_PREFIX):
                        p = os.path.join(dirpath, name)
                        try:
                            if os.stat(p).st_mtime <= cutoff:
                                os.unlink(p)
                                removed += 1
                        except FileNotFoundError:
                            pass
            return removed

        return await _io(sweep, what="sweep")
