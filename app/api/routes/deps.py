"""Request-scoped access to what the lifespan built."""

from __future__ import annotations

from fastapi import Request

from app.config import Settings
from app.core.service import BlockService


def service(request: Request) -> BlockService:
    svc: BlockService = request.app.state.service
    return svc


def settings(request: Request) -> Settings:
    cfg: Settings = request.app.state.settings
    return cfg
