"""Who may call: principals (role and namespace scope), the bearer-token table, and the tokens file.

A principal is named by a bearer token (kept as its sha256 digest, compared with :func:`hmac.compare_digest`
against every entry) or by a client certificate (:mod:`app.api.middleware.cert_identity`). :class:`Principals`
holds the table auth checks against; it is rebuilt from the settings and the tokens file on SIGHUP and when the
file changes (a principal taken out of the file is refused from the next request on; a file that does not load
keeps the table in use).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from app.api.middleware.cert_identity import CertPrincipals
from app.api.reloading import Reloader
from app.config import Settings, TokenSpec
from contract.keys import InvalidKey, parse_namespace


class Role(IntEnum):
    read = 1
    write = 2
    admin = 3


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    role: Role
    namespaces: frozenset[str] | None
    """None: every namespace."""


def principal_of(spec: TokenSpec) -> Principal:
    return Principal(
        name=spec.name,
        role=Role[spec.role],
        namespaces=None if spec.namespaces is None else frozenset(spec.namespaces),
    )


class TokenTable:
    """Presented token -> Principal, by sha256 digest, compared in constant time with every entry."""

    def __init__(self, specs: Iterable[TokenSpec]) -> None:
        self._entries = [(spec.sha256.lower().encode(), principal_of(spec)) for spec in specs if spec.sha256]

    def __len__(self) -> int:
        return len(self._entries)

    def authenticate(self, token: str) -> Principal | None:
        digest = hash_token(token).encode()
        found: Principal | None = None
        for stored, principal in self._entries:  # no early exit: the time does not depend on which one matched
            if hmac.compare_digest(digest, stored):
                found = principal
        return found


_TOKEN_LIST = TypeAdapter(list[TokenSpec])


def read_tokens_file(path: Path) -> list[TokenSpec]:
    """A JSON list (or ``{"tokens": [...]}``) or a TOML file of ``[[tokens]]`` tables."""
    text = path.read_text()
    raw: Any = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    if isinstance(raw, dict):
        raw = raw.get("tokens", [])
    try:
        return _TOKEN_LIST.validate_python(raw)
    except ValidationError as exc:
        raise ValueError(f"tokens file {path}: {exc}") from exc


def load_tokens(settings: Settings) -> list[TokenSpec]:
    specs = list(settings.tokens)
    if settings.tokens_file is not None:
        specs += read_tokens_file(settings.tokens_file)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("token names must be unique")
    for spec in specs:
        try:
            CertPrincipals([spec])
        except ValueError as exc:
            raise ValueError(f"token {spec.name!r}: {exc}") from exc
        for ns in spec.namespaces or ():
            try:
                parse_namespace(ns)
            except InvalidKey as exc:
                raise ValueError(f"token {spec.name!r}: {exc}") from exc
    return specs


@dataclass(frozen=True, slots=True)
class PrincipalTable:
    """Bearer tokens and certificate names -> principals, built from one reading of the settings and file."""

    tokens: TokenTable
    certs: CertPrincipals

    @classmethod
    def of(cls, specs: list[TokenSpec]) -> PrincipalTable:
        return cls(tokens=TokenTable(specs), certs=CertPrincipals(specs))


class Principals(Reloader[PrincipalTable]):
    """The principal table in use (``table``), kept in step with the tokens file."""

    what = "tokens file"

    def __init__(self, *, settings: Settings) -> None:
        super().__init__(files=(settings.tokens_file,), interval_s=settings.tokens_reload_interval_s)
        self.settings = settings
        self.table = self.load()

    def load(self) -> PrincipalTable:
        return PrincipalTable.of(load_tokens(self.settings))

    def install(self, value: PrincipalTable) -> None:
        self.table = value
