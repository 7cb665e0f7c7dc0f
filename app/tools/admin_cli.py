"""Operator commands: ``kvgate ls``, ``stats``, ``purge NS`` (HTTP to a running gateway), ``gc`` and ``scrub``
(offline)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from app.tools.tls_client import CaCert, ClientCert, ClientKey, ClientTLS

DEFAULT_URL = "http://127.0.0.1:8750"
Url = Annotated[str, typer.Option("--url", envvar="KVGATE_URL", help="the gateway [env KVGATE_URL]")]
Token = Annotated[
    str | None, typer.Option("--token", envvar="KVGATE_TOKEN", help="admin bearer token [env KVGATE_TOKEN]")
]

Json = Annotated[bool, typer.Option("--json", help="print JSON (the API's answer) instead of a table")]

console = Console()
err_console = Console(stderr=True)  # errors and progress bars: stdout stays a clean table or JSON


def _human(n: int | float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _call(method: str, url: str, path: str, token: str | None, tls: ClientTLS | None = None) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    verify = (tls or ClientTLS()).context()
    try:
        resp = httpx.request(method, f"{url.rstrip('/')}{path}", headers=headers, timeout=60.0, verify=verify)
    except httpx.HTTPError as exc:
        err_console.print(f"[red]cannot reach {url}: {exc}[/red]")
        raise typer.Exit(2) from exc
    if resp.status_code >= 400:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:200]
        err_console.print(f"[red]{resp.status_code}: {message}[/red]")
        raise typer.Exit(1)
    return resp.json()


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2))


def ls(
    url: Url = DEFAULT_URL,
    token: Token = None,
    as_json: Json = False,
    cacert: CaCert = None,
    cert: ClientCert = None,
    key: ClientKey = None,
) -> None:
    """Namespaces on a running gateway: blocks, bytes, hits, never-read share."""
    data = _call("GET", url, "/v1/namespaces", token, ClientTLS(cacert=cacert, cert=cert, key=key))
    if as_json:
        _print_json(data)
        return
    table = Table(title=f"kvgate namespaces at {url}")
    for col in ("namespace", "blocks", "bytes", "hits", "never read", "last write", "config"):
        table.add_column(col, justify="left" if col == "namespace" else "right")
    for ns in data["namespaces"]:
        ratio = ns["never_read_ratio"]
        style = "red" if ns["blocks"] >= 100 and ratio > 0.99 else ""
        table.add_row(
            ns["namespace"],
            str(ns["blocks"]),
            _human(ns["bytes"]),
            str(ns["hits"]),
            f"[{style}]{ratio:.1%}[/{style}]" if style else f"{ratio:.1%}",
            _when(ns["last_write"]),
            "yes" if ns["has_config"] else "no",
        )
    console.print(table)


def stats(
    url: Url = DEFAULT_URL,
    token: Token = None,
    as_json: Json = False,
    cacert: CaCert = None,
    cert: ClientCert = None,
    key: ClientKey = None,
) -> None:
    """Usage, capacity, hits, misses and evictions of a running gateway."""
    s = _call("GET", url, "/v1/stats", token, ClientTLS(cacert=cacert, cert=cert, key=key))
    if as_json:
        _print_json(s)
        return
    table = Table(title=f"kvgate stats at {url}", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    ratio = s["usage_ratio"]
    rows = [
        ("usage", _human(s["usage_bytes"]) + (f" ({ratio:.1%})" if ratio is not None else "")),
        ("max_bytes", _human(s["max_bytes"]) if s["max_bytes"] else "unbounded"),
        ("watermarks", f"{s['low_watermark']:.0%} .. {s['high_watermark']:.0%}"),
        ("blocks", str(s["blocks"])),
        ("namespaces", str(s["namespaces"])),
        ("hits", str(s["hits"])),
        ("misses", str(s["misses"])),
        ("evictions", f"{s['evictions']} ({_human(s['evicted_bytes'])})"),
        ("uptime", f"{s['uptime_s']:.0f} s"),
    ]
    for what, value in rows:
        table.add_row(what, value)
    console.print(table)


def purge(
    namespace: Annotated[str, typer.Argument(help="the namespace to remove, e.g. org_model_0123456789ab")],
    url: Url = DEFAULT_URL,
    token: Token = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask")] = False,
    cacert: CaCert = None,
    cert: ClientCert = None,
    key: ClientKey = None,
) -> None:
    """Remove a namespace's blocks, rows and config from a running gateway."""
    if not yes and not typer.confirm(f"purge every block of {namespace}?"):
        raise typer.Exit(1)
    tls = ClientTLS(cacert=cacert, cert=cert, key=key)
    r = _call("DELETE", url, f"/v1/namespaces/{namespace}", token, tls)
    console.print(f"purged {r['namespace']}: {r['blocks']} blocks, {_human(r['bytes'])}, config={r['config']}")


