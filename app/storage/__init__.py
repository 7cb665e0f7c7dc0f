"""Block stores: one module per medium behind the BlockStore protocol, and a factory."""

from __future__ import annotations

from app.config import Backend, FsBackend, MemoryBackend, Settings
from app.storage.base import BlockStore, ObjectInfo, ObjectReader, Version


def build_store(cfg: Backend, *, settings: Settings) -> BlockStore:
    if isinstance(cfg, FsBackend):
        from app.storage.filesystem import FilesystemStore

        root = settings.blocks_root
        assert root is not None  # the fs backend's
        return FilesystemStore(
            root=root, fsync=cfg.fsync, chunk_bytes=settings.io_chunk_bytes, inline_bytes=cfg.inline_io_bytes
        )
    if isinstance(cfg, MemoryBackend):
        from app.storage.memory import MemoryStore

        return MemoryStore(chunk_bytes=settings.io_chunk_bytes)
    from app.storage.s3 import S3Store

    return S3Store(cfg=cfg, chunk_bytes=settings.io_chunk_bytes)


__all__ = ["BlockStore", "ObjectInfo", "ObjectReader", "Version", "build_store"]
