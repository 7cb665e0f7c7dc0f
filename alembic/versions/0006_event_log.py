"""The KV event log: a row per committed change of a block, in the change's own transaction; the published batches;
the publisher's state (next sequence number, last row covered, rows held, term).

New tables only (no rebuild of ``blocks`` or ``parts``: the usage triggers of 0004 stay in place).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "event_log",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("kind", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.String(512), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("digest", sa.String(80), nullable=False),
        sa.Column("tokens", sa.Text(), nullable=True),
        sa.Column("parent", sa.String(128), nullable=True),
        sa.Column("waits_for", sa.Text(), nullable=True),
        sa.Column("token", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_event_log")),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "event_batches",
        sa.Column("seq", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("topic", sa.String(1024), nullable=False),
        sa.Column("ids", sa.Text(), nullable=False),
        sa.Column("low", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_event_batches")),
    )
    op.create_table(
        "event_state",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("term", sa.BigInteger(), nullable=False),
        sa.Column("next_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_id", sa.BigInteger(), nullable=False),
        sa.Column("held", sa.Text(), nullable=False),
        sa.Column("waiting", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_event_state")),
    )


def downgrade() -> None:
    op.drop_table("event_state")
    op.drop_table("event_batches")
    op.drop_table("event_log")
