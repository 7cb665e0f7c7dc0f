"""``kvgate import DIR``: adopt a directory written by vLLM's ``fs`` tier (or by kvgate's filesystem backend).

Every file under DIR whose relative path is a kvgate key is taken: ``<ns>/config.json`` through
``BlockService.put_config`` (its fields must hash to the namespace's name; the bytes are kept verbatim), and block
files through the service as well. When DIR *is* the gateway's filesystem data root the files are already in place,
so each is only hashed and given its index row (adopted in place); otherwise each is copied into the configured
store (filesystem or S3) through ``BlockService.put``, which writes the data before the row as every PUT does.
Anything else (vLLM's ``*.tmp`` files of interrupted writes, probe files, stray names) is skipped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import anyio.to_thread
import typer

from app.backends import open_backends
from app.config import FsBackend, Settings
from app.core.assembly import Core, open_core
from app.errors import CorruptData, KVGateError, PreconditionFailed
from contract.keys import InvalidKey, parse_block_key, parse_config_key

log = logging.getLogger("kvgate.importer")

_READ_CHUNK = 4 * 1024 * 1024
_MAX_EXAMPLES = 10


@dataclass(slots=True)
class ImportReport:
    source: str
    in_place: bool
    namespaces: int = 0
    blocks: int = 0
    bytes: int = 0
    already_indexed: int = 0
    corrupt: int = 0
    """files whose bytes were not those kvgate sealed them with (bit rot): moved aside, not adopted"""
    skipped: int = 0
    failed: int = 0
    examples: dict[str, list[str]] = field(default_factory=lambda: {"skipped": [], "failed": []})

    def note(self, kind: str, what: str) -> None:
        if len(self.examples[kind]) < _MAX_EXAMPLES:
            self.examples[kind].append(what)


def _walk(root: Path) -> list[tuple[str, int]]:
    """Relative paths and sizes of the regular files under ``root`` (sorted, so runs are repeatable)."""
    found: list[tuple[str, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(full)
                if os.path.isfile(full) and not os.path.islink(full):
                    rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                    found.append((rel.replace(os.sep, "/"), st.st_size))
    return found


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    f = await anyio.to_thread.run_sync(path.open, "rb")
    try:
        while chunk := await anyio.to_thread.run_sync(f.read, _READ_CHUNK):
            yield chunk
    finally:
        await anyio.to_thread.run_sync(f.close)


class Importer:
    def __init__(
        self,
        *,
        core: Core,
        source: Path,
        in_place: bool,
        concurrency: int,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.progress = progress  # progress(done, total) after each block file
        self._total = self._done = 0
        self.core = core
        self.source = source
        self.in_place = in_place
        self.concurrency = concurrency
        self.report = ImportReport(source=str(source), in_place=in_place)

    async def run(self) -> ImportReport:
        files = await anyio.to_thread.run_sync(_walk, self.source)
        blocks: list[tuple[str, int]] = []
        for rel, size in files:
            try:
                parse_config_key(rel)
            except InvalidKey:
                pass
            else:
                await self._config(rel)
                continue
            try:
                parse_block_key(rel)
            except InvalidKey:
                self.report.skipped += 1
                self.report.note("skipped", rel)
                continue
            blocks.append((rel, size))
        work: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        self._total = len(blocks)
        for item in blocks:
            work.put_nowait(item)
        workers = [asyncio.create_task(self._worker(work)) for _ in range(max(1, self.concurrency))]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
        return self.report

    async def _config(self, rel: str) -> None:
        namespace = parse_config_key(rel)
        try:
            raw = await anyio.to_thread.run_sync((self.source / rel).read_bytes)
            fields = json.loads(raw)
            if not isinstance(fields, dict):
                raise ValueError("config.json is not a JSON object")
            await self.core.service.put_config(namespace, fields, raw)
        except (OSError, ValueError, KVGateError) as exc:
            self.report.failed += 1
            self.report.note("failed", f"{rel}: {exc}")
            return
        self.report.namespaces += 1

    async def _worker(self, work: asyncio.Queue[tuple[str, int]]) -> None:
        while True:
            try:
                rel, size = work.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                await self._block(rel, size)
            except (OSError, KVGateError) as exc:
                self.report.failed += 1
                self.report.note("failed", f"{rel}: {exc}")
            self._done += 1
            if self.progress is not None:
                self.progress(self._done, self._total)

    async def _block(self, rel: str, size: int) -> None:
        key = parse_block_key(rel)
        if await self.core.versions.read(key.path, fresh=True) is not None:
            self.report.already_indexed += 1
            return
        try:  # both conditional: a key a gateway stored meanwhile keeps the gateway's version
            if self.in_place:
                try:
                    if (await self.core.upkeep.adopt(key)) is None:
                        raise FileNotFoundError(rel)
                except CorruptData:
                    self.report.corrupt += 1
                    return
            else:
                source = _file_chunks(self.source / rel)
                await self.core.service.put(key, source, size=size, digest=None, create_only=True)
        except PreconditionFailed:
            self.report.already_indexed += 1
            return
        self.report.blocks += 1
        self.report.bytes += size


async def import_dir(
    *, source: Path, settings: Settings, concurrency: int = 8, progress: Callable[[int, int], None] | None = None
) -> ImportReport:
    """Adopt ``source`` into the gateway configured by ``settings`` (its store and index)."""
    source = await anyio.to_thread.run_sync(source.resolve)
    if not await anyio.to_thread.run_sync(source.is_dir):
        raise FileNotFoundError(f"{source} is not a directory")
    async with open_backends(settings) as backends, open_core(backends, settings=settings, cache=False) as core:
        in_place = isinstance(settings.backend, FsBackend) and source == settings.blocks_root
        importer = Importer(core=core, source=source, in_place=in_place, concurrency=concurrency, progress=progress)
        report = await importer.run()
    log.info("imported %s blocks=%d namespaces=%d failed=%d", source, report.blocks, report.namespaces, report.failed)
    return report


def import_command(
    source: Annotated[Path, typer.Argument(help="a directory written by vLLM's fs tier (its root_dir)")],
    data_dir: Annotated[Path | None, typer.Option(help="gateway data root [env KVGATE_DATA_DIR]")] = None,
    db_url: Annotated[str | None, typer.Option(help="index URL [env KVGATE_DB_URL]")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="blocks hashed or copied at once")] = 8,
) -> None:
    """Adopt a vLLM fs-tier directory: in place when it is the data root (--data-dir/blocks), else copied in."""
    overrides: dict[str, Any] = {"data_dir": data_dir, "db_url": db_url}
    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("import"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=Console(stderr=True)) as bar:
            task = bar.add_task("import", total=None)
            tick = lambda done, total: bar.update(task, completed=done, total=total)  # noqa: E731
            report = asyncio.run(import_dir(source=source, settings=settings, concurrency=concurrency, progress=tick))
    except (FileNotFoundError, KVGateError) as exc:
        typer.echo(f"kvgate import: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(json.dumps(asdict(report), indent=2))
    if report.failed:
        raise typer.Exit(1)
