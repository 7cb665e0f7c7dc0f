"""The connector's errors: an outage, a TLS misconfiguration, a refusal. A miss is None, never an error."""

from __future__ import annotations


class ConnectorError(Exception):
    """Base of the connector's errors."""


class GatewayUnavailable(ConnectorError):
    """The gateway cannot be reached, or answered 502/503/504 after the retries: an outage, not a miss."""


class GatewayTLSError(ConnectorError):
    """TLS failed: a certificate file that does not load, a server certificate this client does not trust, or a
    client certificate the gateway refused. Configuration, not an outage: never retried."""


class GatewayRejected(ConnectorError):
    """The gateway refused the request (4xx other than 404, or a 5xx that is not an outage): a bug or a conflict,
    not worth a retry."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
