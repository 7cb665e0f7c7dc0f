"""TLS options of the commands that talk to a running gateway (``ls``, ``stats``, ``purge``, ``bench``): named as
curl names them, each also an environment variable."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

CaCert = Annotated[
    Path | None,
    typer.Option("--cacert", envvar="KVGATE_CACERT", help="CA bundle that signs the gateway's certificate [env]"),
]
ClientCert = Annotated[
    Path | None,
    typer.Option("--cert", envvar="KVGATE_CLIENT_CERT", help="client certificate, PEM (mutual TLS) [env]"),
]
ClientKey = Annotated[
    Path | None, typer.Option("--key", envvar="KVGATE_CLIENT_KEY", help="the client certificate's key, PEM [env]")
]


@dataclass(frozen=True, kw_only=True)
class ClientTLS:
    cacert: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def context(self) -> ssl.SSLContext:
        """A verifying client context (the system's CAs unless ``cacert``); BadParameter naming a file that fails."""
        if self.key is not None and self.cert is None:
            raise typer.BadParameter("--key needs --cert", param_hint="key")
        try:
            ctx = ssl.create_default_context(cafile=str(self.cacert) if self.cacert else None)
            if self.cert is not None:
                ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            files = ", ".join(str(p) for p in (self.cacert, self.cert, self.key) if p)
            raise typer.BadParameter(f"cannot load the TLS files ({files}): {exc}") from exc
        return ctx
