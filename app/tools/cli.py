"""The ``kvgate`` command: serve, and the operator's tools.

A command's module is imported when that command runs (or its help is shown), not at every start: ``kvgate serve``
loads no load generator, importer or table printer, and ``kvgate stats`` no index, migrations or server.
"""

from __future__ import annotations

import importlib
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup
from typer.main import get_command_from_info
from typer.models import CommandInfo

if TYPE_CHECKING:
    from typer import _click as click  # typer's own copy of click: its types, for the overrides' signatures

LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("app.tools.bench", "bench_command"),
    "import": ("app.tools.importer", "import_command"),
    "events": ("app.tools.events_cli", "events_command"),
    "ls": ("app.tools.admin_cli", "ls"),
    "stats": ("app.tools.admin_cli", "stats"),
    "purge": ("app.tools.admin_cli", "purge"),
    "gc": ("app.tools.admin_cli", "gc"),
    "scrub": ("app.tools.admin_cli", "scrub"),
}
"""The commands defined in modules of their own: name -> (module, function), in the order help lists them."""


class _LazyGroup(TyperGroup):
    """The root group: the commands of :data:`LAZY_COMMANDS` are built from their module when first asked for."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._loaded: dict[str, click.Command] = {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = super().list_commands(ctx)
        groups = [n for n in names if isinstance(self.commands[n], TyperGroup)]  # typer lists them last
        return [*(n for n in names if n not in groups), *LAZY_COMMANDS, *groups]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in LAZY_COMMANDS:
            return super().get_command(ctx, cmd_name)
        if cmd_name not in self._loaded:
            module, function = LAZY_COMMANDS[cmd_name]
            callback: Callable[..., Any] = getattr(importlib.import_module(module), function)
            info = CommandInfo(name=cmd_name, callback=callback)
            self._loaded[cmd_name] = get_command_from_info(
                info, pretty_exceptions_short=True, rich_markup_mode=self.rich_markup_mode
            )
        return self._loaded[cmd_name]


class _ServeCommand(TyperCommand):
    """``serve``: its help ends with every setting, listed from the Settings model when the help is shown."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from app.settings_help import help_epilog

        self.epilog = help_epilog()
        super().format_help(ctx, formatter)


EXIT_CODES = (
    "Exit codes: 0 done; 1 the command ran and something failed (an HTTP error from the gateway, blocks that "
    "failed to import, bench errors or checksum failures, a purge not confirmed); 2 it could not run (a bad flag "
    "or setting, the gateway unreachable, a missing directory)."
)

cli = typer.Typer(
    cls=_LazyGroup,
    help="kvgate: a KV-cache block gateway for LLM inference.",
    no_args_is_help=True,
    epilog=EXIT_CODES,
)


@cli.callback()
def _root() -> None:
    """kvgate: a KV-cache block gateway for LLM inference."""


