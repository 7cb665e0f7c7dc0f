"""Fixtures of the in-process tests: a gateway on the memory store and one on a filesystem store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.inprocess.harness import InProcessGateway, running, settings_for


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[InProcessGateway]:
    async with running(settings_for(tmp_path)) as g:
        yield g


@pytest.fixture
async def fs_gw(tmp_path: Path) -> AsyncIterator[InProcessGateway]:
    async with running(settings_for(tmp_path, fs=True)) as g:
        yield g
