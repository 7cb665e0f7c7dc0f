"""``kvgate events``: tail a running gateway's KV events (``GET /v1/events``), one JSON batch a line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated

import typer

from app.tools.admin_cli import DEFAULT_URL, Token, Url
from app.tools.tls_client import CaCert, ClientCert, ClientKey, ClientTLS


def sse_messages(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(event, data) of each server-sent event in ``lines``; comments (heartbeats) skipped."""
    event, data = "message", list[str]()
    for line in lines:
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)


def events_command(
    url: Url = DEFAULT_URL,
    token: Token = None,
    since: Annotated[int | None, typer.Option(help="start from this sequence number (still held)")] = None,
    namespace: Annotated[str | None, typer.Option(help="only this namespace's events")] = None,
    count: Annotated[int | None, typer.Option(help="stop after this many batches")] = None,
    cacert: CaCert = None,
    cert: ClientCert = None,
    key: ClientKey = None,
) -> None:
    """Tail the gateway's KV events: each batch as one JSON line ({"seq", "ts", "events"}); notes on stderr."""
    import httpx

    params: dict[str, str | int] = {}
    if since is not None:
        params["since"] = since
    if namespace is not None:
        params["namespace"] = namespace
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    verify = ClientTLS(cacert=cacert, cert=cert, key=key).context()
    seen = 0
    try:
        with httpx.stream(
            "GET",
            f"{url.rstrip('/')}/v1/events",
            params=params,
            headers=headers,
            verify=verify,
            timeout=httpx.Timeout(10.0, read=None),
        ) as resp:
            if resp.status_code >= 400:
                resp.read()
                typer.echo(f"kvgate: {resp.status_code}: {resp.text[:300]}", err=True)
                raise typer.Exit(1)
            for event, data in sse_messages(resp.iter_lines()):
                if event != "batch":
                    typer.echo(f"kvgate: {event} {data}", err=True)
                    if event in ("overflow", "closed"):
                        raise typer.Exit(3)
                    continue
                typer.echo(json.dumps(json.loads(data), separators=(",", ":")))
                seen += 1
                if count is not None and seen >= count:
                    return
    except httpx.HTTPError as exc:
        typer.echo(f"kvgate: cannot reach {url}: {exc}", err=True)
        raise typer.Exit(2) from exc