@cli.command(cls=_ServeCommand)
def serve(
    host: Annotated[str | None, typer.Option(help="bind address [env KVGATE_HOST; default 127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option(help="port [env KVGATE_PORT; default 8750]")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="data root [env KVGATE_DATA_DIR; ./kvgate-data]")] = None,
    db_url: Annotated[str | None, typer.Option(help="index URL [env KVGATE_DB_URL; SQLite in data dir]")] = None,
    workers: Annotated[
        int | None, typer.Option(help="gateway processes on one socket, e.g. one per core [env KVGATE_WORKERS; 1]")
    ] = None,
    tls_certfile: Annotated[
        Path | None, typer.Option(help="serve HTTPS with this certificate chain, PEM [env KVGATE_TLS_CERTFILE]")
    ] = None,
    tls_keyfile: Annotated[
        Path | None, typer.Option(help="the certificate's private key, PEM [env KVGATE_TLS_KEYFILE]")
    ] = None,
    tls_client_ca: Annotated[
        Path | None,
        typer.Option(help="CA bundle for client certificates; turns them on [env KVGATE_TLS_CLIENT_CA]"),
    ] = None,
    tls_client_auth: Annotated[
        str | None, typer.Option(help="required | optional client certificate [env KVGATE_TLS_CLIENT_AUTH]")
    ] = None,
    tls_min_version: Annotated[
        str | None, typer.Option(help="1.2 | 1.3 [env KVGATE_TLS_MIN_VERSION; default 1.2]")
    ] = None,
    listen_fd: Annotated[int | None, typer.Option(hidden=True, help="(a worker) serve this inherited socket")] = None,
) -> None:
    """Run the gateway (uvicorn with uvloop and httptools); HTTPS with --tls-certfile (reloaded on SIGHUP or change);
    --workers N runs N processes on one socket."""
    from app.config import Settings
    from app.main import create_server

    overrides: dict[str, Any] = {"host": host, "port": port, "data_dir": data_dir, "db_url": db_url}
    overrides |= {
        "workers": workers,
        "tls_certfile": tls_certfile,
        "tls_keyfile": tls_keyfile,
        "tls_client_ca": tls_client_ca,
        "tls_client_auth": tls_client_auth,
        "tls_min_version": tls_min_version,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    settings = Settings(**given)
    if listen_fd is None and settings.workers > 1:
        from app.main import serve_workers

        # the workers read the same settings: the flags given here go to them as their variables
        raise typer.Exit(serve_workers(settings, env={f"KVGATE_{k.upper()}": str(v) for k, v in given.items()}))
    try:
        server = create_server(settings)
    except ValueError as exc:
        typer.echo(f"kvgate: {exc}", err=True)
        raise typer.Exit(2) from exc
    if listen_fd is None:  # a worker's supervisor has printed them
        for warning in server.warnings:
            typer.echo(f"kvgate: WARNING: {warning}", err=True)
    started = server.run(None if listen_fd is None else [socket.socket(fileno=listen_fd)])
    if not started:
        raise typer.Exit(3)  # as uvicorn.run: the server did not start


token_cli = typer.Typer(help="Bearer tokens: make one, hash one for KVGATE_TOKENS / KVGATE_TOKENS_FILE.")
cli.add_typer(token_cli, name="token")


@token_cli.command("hash")
def token_hash(
    token: Annotated[str | None, typer.Argument(help="the token; read from stdin when omitted")] = None,
) -> None:
    """Print the sha256 of a token, as the tokens settings store it."""
    import sys

    from app.api.middleware.principals import hash_token

    text = token if token is not None else sys.stdin.readline().strip()
    if not text:
        raise typer.BadParameter("empty token")
    typer.echo(hash_token(text))


@token_cli.command("new")
def token_new(
    name: Annotated[str, typer.Option(help="who holds it (shown in logs)")],
    role: Annotated[str, typer.Option(help="read | write | admin")] = "read",
    namespace: Annotated[list[str] | None, typer.Option(help="limit to this namespace (repeatable)")] = None,
) -> None:
    """Make a random token: prints the token (give it to the client) and its entry for the tokens file."""
    import json
    import secrets

    from app.api.middleware.principals import hash_token
    from app.config import TokenSpec

    token = secrets.token_urlsafe(32)
    spec = TokenSpec(name=name, sha256=hash_token(token), role=role, namespaces=namespace or None)
    typer.echo(f"token: {token}")
    typer.echo(json.dumps(spec.model_dump(exclude_none=True)))


@cli.command("settings")
def settings_command(
    markdown: Annotated[bool, typer.Option("--markdown", help="the table of docs/settings.md")] = False,
) -> None:
    """List every setting: environment variable, default, meaning."""
    from app.settings_help import markdown_table, rows

    if markdown:
        typer.echo(markdown_table())
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("variable", "default", "meaning")
    for row in rows():
        table.add_row(row.variable, row.default, row.meaning)
    Console().print(table)


@cli.command()
def migrate(
    alembic_ini: Annotated[
        bool, typer.Option("--alembic-ini", help="only print the path of the alembic.ini shipped with kvgate")
    ] = False,
) -> None:
    """Bring the index to the newest schema (what `kvgate serve` does at start-up), then exit."""
    import asyncio

    from app.config import Settings
    from app.index.migrate import alembic_ini as ini_path
    from app.index.migrate import upgrade_head

    if alembic_ini:
        typer.echo(str(ini_path()))
        return
    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    asyncio.run(upgrade_head(settings.resolved_db_url))
    typer.echo(f"index at head: {settings.resolved_db_url.split('://')[0]}")


def main() -> None:
    """The console script: a bad setting is one line per problem on stderr and exit code 2, never a traceback."""
    import sys

    try:
        cli()
    except Exception as exc:
        from app.settings_help import error_lines, is_settings_error

        if not is_settings_error(exc):
            raise
        for line in error_lines(exc):  # type: ignore[arg-type]
            print(f"kvgate: {line}", file=sys.stderr)
        sys.exit(2)
