"""The filesystem store's file-level pieces: version stamps, staged (temp) files, durable directory changes, reads.

**A version's stamp** is ``<id>.<mtime_ns>``: ``id`` is 128 random bits drawn when the version is staged, written
into the file's extended attribute ``user.kvgate.version`` together with the mtime the file had once written
(``fsetxattr`` does not move the mtime; a rename or a hard link keeps both). A reader opens the key's file and
reads the attribute and the mtime from the open descriptor: the stamp it finds is the row's only if the file is
that very version, unchanged since. Ids never repeat, whatever the kernel does with inode numbers or how coarse its
timestamps are; a file changed in place keeps its id but not its mtime, so it no longer matches. A file without a
valid attribute (written by vLLM's fs tier, or by kvgate before stamps had ids) is named ``<inode>:<mtime_ns>``,
the stamps of earlier releases, which rows written then still hold.

**The sealed checksum**: the attribute also carries, after a space, the checksum the bytes had when they were
sealed (``<id>.<mtime_ns> crc64nvme:<hex>``). Bit rot keeps both id and mtime, so it is the only witness left when
no row names the file (a crash between rename and commit, a lost index): ``hash_file`` refuses to vouch for bytes
that are not those sealed (``CorruptData``), and nobody adopts them under a fresh checksum.

**A staged version** is ``.kvgate-tmp-<id>.<name>`` in its key's directory, where ``name`` is the key's file name:
its writer holds an open-file-description lock on it until it is published or discarded, so a sweep can tell a
live writer's file (locked) from one a crash left behind (unlocked), with no clock involved. Between the file's
creation and its lock a sweep may take it: the writer waits for the lock, then checks that the name is still its
file, and makes it again if not (``create_locked``); an upload's file is locked before it is linked as staged.

**Quarantined bytes** (judged corrupt) are renamed to ``.kvgate-corrupt-<id>.<name>`` before their row goes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import struct
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from app.errors import BackendUnavailable, CorruptData, InsufficientStorage, SizeMismatch
from app.storage.base import BodyChecker, ObjectInfo, Version
from app.threads import run_sync
from contract.wire import Checksum, parse_checksum_token

TEMP_PREFIX = ".kvgate-tmp-"
QUARANTINE_PREFIX = ".kvgate-corrupt-"
"""Bytes judged corrupt, moved aside under ``<prefix><id>.<name>`` before their row goes: kept for the operator to
inspect (never counted, listed, adopted or read), removed at will."""
XATTR = "user.kvgate.version"
T = TypeVar("T")
_FLOCK = struct.Struct("@hhqqi4x")
_NO_XATTR = (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP)
_nowait = hasattr(os, "RWF_NOWAIT")
"""Whether ``read_cached`` may try a non-blocking read (cleared when the kernel or filesystem refuses one)."""


def translate(exc: OSError, what: str) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientStorage(f"{what}: no space left on the block store")
    return BackendUnavailable(f"{what}: {exc.strerror or exc}")


async def io(fn: Callable[..., T], *args: object, what: str, inline: bool = False) -> T:
    """``fn(*args)`` on a worker thread (app/threads.py), or here on the event loop when ``inline`` (a call that
    cannot wait on the disk: see FilesystemStore); OSErrors other than a missing file become the domain's errors."""
    try:
        if inline:
            return fn(*args)
        return await run_sync(fn, *args)
    except (FileNotFoundError, NotADirectoryError):
        raise
    except OSError as exc:
        raise translate(exc, what) from exc


# -- stamps ---------------------------------------------------------------------------------------------------


def new_id() -> str:
    return uuid.uuid4().hex


def id_of(stamp: str) -> str | None:
    """The version id of one of this store's stamps (None for an ``<inode>:<mtime>`` stamp)."""
    vid, sep, _ = stamp.partition(".")
    return vid if sep and len(vid) == 32 else None


def read_cached(fd: int, n: int, pos: int) -> bytearray | None:
    """Up to ``n`` bytes of the file open as ``fd`` from ``pos`` if the page cache holds the first of them, without
    waiting on the disk (``RWF_NOWAIT``); None when reading them would wait (or the filesystem cannot tell)."""
    global _nowait
    if not _nowait:
        return None
    buf = bytearray(n)
    try:
        got = os.preadv(fd, [buf], pos, os.RWF_NOWAIT)
    except BlockingIOError:
        return None
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        _nowait = False  # a filesystem without non-blocking buffered reads: every read goes to a thread
        return None
    if got < n:
        del buf[got:]  # a short read: the cached part (or nothing at the end of the file)
    return buf


def _attribute(target: int | str | Path) -> str:
    try:
        raw = os.getxattr(target, XATTR)
    except OSError as exc:
        if exc.errno not in _NO_XATTR:
            raise
        return ""
    return raw.decode("ascii", "replace")


