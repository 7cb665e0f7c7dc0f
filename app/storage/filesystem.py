"""Blocks as files under a root directory, laid out exactly as vLLM's fs tier lays them out.

A version is written to a staged file beside its key's file, checked, stamped and fsynced (``stage``; the stamps
and staged files are described in app/storage/fs_files.py); it is renamed into place, and the directory fsynced, by
``publish``, which the core calls after the index row naming the version committed. A crash leaves the old file or
the new one, never a torn block; a staged version that a committed row names is published by recovery
(``roll_forward``), one that no row names is dropped (``leftovers``). Removing a version is conditional on the
file still being that version, and durable (the directory is fsynced) before it returns.

File calls run on worker threads (app/threads.py), except those that cannot wait on the disk (``inline_bytes``):
a read the page cache holds (``RWF_NOWAIT``; a read that would wait goes to a thread) and its open, and, when the
store does not fsync, a small version's writes, rename and discard. Those run on the event loop, where a hop to a
thread and back costs more CPU than the call (PUT 64 KiB 0.73x, GET 64 KiB 0.59x of the CPU with every call on a
thread: ``python -m benchmarks.gateway.cost``), as nginx runs its file calls on its event loop.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from app.errors import BackendUnavailable, BlockNotFound, DigestMismatch, InvalidRequest, SizeMismatch, VersionMismatch
from app.storage.base import (
    BlockStore,
    BodyChecker,
    BodyPieces,
    ClosingReader,
    Leftover,
    ObjectInfo,
    Region,
    Staged,
    Version,
)
from app.storage.fs_files import (
    NO_LINKS,
    TEMP_PREFIX,
    batched,
    clear_files,
    copy_range,
    create_locked,
    drop_unlocked,
    find_leftovers,
    fsync_dir,
    grouped,
    hash_file,
    id_of,
    io,
    lock_file,
    make_dirs,
    new_id,
    probe_xattrs,
    quarantine_file,
    read_cached,
    read_stamp,
    restamp_file,
    roll_forward_file,
    seal_stamp,
    sweep_empty_dirs,
    temp_file,
    temp_name,
    walk_files,
    write_all,
)
from contract.wire import DEFAULT_ALGORITHM

__all__ = ["TEMP_PREFIX", "FilesystemStore", "FsReader"]


@dataclass(slots=True)
class _Temp:
    """A staged file and the descriptor that holds its writer's lock (closed by publish or discard)."""

    path: str | Path
    fd: int

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class FsReader(ClosingReader):
    __slots__ = ("_chunk", "_fd", "_inline", "size", "stamp")

    def __init__(self, fd: int, size: int, chunk_bytes: int, stamp: str, *, inline: bool = False) -> None:
        self._fd = fd
        self.size = size
        self._chunk = chunk_bytes
        self.stamp = stamp
        self._inline = inline

    async def chunks(self, *, start: int, end: int) -> AsyncIterator[bytes | bytearray]:
        pos = start
        while pos < end:
            n = min(self._chunk, end - pos)
            # from the page cache here when it holds them (no thread hop), else on a worker thread
            cached = await io(read_cached, self._fd, n, pos, what="read", inline=True) if self._inline else None
            data = cached if cached is not None else await io(os.pread, self._fd, n, pos, what="read")
            if not data:
                raise BackendUnavailable("block file shrank while being read")
            pos += len(data)
            yield data

    async def aclose(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


class FilesystemStore(BlockStore):
    uploads: ClassVar[bool] = True

    def __init__(
        self, *, root: Path, fsync: bool = True, chunk_bytes: int = 4 * 1024 * 1024, inline_bytes: int = 0
    ) -> None:
        self.root = root.resolve()
        self._root = str(self.root)
        self._fsync = fsync
        self._chunk = chunk_bytes
        self._inline = inline_bytes
        """File calls that cannot wait on the disk run on the event loop, not a worker thread (a hop costs more CPU
        than a small write): reads served by the page cache and their opens when > 0; a version's writes, rename
        and discard too when the store does not fsync and the body is at most this many bytes."""

    def _inline_write(self, size: int) -> bool:
        return not self._fsync and size <= self._inline

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        await io(lambda: self.root.mkdir(parents=True, exist_ok=True), what="create data root")
        await io(probe_xattrs, self.root, what="probe data root")

    async def close(self) -> None:
        return None

    async def check(self) -> None:
        def probe() -> None:
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "data root is not writable")

        try:
            await io(probe, what="check")
        except FileNotFoundError as exc:
            raise BackendUnavailable("data root is missing") from exc

    # -- paths -----------------------------------------------------------------------------------------------

    def path_of(self, key: str) -> Path:
        """The file of ``key``; keys are validated by contract.keys, this is defence in depth."""
        return Path(self.file_of(key))

    def file_of(self, key: str) -> str:
        """``path_of`` as a string, for the data path (a ``Path`` costs more to build than the write it names)."""
        if not key or "\\" in key or "\0" in key or "//" in key or key.startswith(("/", ".")) or key.endswith("/"):
            raise InvalidRequest(f"unsafe key {key[:120]!r}")  # an empty segment
        if "/." in key:
            raise InvalidRequest("key segments must not start with '.'")  # '.' and '..' among them
        return f"{self._root}/{key}"

    # -- writes ----------------------------------------------------------------------------------------------

    async def put(
        self, key: str, body: AsyncIterable[bytes], *, size: int, expected_digest: str | None = None
    ) -> Version:
        staged = await self.stage(key, body, size=size, expected_digest=expected_digest)
        try:
            await self.publish(staged)
        except BaseException:
            await self.discard(staged)
            raise
        return staged.meta

    async def stage(
        self,
        key: str,
        body: AsyncIterable[bytes],
        *,
        size: int,
        expected_digest: str | None = None,
        algorithm: str | None = None,
        stamp: str | None = None,
    ) -> Staged:
        """Stream ``body`` into a staged file beside the key's file, check it, stamp it, fsync it; not renamed."""
        if stamp is not None:
            raise ValueError("this store names its versions itself (new_stamp is None)")
        vid = new_id()
        tmp = temp_file(vid, self.file_of(key))
        checker = BodyChecker(size=size, expected_digest=expected_digest, algorithm=algorithm)
        inline = self._inline_write(size)
        fd = -1

        def step(pieces: list[bytes], last: bool) -> Staged | None:
            # one worker-thread hop per batch; a body that fits one batch is created, written and sealed in one
            nonlocal fd
            if fd < 0:
                fd = create_locked(tmp, fsync=self._fsync)
            for piece in pieces:  # the network chunks go down as one writev: hashed and written in place, no copy
                checker.update(piece)
            write_all(fd, pieces, None)
            if not last:
                return None
            meta = checker.finish()
            stamp = seal_stamp(fd, vid=vid, digest=meta.digest)
            if self._fsync:
                os.fsync(fd)
            return Staged(key=key, meta=meta, stamp=stamp, handle=_Temp(tmp, fd))

        try:
            if isinstance(body, BodyPieces):  # all here already (the PUT lane): no generator to step through
                groups = grouped(body, chunk_bytes=self._chunk)
                for i, pieces in enumerate(groups, 1):
                    staged = await io(step, pieces, i == len(groups), what="write", inline=inline)
                assert staged is not None
                return staged
            batches = aiter(batched(body, chunk_bytes=self._chunk))
            pending = await anext(batches, None)
            while True:
                following = await anext(batches, None) if pending is not None else None
                staged = await io(step, pending or [], following is None, what="write", inline=inline)
                if staged is not None:
                    return staged
                pending = following
        except BaseException:
            if fd >= 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                os.close(fd)
            raise

    async def place(self, key: str, offset: int, source: Staged) -> None:
        """Copy staged part ``source`` into upload file ``key`` at ``offset`` (created if missing; fsynced if the
        store fsyncs), in the kernel (``copy_file_range``): no byte of it passes through memory here. The caller
        orders writes to one upload (app/core/parts.py: under the key's lock, checked regions only)."""
        path = self.path_of(key)
        temp = source.handle
        assert isinstance(temp, _Temp)

        def run() -> None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
            try:
                fd = os.open(path, flags, 0o644)
            except FileNotFoundError:
                make_dirs(path.parent, fsync=self._fsync)
                fd = os.open(path, flags, 0o644)
            try:
                copy_range(temp.fd, fd, size=source.meta.size, offset=offset, chunk_bytes=self._chunk)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

        await io(run, what="write")

    async def stage_upload(
        self, key: str, target: str, regions: Sequence[Region], total: int, *, algorithm: str | None = None
    ) -> Staged:
        """Stage upload file ``key`` as a version of ``target`` by a hard link beside ``target``'s file (no copy):
        one read pass checks each region's digest and hashes the whole. The link is what ``publish`` renames and
        ``discard`` drops; the upload's own name stays until ``delete``, so a failed commit loses no part."""
        src = self.path_of(key)
        vid = new_id()
        tmp = temp_name(vid, self.path_of(target))

        def run() -> Staged:
            # the upload's file is locked before it gets its staged name (a link to the same file): no sweep ever
            # finds that name unlocked
            fd = os.open(src, os.O_RDWR | os.O_CLOEXEC)
            try:
                lock_file(fd, wait=True)  # a sweep looking at a leftover link of it holds it for a few calls
                meta = self._check_upload(fd, regions, total, algorithm=algorithm)
                try:
                    linked = _link(src, tmp)
                except FileNotFoundError:
                    make_dirs(tmp.parent, fsync=self._fsync)
                    linked = _link(src, tmp)
                if not linked:  # a filesystem without hard links: a copy, created locked
                    copy = create_locked(tmp, fsync=self._fsync)
                    try:
                        copy_range(fd, copy, size=total, offset=0, chunk_bytes=self._chunk)
                    finally:
                        os.close(fd)
                        fd = copy
                stamp = seal_stamp(fd, vid=vid, digest=meta.digest)
                if self._fsync:
                    os.fsync(fd)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            return Staged(key=target, meta=meta, stamp=stamp, handle=_Temp(tmp, fd))

        try:
            return await io(run, what="stage upload")
        except FileNotFoundError as exc:
            raise BlockNotFound(key) from exc

    def _check_upload(self, fd: int, regions: Sequence[Region], total: int, *, algorithm: str | None) -> Version:
        """Read the upload open as ``fd`` once: each region's digest checked, the whole hashed."""
        if (held := os.fstat(fd).st_size) != total:
            raise SizeMismatch(f"upload holds {held} bytes of {total}")
        whole = BodyChecker(size=total, expected_digest=None, algorithm=algorithm)
        for region in regions:
            part = BodyChecker(size=region.end - region.start, expected_digest=region.digest)
            pos = region.start
            while pos < region.end:
                data = os.pread(fd, min(self._chunk, region.end - pos), pos)
                if not data:
                    raise SizeMismatch("upload shrank while being read")
                part.update(data)
                whole.update(data)
                pos += len(data)
            try:
                part.finish()
            except DigestMismatch as exc:
                raise DigestMismatch(f"bytes {region.start}-{region.end - 1} are not the part recorded") from exc
        return whole.finish()

    async def publish(self, staged: Staged) -> None:
        """Rename the staged file over the key's file (atomic), then fsync the directory."""
        temp = staged.handle
        assert isinstance(temp, _Temp)
        final = self.file_of(staged.key)

        def rename() -> None:
            try:
                os.replace(temp.path, final)
                if self._fsync:
                    fsync_dir(os.path.dirname(final))
            finally:
                temp.close()

        try:
            await io(rename, what="publish", inline=self._inline_write(staged.meta.size))
        except (FileNotFoundError, NotADirectoryError) as exc:  # the staged file is gone: an outage, not a 500
            raise BackendUnavailable(f"publish {staged.key!r}: staged file is gone") from exc

    async def discard(self, staged: Staged) -> None:
        temp = staged.handle
        assert isinstance(temp, _Temp)

        def drop() -> None:
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp.path)
            finally:
                temp.close()

        await io(drop, what="discard", inline=self._inline_write(staged.meta.size))

    async def release(self, staged: Staged) -> None:
        """Close the staged file, which releases its writer's lock: a leftover for recovery (``roll_forward`` if the
        row names it, ``drop_leftover`` if not)."""
        temp = staged.handle
        assert isinstance(temp, _Temp)
        await io(temp.close, what="release", inline=True)

    async def remove(self, key: str, *, stamp: str | None) -> bool:
        """Unlink the key's file if it is version ``stamp`` (None: whatever is there), then fsync its directory:
        an acknowledged removal survives a power loss."""
        path = self.path_of(key)

        def run() -> bool:
            try:
                if stamp is not None and read_stamp(path, os.stat(path)) != stamp:
                    return False
                os.unlink(path)
            except (FileNotFoundError, NotADirectoryError):
                return False
            if self._fsync:
                fsync_dir(path.parent)
            return True

        return await io(run, what="remove")

    async def delete(self, key: str) -> bool:
        return await self.remove(key, stamp=None)

    async def clear(self, key: str, *, stamp: str | None) -> bool:
        """Unlink whatever file is under ``key`` and the staged file of version ``stamp`` (a committed version a
        crash left unpublished), then fsync the directory once; True if anything went."""
        path = self.path_of(key)
        vid = None if stamp is None else id_of(stamp)
        staged = None if vid is None else temp_name(vid, path)
        return await io(clear_files, path, staged, self._fsync, what="remove")

    async def quarantine(self, key: str, *, stamp: str | None) -> bool:
        """Rename the key's file, if it is still version ``stamp``, to a quarantine name beside it that listing,
        adoption and reads skip, then fsync the directory."""
        if stamp is None:  # every file has a stamp here: none names no file
            return False
        return await io(quarantine_file, self.path_of(key), stamp, self._fsync, what="quarantine")

    async def roll_forward(self, key: str, stamp: str) -> bool:
        """Publish the staged file of version ``stamp`` that a crash left between its commit and its rename."""
        vid = id_of(stamp)
        if vid is None:
            return False
        final = self.path_of(key)
        return await io(roll_forward_file, temp_name(vid, final), final, stamp, self._fsync, what="roll forward")

    async def leftovers(self) -> Sequence[Leftover]:
        """Staged files whose writer is gone (nobody holds their lock), with the key and stamp each was for."""
        return [Leftover(key=k, stamp=st, name=n) for k, st, n in await io(find_leftovers, self.root, what="sweep")]

    async def drop_leftover(self, leftover: Leftover) -> bool:
        path = Path(leftover.name)
        if not path.is_relative_to(self.root) or not path.name.startswith(TEMP_PREFIX):
            raise InvalidRequest(f"not a staged file of this store: {leftover.name!r}")
        return await io(drop_unlocked, path, what="sweep")

    # -- reads -----------------------------------------------------------------------------------------------

    async def open(self, key: str, *, stamp: str | None = None) -> FsReader:
        """Open the key's file; with ``stamp``, only if the open file is that version (the fd then pins it)."""
        path = self.file_of(key)

        def do_open() -> tuple[int, int, str]:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                return fd, st.st_size, read_stamp(fd, st)
            except BaseException:
                os.close(fd)
                raise

        try:
            fd, size, found = await io(do_open, what="open", inline=self._inline > 0)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise BlockNotFound(key) from exc
        if stamp is not None and found != stamp:
            os.close(fd)
            raise VersionMismatch(f"{key!r} holds version {found}, the index names {stamp}")
        return FsReader(fd, size, self._chunk, found, inline=self._inline > 0)

    def open_now(self, key: str, *, stamp: str, size: int) -> int | None:
        """A descriptor of the key's file if it is version ``stamp`` of ``size`` bytes and reading it will not wait
        on the disk, opened here and now (the GET lane sends it with ``sendfile``, app/api/server/get_lane.py);
        None for anything else (the reader of :meth:`open` then serves it). Inline reads off (``inline_bytes`` 0: a
        data root whose metadata or pages the kernel may not hold) is always None. The page cache is probed once,
        at the file's first byte (``RWF_NOWAIT``): a file written or read lately is cached whole, and the kernel's
        LRU ages a file's pages in the order they were touched, so a file written or read from its start loses its
        first page before the others. A probe is a heuristic, never a guarantee (what it does not see, ``sendfile``
        reads from the disk): it costs a syscall per GET, so one, not one per end. Not the integrity check: the
        stamp is."""
        if self._inline <= 0:
            return None
        try:
            fd = os.open(self.file_of(key), os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, InvalidRequest):
            return None
        try:
            st = os.fstat(fd)
            same = st.st_size == size and read_stamp(fd, st) == stamp
            if same and _cached_at(fd, 0, size):
                return fd
        except OSError:
            pass
        os.close(fd)
        return None

    async def head(self, key: str) -> int | None:
        path = self.path_of(key)
        try:
            st = await io(os.stat, path, what="stat")
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size

    async def digest(self, key: str, *, algorithm: str = DEFAULT_ALGORITHM) -> Version:
        return await self._hash(key, claim=False, algorithm=algorithm)

    def issued(self, stamp: str | None) -> bool:
        return stamp is not None and id_of(stamp) is not None

    async def restamp(self, key: str, *, stamp: str) -> str | None:
        """Give the file under ``key`` an id of ours if it is still version ``stamp`` (an ``<inode>:<mtime>`` stamp
        of an earlier release), without reading it."""
        return await io(restamp_file, self.path_of(key), stamp, self._fsync, what="restamp")

    async def claim(self, key: str, *, algorithm: str = DEFAULT_ALGORITHM) -> Version:
        """Hash the file under ``key`` and, if it carries no stamp of this store's (vLLM wrote it, or an earlier
        kvgate), give it one: from then on its readers are checked against an id that never repeats."""
        return await self._hash(key, claim=True, algorithm=algorithm)

    async def _hash(self, key: str, *, claim: bool, algorithm: str) -> Version:
        try:
            return await io(hash_file, self.path_of(key), self._chunk, claim, self._fsync, algorithm, what="read")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise BlockNotFound(key) from exc

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Walk the root in a worker thread, yielding published files in batches (staged files are skipped)."""
        for info in await io(walk_files, self.root, prefix, what="list"):
            yield info

    async def remove_empty_dirs(self, prefix: str, *, older_than_s: float) -> int:
        """Remove empty directories under ``prefix`` (not ``prefix`` itself) untouched for ``older_than_s``; how
        many. A write that needs one again makes it again (``place``, ``stage``)."""
        return await io(sweep_empty_dirs, self.path_of(prefix.rstrip("/")), older_than_s, what="sweep")


def _link(src: Path, dst: Path) -> bool:
    """Hard-link ``src`` as ``dst``; False where the filesystem (or the file) takes no more links."""
    try:
        os.link(src, dst)
        return True
    except OSError as exc:
        if exc.errno not in NO_LINKS:
            raise
    return False


def _cached_at(fd: int, pos: int, size: int) -> bool:
    """Whether the page cache holds the byte at ``pos`` of the file open as ``fd`` (an empty file: nothing to hold)."""
    if size == 0:
        return True
    got = read_cached(fd, 1, pos)
    return got is not None and len(got) == 1
