"""The stored version each block row describes (a stamp: the file's inode and mtime, or the S3 object's suffix).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("blocks") as batch:
        batch.add_column(sa.Column("stamp", sa.String(80), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("blocks") as batch:
        batch.drop_column("stamp")