def read_stamp(target: int | str | Path, st: os.stat_result) -> str:
    """The stamp of the file open as ``target`` (a descriptor, or a path), whose stat is ``st``."""
    return _stamp_in(_attribute(target), st)


def _stamp_in(value: str, st: os.stat_result) -> str:
    """The stamp an attribute ``value`` gives a file whose stat is ``st``."""
    stamp = value.partition(" ")[0]
    vid, sep, mtime = stamp.partition(".")
    if sep and len(vid) == 32 and mtime == str(st.st_mtime_ns):
        return stamp
    return f"{st.st_ino}:{st.st_mtime_ns}"


def _sealed_in(value: str) -> Checksum | None:
    """The checksum an attribute ``value`` says the file had when this store sealed it (its mtime need not match
    any more: a touched file is still judged by its bytes); None if sealed without one, or never sealed."""
    stamp, _, digest = value.partition(" ")
    if len(stamp.partition(".")[0]) != 32 or not digest:
        return None
    try:
        return parse_checksum_token(digest)
    except ValueError:
        return None  # not ours to read: as if sealed without one


def seal_stamp(fd: int, *, vid: str, digest: str | None) -> str:
    """Give the file open as ``fd`` (written in full, its bytes' checksum ``digest``) the stamp of version ``vid``,
    with the checksum beside it; the stamp."""
    stamp = f"{vid}.{os.fstat(fd).st_mtime_ns}"
    os.setxattr(fd, XATTR, f"{stamp} {digest}".encode() if digest else stamp.encode())
    return stamp


def probe_xattrs(root: Path) -> None:
    """Refuse a data root whose filesystem keeps no user extended attributes (the version ids live there)."""
    probe = root / f"{TEMP_PREFIX}probe-{new_id()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.setxattr(fd, XATTR, b"probe")
        if os.getxattr(fd, XATTR) != b"probe":
            raise OSError(errno.EIO, "extended attribute read back differs")
    except OSError as exc:
        raise BackendUnavailable(
            f"data root {root} cannot keep kvgate's version ids (user extended attributes: {exc.strerror or exc}); "
            "use ext4, XFS or btrfs (tmpfs needs Linux 6.6 or later)"
        ) from exc
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


# -- staged files ---------------------------------------------------------------------------------------------


def temp_name(vid: str, final: Path) -> Path:
    return final.parent / f"{TEMP_PREFIX}{vid}.{final.name}"


def temp_file(vid: str, final: str) -> str:
    """``temp_name`` of a path given as a string."""
    parent, _, name = final.rpartition("/")
    return f"{parent}/{TEMP_PREFIX}{vid}.{name}"


def parse_temp(name: str) -> tuple[str, str] | None:
    """``.kvgate-tmp-<id>.<name>`` -> (id, name); None for any other file name."""
    if not name.startswith(TEMP_PREFIX):
        return None
    vid, sep, rest = name[len(TEMP_PREFIX) :].partition(".")
    return (vid, rest) if sep and len(vid) == 32 and rest else None


