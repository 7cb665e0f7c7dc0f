"""The ``kvgate`` command: serve, and the operator's tools."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

cli = typer.Typer(help="kvgate: a KV-cache block gateway for LLM inference.", no_args_is_help=True)


@cli.callback()
def _root() -> None:
    """kvgate: a KV-cache block gateway for LLM inference."""


@cli.command()
def serve(
    host: Annotated[str | None, typer.Option(help="bind address [env KVGATE_HOST; default 127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option(help="port [env KVGATE_PORT; default 8750]")] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="data root [env KVGATE_DATA_DIR; ./kvgate-data]")
    ] = None,
    db_url: Annotated[
        str | None, typer.Option(help="index URL [env KVGATE_DB_URL; SQLite in data dir]")
    ] = None,
    workers: Annotated[int, typer.Option(help="uvicorn worker processes (PostgreSQL index only)")] = 1,
) -> None:
    """Run the gateway (uvicorn with uvloop and httptools)."""
    import uvicorn

    from app.config import Settings
    from app.main import create_app

    overrides = {k: v for k, v in {"host": host, "port": port, "data_dir": data_dir, "db_url": db_url}.items() if v}
    settings = Settings(**overrides)
    if workers != 1:
        raise typer.BadParameter(
            "run several gateways as separate processes behind a load balancer", param_hint="workers"
        )
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_level=settings.log_level,
        access_log=False,
        timeout_keep_alive=30,
    )


def main() -> None:
    cli()
