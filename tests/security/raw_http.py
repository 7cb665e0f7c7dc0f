"""HTTP/1.1 as a hostile client writes it: raw bytes on a fresh connection, nothing cleaned up by a client library;
only the answer's head is read (an event stream never ends)."""

from __future__ import annotations

import contextlib
import socket


def send_raw(port: int, request: bytes, *, timeout_s: float = 60.0) -> tuple[int, bytes]:
    """Send one request on its own connection; the status (0: closed without an answer) and the answer's head."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(request)  # the server may answer (431, 413) and close before all of it is sent
        head = b""
        try:
            while b"\r\n\r\n" not in head and len(head) < 65536:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                head += chunk
        except ConnectionResetError:
            pass
    if not head.startswith(b"HTTP/1.1 "):
        return 0, head[:300]
    return int(head[9:12]), head.split(b"\r\n\r\n", 1)[0][:600]


def encode_header(value: str) -> bytes:
    """Header bytes as a hostile client would send them: latin-1 where it fits, else UTF-8."""
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogatepass")


def build(
    method: str, target: str, headers: list[tuple[str, bytes]], body: bytes, *, length: bytes | None = None
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1".encode("latin-1", "replace"), b"Host: 127.0.0.1", b"Connection: close"]
    lines += [name.encode() + b": " + value for name, value in headers]
    if method not in ("GET", "HEAD", "DELETE") or body:
        lines.append(b"Content-Length: " + (length if length is not None else str(len(body)).encode()))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body
