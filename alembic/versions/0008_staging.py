"""Staging intents: a version object (S3) or part object is recorded, with the database's clock, before it is
written; its commit deletes the intent in its own transaction, a sweep only an old one (app/index/staging.py).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "staging",
        sa.Column("key", sa.String(640), nullable=False),
        sa.Column("stamp", sa.String(80), nullable=False),
        sa.Column("staged_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("key", "stamp", name="pk_staging"),
    )


def downgrade() -> None:
    op.drop_table("staging")
