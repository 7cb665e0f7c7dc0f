"""Initial schema: blocks and namespaces.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "blocks",
        sa.Column("key", sa.String(512), nullable=False),
        sa.Column("namespace", sa.String(256), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("grp", sa.BigInteger(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("last_access", sa.Float(), nullable=False),
        sa.Column("hits", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_blocks"),
    )
    op.create_index("ix_blocks_namespace", "blocks", ["namespace"])
    op.create_index("ix_blocks_last_access", "blocks", ["last_access"])
    op.create_table(
        "namespaces",
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("fields", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_namespaces"),
    )


def downgrade() -> None:
    op.drop_table("namespaces")
    op.drop_index("ix_blocks_last_access", table_name="blocks")
    op.drop_index("ix_blocks_namespace", table_name="blocks")
    op.drop_table("blocks")