def lock_file(fd: int, *, wait: bool = False) -> bool:
    """Take the writer's lock on the file open as ``fd`` (open for writing); False if another description holds
    it (``wait``: block until it is free)."""
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    try:
        fcntl.fcntl(fd, cmd, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def make_dirs(path: str | Path, *, fsync: bool) -> None:
    """Create directory ``path`` and its missing ancestors; ``fsync``: each one made is then fsynced in its parent,
    once (a file published under it, its own directory fsynced, must not lose the directories above it to a power
    loss). A directory another process made meanwhile is fsynced in its parent all the same."""
    missing: list[str] = []
    at = os.fspath(path)
    while not os.path.isdir(at):
        missing.append(at)
        parent = os.path.dirname(at)
        if parent == at:
            break
        at = parent
    for made in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(made)
    if fsync:
        for made in reversed(missing):
            fsync_dir(os.path.dirname(made))


def create_locked(path: str | Path, *, fsync: bool = True, tries: int = 3) -> int:
    """Create ``path`` (exclusively, its directory if need be) holding the writer's lock. A sweep can open the
    file between its creation and the lock (it locks it, then unlinks it or lets it be): so the lock is waited
    for, never skipped, and then the name is checked to be still this very file; one swept in between is made
    again under the same name (nothing was written to it). BackendUnavailable if that keeps happening."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for _ in range(tries):
        try:  # the key's directory is there for all but a prefix's first block: no mkdir walk per PUT
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:
            make_dirs(os.path.dirname(path), fsync=fsync)
            fd = os.open(path, flags, 0o644)
        try:
            lock_file(fd, wait=True)  # a sweep holds it for a few calls at most
            if same_file(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise BackendUnavailable(f"staged file {os.path.basename(path)!r} was swept while being created")


def same_file(fd: int, path: str | Path) -> bool:
    """Whether ``path`` names the file open as ``fd``."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


WRITE_CALL_BYTES = 1024 * 1024
"""The most bytes one ``writev``/``pwritev`` call hands the kernel. A write that covers an aligned 2 MiB range of
a file lets the kernel's page cache take a whole 2 MiB folio for it (ext4 on Linux 6.x with large folios), and on a
VM that hands free memory back to its host (virtio-balloon free page reporting) such a block is one the host has
taken back: the copy into it then costs several times the same bytes in smaller folios. Calls of 1 MiB and less
cost about the same as each other, one call of 2 MiB several times more, also with the page cache growing all
along (``python -m benchmarks.primitives.write_calls [--keep]``; figures: docs/benchmarks.md)."""


def write_all(fd: int, pieces: Sequence[bytes], offset: int | None) -> None:
    """All of ``pieces`` by writev (at the file position) or pwritev (at ``offset``) calls of at most
    :data:`WRITE_CALL_BYTES` each (one call for a body that small), short writes resumed."""
    views = [memoryview(p) for p in pieces]
    while views:
        call: list[memoryview] = []
        room = WRITE_CALL_BYTES
        for view in views:
            if len(view) > room:
                if room:
                    call.append(view[:room])
                break
            call.append(view)
            room -= len(view)
        written = os.writev(fd, call) if offset is None else os.pwritev(fd, call, offset)
        if offset is not None:
            offset += written
        while views and written >= len(views[0]):
            written -= len(views.pop(0))
        if views and written:
            views[0] = views[0][written:]


_NO_COPY_RANGE = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM)
"""errnos of a kernel or filesystem pair without copy_file_range between these files: copied through user space."""


def copy_range(src: int, dst: int, *, size: int, offset: int, chunk_bytes: int) -> None:
    """Bytes ``[0, size)`` of the file open as ``src`` to ``offset`` of the file open as ``dst``: in the kernel
    (``copy_file_range``), else ``chunk_bytes`` at a time through user space. SizeMismatch if ``src`` is shorter."""
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(src, dst, size - done, done, offset + done)
            if n == 0:
                raise SizeMismatch(f"staged part ended after {done} of {size} bytes")
            done += n
        return
    except OSError as exc:
        if exc.errno not in _NO_COPY_RANGE:
            raise
    while done < size:
        data = os.pread(src, min(chunk_bytes, size - done), done)
        if not data:
            raise SizeMismatch(f"staged part ended after {done} of {size} bytes")
        write_all(dst, [data], offset + done)
        done += len(data)


def fsync_dir(path: str | Path) -> None:
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK)
"""errnos of a filesystem (or a file) that takes no more hard links."""


MAX_PIECES = 512
"""Pieces of one writev at most (under IOV_MAX)."""


def grouped(body: list[bytes], *, chunk_bytes: int, max_pieces: int = MAX_PIECES) -> list[list[bytes]]:
    """``batched`` of a body all in memory, as lists (an empty body is one empty list); a body under one chunk is
    taken as it is (an empty piece may stay in it)."""
    if len(body) <= max_pieces and sum(map(len, body)) < chunk_bytes:
        return [body]
    out: list[list[bytes]] = []
    pieces: list[bytes] = []
    held = 0
    for piece in body:
        if not piece:
            continue
        pieces.append(piece)
        held += len(piece)
        if held >= chunk_bytes or len(pieces) >= max_pieces:
            out.append(pieces)
            pieces, held = [], 0
    if pieces or not out:
        out.append(pieces)
    return out


async def batched(
    body: AsyncIterable[bytes], *, chunk_bytes: int, max_pieces: int = MAX_PIECES
) -> AsyncIterator[list[bytes]]:
    """Group network chunks into lists of at least ``chunk_bytes`` (at most ``max_pieces``); ``grouped`` is the same
    for a body all in memory."""
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


# -- recovery, sweeps and walks (blocking: the store runs each on a worker thread) --------------------------------


def roll_forward_file(tmp: Path, final: Path, stamp: str, fsync: bool) -> bool:
    """Rename the staged file ``tmp`` over ``final`` if it is version ``stamp`` and no writer holds it."""
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        if not lock_file(fd) or read_stamp(fd, os.fstat(fd)) != stamp:
            return False  # a live writer's file (it publishes it itself), or not that version
        os.replace(tmp, final)
        if fsync:
            fsync_dir(final.parent)
        return True
    finally:
        os.close(fd)


