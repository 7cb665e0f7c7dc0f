"""CI-sized soak (the note's run: `python -m benchmarks.gateway.soak --duration 120 --clients 64`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from benchmarks.gateway.soak import run_soak, soak_gateway


def test_soak_64_clients(tmp_path: Path) -> None:
    gw = soak_gateway(tmp_path / "data")
    try:
        assert gw.proc is not None
        fig = asyncio.run(run_soak(gw.url, gw.proc.pid, duration_s=20, clients=64))
    finally:
        gw.stop()
    print(f"soak figures: {fig}")
    assert fig.errors == 0, fig.first_errors
    assert fig.mismatches == 0
    assert fig.requests > 500
    assert {"put", "get", "head", "lookup"} <= set(fig.by_op)