async def _gc(data_dir: Path | None, db_url: str | None, stale_parts_s: float, progress: Progress) -> Any:
    from app.backends import open_backends
    from app.config import Settings
    from app.core.assembly import open_core
    from app.core.reconcile import reconcile

    overrides: dict[str, Any] = {"data_dir": data_dir, "db_url": db_url}
    cfg = Settings(**{k: v for k, v in overrides.items() if v is not None})
    tasks: dict[str, Any] = {}

    def note(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = progress.add_task(phase, total=max(total, 1))
        progress.update(tasks[phase], completed=done if total else 1, total=max(total, 1))

    async with open_backends(cfg) as backends, open_core(backends, settings=cfg, cache=False) as core:
        return await reconcile(
            upkeep=core.upkeep,
            store=core.store,
            index=core.index,
            concurrency=cfg.reconcile_concurrency,
            stale_parts_s=stale_parts_s,
            progress=note,
        )


def gc(
    data_dir: Annotated[Path | None, typer.Option(help="data root [env KVGATE_DATA_DIR]")] = None,
    db_url: Annotated[str | None, typer.Option(help="index URL [env KVGATE_DB_URL]")] = None,
    stale_parts_s: Annotated[
        float, typer.Option(help="drop incomplete multi-part uploads whose oldest part is older than this")
    ] = 3600.0,
    as_json: Json = False,
) -> None:
    """Reconcile the index with the store directly (no gateway needed; safe beside running gateways, which share
    each key's lock through the data directory): roll forward what crashes left, drop dead rows, adopt orphan data."""
    columns = (TextColumn("{task.description:>7}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console) as progress:
        report = asyncio.run(_gc(data_dir, db_url, stale_parts_s, progress))
    if as_json:
        _print_json(dataclasses.asdict(report))
        return
    table = Table(title="kvgate gc", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for what, value in (
        ("rows dropped (no data)", report.rows_dropped),
        ("blocks adopted (no row)", report.adopted),
        ("rows in doubt (another version on disk)", report.resized),
        ("committed versions rolled forward", report.rolled_forward),
        ("rows given version ids", report.stamps_upgraded),
        ("corrupt blocks quarantined (rows removed)", report.corrupt_removed),
        ("configs adopted", report.configs_adopted),
        ("temp files removed", report.temp_removed),
        ("stale uploads dropped (parts)", report.stale_uploads_dropped),
        ("empty upload directories removed", report.part_dirs_removed),
        ("left alone", len(report.left_alone)),
        ("keys deferred (index or store failed; run again)", report.deferred),
        ("blocks now", report.blocks),
        ("bytes now", _human(report.bytes)),
        ("seconds", f"{report.seconds:.2f}"),
    ):
        table.add_row(what, str(value))
    console.print(table)


async def _scrub(data_dir: Path | None, db_url: str | None, bytes_per_s: int | None, progress: Progress) -> Any:
    from app.backends import open_backends
    from app.config import Settings
    from app.core.assembly import open_core
    from app.core.scrub import Scrub

    overrides: dict[str, Any] = {"data_dir": data_dir, "db_url": db_url}
    cfg = Settings(**{k: v for k, v in overrides.items() if v is not None})
    task = progress.add_task("scrub", total=None)

    def note(done: int, total: int) -> None:
        progress.update(task, completed=done, total=max(total, 1))

    async with open_backends(cfg) as backends, open_core(backends, settings=cfg, cache=False) as core:
        scrub = Scrub(upkeep=core.upkeep, index=core.index, coordinator=None, bytes_per_s=bytes_per_s)
        return await scrub.run(progress=note)


def scrub(
    data_dir: Annotated[Path | None, typer.Option(help="data root [env KVGATE_DATA_DIR]")] = None,
    db_url: Annotated[str | None, typer.Option(help="index URL [env KVGATE_DB_URL]")] = None,
    bytes_per_s: Annotated[
        int | None, typer.Option(help="read at most this many bytes a second (default: as fast as the store reads)")
    ] = None,
    as_json: Json = False,
) -> None:
    """Read every stored block back and check it against its row, now (no gateway needed; safe beside running
    gateways): corrupt blocks are quarantined and their rows removed (a miss; a BlockRemoved event)."""
    columns = (TextColumn("{task.description:>7}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console) as progress:
        report = asyncio.run(_scrub(data_dir, db_url, bytes_per_s, progress))
    if as_json:
        _print_json(dataclasses.asdict(report))
        return
    table = Table(title="kvgate scrub", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for what, value in (
        ("blocks intact", report.blocks),
        ("bytes read", _human(report.bytes)),
        ("corrupt blocks (quarantined, rows removed)", report.corrupt),
        ("rows settled (their version was not there)", report.settled),
        ("blocks not read (store failed)", report.failed),
        ("seconds", f"{report.seconds:.2f}"),
    ):
        table.add_row(what, str(value))
    console.print(table)