def clear_files(path: Path, staged: Path | None, fsync: bool) -> bool:
    """Unlink the file at ``path`` whatever version it is, and the staged file ``staged`` unless a live writer
    holds it, then fsync their directory; True if either was there."""
    gone = False
    try:
        path.unlink()
        gone = True
    except (FileNotFoundError, NotADirectoryError):
        pass
    if staged is not None:
        gone = drop_unlocked(staged) or gone
    if gone and fsync:
        fsync_dir(path.parent)
    return gone


def quarantine_name(path: Path) -> Path:
    return path.parent / f"{QUARANTINE_PREFIX}{new_id()}.{path.name}"


def quarantine_file(path: Path, stamp: str, fsync: bool) -> bool:
    """Rename the file at ``path``, if it is version ``stamp``, to a quarantine name beside it (a dot name: never
    listed, adopted or read), then fsync the directory; False if it is not there or not that version."""
    try:
        if read_stamp(path, os.stat(path)) != stamp:
            return False
        os.rename(path, quarantine_name(path))
    except (FileNotFoundError, NotADirectoryError):
        return False
    if fsync:
        fsync_dir(path.parent)
    return True


def restamp_file(path: Path, stamp: str, fsync: bool) -> str | None:
    """A new stamp of ours for the file at ``path`` if it is still version ``stamp``; None if it is not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        value = _attribute(fd)
        if _stamp_in(value, os.fstat(fd)) != stamp:
            return None
        sealed = _sealed_in(value)
        new = seal_stamp(fd, vid=new_id(), digest=None if sealed is None else sealed.token)
        if fsync:
            os.fsync(fd)
        return new
    finally:
        os.close(fd)


def find_leftovers(root: Path) -> list[tuple[str, str, str]]:
    """(key, stamp, path) of every staged file under ``root`` that no writer holds ("" key: not parseable)."""
    found: list[tuple[str, str, str]] = []
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            if not name.startswith(TEMP_PREFIX):
                continue
            path = os.path.join(dirpath, name)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if not lock_file(fd):
                    continue  # its writer is alive
                stamp = read_stamp(fd, os.fstat(fd))
            finally:
                os.close(fd)
            parsed = parse_temp(name)
            rel_dir = os.path.relpath(dirpath, root)
            key = "" if parsed is None else (parsed[1] if rel_dir == "." else f"{rel_dir}/{parsed[1]}")
            found.append((key.replace(os.sep, "/"), stamp, path))
    return found


def drop_unlocked(path: Path) -> bool:
    """Unlink the staged file ``path`` unless a writer holds it; False if it is gone or held."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        if not lock_file(fd):
            return False
        path.unlink()
        return True
    finally:
        os.close(fd)


def hash_file(path: Path, chunk: int, claim: bool, fsync: bool, algorithm: str) -> Version:
    """The size, checksum (in ``algorithm``, with the chunk CRCs) and stamp of the file at ``path``; ``claim``: a
    file without a stamp of ours gets one. CorruptData if this store sealed other bytes under that name."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        checker = BodyChecker(size=st.st_size, expected_digest=None, algorithm=algorithm)
        pos = 0
        while pos < st.st_size:
            data = os.pread(fd, min(chunk, st.st_size - pos), pos)
            if not data:
                raise BackendUnavailable("block file shrank while being read")
            checker.update(data)
            pos += len(data)
        meta = checker.finish()
        value = _attribute(fd)
        stamp, sealed = _stamp_in(value, st), _sealed_in(value)
        if sealed is not None and sealed.algorithm == algorithm and sealed.token != meta.digest:
            raise CorruptData(f"bytes are {meta.digest}, sealed {sealed.token}", stamp=stamp)
        if claim and id_of(stamp) is None and os.fstat(fd).st_mtime_ns == st.st_mtime_ns:
            try:
                stamp = seal_stamp(fd, vid=new_id(), digest=meta.digest)
                if fsync:
                    os.fsync(fd)
            except PermissionError:
                pass  # not ours to stamp (another owner): it keeps its inode:mtime stamp
        return dataclasses.replace(meta, stamp=stamp)
    finally:
        os.close(fd)


def walk_files(root: Path, prefix: str) -> list[ObjectInfo]:
    """Every published file under ``root`` whose key starts with ``prefix`` (dot files and directories skipped)."""
    found: list[ObjectInfo] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if not rel.startswith(prefix):
                continue
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
                stamp = read_stamp(path, st)
            except FileNotFoundError:
                continue
            found.append(ObjectInfo(key=rel.replace(os.sep, "/"), size=st.st_size, mtime=st.st_mtime, stamp=stamp))
    return found


def sweep_empty_dirs(top: Path, older_than_s: float) -> int:
    """Remove empty directories below ``top`` untouched for ``older_than_s``; how many."""
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
