"""Chunk checksums: the CRC64NVME of each chunk of a version, so that every Range GET is verified at every size.

Each row's algorithm needs no column and no rewrite: ``blocks.digest`` (and ``parts.digest``) hold a checksum token
(contract.wire.Checksum.token), ``crc64nvme:<hex>`` for a CRC64NVME, and a sha256 as the bare 64 hex digits every
row before this revision holds; so every existing row already says it is a sha256. Plain ADD COLUMN (no table
rebuild), so the usage triggers of 0004 stay in place.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("blocks", sa.Column("chunk_bytes", sa.Integer(), nullable=True))
    op.add_column("blocks", sa.Column("chunk_sums", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    # SQLite drops a column in place (3.35+) when nothing refers to it: no table rebuild, the triggers stay
    op.drop_column("blocks", "chunk_sums")
    op.drop_column("blocks", "chunk_bytes")
