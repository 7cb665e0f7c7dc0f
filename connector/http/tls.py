"""TLS for BlockClient: the SSLContext from the configured files, what a failed connection says about TLS, and the
start-up check that a certificate problem fails loudly."""

from __future__ import annotations

import logging
import ssl

import aiohttp

from connector.http.errors import GatewayTLSError

log = logging.getLogger("kvgate.connector.client")


def client_ssl_context(*, ca_file: str | None, cert_file: str | None, key_file: str | None) -> ssl.SSLContext | bool:
    """The SSLContext for https URLs: the CA bundle (or the system's), and the client certificate if one is set.

    True (aiohttp's default verification) when nothing is configured; GatewayTLSError when a file does not load.
    """
    if ca_file is None and cert_file is None:
        if key_file is not None:
            raise GatewayTLSError("key_file needs cert_file")
        return True
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
        if cert_file is not None:
            ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        files = ", ".join(f for f in (ca_file, cert_file, key_file) if f)
        raise GatewayTLSError(f"cannot load the TLS files ({files}): {exc}") from exc
    return ctx


def tls_failure(exc: BaseException) -> str | None:
    """What went wrong in TLS, when ``exc`` (or an error it wraps) is a TLS failure; None for anything else."""
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            return None
        if isinstance(seen, aiohttp.ClientConnectorCertificateError):
            return f"the gateway's certificate is not trusted: {seen.certificate_error}"
        if isinstance(seen, aiohttp.ClientSSLError):  # before ssl.SSLError: some of them are both
            return str(seen)
        if isinstance(seen, ssl.SSLCertVerificationError):  # the lean pool's (connector/http/http1.py), unwrapped
            return f"the gateway's certificate is not trusted: {seen}"
        if isinstance(seen, ssl.SSLError):
            return str(getattr(seen, "reason", None) or seen)
        nxt = getattr(seen, "os_error", None)
        seen = nxt if isinstance(nxt, BaseException) and nxt is not seen else (seen.__cause__ or seen.__context__)
    return None


async def check_tls(session: aiohttp.ClientSession, base_url: str) -> None:
    """GET /healthz once: GatewayTLSError on a certificate problem; a gateway that is down only logs a warning.

    A gateway that refuses the client's certificate (none, expired, another CA) ends the handshake by closing
    the connection: uvloop and asyncio drop the TLS alert. Every kvgate answers /healthz, so a connection
    closed after the handshake without a byte of answer is reported as that refusal.
    """
    try:
        async with session.get("/healthz") as resp:
            await resp.read()
    except aiohttp.ClientConnectorError as exc:  # no connection at all (or a handshake that failed): below
        tls = tls_failure(exc)
        if tls is not None:
            raise GatewayTLSError(f"TLS to the gateway {base_url} failed: {tls}") from exc
        log.warning("gateway %s not reachable at start-up (TLS not checked yet): %s", base_url, exc)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        # connected, then closed or reset with no answer: on a busy gateway the close of a refused handshake
        # can arrive as a reset rather than a clean disconnect
        tls = tls_failure(exc)
        if tls is not None:
            raise GatewayTLSError(f"TLS to the gateway {base_url} failed: {tls}") from exc
        raise GatewayTLSError(
            f"TLS to the gateway {base_url} failed: the gateway closed the connection after the "
            "handshake without answering: it refused this client's certificate (none configured, expired, or "
            "not signed by a CA in its tls_client_ca)"
        ) from exc
    except (aiohttp.ClientConnectionError, ConnectionError, TimeoutError) as exc:
        tls = tls_failure(exc)
        if tls is not None:
            raise GatewayTLSError(f"TLS to the gateway {base_url} failed: {tls}") from exc
        log.warning("gateway %s not reachable at start-up (TLS not checked yet): %s", base_url, exc)
