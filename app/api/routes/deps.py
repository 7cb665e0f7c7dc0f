"""Request-scoped access to what the lifespan built."""

from __future__ import annotations

from fastapi import Request

from app.config import Settings
from app.core.assembly import Core
from app.core.capacity import Capacity
from app.core.service import BlockService
from app.core.upkeep import Upkeep


def _core(request: Request) -> Core:
    core: Core = request.app.state.core
    return core


def service(request: Request) -> BlockService:
    return _core(request).service


def settings(request: Request) -> Settings:
    cfg: Settings = request.app.state.settings
    return cfg


def upkeep(request: Request) -> Upkeep:
    return _core(request).upkeep


def capacity(request: Request) -> Capacity:
    return _core(request).capacity
